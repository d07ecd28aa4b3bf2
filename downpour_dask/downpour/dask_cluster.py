"""The driver's protocols (:mod:`.protocols`) on a real Dask client.

:class:`DaskCluster` runs the replicas' tasks and mailboxes on workers, reads what the worker
processes keep for the driver (:mod:`.registry`: fetched shard copies, push-log rows) and tells
replicas where a replaced shard lives (a ``distributed.Variable`` per shard).
:class:`DaskServer` is the driver's view of a :class:`~downpour_dask.ps.server.ParameterServer`:
shards by index, the model's vector in its own order.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
from distributed import Client, Future, Variable, wait

from ..core.optim import UpdateRule
from ..core.partition import PartitionPlan
from ..ps.protocol import ShardLostError
from ..ps.server import ParameterServer
from ..runtime.cluster import cluster_workers
from .registry import drain_rows, fetched_copy, forget_run, shard_variable

#: Seconds a cached worker list may be old (asking costs a scheduler round trip).
ALIVE_EVERY = 0.5


class DaskCluster:
    """The workers of one fit (named ``run`` on the workers) through a Dask client."""

    def __init__(self, client: Client, run: str):
        self.client, self.run = client, run
        self.variables: dict[int, Variable] = {}
        self._alive: list[str] = []
        self._alive_at = -math.inf

    def workers(self, fresh: bool = True) -> list[str]:
        now = time.monotonic()
        if fresh or now - self._alive_at >= ALIVE_EVERY:
            self._alive = sorted(cluster_workers(self.client))
            self._alive_at = now
        return list(self._alive)

    def submit(self, function: Callable[..., Any], *args: Any, worker: str, key: str) -> Future:
        return self.client.submit(
            function, *args, workers=[worker], allow_other_workers=False, pure=False, key=key
        )

    def start_actor(self, cls: type, worker: str, key: str) -> Future:
        return self.client.submit(
            cls, actor=True, workers=[worker], allow_other_workers=False, pure=False, key=key
        )

    def scatter(self, values: list[Any], worker: str) -> list[Any]:
        # hash=False: unique keys, so an earlier fit releasing equal data cannot race this one
        return list(self.client.scatter(values, workers=[worker], hash=False))

    def wait(self, tasks: list[Future], timeout: float) -> None:
        with contextlib.suppress(TimeoutError, CancelledError):  # a lost task: seen by its owner
            wait(tasks, timeout=timeout)

    def fetched_copies(self, shard: int, key: str, workers: list[str]) -> dict[str, Any]:
        return self.client.run(
            fetched_copy, self.run, shard, key, workers=workers, on_error="return"
        )

    def drain_rows(self) -> list[tuple]:
        found = self.client.run(drain_rows, self.run, on_error="ignore")
        return [tuple(row) for rows in found.values() for row in rows]

    def announce_shard(self, shard: int, future: Any) -> None:
        if shard not in self.variables:
            self.variables[shard] = Variable(shard_variable(self.run, shard), client=self.client)
        self.variables[shard].set(future)  # replicas waiting for a replacement pick it up

    def forget(self) -> None:
        """At the end of the fit: drop what workers keep for this run, and the variables."""
        with contextlib.suppress(Exception):
            self.client.run(forget_run, self.run, on_error="ignore")
        for variable in self.variables.values():
            with contextlib.suppress(Exception):
                variable.delete()


class DaskServer:
    """The driver's view of ``server``: shards by index, and :meth:`pull` returning the
    model's vector (unpacked by ``plan`` when the model is split into partitions)."""

    def __init__(
        self,
        server: ParameterServer,
        client: Client,
        rule: UpdateRule,
        plan: PartitionPlan | None = None,
    ):
        self.server, self.client, self.rule, self.plan = server, client, rule, plan
        #: Whether the shards were told to stop: a replacement shard is told too.
        self.stopped = False

    @property
    def workers(self) -> list[str]:
        return self.server.workers

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return self.server.ranges

    def shard_key(self, shard: int) -> str:
        return self.server.shards[shard].key

    def portable(self, first: int = 0, stop: int | None = None) -> ParameterServer:
        if first == 0 and stop in (None, self.server.n_shards):
            return self.server.portable()
        return self.server.subset(first, stop).portable()

    def versions(self, timeout: float) -> list[int]:
        return self.server.versions(timeout)

    def pull(self, timeout: float) -> tuple[np.ndarray, list[int]]:
        values, versions = self.server.pull(timeout)
        return (values if self.plan is None else self.plan.unpack(values)), versions

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        return self.server.shard_status(shard, timeout)

    def lost_shards(self, timeout: float) -> list[int]:
        return self.server.lost_shards(timeout)

    def request_stop(self, timeout: float) -> None:
        self.stopped = True
        self.server.request_stop(timeout)

    def release_warmstart(self, timeout: float) -> None:
        self.server.release_warmstart(timeout)

    def export_state(self, timeout: float) -> list[dict[str, Any]]:
        return self.server.export_state(timeout)

    def replace_shard(
        self, shard: int, values: np.ndarray, worker: str, state: dict[str, Any], timeout: float
    ) -> Future:
        restore = {**state, "stopped": self.stopped}
        return self.server.replace_shard(
            self.client, shard, values, self.rule, worker, restore, timeout
        )

    def shard_events(self, timeout: float) -> list[tuple[float, str, str, dict[str, Any]]]:
        """Every event the shards recorded (wall-clock times), each with the recording shard's
        index in its data (``{"shard": i, ...}``), in time order."""
        found = []
        for i in range(self.server.n_shards):
            try:
                events = self.server.subset(i, i + 1).events(timeout)
            except ShardLostError as err:  # numbered within the one-shard view: renumber it
                raise ShardLostError(f"shard {i}: {err}", i) from err
            for event in events:
                data = event[3] if len(event) > 3 else {}
                found.append((*event[:3], {"shard": i, **(data or {})}))
        return sorted(found, key=lambda e: e[0])
