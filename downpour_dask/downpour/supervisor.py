"""Noticing what failed during a Downpour fit, and deciding what to do about it.

Dask re-runs tasks of a dead worker but never brings back an actor, and a replica's task is
pinned to its worker, so the :class:`Supervisor` looks at every replica task and every shard's
worker and decides:

* a **shard** whose worker left the cluster is restored (:mod:`.shard_recovery`) -- *before* any
  replica is restarted, or the restart would be handed the dead shard;
* a **replica** whose worker died (``KilledWorker``, a cancelled or lost task, its worker gone,
  or a finished task whose result died with its worker) or has not been heard from for
  ``timeout`` seconds, 10 at least (stopped or hung: Dask keeps listing it), is restarted on the
  least-loaded surviving worker, continuing after the steps it had pushed (should that worker
  stop before the replica has started there, on the next one); a model-parallel replica moves
  as a whole, its partitions on distinct workers where possible;
* a replica that raised an error of its own (a data error, a bug) ends the run with it, and so
  does the :data:`MAX_REPLICA_RESTARTS`-th restart of a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from distributed import KilledWorker

from ..base import RunRecorder
from ..ps.protocol import SHARD_ERRORS
from .model_parallel import PartitionLost
from .protocols import Cluster, Server
from .shard_recovery import ShardRecovery
from .tasks import ReplicaTasks

#: How often the driver restarts replicas whose worker died before it gives up on the run.
MAX_REPLICA_RESTARTS = 10
#: The least silence (seconds without a heartbeat) that makes a worker stopped or hung, however
#: short the fit's ``timeout``: Dask's heartbeats come every 0.5-2 s on clusters of up to 200
#: workers, and a busy worker's can come seconds late.
SILENT_AFTER = 10.0

T = TypeVar("T")


class Supervisor:
    """Checks one fit's replicas and shards, and restarts or restores what was lost.

    Parameters
    ----------
    cluster, server : Cluster, Server
        The workers, and the parameter server.
    tasks : ReplicaTasks
        The replicas' slots and tasks.
    recovery : ShardRecovery
        Restores lost shards.
    recorder : RunRecorder
        Receives ``replica_failed`` and ``replica_restarted`` events.
    n_push : int
        Steps per push: a replica restarts after ``pushes * n_push`` steps.
    timeout : float
        Seconds a shard or a task result may take.
    """

    def __init__(
        self,
        cluster: Cluster,
        server: Server,
        tasks: ReplicaTasks,
        recovery: ShardRecovery,
        recorder: RunRecorder,
        n_push: int,
        timeout: float,
    ):
        self.cluster, self.server, self.tasks = cluster, server, tasks
        self.recovery, self.recorder = recovery, recorder
        self.n_push, self.timeout = n_push, timeout
        self.restarts = 0

    def check(self) -> None:
        """Restore shards and restart replicas whose workers died; gather the results of
        finished replicas; raise a replica's own error as the run's failure."""
        tasks = self.tasks
        # A cached worker list is enough to notice a dead shard soon, but when a replica needs
        # attention the list must be fresh: lost shards are restored *before* a replica is
        # restarted, or the restart would get the dead shard's actor.
        troubled = any(
            i not in tasks.results and task.status != "pending"
            for i, task in enumerate(tasks.tasks)
        )
        alive = self.cluster.workers(fresh=troubled)
        self.recovery.poll_fences()  # replaced shards whose stopped worker came back
        for shard, worker in enumerate(list(self.server.workers)):
            if worker not in alive:
                reason = f"worker {worker} left the cluster"
                self.recovery.recover(shard, reason, self.cluster.workers())
        for i, task in enumerate(tasks.tasks):
            if i in tasks.results or i in tasks.leaving:  # leaving ones: see .elastic
                continue
            reason = self._trouble(i, task, alive)
            if reason is None:
                continue
            replica, partition = tasks.slots[i]
            self.restart(replica, reason, self._heard(), partition)

    def _heard(self) -> list[str]:
        """The live workers, but those silent for ``timeout`` seconds (stopped or hung): no
        replica is moved onto one."""
        workers = self.cluster.workers()
        heard = [w for w in workers if self.cluster.silent_for(w) < self._silence()]
        return heard or workers

    def _silence(self) -> float:
        """Seconds without a heartbeat after which a worker counts as stopped or hung."""
        return max(self.timeout, SILENT_AFTER)

    def _trouble(self, i: int, task: Any, alive: list[str]) -> str | None:
        """Why slot ``i``'s replica must be restarted, or None if it is fine; gathers the
        result of a finished task."""
        if task.status == "finished":
            # Gathered now, not at the end: a finished task's result lives on its worker,
            # and a worker that dies before the run ends would take it along.
            try:
                self.tasks.results[i] = task.result(timeout=self.timeout)
                return None
            except Exception as err:  # any way of losing it means the same
                return f"its result was lost with its worker ({err!r})"
        if task.status == "error":
            error = task.exception(timeout=self.timeout)
            # A partition whose peer died fails with PartitionLost: restart the replica too.
            if not isinstance(error, (KilledWorker, PartitionLost)):
                self.server.request_stop(self.timeout)
                raise RuntimeError(f"replica task {task.key} failed: {error!r}") from error
            return f"{error!r}"
        if task.status in ("cancelled", "lost"):
            return f"its task was {task.status}"
        worker = self.tasks.workers[i]
        if worker not in alive:
            return f"worker {worker} left the cluster"
        silent = self.cluster.silent_for(worker)
        if silent >= self._silence():  # Dask keeps a stopped worker listed, its task running
            return f"worker {worker} has not been heard from for {silent:.0f} s (stopped or hung)"
        return None

    def restart(self, replica: int, reason: str, alive: list[str], partition: int = 0) -> None:
        """Move ``replica`` to the least-loaded workers of ``alive``, after the steps it pushed.

        Events: ``replica_failed`` ``{replica, reason}`` (and ``partition`` with model
        parallelism), then ``replica_restarted`` ``{replica, workers, step}``: the new worker
        of each partition, and the step it continues after.

        Raises
        ------
        RuntimeError
            If this run already restarted :data:`MAX_REPLICA_RESTARTS` replicas.
        """
        tasks = self.tasks
        where = {} if tasks.plan is None else {"partition": partition}
        why = reason if tasks.plan is None else f"partition {partition}: {reason}"
        self.recorder.event(
            "replica_failed", f"replica {replica}: {why}", replica=replica, reason=reason, **where
        )
        if self.restarts >= MAX_REPLICA_RESTARTS:
            self.server.request_stop(self.timeout)
            raise RuntimeError(
                f"replica {replica} failed ({why}) after {self.restarts} replica restarts in "
                f"this run; giving up"
            )
        self.restarts += 1
        tasks.stop_replica(replica, f"replica {replica} is restarted: {why}")
        step = self._steps_pushed(replica)
        workers = self._resume(replica, alive, step)
        self.recorder.event(
            "replica_restarted",
            f"replica {replica} on {', '.join(workers)}, continuing after step {step}",
            replica=replica,
            workers=workers,
            step=step,
        )

    def _resume(self, replica: int, alive: list[str], step: int) -> list[str]:
        """Start ``replica`` again on the best-placed workers of ``alive`` (returned).  A start
        that times out -- a worker stopped after it was chosen, which Dask still lists -- is
        recorded as another ``replica_failed`` and tried on the workers not yet tried; the
        TimeoutError is raised once none is left."""
        candidates = list(alive)
        while True:
            workers = self._placement(replica, candidates)
            try:
                self.tasks.resume_replica(replica, workers, step)
                return workers
            except TimeoutError as err:
                candidates = [w for w in candidates if w not in workers]
                if not candidates:
                    raise
                reason = f"its start on {', '.join(workers)} did not finish: {err}"
                self.recorder.event(
                    "replica_failed", f"replica {replica}: {reason}", replica=replica,
                    reason=reason,
                )  # fmt: skip

    def _placement(self, replica: int, alive: list[str]) -> list[str]:
        """Workers for ``replica``'s partitions: those running the fewest other replicas'
        unfinished tasks first, then those holding no shard; distinct where possible."""
        tasks = self.tasks
        load = {w: 0 for w in alive}
        for i, (r, _) in enumerate(tasks.slots):
            worker = tasks.workers[i]
            if r != replica and worker in load and tasks.tasks[i].status != "finished":
                load[worker] += 1
        shard_workers = set(self.server.workers)
        ranked = sorted(alive, key=lambda w: (load[w], w in shard_workers, w))
        return [ranked[p % len(ranked)] for p in range(len(tasks.slots_of(replica)))]

    def _steps_pushed(self, replica: int) -> int:
        """Steps ``replica`` pushed, by the partition furthest ahead (none is pushed twice):
        each partition's first shard counts its accepted pushes."""
        done = 0
        for shard in self.tasks.shard_bounds[:-1]:
            status = self.server.shard_status(shard, self.timeout)
            done = max(done, int(status["accepted_by_replica"].get(replica, 0)) * self.n_push)
        return done

    # -- shard calls that may meet a lost shard --------------------------------------------------
    def recover_lost_shards(self, error: BaseException) -> None:
        """After a shard call failed with ``error``: restore the lost shard(s), or re-raise."""
        self.recovery.recover_lost(error)

    def recovering(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, restoring lost shards and calling again (up to three tries): after
        the replicas finished, the run's result still lives on the shards."""
        for attempt in range(3):
            try:
                return call(*args)
            except SHARD_ERRORS as err:
                if attempt == 2:
                    raise
                self.recover_lost_shards(err)
        raise AssertionError("unreachable")
