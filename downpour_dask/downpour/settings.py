"""What one Downpour fit needs of the estimator's checked arguments: :class:`FitSettings`.

:meth:`~downpour_dask.DownpourSGD.fit` checks its arguments, resolves the defaults that depend on
each other (the local rate ``alpha``, one epoch when no limit is given, the shards' ranges and
the partition plan) and hands the result to the :class:`~.driver.Driver` -- which so depends on
these plain values, not on the estimator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..core.consistency import ASYNC, Consistency
from ..core.optim import UpdateRule
from ..core.partition import PartitionPlan
from ..core.protocol import TrainableModel
from ..data.datasets import Dataset, ShardedDataset


@dataclass(frozen=True)
class FitSettings:
    """The settings of one fit (see :class:`~downpour_dask.DownpourSGD` for their meaning)."""

    model: TrainableModel
    rule: UpdateRule
    n_replicas: int  # "auto" until replica_count.resolve_settings
    n_shards: int
    ranges: list[tuple[int, int]]  # each shard's range of the server's vector
    plan: PartitionPlan | None  # how replicas are split (None: not)
    batch_size: int
    n_fetch: int
    n_push: int
    max_inflight: int
    local_learning_rate: float  # alpha, resolved
    warmstart_steps: int
    max_epochs: int | None  # resolved: one epoch when no limit was given
    max_steps: int | None
    max_seconds: float | None
    eval_every: float
    random_state: int | None
    timeout: float
    checkpoint_every: float
    checkpoint_dir: str | os.PathLike[str] | None
    transport: str
    config: dict[str, Any]  # the estimator's part of the experiment's config
    initial: np.ndarray | None = None  # where to start (warm_start), in the model's layout
    max_grad_norm: float | None = None  # each shard clips a push's slice to this norm
    consistency: Consistency = ASYNC  # async, SSP or BSP (core/consistency.py)
    top_k: float | None = None  # share of each shard's coordinates a push sends
    elastic_alpha: float | None = None  # EASGD's moving rate alpha (None: not EASGD)
    max_replicas: int | None = None  # replicas may be added on workers that join, up to this
    follow_workers: bool = False  # n_replicas="auto" without max_replicas: a replica per worker

    @property
    def partitions(self) -> int:
        """Partitions of each replica."""
        return 1 if self.plan is None else self.plan.partitions


def replica_subsets(train: Any, n_replicas: int) -> Any:
    """The replicas' data: contiguous in-memory subsets of ``train``, or the ShardedDataset as
    it is (each replica streams its own part of it)."""
    if not isinstance(train, ShardedDataset):
        return Dataset(*train).partition(n_replicas)  # raises if a replica gets no rows
    n_rows = train.n_rows
    if n_rows is not None and n_rows < n_replicas:  # Dask: checked once persisted
        raise ValueError(
            f"cannot give each of {n_replicas} replicas its own data: the dataset has "
            f"only {n_rows} rows; use n_replicas <= {n_rows}"
        )
    return train


def from_arguments(arguments: dict[str, Any], **resolved: Any) -> FitSettings:
    """The settings of a fit: the estimator's ``arguments`` (``get_params()``) that are
    :class:`FitSettings` fields as they are, the others (``model``, the rule, ranges, ...)
    ``resolved`` by the estimator."""
    names = {f.name for f in fields(FitSettings)}
    return FitSettings(**{**{k: v for k, v in arguments.items() if k in names}, **resolved})
