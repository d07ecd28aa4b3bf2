"""One Downpour fit on a Dask client, from placing the data to the experiment log.

:class:`Driver` is what :meth:`~downpour_dask.DownpourSGD.fit` runs once its arguments are
checked.  In order: it places each replica's data on a worker (before the run's clock starts),
starts the parameter-server shards (next to replica 0's partitions with model parallelism),
starts every replica -- the others wait on the shards for replica 0's warmstart --, watches the
warmstart, supervises until every replica has finished (:mod:`.supervision`), reads the final
parameters, and always lets go of what it started: tasks, mailboxes, shards, the published
name (should the driver die first, the scheduler does, :mod:`.driver_loss`).  The decisions of
the run are its collaborators': :mod:`.supervisor`, :mod:`.shard_recovery`, :mod:`.tasks`,
:mod:`.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client

from .. import live
from ..base import RunRecorder
from ..checkpoint import Checkpoint
from ..core import protocol
from ..core.blas import one_blas_thread
from ..data.datasets import ShardedDataset
from ..log import Experiment, Progress
from ..ps.server import ParameterServer
from ..runtime.cluster import cluster_workers
from ..runtime.placement import place_replicas
from .checkpoints import Checkpoints, initial_states, restore_args, steps_pushed
from .dask_cluster import DaskCluster, DaskServer
from .divergence import check_finite
from .elastic import Elastic, newcomer_limits, training_replicas
from .model_parallel import partition_workers
from .publication import Publication
from .replica import ReplicaConfig
from .replica_count import replica_limit
from .settings import FitSettings
from .shard_recovery import ShardRecovery
from .shares import DataShares, shareable
from .supervision import Limits, SupervisionLoop, take_rows
from .supervisor import Supervisor
from .tasks import ReplicaTasks


class Driver:
    """One execution of :meth:`DownpourSGD.fit` on ``client``: call :meth:`execute` once, then
    read :attr:`params`, :attr:`status` and :attr:`experiment`.

    Parameters
    ----------
    fit : FitSettings
        The estimator's checked arguments.
    client : distributed.Client
    data : list of (X, y), or ShardedDataset
        Each replica's in-memory subset, or the files / Dask data the replicas stream.
    evaluation : (X, y), optional
        Evaluated every ``eval_every`` seconds and at the end.
    resumed : Checkpoint, optional
        The checkpoint to continue from.
    callback : callable, optional
        Receives :class:`Progress` snapshots.
    publish : str, optional
        Name to publish the running server under.
    """

    def __init__(
        self,
        fit: FitSettings,
        client: Client,
        data: Any,
        evaluation: tuple[np.ndarray, np.ndarray] | None = None,
        resumed: Checkpoint | None = None,
        callback: Callable[[Progress], None] | None = None,
        publish: str | None = None,
    ):
        self.fit, self.client, self.data, self.evaluation = fit, client, data, evaluation
        self.resumed, self.callback, self.publish = resumed, callback, publish
        self.metric = "accuracy" if fit.model.is_classifier else "r2"
        self.token = uuid.uuid4().hex[:8]  # names this run's tasks, variables, worker records
        self.wire_secret = secrets.token_bytes(32)  # the shards' direct connections ask for it
        self.cluster = DaskCluster(client, self.token, fit.timeout)
        #: The outcome, once :meth:`execute` returned.
        self.params: np.ndarray | None = None
        self.status: pd.DataFrame | None = None
        self.experiment: Experiment | None = None

    # -- the fit ---------------------------------------------------------------------------------
    def execute(self) -> None:
        """Run the fit to its end (see the module docstring for the order of things)."""
        fit, client = self.fit, self.client
        workers = self._workers()
        placed = place_replicas(  # data placement is not training time: before t0
            client, self.data, fit.n_replicas, workers, fit.batch_size, fit.model, fit.timeout
        )
        recorder = RunRecorder(self.metric)  # the run's clock starts now
        initial, restore, seed = self._initial(recorder)
        server = ParameterServer.create(
            client,
            initial,
            fit.n_shards,
            fit.rule,
            self._shard_workers(placed.replicas[0].worker, workers),
            fit.timeout,
            restore=restore,
            ranges=fit.ranges,
            max_grad_norm=fit.max_grad_norm,
            wire_secret=self.wire_secret,
        )
        view = DaskServer(server, client, fit.rule, fit.plan)
        first_shards = self._first_shards()
        arrays = None if isinstance(self.data, ShardedDataset) else self.data
        tasks = ReplicaTasks(
            self.cluster, view, fit.model, self.token, fit.timeout, fit.plan,
            [*first_shards, fit.n_shards], arrays,
        )  # fmt: skip
        publication, elastic = None, None
        if self.publish is not None:
            info = self._live_info(recorder, placed.n_rows)
            publication = Publication(client, self.publish, info)
        try:
            self.cluster.let_go_if_driver_lost(server.futures, self.publish, self.wire_secret)
            for i, future in enumerate(server.futures):  # replicas find replacements there
                self.cluster.announce_shard(i, future, 0)
            checkpoints = Checkpoints(
                view,
                initial_states(server.ranges, initial, fit.rule, restore),
                recorder,
                fit.checkpoint_every,
                fit.timeout,
                fit.checkpoint_dir,
                meta={"model": protocol.config(fit.model), "partitions": fit.partitions},
                before_write=functools.partial(take_rows, self.cluster, recorder),
            )
            self._record_start(recorder, len(workers))
            republish = publication and functools.partial(publication.republish, server)
            recovery = ShardRecovery(
                self.cluster, view, checkpoints, recorder, fit.timeout, republish,
                reported_acks=tasks.acked_version,
            )  # fmt: skip
            supervisor = Supervisor(
                self.cluster, view, tasks, recovery, recorder, fit.n_push, fit.timeout
            )
            self.cluster.watch_membership()  # workers that join or leave (.membership)
            shares = DataShares(shareable(self.data, placed.replicas), seed)
            tasks.share_of = shares.positions
            grow = functools.partial(
                self._add_replica, tasks, view, shares, placed, recorder.t0, seed
            )
            elastic = Elastic(
                self.cluster, view, tasks, recovery, recorder, fit.n_replicas, replica_limit(fit),
                grow if fit.plan is None and shares.data else None, checkpoints.before_write,
                fit.timeout, fit.n_push,
            )  # fmt: skip
            loop = SupervisionLoop(
                self.cluster, view, tasks, supervisor, checkpoints, recorder,
                self._limits(placed.n_rows), self._scorer(), self._reporter(publication), elastic,
            )  # fmt: skip
            if publication is not None:
                publication.publish(server)
            done = steps_pushed(restore, first_shards, fit.n_push)
            warm = fit.n_replicas > 1 and fit.warmstart_steps > 0 and self.resumed is None
            gate = -(-fit.warmstart_steps // fit.n_push) if warm else 0  # replica 0's pushes
            for r, place in enumerate(placed.replicas):
                start, wait_for = done.get(r, 0), gate if r else 0
                configs = [
                    self._replica_config(r, p, recorder.t0, seed, start, wait_for)
                    for p in range(fit.partitions)
                ]
                where = partition_workers(place.worker, fit.partitions, workers)
                tasks.start_replica(r, where, place.data, place.parts, configs)
            if warm:
                loop.warmstart(gate, fit.warmstart_steps)
            loop.run()
            self.params, versions = loop.finish()
            self.status = supervisor.recovering(server.status, fit.timeout)
            shard_events = supervisor.recovering(view.shard_events, fit.timeout)
            recovery.settle()  # the final count of updates lost with replaced shards
            self.status["lost_updates"] = recovery.lost_updates(fit.n_shards)
            recorder.add_events((e[0] - recorder.t0, *e[1:]) for e in shard_events)
            loop.collect_rows(last=True)  # the replicas' last rows, before they are forgotten
            loop.record_stop(versions)  # last: a shard restored in the calls above comes first
            results = tasks.ordered_results()
        finally:  # a failed driver stops the replicas first: they end against live shards
            tasks.end(functools.partial(view.request_stop, fit.timeout))
            if publication is not None:
                publication.unpublish()
            self.cluster.forget()
            server.close()
            if elastic is not None:  # its workers' shards are let go of now
                elastic.finish()
        config = {**fit.config, "n_rows": placed.n_rows, "workers": workers, "data": placed.info}
        config.update(elastic.summary(tasks.summary(results)), max_replicas=fit.max_replicas,
                      rows_per_epoch=shares.rows_read())  # fmt: skip
        config["replica_restarts"] = supervisor.restarts
        config["shard_incarnations"] = recovery.incarnations()
        self.experiment = recorder.experiment(config)
        evals = recorder.evals
        if evals:
            check_finite(self.params, evals[-1]["loss"], evals[0]["loss"])
        else:
            check_finite(self.params)

    def _initial(self, recorder: RunRecorder) -> tuple[np.ndarray, list[dict] | None, int]:
        """The server's starting vector (partition by partition with model parallelism), the
        shards' saved states when resuming -- the recorder then continues the checkpoint's log
        and time axis --, and the seed of the replicas' data order."""
        fit = self.fit
        rng = np.random.default_rng(fit.random_state)
        initial = fit.model.init(rng)  # drawn in any case: the seed below stays the same
        if fit.initial is not None:
            initial = fit.initial
        if fit.plan is not None:
            initial = fit.plan.pack(initial)
        seed = int(rng.integers(2**31)) if fit.random_state is None else fit.random_state
        if self.resumed is None:
            return initial, None, seed
        recorder.restore(self.resumed.meta, self.resumed.elapsed)
        initial = np.concatenate([s.values for s in self.resumed.shards])
        return initial, restore_args(self.resumed), seed

    def _workers(self) -> list[str]:
        """The cluster's workers, checked against what the fit needs of them."""
        partitions = self.fit.partitions
        workers = sorted(cluster_workers(self.client))
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        if partitions > len(workers):
            raise ValueError(
                f"partitions={partitions} puts each replica's partitions on "
                f"{partitions} different workers, but the cluster has {len(workers)}; use "
                f"partitions <= {len(workers)} or a cluster with more workers"
            )
        if self.publish is not None:
            Publication.check_free(self.client, self.publish)
        return workers

    def _record_start(self, recorder: RunRecorder, n_workers: int) -> None:
        """Events ``resumed`` ``{path, versions, elapsed}`` (when resuming) and ``start``
        ``{n_replicas, n_shards, n_workers}``."""
        fit, resumed = self.fit, self.resumed
        if resumed is not None:
            recorder.event(
                "resumed",
                f"from {resumed.path} at versions {resumed.versions} "
                f"({resumed.elapsed:.1f} s into the run)",
                path=str(resumed.path),
                versions=list(resumed.versions),
                elapsed=resumed.elapsed,
            )
        recorder.event(
            "start",
            f"{fit.n_replicas} replicas, {fit.n_shards} shards on {n_workers} workers",
            n_replicas=fit.n_replicas,
            n_shards=fit.n_shards,
            n_workers=n_workers,
        )

    # -- pieces ----------------------------------------------------------------------------------
    def _replica_config(
        self, r: int, p: int, t0: float, seed: int, start: int, gate: int
    ) -> ReplicaConfig:
        fit = self.fit
        return ReplicaConfig(
            replica=r,
            batch_size=fit.batch_size,
            n_fetch=fit.n_fetch,
            n_push=fit.n_push,
            max_inflight=fit.max_inflight,
            local_learning_rate=fit.local_learning_rate,
            seed=seed,  # the same for every partition of a replica: they read the same batches
            t0=t0,
            max_epochs=fit.max_epochs,
            max_steps=fit.max_steps,
            timeout=fit.timeout,
            run=self.token,
            start_step=start,
            topic=live.topic(self.publish) if self.publish is not None else "",
            partition=p,
            transport=fit.transport,
            start_after_version=gate,
            wire_secret=self.wire_secret,
            staleness_bound=fit.consistency.bound,
            n_replicas=fit.n_replicas,
            top_k=fit.top_k,
            elastic_alpha=fit.elastic_alpha,
            centre_rate=fit.rule.learning_rate,
        )

    def _add_replica(
        self, tasks: ReplicaTasks, view: DaskServer, shares: DataShares, placed: Any, t0: float,
        seed: int, replica: int, worker: str, n_active: int,
    ) -> int | None:  # fmt: skip
        """Start ``replica`` on ``worker`` (which joined) with ``1/n_active`` of what each
        training replica reads (:mod:`.shares`), for what is left of the others' epochs or
        steps; its rows per epoch, None if there was nothing to share (one file each)."""
        fit = self.fit
        split = shares.add(replica, training_replicas(tasks))
        if split is None:
            return None
        new, changed = split
        for r, positions in changed.items():  # they read less from their next epoch (or file)
            self.cluster.assign_share(tasks.workers[tasks.slots_of(r)[0]], r, positions)
        data = new
        if isinstance(self.data, list):  # in memory: to the new worker
            self.data.append(new)  # (ReplicaTasks.arrays)
            data = tuple(self.cluster.scatter(list(new), worker))
        epochs, steps = newcomer_limits(view.shard_status(0, fit.timeout), placed.n_rows or 0,
                                        fit.n_push, n_active, fit.max_epochs, fit.max_steps)
        config = dataclasses.replace(
            self._replica_config(replica, 0, t0, seed, 0, 0), max_epochs=epochs, max_steps=steps
        )
        tasks.start_replica(replica, [worker], data, (), [config])
        return shares.rows(replica)

    def _limits(self, n_rows: int | None) -> Limits:
        fit = self.fit
        return Limits(
            eval_every=fit.eval_every,
            timeout=fit.timeout,
            max_seconds=fit.max_seconds,
            max_epochs=fit.max_epochs,
            max_steps=fit.max_steps,
            n_rows=n_rows,
            n_replicas=fit.n_replicas,
            n_push=fit.n_push,
        )

    def _first_shards(self) -> list[int]:
        """Index of each partition's first shard (shard 0 alone without partitions)."""
        if self.fit.plan is None:
            return [0]
        counts = self.fit.plan.shards_per_partition(self.fit.n_shards)
        return [sum(counts[:p]) for p in range(len(counts))]

    def _shard_workers(self, first: str, workers: list[str]) -> list[str]:
        """Where each shard goes: round robin over the workers; with model parallelism, next to
        the partition of replica 0 whose parameters it holds (further shards of a partition
        continue round robin from there)."""
        plan = self.fit.plan
        if plan is None:
            return workers
        placed = []
        start = workers.index(first)
        for p, count in enumerate(plan.shards_per_partition(self.fit.n_shards)):
            for j in range(count):
                placed.append(workers[(start + p + j * plan.partitions) % len(workers)])
        return placed

    def _scorer(self) -> Callable[[np.ndarray], dict[str, float]] | None:
        """Loss and score of parameters on the evaluation data (None without any)."""
        if self.evaluation is None:
            return None
        X, y = self.evaluation
        model, metric = self.fit.model, self.metric

        def scores(params: np.ndarray) -> dict[str, float]:
            with one_blas_thread():  # beside the training, which may share these cores
                loss, score = protocol.loss_and_score(model, params, X, y)
            return {"loss": loss, metric: score}

        return scores

    def _reporter(self, publication: Publication | None) -> Callable[[Progress], None] | None:
        """Where progress snapshots go: watchers of a published run, and the callback."""
        callback = self.callback
        if publication is None:
            return callback

        def report(progress: Progress) -> None:
            publication.report(progress)
            if callback is not None:
                callback(progress)

        return report

    def _live_info(self, recorder: RunRecorder, n_rows: int | None) -> dict[str, Any]:
        """What a published run tells processes that attach to it (msgpack/JSON-able)."""
        fit = self.fit
        return {
            "estimator": "DownpourSGD",
            "model": protocol.config(fit.model),
            "t0": recorder.t0,
            "n_replicas": fit.n_replicas,
            "n_shards": fit.n_shards,
            "partitions": fit.partitions,
            "n_rows": n_rows,
            "metric": self.metric,
        }
