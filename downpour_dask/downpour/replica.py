"""One Downpour model replica as a long-running Dask task: :func:`run_replica`.

The loop itself (:class:`~.replica_loop.ReplicaLoop`) knows shards only through channels and
imports no Dask.  This module puts it on the cluster: it opens a channel to each shard actor
(:func:`~downpour_dask.ps.opening.open_channels`: in-process, direct connection or actor
messages, and where to find a lost shard's replacement), gives the loop a :class:`WorkerSink`
that keeps its push rows and fetched copies in this worker's registry (:mod:`.registry`) for the
driver and logs its metrics on the run's event topic, and leaves the worker's thread pool for
the length of the fit.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
from distributed import get_worker, secede

from ..core.protocol import TrainableModel
from ..data.stream import StreamSpec, make_source
from ..log import PushRow, plain
from ..ps.opening import open_channels
from ..ps.server import ParameterServer
from ..runtime.dask_internals import CancelWatch, release_hold
from ..runtime.malloc import tune_malloc
from ..runtime.xla_threads import size_xla_pools
from .clocked_loop import ClockedReplicaLoop
from .easgd_loop import ElasticReplicaLoop
from .registry import (
    is_leaving,
    keep_acked,
    keep_returned,
    keep_row,
    remember_fetched,
    replica_running,
    shard_variable,
)
from .replica_loop import ReplicaConfig, ReplicaLoop
from .shares import shared_source

__all__ = ["ReplicaConfig", "WorkerSink", "run_loop", "run_replica"]

#: The fields of a push row a replica logs on the run's event topic.
METRIC_FIELDS = ("time", "replica", "step", "loss", "examples", "staleness", "version")


class WorkerSink:
    """Where a replica task leaves what must outlive it, in its worker process.

    Push rows and fetched shard copies go to the registry under the fit's token ``run`` (none
    without one), and about once a second the latest push goes to the published run's event
    ``topic`` (what ``downpour-dask watch`` and ``Client.get_events`` read).
    """

    #: Seconds between two metrics events of one replica.
    METRICS_EVERY = 1.0
    #: Seconds between two looks at whether the replica's task was cancelled.
    CANCEL_CHECK_EVERY = 0.25

    def __init__(self, run: str, topic: str = ""):
        self.run, self.topic = run, topic
        self.last_metrics = -math.inf
        #: Set by :func:`run_loop`: stops the replica after this push when its worker leaves
        #: or its driver let it go.
        self.stop_replica: Any = None
        self.retired = False  # whether it stopped because its worker is leaving
        self._cancelled = CancelWatch(self.CANCEL_CHECK_EVERY)

    def keep_row(self, row: PushRow) -> None:
        if self.run:
            keep_row(self.run, row)
            if self.stop_replica is not None and is_leaving(self.run):
                self.retired = True  # finish this step, push what is accrued, hand back
                self.stop_replica()
        if self.stop_replica is not None and self.abandoned():
            self.stop_replica()
        if self.topic and row.time - self.last_metrics >= self.METRICS_EVERY:
            self._log_metrics(row)

    def abandoned(self) -> bool:
        """Whether this replica's task was cancelled: its driver failed or ended and let it go
        (it asked its shards to stop too, but a stop that did not arrive would leave the
        replica training, or waiting for a warmstart, on shards nobody reads).  Looked up at
        most every :attr:`CANCEL_CHECK_EVERY` seconds."""
        return self._cancelled()

    def keep_fetched(self, shard: int, key: str, version: int, values: np.ndarray) -> bool:
        return bool(self.run) and remember_fetched(self.run, shard, key, version, values)

    def keep_acked(self, shard: int, key: str, version: int) -> None:
        if self.run:
            keep_acked(self.run, shard, key, version)

    def _log_metrics(self, row: PushRow) -> None:
        """Log ``row`` on the run's topic; never fails the replica."""
        self.last_metrics = row.time
        fields = {name: plain(getattr(row, name)) for name in METRIC_FIELDS}
        with contextlib.suppress(Exception):
            get_worker().log_event(
                self.topic, {"kind": "replica", **fields, "partition": row.partition}
            )


def run_loop(
    server: ParameterServer,
    model: TrainableModel,
    config: ReplicaConfig,
    source: Any,
    loop_class: type[ReplicaLoop] = ReplicaLoop,
) -> dict[str, Any]:
    """Run a replica loop (``loop_class``) over channels to ``server``'s shards on ``source``.

    A lost shard's replacement is looked up in the variable the driver publishes it in
    (:func:`~.registry.shard_variable` of the fit's ``config.run``); ``config.transport``
    ``"dask"`` keeps every remote shard on actor messages.
    """
    replacements = None
    if config.run:
        replacements = [shard_variable(config.run, shard) for shard in server.ids]
    with replica_running(config.run):  # a lost driver's cleanup waits for it (.driver_loss)
        channels = open_channels(
            server,
            config.replica,
            config.timeout,
            replacements,
            direct=config.transport in ("auto", "one-sided"),
            secret=config.wire_secret,
            one_sided=config.transport == "one-sided",
        )
        try:
            sink = WorkerSink(config.run, config.topic)
            loop = loop_class(channels, server.ranges, model, config, sink)
            if loop_class is ReplicaLoop:  # a split replica's partitions move as one: crash path
                sink.stop_replica = lambda: setattr(loop, "stop", True)
            result = loop.run(source)
            if sink.retired:  # a closing worker cancels this task: the driver reads it from there
                result = {**result, "retired": True}
                keep_returned(config.run, result)
            return result
        finally:
            for channel in channels:
                channel.close()
            for shard in server.shards:  # (see DaskShardChannel.close)
                release_hold(shard)


def run_replica(
    server: ParameterServer,
    model: TrainableModel,
    data: tuple[np.ndarray, np.ndarray] | StreamSpec,
    config: ReplicaConfig,
    parts: list | tuple = (),
) -> dict[str, Any]:
    """Dask task entry point: leave the worker's thread pool and run one replica to completion.

    ``data`` is the replica's in-memory ``(X, y)`` subset or a :class:`StreamSpec` naming its
    shards, which it then reads here, on its worker; ``parts`` are its Dask partitions (Dask
    resolves the futures passed in from the worker's own memory).
    """
    secede()  # a replica runs for the whole fit; it must not hold one of the worker's task slots
    tune_malloc()  # see runtime/malloc.py: received messages must not be page-faulted afresh
    size_xla_pools()  # a JAX model computes in the worker's threads (runtime/xla_threads.py)
    source: Any = make_source(data, config.batch_size, parts)
    if config.run:  # follows the share of the data the driver assigns it (a replica joined)
        source = shared_source(source, config.run, config.replica)
    loop: type[ReplicaLoop] = ReplicaLoop
    if config.staleness_bound is not None:  # SSP or BSP: see clocked_loop.py
        loop = ClockedReplicaLoop
    elif config.elastic_alpha is not None:  # EASGD: see easgd_loop.py
        loop = ElasticReplicaLoop
    return run_loop(server, model, config, source, loop)
