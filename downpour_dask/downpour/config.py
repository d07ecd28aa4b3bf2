"""What one replica's loop is given: its settings, :class:`ReplicaConfig` (what the driver
hands each replica task; see :class:`~downpour_dask.DownpourSGD` for the meanings), and where it
leaves what must outlive it, a :class:`ReplicaSink` (the worker's registry, in a Dask task; a
recording fake in the tests).  No Dask here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..log import PushRow


@dataclass(frozen=True)
class ReplicaConfig:
    """Settings of one replica's loop (see :class:`~downpour_dask.DownpourSGD` for meanings)."""

    replica: int
    batch_size: int
    n_fetch: int
    n_push: int
    local_learning_rate: float
    seed: int
    t0: float  # wall-clock time at which fit started; log times are relative to it
    max_epochs: int | None = None
    max_steps: int | None = None
    max_inflight: int = 4
    timeout: float = 120.0
    run: str = ""  # the fit's token: names the shard variables (see shard_variable)
    start_step: int = 0  # a restarted replica skips the batches it already trained on
    topic: str = ""  # a published run's event topic: the replica logs its metrics there
    partition: int = 0  # which partition of a model-parallel replica this loop runs
    transport: str = "auto"  # "auto": wire.py's direct connections where possible; "dask": actors
    start_after_version: int = 0  # wait for replica 0's warmstart: every shard's version
    wire_secret: bytes = field(default=b"", repr=False)  # the run's, for ps/service.py
    staleness_bound: int | None = None  # SSP's s (0: BSP); None: asynchronous (clocked_loop.py)
    n_replicas: int = 1  # replicas whose clocks an SSP/BSP replica waits on
    elastic_alpha: float | None = None  # EASGD's moving rate (easgd_loop.py); None: not EASGD
    centre_rate: float = 1.0  # the shards' SGD rate, which an EASGD push is divided by
    top_k: float | None = None  # share of each shard's coordinates a push sends (compression.py)


class ReplicaSink(Protocol):
    """Where a replica leaves what must outlive it (the worker's registry, in a Dask task)."""

    def keep_row(self, row: PushRow) -> None:
        """Record one acknowledged push for the run's push log."""
        ...

    def keep_fetched(self, shard: int, key: str, version: int, values: np.ndarray) -> bool:
        """Offer shard ``shard``'s fetched ``values`` (from actor ``key``) as a copy the driver
        may restore it from; True if kept (the caller then leaves ``values`` untouched)."""
        ...

    def keep_acked(self, shard: int, key: str, version: int) -> None:
        """Note that shard actor ``key`` accepted a push of this replica at ``version``."""

    def abandoned(self) -> bool:
        """Whether the replica's driver let it go (its Dask task was cancelled): it then stops,
        whatever its shards still answer."""
        ...
