"""The Downpour SGD estimator: many replicas training asynchronously against a sharded server.

``DownpourSGD.fit`` places the parameter-server shards on distinct workers, gives each model
replica its own contiguous subset of the data on its own worker, warmstarts with one replica
before unleashing the others (as the paper does with Adagrad), evaluates the current parameters
from the driver every ``eval_every`` seconds, stops the replicas cooperatively when time is up,
and records everything in an :class:`~downpour_dask.log.Experiment`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client, Future, Security, wait

from .. import live
from .._version import __version__
from ..base import ParamServerEstimator, check_int, check_positive
from ..checkpoint import Checkpoint, ShardState, read_checkpoint
from ..core import optim
from ..core.models import Model
from ..core.params import split_range
from ..core.partition import PartitionPlan
from ..data.datasets import Dataset, ShardedDataset, as_dataset
from ..log import EVAL_COLUMNS, PUSH_COLUMNS, Experiment, Progress, events_frame
from ..ps.protocol import SHARD_ERRORS
from ..ps.server import ParameterServer
from ..runtime.cluster import check_security, cluster_client, cluster_workers
from ..runtime.placement import place_replicas
from .model_parallel import partition_workers
from .recovery import Recovery
from .replica import ReplicaConfig

#: Values of ``DownpourSGD(transport=...)``.
TRANSPORTS = ("auto", "dask")


class DownpourSGD(ParamServerEstimator):
    """Downpour SGD (Dean et al., 2012) on a Dask cluster.

    Parameters
    ----------
    model : Model
        A :mod:`downpour_dask.models` model, e.g. ``models.MLP(784, (128,), 10)``.
    n_replicas : int, default 4
        Model replicas; each trains on its own 1/n_replicas of the data.
    n_shards : int, default 2
        Parameter-server shards (Dask actors), placed on distinct workers where possible.
    optimizer : str or UpdateRule, default "adagrad"
        Update rule the shards apply: one of :data:`downpour_dask.optim.OPTIMIZERS`, or an
        :class:`~downpour_dask.optim.UpdateRule` (then ``learning_rate`` must equal its rate).
    learning_rate : float, default 0.05
        The rule's rate (Adagrad's gamma).
    batch_size : int, default 64
        Minibatch size of each replica step.
    n_fetch, n_push : int, default 1
        A replica fetches parameters every ``n_fetch`` steps and pushes its accrued gradient every
        ``n_push`` steps (the paper's experiments used 1 and 1).
    max_inflight : int, default 4
        Pushes a replica may have sent and not yet seen acknowledged before it waits
        (back-pressure).  More hides more round-trip latency when steps are short (measured:
        2 replicas of MLP 784-256-10 at n_push=1 train 15% faster with 4 than with 2) but lets a
        replica run further ahead of the shards.
    local_learning_rate : float, optional
        The replica's local rate ``alpha`` between fetches; default ``learning_rate``. 0 gives the
        paper's plain overwrite-on-fetch.
    warmstart_steps : int, default 0
        Steps replica 0 trains alone before the other replicas start.
    max_epochs, max_steps : int, optional
        Each replica stops after this many passes over its own data / this many steps.
    max_seconds : float, optional
        Wall-clock budget of training; the replicas are stopped when it runs out.
        If none of the three limits is given, each replica does one epoch.
    eval_every : float, default 0.5
        Seconds between evaluations of the current parameters on ``eval_data``.
    random_state : int, optional
        Seeds the initial parameters and every replica's data order.
    timeout : float, default 120
        Seconds any single call into a shard may take before the run fails instead of hanging.
    security : distributed.Security or True, optional
        TLS for the embedded local cluster started when ``fit`` gets no client: ``True`` for
        temporary self-signed certificates (``Security.temporary()``), or a ``Security`` with
        certificates for every role.  That cluster then listens on TLS only.  Give a client of
        an existing cluster its own ``security`` instead.
    checkpoint_dir : str or path, optional
        Directory for periodic checkpoints of every shard (values, update-rule state, version)
        and of the experiment log so far, and for one when the fit ends;
        ``fit(..., resume_from=checkpoint_dir)`` continues from the latest one.  See
        :mod:`downpour_dask.checkpoint` for the layout.
    checkpoint_every : float, default 30
        Seconds between checkpoints.  The driver also keeps the latest one in memory (even
        without ``checkpoint_dir``) to restore a shard whose worker dies.
    partitions : int, default 1
        Model parallelism: split every replica of an MLP into this many partitions on as many
        different workers, by neurons (partition p owns the p-th block of units of every hidden
        layer; see :mod:`downpour_dask.partition`).  Each partition fetches and pushes only its
        own parameters, from shards that hold nothing else (``n_shards >= partitions``); only
        activations and their gradients that cross partitions travel.  Needs an MLP, at most as
        many partitions as the narrowest hidden layer has units, and as many workers.
    transport : {"auto", "dask"}, default "auto"
        How a replica reaches shards on other workers.  ``"auto"``: a direct TCP connection per
        shard (:mod:`downpour_dask.wire`) where the cluster's comm is plain TCP, else Dask actor
        messages; measured 5x less CPU per push + pull than an actor call, which on a small
        machine goes to the gradients instead.  ``"dask"``: actor messages only.  Shards on the
        replica's own worker are called in-process either way.

    Attributes
    ----------
    params_ : ndarray
        The trained flat float32 parameter vector.
    experiment_ : Experiment
        Pushes, evaluations and events of the run.
    server_status_ : DataFrame
        Per-shard counters at the end of the run (versions, accepted/refused pushes, staleness).
    """

    def __init__(
        self,
        model: Model,
        n_replicas: int = 4,
        n_shards: int = 2,
        optimizer: str | optim.UpdateRule = "adagrad",
        learning_rate: float = 0.05,
        batch_size: int = 64,
        n_fetch: int = 1,
        n_push: int = 1,
        max_inflight: int = 4,
        local_learning_rate: float | None = None,
        warmstart_steps: int = 0,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        eval_every: float = 0.5,
        random_state: int | None = None,
        timeout: float = 120.0,
        security: Security | bool | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float = 30.0,
        partitions: int = 1,
        transport: str = "auto",
    ):
        self.model = model
        self.n_replicas = n_replicas
        self.n_shards = n_shards
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.max_inflight = max_inflight
        self.local_learning_rate = local_learning_rate
        self.warmstart_steps = warmstart_steps
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.eval_every = eval_every
        self.random_state = random_state
        self.timeout = timeout
        self.security = security
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.partitions = partitions
        self.transport = transport

    # -- validation ------------------------------------------------------------------------------
    def _check_arguments(self) -> optim.UpdateRule:
        """Check every constructor argument; return the update rule. Raises before any Dask work."""
        if not isinstance(self.model, Model):
            raise TypeError(
                f"model must be a downpour_dask.models model (e.g. models.MLP), "
                f"got {type(self.model).__name__}"
            )
        check_int("n_replicas", self.n_replicas, 1)
        check_int("n_shards", self.n_shards, 1, self.model.layout.size)
        check_int("partitions", self.partitions, 1)
        self._shard_ranges()  # partitions the model cannot take, or too few shards, raise here
        check_int("batch_size", self.batch_size, 1)
        check_int("n_fetch", self.n_fetch, 1)
        check_int("n_push", self.n_push, 1)
        check_int("max_inflight", self.max_inflight, 1)
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                f"got {self.transport!r}"
            )
        check_int("warmstart_steps", self.warmstart_steps, 0)
        check_int("max_epochs", self.max_epochs, 1, allow_none=True)
        check_int("max_steps", self.max_steps, 1, allow_none=True)
        check_positive("max_seconds", self.max_seconds, allow_none=True)
        check_positive("learning_rate", self.learning_rate)
        check_positive(
            "local_learning_rate", self.local_learning_rate, allow_none=True, allow_zero=True
        )
        check_positive("eval_every", self.eval_every)
        check_positive("timeout", self.timeout)
        check_security(self.security)
        check_positive("checkpoint_every", self.checkpoint_every)
        path_like = isinstance(self.checkpoint_dir, (str, os.PathLike))
        if self.checkpoint_dir is not None and not path_like:
            raise TypeError(
                f"checkpoint_dir must be a path (str or os.PathLike) or None, got "
                f"{type(self.checkpoint_dir).__name__}"
            )
        if self.random_state is not None:
            check_int("random_state", self.random_state, 0)
        if isinstance(self.optimizer, optim.UpdateRule):
            if self.optimizer.learning_rate != self.learning_rate:
                raise ValueError(
                    f"optimizer has learning_rate {self.optimizer.learning_rate}, but "
                    f"learning_rate={self.learning_rate}; give the same value to both"
                )
            return self.optimizer
        if not isinstance(self.optimizer, str):
            raise TypeError(
                f"optimizer must be one of {', '.join(optim.OPTIMIZERS)} or an UpdateRule, "
                f"got {type(self.optimizer).__name__}"
            )
        return optim.make(self.optimizer, self.learning_rate)

    def _plan(self) -> PartitionPlan | None:
        """How replicas are split (None without model parallelism)."""
        return None if self.partitions == 1 else PartitionPlan(self.model, self.partitions)

    def _shard_ranges(self) -> list[tuple[int, int]]:
        """The shards' ranges of the server's vector: balanced, or aligned with partitions."""
        plan = self._plan()
        if plan is None:
            return split_range(self.model.layout.size, self.n_shards)
        return plan.shard_ranges(self.n_shards)

    def _check_data(self, data: Any, y: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
        dataset = as_dataset(data, y, what=what)
        try:
            return self.model.check_data(dataset.X, dataset.y)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{what}: {err}") from None

    def _check_sharded(self, data: ShardedDataset, y: Any) -> ShardedDataset:
        """Check files/Dask data against the model from metadata (rows are read by replicas)."""
        if y is not None:
            raise TypeError("data is a ShardedDataset (it holds the targets), so y must be None")
        data.check_model(self.model, "data")
        n_rows = data.n_rows
        if n_rows is not None and n_rows < self.n_replicas:  # Dask: checked once persisted
            raise ValueError(
                f"cannot give each of {self.n_replicas} replicas its own data: the dataset has "
                f"only {n_rows} rows; use n_replicas <= {n_rows}"
            )
        return data

    # -- fitting ---------------------------------------------------------------------------------
    def fit(
        self,
        data: Dataset | ShardedDataset | tuple | np.ndarray,
        y: np.ndarray | None = None,
        *,
        eval_data: Dataset | tuple | None = None,
        client: Client | None = None,
        callback: Callable[[Progress], None] | None = None,
        publish: str | None = None,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> DownpourSGD:
        """Train with Downpour SGD; returns ``self``.

        Parameters
        ----------
        data : Dataset, ShardedDataset, (X, y) tuple, or X
            Training data; with ``X``, pass the targets as ``y``.  A ShardedDataset
            (``datasets.from_parquet``, ``from_npy``, ``from_csv``, ``from_dask``) is streamed:
            each replica reads only its own shards, on its worker.
        eval_data : Dataset or (X, y), optional
            Evaluated every ``eval_every`` seconds and at the end (``experiment_.evals``).
        client : distributed.Client, optional
            The cluster to run on; by default an embedded local cluster is started and closed.
        callback : callable, optional
            Called with a :class:`~downpour_dask.log.Progress` snapshot about four times a
            second while training (progress bars, live plots).  An exception it raises stops
            the replicas and propagates out of ``fit``.
        publish : str, optional
            Publish the running parameter server on the cluster under this name, so other
            processes can follow it with ``downpour_dask.attach(name, client)`` or
            ``downpour-dask watch NAME``; progress is logged under the scheduler event topic
            ``downpour-dask/<name>``.  Unpublished when ``fit`` returns or fails.
        resume_from : str or path, optional
            A ``checkpoint_dir`` of an interrupted fit with the same model, ``n_shards`` and
            data: the shards start from its latest checkpoint (values, update-rule state,
            versions), each replica skips the steps it had pushed, and the experiment continues
            the old one's pushes, evaluations, events and time axis (up to the checkpoint).
            Checkpoints go on being written there unless ``checkpoint_dir`` is set.
        """
        rule = self._check_arguments()
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        if publish is not None:
            live.check_name(publish)
        if isinstance(data, ShardedDataset):
            subsets = self._check_sharded(data, y)
        else:
            X, y = self._check_data(data, y, "data")
            subsets = Dataset(X, y).partition(self.n_replicas)  # raises if a replica gets no rows
        evaluation = None if eval_data is None else self._check_data(eval_data, None, "eval_data")
        max_epochs = self.max_epochs
        if max_epochs is None and self.max_steps is None and self.max_seconds is None:
            max_epochs = 1
        resumed = None if resume_from is None else self._check_resume(resume_from)
        with cluster_client(client, self.security) as active:
            run = _Run(self, active, rule, subsets, evaluation, max_epochs)
            run.resumed = resumed
            run.checkpoint_dir = self.checkpoint_dir if self.checkpoint_dir else resume_from
            run.callback = callback
            run.publish = publish
            run.execute()
        self.params_ = run.params
        self.experiment_ = run.experiment
        self.server_status_ = run.status
        return self

    def _check_resume(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Read the checkpoint to resume from and check it fits this estimator."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"resume_from must be a path, got {type(path).__name__}")
        checkpoint = read_checkpoint(path)  # CheckpointError (a ValueError) naming the file
        ranges = self._shard_ranges()
        found = [(s.start, s.stop) for s in checkpoint.shards]
        saved_partitions = int(checkpoint.meta.get("partitions", 1))
        if found != [tuple(r) for r in ranges] or saved_partitions != self.partitions:
            raise ValueError(
                f"resume_from={str(path)!r}: the checkpoint holds {len(found)} shard(s) covering "
                f"{found[-1][1]} parameters of a model in {saved_partitions} partition(s), but "
                f"this estimator has n_shards={self.n_shards}, partitions={self.partitions} and "
                f"a model of {self.model.layout.size} parameters; use the interrupted run's "
                f"settings"
            )
        saved_model = checkpoint.meta.get("model")
        if saved_model is not None and saved_model != self.model.get_config():
            raise ValueError(
                f"resume_from={str(path)!r}: the checkpoint was written for model "
                f"{saved_model}, not {self.model.get_config()}"
            )
        return checkpoint

    def _config(self, n_rows: int, workers: list[str]) -> dict[str, Any]:
        skip = ("model", "optimizer", "security")
        config = {k: v for k, v in self.get_params().items() if k not in skip}
        if config.get("checkpoint_dir") is not None:
            config["checkpoint_dir"] = str(config["checkpoint_dir"])
        config["tls"] = self.security is not None  # the Security object itself is not JSON
        config["model"] = self.model.get_config()
        config["optimizer"] = (
            self.optimizer.get_config()
            if isinstance(self.optimizer, optim.UpdateRule)
            else self.optimizer
        )
        config.update(
            estimator=type(self).__name__,
            library_version=__version__,
            n_rows=n_rows,
            workers=workers,
        )
        return config


class _Run(Recovery):
    """One execution of :meth:`DownpourSGD.fit` on a client: the driver's side of the run."""

    def __init__(self, est: DownpourSGD, client: Client, rule, subsets, evaluation, max_epochs):
        self.est, self.client, self.rule = est, client, rule
        self.subsets, self.evaluation, self.max_epochs = subsets, evaluation, max_epochs
        self.events: list[tuple[float, str, str]] = []
        self.evals: list[dict[str, Any]] = []
        self.rows: list[tuple] = []  # the push log, collected from the replicas' workers
        self.metric = "accuracy" if est.model.is_classifier else "r2"
        self.callback: Callable[[Progress], None] | None = None
        self.publish: str | None = None  # the name to publish the run under, if any
        self.published = False
        self.phase = "training"
        self.last_report = -math.inf  # time.monotonic() of the last progress report
        self.resumed: Checkpoint | None = None  # set by fit(resume_from=...)
        self.checkpoint_dir: str | os.PathLike[str] | None = None
        self.token = uuid.uuid4().hex[:8]  # names this run's shard variables
        self.futures: list[Future] = []
        self.restarts = 0
        self.stop_sent = False

    def _event(self, kind: str, detail: str = "") -> None:
        self.events.append((time.time() - self.t0, kind, detail))

    def execute(self) -> None:
        est, client = self.est, self.client
        workers = sorted(cluster_workers(client))
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        if est.partitions > len(workers):
            raise ValueError(
                f"partitions={est.partitions} puts each replica's partitions on "
                f"{est.partitions} different workers, but the cluster has {len(workers)}; use "
                f"partitions <= {len(workers)} or a cluster with more workers"
            )
        if self.publish is not None and live.is_published(client, self.publish):
            raise ValueError(
                f"publish={self.publish!r}: a run or dataset of that name is already published "
                f"on the scheduler; choose another name"
            )
        placed = place_replicas(  # data placement is not training time: before t0
            client, self.subsets, est.n_replicas, workers, est.batch_size, est.model, est.timeout
        )
        placements, self.n_rows, self.data_info = placed.replicas, placed.n_rows, placed.info
        self.t0 = time.time()
        rng = np.random.default_rng(est.random_state)
        self.plan = est._plan()
        initial = est.model.init(rng)
        if self.plan is not None:  # the server holds the parameters partition by partition
            initial = self.plan.pack(initial)
        seed = int(rng.integers(2**31)) if est.random_state is None else est.random_state
        restore = None
        if self.resumed is not None:  # continue the interrupted run's time axis and log
            self.t0 -= self.resumed.elapsed
            initial = np.concatenate([s.values for s in self.resumed.shards])
            restore = [_restore_args(s) for s in self.resumed.shards]
            self.evals = [dict(e) for e in self.resumed.meta.get("evals", [])]
            self.events = [tuple(e) for e in self.resumed.meta.get("events", [])]
            self.rows = [tuple(r) for r in self.resumed.meta.get("pushes", [])]
        self.server = ParameterServer.create(
            client,
            initial,
            est.n_shards,
            self.rule,
            self._shard_workers(placements[0].worker, workers),
            est.timeout,
            restore=restore,
            ranges=est._shard_ranges(),
        )
        self._start_supervision(initial, restore)
        if self.resumed is not None:
            self._event(
                "resumed",
                f"from {self.resumed.path} at versions {self.resumed.versions} "
                f"({self.resumed.elapsed:.1f} s into the run)",
            )
        self._event(
            "start", f"{est.n_replicas} replicas, {est.n_shards} shards on {len(workers)} workers"
        )
        futures = self.futures
        try:
            if self.publish is not None:
                live.publish(client, self.publish, self.server, self._live_info())
                self.published = True
            alpha = (
                est.learning_rate if est.local_learning_rate is None else est.local_learning_rate
            )
            self.placements = placements
            done = self._steps_done(restore)
            warm = est.n_replicas > 1 and est.warmstart_steps > 0 and self.resumed is None
            gate = -(-est.warmstart_steps // est.n_push) if warm else 0  # replica 0's pushes
            for r, place in enumerate(placements):
                placed = partition_workers(place.worker, est.partitions, workers)
                if self.plan is not None:
                    self._open_mailboxes(r, placed)
                for p, worker in enumerate(placed):
                    self._start_slot(
                        r,
                        p,
                        worker,
                        place.data,
                        self._replica_config(r, p, alpha, seed, done.get(r, 0), gate if r else 0),
                    )
            if warm:
                self._warmstart(futures[0], gate)
            self._supervise(futures)
            self.params, versions = self._recovering(self._pull)
            self._evaluate(self.params, versions)
            if self.callback is not None or self.publish is not None:
                self.phase = "done"
                self._report(self._recovering(self._progress))
            if self.checkpoint_dir is not None:  # the end is a checkpoint too: resume from it
                self._recovering(self._maybe_checkpoint, True)
            self._event("stop", f"versions {versions}")
            self.status = self._recovering(self.server.status, est.timeout)
            shard_events = self._recovering(self.server.events, est.timeout)
            results = [self.results[i] for i in range(len(futures))]
            self._collect_rows(force=True)  # the replicas' last rows, before they are forgotten
        finally:
            if any(not f.done() for f in futures):  # the driver failed: let replicas finish
                with contextlib.suppress(Exception):
                    self.server.request_stop(est.timeout)
            for f in futures:
                f.cancel()
            if self.published:
                live.unpublish(client, self.publish)
            self._end_supervision()
            self.server.close()
        self.experiment = self._experiment(results, shard_events, workers)

    def _replica_config(
        self, r: int, p: int, alpha: float, seed: int, start: int, gate: int = 0
    ) -> ReplicaConfig:
        est = self.est
        return ReplicaConfig(
            replica=r,
            batch_size=est.batch_size,
            n_fetch=est.n_fetch,
            n_push=est.n_push,
            max_inflight=est.max_inflight,
            local_learning_rate=alpha,
            seed=seed,  # the same for every partition of a replica: they read the same batches
            t0=self.t0,
            max_epochs=self.max_epochs,
            max_steps=est.max_steps,
            timeout=est.timeout,
            run=self.token,
            start_step=start,
            topic=live.topic(self.publish) if self.publish is not None else "",
            partition=p,
            transport=est.transport,
            start_after_version=gate,
        )

    def _shard_workers(self, first: str, workers: list[str]) -> list[str]:
        """Where each shard goes: round robin over the workers; with model parallelism, next to
        the partition of replica 0 whose parameters it holds (further shards of a partition
        continue round robin from there)."""
        if self.plan is None:
            return workers
        placed = []
        counts = self.plan.shards_per_partition(self.est.n_shards)
        start = workers.index(first)
        for p, count in enumerate(counts):
            for j in range(count):
                placed.append(workers[(start + p + j * self.plan.partitions) % len(workers)])
        return placed

    def _recovering(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` after the replicas finished: a shard whose worker dies now (the run's
        result is still on the shards) is restored like one lost mid-run, and the call made
        again."""
        for attempt in range(3):
            try:
                return call(*args)
            except SHARD_ERRORS as err:
                if attempt == 2:
                    raise
                self._recover_lost_shards(err)

    def _pull(self) -> tuple[np.ndarray, list[int]]:
        """The model's flat parameters assembled from every shard, and each shard's version."""
        values, versions = self.server.pull(self.est.timeout)
        return (values if self.plan is None else self.plan.unpack(values)), versions

    def _warmstart(self, first: Future, target: int) -> None:
        """Watch replica 0 make ``target`` pushes (``warmstart_steps`` steps) alone.

        The other replicas wait for that on the shards themselves (see
        ``Replica._await_warmstart``); the driver logs the end, and releases them if replica 0
        finishes without reaching it.
        """
        self.phase = "warmstart"
        while not first.done():
            self._check_failures()
            first = self.futures[0]  # replica 0 may have been restarted
            try:
                if self._tick() >= target:
                    break
            except SHARD_ERRORS as err:  # a shard was lost: restore it, then go on
                self._recover_lost_shards(err)
            try:
                wait(first, timeout=min(self.est.eval_every, 0.05))
            except (TimeoutError, CancelledError):  # a lost replica: restarted
                pass
        for attempt in range(2):
            try:
                self.server.call_all("release_warmstart", timeout=self.est.timeout)
                break
            except SHARD_ERRORS as err:  # a shard was lost: restore it, then release the new one
                if attempt:
                    raise
                self._recover_lost_shards(err)
        self.phase = "training"
        self._event(
            "warmstart_done", f"replica 0 trained alone for {self.est.warmstart_steps} steps"
        )

    def _supervise(self, futures: list[Future]) -> None:
        """Evaluate periodically and enforce ``max_seconds`` until every replica has finished."""
        est = self.est
        while True:
            try:
                wait(futures, timeout=self._until_next_tick())
            except (TimeoutError, CancelledError):  # a lost replica: restarted
                pass
            self._check_failures()  # restarts replicas and shards lost with their workers
            if len(self.results) == len(futures):  # every replica finished, its result in hand
                return
            try:
                self._tick()
                self._maybe_checkpoint()
                self._collect_rows()
                if (
                    not self.stop_sent
                    and est.max_seconds is not None
                    and time.time() - self.t0 >= est.max_seconds
                ):
                    self.server.request_stop(est.timeout)
                    self._event("stop_requested", f"max_seconds={est.max_seconds} reached")
                    self.stop_sent = True
            except SHARD_ERRORS as err:  # a shard was lost: restore it, then go on
                self._recover_lost_shards(err)

    #: Seconds between progress reports to the callback and to watchers of a published run.
    REPORT_EVERY = 0.25

    def _until_next_tick(self) -> float:
        """How long the supervision loop may wait: until the next evaluation is due (so that
        evaluations keep to ``eval_every`` instead of drifting late) or the next report."""
        watched = self.callback is not None or self.publish is not None
        interval = min(self.est.eval_every, self.REPORT_EVERY) if watched else self.est.eval_every
        if self.evaluation is not None:
            last = self.evals[-1]["time"] if self.evals else -np.inf
            due = last + self.est.eval_every - (time.time() - self.t0)
            interval = min(interval, due)
        return max(0.002, interval)

    def _tick(self) -> int:
        """Evaluate if ``eval_every`` has passed since the last evaluation, report progress to
        the callback; return the (minimum) version."""
        last = self.evals[-1]["time"] if self.evals else -np.inf
        if self.evaluation is None or time.time() - self.t0 - last < self.est.eval_every:
            versions = self.server.versions(self.est.timeout)  # a few bytes, not the vector
        else:
            params, versions = self._pull()
            self._evaluate(params, versions)
        version = min(versions)
        self.known_versions = [max(k, v) for k, v in zip(self.known_versions, versions)]
        watched = self.callback is not None or self.publish is not None
        if watched and time.monotonic() - self.last_report >= self.REPORT_EVERY:
            self._report(self._progress())
        return version

    def _report(self, progress: Progress) -> None:
        """Hand a snapshot to the callback and, for a published run, log it for watchers."""
        self.last_report = time.monotonic()
        if self.publish is not None:
            live.log_progress(self.client, self.publish, progress)
        if self.callback is not None:
            self.callback(progress)

    def _live_info(self) -> dict[str, Any]:
        """What a published run tells processes that attach to it (msgpack/JSON-able)."""
        est = self.est
        return {
            "estimator": type(est).__name__,
            "model": est.model.get_config(),
            "t0": self.t0,
            "n_replicas": est.n_replicas,
            "n_shards": est.n_shards,
            "partitions": est.partitions,
            "n_rows": self.n_rows,
            "metric": self.metric,
        }

    def _progress(self) -> Progress:
        """Read shard 0's counters and estimate how much of the run is done."""
        est = self.est
        status = self.server.shards[0].status().result(timeout=est.timeout)
        elapsed = time.time() - self.t0
        examples = int(status["examples"])
        fractions = []
        if self.max_epochs is not None:
            fractions.append(examples / (self.max_epochs * self.n_rows))
        if est.max_steps is not None:
            total_steps = est.max_steps * est.n_replicas
            fractions.append(status["accepted"] * est.n_push / total_steps)
        if est.max_seconds is not None:
            fractions.append(elapsed / est.max_seconds)
        score = self.evals[-1][self.metric] if self.evals else math.nan
        return Progress(
            time=elapsed,
            examples=examples,
            pushes=int(status["accepted"]),
            loss=float(status["recent_loss"]),
            score=float(score),
            metric=self.metric,
            fraction=min(1.0, max(fractions, default=0.0)),
            phase=self.phase,
        )

    def _evaluate(self, params: np.ndarray, versions: list[int]) -> None:
        if self.evaluation is None:
            return
        X, y = self.evaluation
        model = self.est.model
        examples = int(self.server.shards[0].status().result(timeout=self.est.timeout)["examples"])
        self.evals.append(
            {
                "time": time.time() - self.t0,
                "version": min(versions),
                "examples_seen": examples,
                "loss": model.loss(params, X, y),
                self.metric: model.score(params, X, y),
            }
        )

    def _experiment(
        self, results: list[dict], shard_events: list, workers: list[str]
    ) -> Experiment:
        rows = [(*row, 0) if len(row) == len(PUSH_COLUMNS) - 1 else row for row in self.rows]
        pushes = pd.DataFrame(rows, columns=list(PUSH_COLUMNS)).astype(PUSH_COLUMNS)
        pushes = pushes.sort_values("time", kind="stable").reset_index(drop=True)
        eval_columns = {**EVAL_COLUMNS, self.metric: "float64"}
        evals = pd.DataFrame(self.evals, columns=list(eval_columns)).astype(eval_columns)
        events = [(t - self.t0, kind, detail) for t, kind, detail in shard_events] + self.events
        config = self.est._config(self.n_rows, workers)
        config["data"] = self.data_info
        config["replica_steps"] = [r["steps"] for r in results if r.get("partition", 0) == 0]
        config["lost_pushes"] = sum(r.get("lost_pushes", 0) for r in results)
        # how each replica (each "replica.partition" of a split model) reached each of its shards
        config["replica_transports"] = {
            (f"{r['replica']}" if self.plan is None else f"{r['replica']}.{r['partition']}"): list(
                r.get("transports", [])
            )
            for r in results
        }
        if self.plan is not None:  # what crossed partition boundaries, over the whole run
            config["partition_bytes_sent"] = sum(r.get("bytes_sent", 0) for r in results)
            first = [*self._first_shards(), self.server.n_shards]
            config["partition_slots"] = [  # where each partition ran, and whom it talked to
                {
                    "replica": r,
                    "partition": p,
                    "worker": worker,
                    "shards": list(range(first[p], first[p + 1])),
                    "sessions": list(result.get("sessions", [])),
                }
                for (r, p), worker, result in zip(self.slots, self.slot_workers, results)
            ]
        config["replica_restarts"] = self.restarts
        return Experiment(config, pushes, evals, events_frame(events))


def _restore_args(state: ShardState) -> dict[str, Any]:
    """What a shard's constructor needs to continue from a checkpointed state."""
    return {"rule_state": state.rule_state, "version": state.version, "counters": state.counters}
