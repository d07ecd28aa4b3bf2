"""Downpour SGD for a sparse model on a Dask cluster: table shards, replica tasks, the log.

:func:`fit_sparse` starts one :class:`~downpour_dask.ps.table.SparseShard` actor per shard
(round-robin over the workers; each makes its own rows from the seed, so a table of billions
of values is never sent), one long task per replica (:mod:`.sparse_task`) running
:func:`~downpour_dask.downpour.sparse_loop.run_sparse_replica` against actor handles it opens
itself, and returns a :class:`SparseFit` holding the shards (until :meth:`SparseFit.close`),
the pushes as a pandas DataFrame and the stop reason.  With ``checkpoint_dir`` it writes an
incremental checkpoint every ``checkpoint_every`` seconds while the replicas run and one at the
end (:mod:`.sparse_checkpoints`); ``restore`` continues from such a directory with any number
of shards.

A replica fetches every ``n_fetch`` steps and pushes every ``n_push`` steps, as the dense
loop does (:mod:`.sparse_accrual`; :mod:`.sparse_loop` runs ``n_fetch = n_push = 1``).  A shard
whose worker leaves the cluster is restored on a surviving worker as its next generation and
the replicas switch to it (:mod:`.sparse_recovery`, the dense path's
:class:`~.shard_recovery.ShardRecovery`); a replica whose worker dies is restarted on a
surviving worker after the steps it pushed, with its share of the data (the dense path's
:class:`~.supervisor.Supervisor` over :class:`~.sparse_replicas.SparseTasks`).  A worker that
leaves gracefully (retired, scaled down, closed by its nanny) first hands its shards over from
their exact final state (the dense path's :class:`~.elastic.Elastic`, told not to move
replicas: those on the worker pause, and the supervisor restarts them once it is gone).  With
``max_replicas``, a worker that joins gets a new replica with a share of the others' data
(:mod:`.sparse_growth`).
``SparseFit.events`` (``shard_lost``, ``shard_restored``, ``replica_failed``,
``replica_restarted``...) and ``SparseFit.lost_updates`` say what happened and what was lost.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client

from ..base import RunRecorder
from ..core import optimizer_spec
from ..core.rows import row_state_shapes
from ..core.sparse import SparseBatch, check_batch, check_sparse_model, table_rows
from ..data.hashing import HashSpec, is_hashed_files
from ..log import Progress, events_frame
from ..ps.refs import refer
from ..ps.rows import SparseLayout
from ..ps.table import SparseShard
from ..runtime.cluster import cluster_workers
from ..runtime.dask_internals import release_hold
from .dask_cluster import DaskCluster
from .elastic import Elastic
from .replica_count import AUTO, check_replicas, resolve
from .shard_recovery import ShardRecovery
from .sparse_accrual import check_schedule
from .sparse_checkpoints import merge_exports, read_sparse, restore_arguments, write_increment
from .sparse_eval import evaluation_frame
from .sparse_growth import SparseGrowth
from .sparse_monitor import SparseMonitor
from .sparse_recovery import (
    SparseSaved,
    SparseServer,
    settle_acknowledged,
    supervise,
)
from .sparse_replicas import SparseTasks
from .sparse_task import replica_task
from .supervisor import Supervisor


class SparseFit:
    """The shards of a sparse fit and what it logged (see :func:`fit_sparse`)."""

    def __init__(self, client: Client, model: Any, layout: SparseLayout, futures: list,
                 workers: list[str], seed: int, timeout: float):
        self.client, self.model, self.layout = client, model, layout
        self.futures, self.workers, self.seed, self.timeout = futures, workers, seed, timeout
        with client.as_current():  # the handles use this client, not the newest one made
            self.actors = [f.result(timeout=timeout) for f in futures]
        self.pushes = pd.DataFrame()
        #: The replicas the fit started with (``n_replicas="auto"`` resolved).
        self.n_replicas = 0
        self.checkpoints: list[Path] = []
        self._pending: dict[int, dict[str, Any]] = {}  # exports of a checkpoint that failed
        #: ``shard_lost`` / ``shard_restored`` / ``shard_fenced`` events (time, kind, detail...).
        self.events = pd.DataFrame()
        #: Per shard, updates its replaced incarnations acknowledged that the fit lost.
        self.lost_updates = [0] * layout.n_shards
        self.recovery: Any = None
        #: With ``eval_data``: the evaluation log (:mod:`.sparse_eval`), else empty.
        self.evaluations = evaluation_frame([])

    def _all(self, method: str) -> list[Any]:
        calls = [getattr(actor, method)() for actor in self.actors]
        return [call.result(timeout=self.timeout) for call in calls]

    def checkpoint(self, root: str | Path, step: int = 0) -> Path:
        """Write an increment: the rows changed since the previous one (see
        :mod:`.sparse_checkpoints`); its path."""
        calls = [actor.export_changed() for actor in self.actors]
        exports, error = [], None
        for s, call in enumerate(calls):
            try:
                export = call.result(timeout=self.timeout)
            except Exception as err:  # noqa: BLE001 - raised below, after keeping the others
                export, error = None, error or err
            if export is not None and s in self._pending:  # rows an earlier failure took
                export = merge_exports(self._pending.pop(s), export)
            exports.append(export)
        if error is not None:  # the shards that answered marked their rows saved: keep them
            self._pending.update({s: e for s, e in enumerate(exports) if e is not None})
            raise error
        path = write_increment(root, exports, self.layout, self.seed, step)
        self.checkpoints.append(path)
        return path

    def counters(self) -> list[dict[str, Any]]:
        """Each shard's counters (version, pushes accepted and refused, rows updated...)."""
        return self._all("status")

    def state(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """The whole dense vector and every table (initial rows plus every updated row); for
        tables that fit in the caller's memory."""
        exports = self._all("export_state")
        dense = np.concatenate([e["values"] for e in exports])
        tables = []
        for t, spec in enumerate(self.layout.specs):
            table = table_rows(spec, t, 0, spec.n_rows, self.seed)
            for e in exports:
                rows = e["tables"][t]
                table[rows["ids"]] = rows["values"]
            tables.append(table)
        return dense, tables

    def close(self) -> None:
        """Let the shard actors go: their futures, and each handle's own future of its key (a
        handle whose methods were called sits in reference cycles of Dask's making and would
        keep its actor alive until Python's cycle collector ran: see ``release_hold``)."""
        server = None if self.recovery is None else self.recovery.server
        replaced = [] if server is None else [*server.replaced_futures.values(),
                                                  *server.replaced.values()]
        for held in [*self.futures, *self.actors, *replaced]:
            release_hold(held)
        self.futures, self.actors = [], []
        if server is not None:
            server.replaced.clear()
            server.replaced_futures.clear()


def _check_files(model: Any, data: Any, n_replicas: int) -> None:
    """ValueError unless ``data`` is ``(paths, HashSpec)`` that fits ``model``, with a file
    for each replica."""
    if not is_hashed_files(data):
        raise TypeError("data must be a SparseBatch or (paths, HashSpec)")
    paths, spec = data
    if len(list(paths)) < n_replicas:
        raise ValueError(
            f"n_replicas={n_replicas} but the data has {len(list(paths))} file(s): each "
            f"replica streams whole files, so give at least one file per replica"
        )
    n_rows = min(t.n_rows for t in model.tables)
    if (len(spec.numeric), len(spec.categorical)) != (model.n_numeric, model.n_fields):
        raise ValueError(
            f"the spec has {len(spec.numeric)} numeric and {len(spec.categorical)} categorical "
            f"columns; the model takes n_numeric={model.n_numeric} and "
            f"n_fields={model.n_fields}"
        )
    if spec.n_rows > n_rows:
        raise ValueError(f"the spec hashes into {spec.n_rows} rows; the model's tables have "
                         f"{n_rows}")


def fit_sparse(
    model: Any,
    data: SparseBatch | tuple[list[str | Path], HashSpec],
    *,
    client: Client,
    n_replicas: int | str = 1,
    n_shards: int = 1,
    optimizer: str = "adagrad",
    learning_rate: float = 0.05,
    batch_size: int = 256,
    max_epochs: int = 1,
    max_steps: int | None = None,
    seed: int = 0,
    timeout: float = 120.0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: float = 60.0,
    restore: str | Path | None = None,
    direct: bool = True,
    n_fetch: int = 1,
    n_push: int = 1,
    local_learning_rate: float | None = None,
    eval_data: SparseBatch | tuple[list[str | Path], HashSpec] | None = None,
    eval_every: float = 5.0,
    publish: str | None = None,
    callback: Callable[[Progress], Any] | None = None,
    max_replicas: int | None = None,
) -> SparseFit:
    """Train ``model`` (a :class:`~downpour_dask.core.sparse.SparseModel`) with ``n_replicas``
    asynchronous replicas against ``n_shards`` table shards; see the module docstring.

    ``data`` is an in-memory :class:`SparseBatch` (replica r trains on rows r, r + R, ...) or
    ``(paths, spec)`` of parquet/CSV files hashed by ``spec`` (replica r streams files r, r + R,
    ...).  ``optimizer``: sgd, momentum, adagrad or their staleness_aware_ variants, by name or spec
    (``"momentum:momentum=0.5"``, :mod:`~downpour_dask.core.optimizer_spec`).  With
    ``direct`` a replica reaches a shard on another worker over a direct connection (the rows
    frame kind of :mod:`~downpour_dask.ps.rows_frames`, authenticated by a secret made for this
    fit) where the cluster's comm is plain TCP, else by actor messages.

    ``n_fetch`` / ``n_push``: a replica fetches the rows of its next ``n_fetch`` batches every
    ``n_fetch`` steps and pushes the gradient it accrued (each row touched once) every
    ``n_push`` steps, training on its local copy in between at ``local_learning_rate``
    (default ``learning_rate``; 0: the fetched values as they are); see :mod:`.sparse_accrual`.
    A replica whose worker dies is restarted on a surviving worker after the steps it pushed
    (``replica_failed`` / ``replica_restarted`` in ``events``), as in
    :class:`~downpour_dask.DownpourSGD`; a shard whose worker leaves gracefully migrates with
    no update lost (``shard_migrated``).  With ``max_replicas`` a worker that joins gets a new
    replica while fewer than that many train (``replica_added``), with ``1/n`` of what each of
    the others reads (:mod:`.sparse_growth`).  ``n_replicas="auto"``: a replica per worker the
    cluster has when the fit starts (and at most one per file), and one on each worker that
    joins, up to ``max_replicas`` if given (``SparseFit.n_replicas``: the count it started
    with).

    ``eval_data`` (a :class:`SparseBatch` or ``(paths, spec)``, read in the driver) is scored
    every ``eval_every`` seconds and at the end, pulling only the rows it touches:
    ``SparseFit.evaluations`` (:mod:`.sparse_eval`).  ``publish="NAME"`` publishes the running
    fit as the dense fit's ``publish`` does, for :func:`downpour_dask.live.attach` and
    ``downpour-dask watch NAME`` (:mod:`.sparse_monitor`); the name is released when the fit
    returns or fails.  ``callback`` gets a :class:`~downpour_dask.log.Progress` snapshot about
    four times a second and at the end (a :class:`~downpour_dask.progress.ProgressBar`); what
    it raises stops the replicas and propagates, as in ``DownpourSGD.fit``.
    """
    check_schedule(n_fetch, n_push, local_learning_rate)
    check_replicas(n_replicas, max_replicas)
    check_sparse_model(model)
    if isinstance(data, SparseBatch):
        data = check_batch(model, data)
    else:
        _check_files(model, data, 1 if n_replicas == AUTO else n_replicas)
    rule = optimizer_spec.build(optimizer, learning_rate)
    row_state_shapes(rule)  # refuses Adam here, before a shard starts, not in a shard's start
    monitor = SparseMonitor(client, model, eval_data, eval_every, publish, callback)  # checks
    layout = SparseLayout.build(model.n_dense, model.tables, n_shards)
    workers = sorted(cluster_workers(client))
    if not workers:
        raise RuntimeError("the Dask cluster has no workers to hold parameter-server shards")
    n_replicas, max_replicas, follow = resolve(n_replicas, max_replicas, len(workers))
    if not isinstance(data, SparseBatch):  # "auto": at most a replica per file
        n_replicas = min(n_replicas, len(list(data[0])))
    dense = model.init_dense(np.random.default_rng(seed))
    restored = None
    if restore is not None:
        saved = read_sparse(restore)
        if [list(s) for s in layout.specs] != [list(s) for s in saved["specs"]]:
            raise ValueError(f"the checkpoint in {restore} holds tables {saved['specs']}, the "
                             f"model has {[list(s) for s in layout.specs]}")
        seed, restored = saved["seed"], restore_arguments(saved, layout)
    secret = uuid.uuid4().hex.encode()
    futures, placed, initial = [], [], []
    for s, (lo, hi) in enumerate(layout.dense):
        address = workers[s % len(workers)]
        values = dense[lo:hi] if restored is None else restored[s]["values"]
        extra = {} if restored is None else {"restore": restored[s]["restore"]}
        futures.append(client.submit(
            SparseShard, s, lo, hi, values, rule, tables=layout.shard_tables(s), seed=seed,
            wire_secret=secret, **extra, actor=True, workers=[address],
            allow_other_workers=False, pure=False))
        placed.append(address)
        initial.append({"values": np.array(values), "rule_state": {}, "version": 0,
                        **extra.get("restore", {})})
    fit = SparseFit(client, model, layout, futures, placed, seed, timeout)
    fit.n_replicas = n_replicas
    run = uuid.uuid4().hex[:12]
    cluster, recorder = DaskCluster(client, run, timeout), RunRecorder("accuracy")
    server = SparseServer(fit, rule, secret)
    started = time.time()
    republish = monitor.bind(fit, data, n_replicas, batch_size, max_epochs, max_steps, started)
    recovery = ShardRecovery(cluster, server, SparseSaved(layout, initial, checkpoint_dir),
                             recorder, timeout, republish)
    fit.recovery = recovery
    alpha = learning_rate if local_learning_rate is None else local_learning_rate
    homes = [workers[r % len(workers)] for r in range(n_replicas)]
    shares, n_rows = None, 0
    if isinstance(data, SparseBatch):
        shares = [data.take(slice(r, None, n_replicas)) for r in range(n_replicas)]
        parts = [cluster.scatter([p], w)[0] for p, w in zip(shares, homes)]  # one object each
        own, n_rows = list(shares), len(data.y)
    else:
        paths, spec = data
        parts = own = [(list(paths)[r::n_replicas], spec) for r in range(n_replicas)]
    limits: dict[int, tuple[int | None, int | None]] = {}  # those of the replicas added

    def start(r: int, part: Any, step: int, worker: str, key: str) -> Any:
        # the shards as they are now: a restarted replica opens those that replaced lost ones
        refs = [refer(a, SparseShard, w) for a, w in zip(fit.actors, fit.workers)]
        epochs, steps = limits.get(r, (max_epochs, max_steps))
        return client.submit(replica_task, model, refs, layout, part, r, batch_size, epochs,
                             steps, seed, timeout, started, secret if direct else None, run,
                             n_fetch, n_push, alpha, step, key, pure=False, workers=[worker],
                             allow_other_workers=False, key=key)

    cluster.watch_membership()  # workers that join or leave (.membership)
    replicas = SparseTasks(cluster, start, parts, shares, homes, layout.n_shards,
                           lambda r: server.recent_pushes(r, timeout), n_push, started)
    limit = float("inf") if follow else max_replicas  # "auto" alone: a replica per join
    growth = None if limit is None else SparseGrowth(
        cluster, server, replicas, own, seed, n_rows, max_epochs, max_steps, n_push, timeout,
        limits)
    supervisor = Supervisor(cluster, server, replicas, recovery, recorder, n_push, timeout)
    elastic = Elastic(cluster, server, replicas, recovery, recorder, n_replicas, limit,
                      None if growth is None else growth.add,
                      collect=lambda: replicas.collect(force=True), timeout=timeout,
                      n_push=n_push, move_replicas=False)
    try:
        cluster.let_go_if_driver_lost(futures, publish, secret)  # should this process die
        monitor.start()
        supervise(supervisor, replicas, fit, recovery, checkpoint_dir,
                  checkpoint_every if checkpoint_dir is not None else 1e9, monitor.tick,
                  elastic)
        records = replicas.records()
        if checkpoint_dir is not None:
            fit.checkpoint(checkpoint_dir)
        monitor.finish()
    except BaseException:  # the replicas end first: they would train on against the shards
        replicas.stop(lambda: server.request_stop(timeout))
        fit.close()
        raise
    finally:
        replicas.release()
        monitor.close()
        cluster.forget()
        elastic.finish()  # retirements Dask aborted for a shard, now that it moved
    fit.pushes = pd.DataFrame(records).drop(columns=["seq", "session"], errors="ignore")
    if recovery.retired:
        recovery.settle()
        settle_acknowledged(recovery, fit.pushes)
    fit.events = events_frame(recorder.events)
    fit.lost_updates = recovery.lost_updates(layout.n_shards)
    fit.evaluations = monitor.frame()
    return fit
