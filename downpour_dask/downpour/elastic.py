"""A Downpour fit that follows its cluster: replicas on workers that join, graceful departures.

:class:`Elastic` is the driver's collaborator for a cluster that changes size while the fit
runs (``cluster.scale``, ``cluster.adapt``, dask-jobqueue allocations, preempted nodes).  It
hears of workers through :mod:`.membership` (Dask's scheduler and worker plugins) and, on each
step of the supervision loop:

- **a worker joins**: while fewer than ``max_replicas`` replicas train, a new replica starts on
  it (``replica_added`` ``{replica, worker, rows}``).  It fetches the current parameters before
  its first step (a warm start) and gets a fair share of the data for the epochs the others
  have left (:func:`remaining`): ``1/n`` of what each of the others reads, for ``n`` replicas
  (they read the rest from their next epoch, or streamed from their next file: :mod:`.shares`).
- **a worker leaves** (retired, scaled down, closing): each shard it holds is fenced and its
  next incarnation starts on a staying worker from the fenced one's exact final state
  (``shard_migrated``, 0 updates lost; :meth:`.ShardRecovery.recover` with ``leaving``).  Its
  replicas finish their step, push what they accrued and return; a replica of the original
  ``n_replicas`` continues on a staying worker after the steps it made -- its data goes along,
  nothing is skipped or read twice --, an added one ends (``replica_retired`` ``{replica,
  worker, steps, moved_to}``).  Then the worker is released; one whose retirement Dask aborted
  because it held a shard (Dask never moves actors) is retired again.  A worker that goes
  before this is done (killed, or its nanny's grace period ran out) is handled by the crash
  path: :mod:`.supervisor` and :mod:`.shard_recovery` -- as does a model-parallel replica, whose
  partitions move together.

A sparse fit (:mod:`.sparse_fit`) uses it too, with ``move_replicas=False``: its shards move
as above, but its replicas only pause on the leaving worker and the crash path restarts them
once it is gone, and no replica is added.

It reaches the cluster through :mod:`.protocols` (and the membership calls of
:class:`~.dask_cluster.DaskCluster`), so its decisions are unit-tested with fakes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ..base import RunRecorder
from .shard_recovery import ShardRecovery
from .tasks import ReplicaTasks

#: Seconds the driver waits for a leaving worker's replicas to return before releasing it
#: anyway (below :data:`.membership.LEAVE_WAIT`: the worker must still be there to be released).
COLLECT_WAIT = 2.5
#: Seconds between releasing a migrated shard's old incarnation and asking Dask to retire its
#: worker again (the release reaches the scheduler on another channel than the request).
RETIRE_AGAIN_AFTER = 0.5


def remaining(limit: int | None, done: float) -> int | None:
    """What is left of ``limit`` (epochs or steps) after ``done``, at least 1 (None: no limit)."""
    if limit is None:
        return None
    return max(1, math.ceil(limit - done))


def training_replicas(tasks: Any) -> list[int]:
    """The replicas with a slot still training (its result not in), in order."""
    return sorted({r for i, (r, _) in enumerate(tasks.slots) if i not in tasks.results})


def newcomer_limits(status: dict[str, Any], n_rows: int, n_push: int, n_active: int,
                    max_epochs: int | None, max_steps: int | None) -> tuple[int | None, int | None]:
    """``(max_epochs, max_steps)`` for a replica added as the ``n_active``-th: what the others
    have left, by shard 0's counters ``status`` (its examples over the ``n_rows`` of an epoch, 0
    if unknown; its pushes, ``n_push`` steps each, shared by the ``n_active - 1`` others)."""
    epochs_done = int(status["examples"]) / max(1, n_rows)
    steps_done = int(status["accepted"]) * n_push / max(1, n_active - 1)
    return remaining(max_epochs, epochs_done), remaining(max_steps, steps_done)


def least_loaded(candidates: list[str], load: dict[str, int]) -> str:
    """The candidate worker with the lowest ``load`` (ties: the first by address)."""
    return min(candidates, key=lambda w: (load.get(w, 0), w))


class Elastic:
    """Grows and shrinks one fit with its cluster (see the module docstring).

    Parameters
    ----------
    cluster : DaskCluster or a fake
        The workers; also ``membership()``, ``release(worker)`` and ``retire(worker)``.
    server : Server
        The parameter server (``release_replaced`` lets go of a migrated incarnation).
    tasks : ReplicaTasks
        The replicas' slots and tasks.
    recovery : ShardRecovery
        Moves shards (fence, final state, next incarnation).
    recorder : RunRecorder
        Receives the events.
    n_replicas : int
        The replicas the fit started with: they keep training wherever their worker goes.
    max_replicas : int or float, optional
        Upper bound on replicas training at once (``inf``: a replica on every worker that
        joins); None: no replica is added.
    add_replica : callable, optional
        ``add_replica(replica, worker, n_active)`` starts replica ``replica`` on ``worker`` with
        a fair share of the data among ``n_active`` replicas and returns its rows, or None
        without starting it when there is no data to share.
    collect : callable, optional
        Takes in the replicas' push-log rows (before a leaving worker is released).
    timeout : float
        Seconds a task result may take.
    n_push : int
        Steps per push (what an added replica lost with its worker had made).
    move_replicas : bool
        Whether a leaving worker's replicas stop after their next push and are moved here
        (their tasks return a ``retired`` result); False (a sparse fit's replicas): they are
        told to pause after their next push, the worker is released as soon as its shards have
        moved, and once it is gone the supervisor's crash path restarts them after the steps
        they pushed.
    """

    def __init__(
        self,
        cluster: Any,
        server: Any,
        tasks: ReplicaTasks,
        recovery: ShardRecovery,
        recorder: RunRecorder,
        n_replicas: int,
        max_replicas: float | None = None,
        add_replica: Callable[[int, str, int], int | None] | None = None,
        collect: Callable[[], None] | None = None,
        timeout: float = 60.0,
        n_push: int = 1,
        move_replicas: bool = True,
    ):
        self.cluster, self.server, self.tasks = cluster, server, tasks
        self.recovery, self.recorder = recovery, recorder
        self.n_replicas, self.max_replicas = n_replicas, max_replicas
        self.add_replica, self.collect, self.timeout = add_replica, collect, timeout
        self.n_push, self.move_replicas = n_push, move_replicas
        self.known = set(cluster.workers())
        self.joined: list[str] = []  # workers that joined and host no replica yet
        self.leaving: dict[str, float] = {}  # worker -> when it is released at the latest
        self.departing = tasks.leaving  # slot -> its leaving worker (the supervisor skips it)
        self.released: set[str] = set()
        self.retire_again: set[str] = set()
        self.retire_due: dict[str, float] = {}  # worker -> when its retirement is asked again
        #: Replicas that stopped because their worker left: ``{replica, worker, steps,
        #: moved_to}``.
        self.retired: list[dict[str, Any]] = []
        self.handled: set[int] = set()  # ids of the retired results already acted on
        self.returned: list[dict[str, Any]] = []  # results of replicas that moved on
        self.added: list[dict[str, Any]] = []

    # -- each supervision step -------------------------------------------------------------------
    def check(self) -> None:
        """Act on what was heard since the last step; collect leaving workers' replicas."""
        for event in self.cluster.membership():
            action, worker = event.get("action"), event.get("worker")
            if action == "joined" and worker not in self.known:
                self.known.add(worker)
                self.joined.append(worker)
            elif action == "leaving" and worker in self.known:
                self.leave(worker, str(event.get("status", "")))
            elif action == "left":
                self.known.discard(worker)
                self.joined = [w for w in self.joined if w != worker]
        self._collect_departing()
        for i, result in self._returned_results():  # also those the supervisor took
            if id(result) not in self.handled:
                self._retire_replica(i, self.tasks.workers[i], result)
        self._grow()

    def settled(self) -> bool:
        """Whether no leaving worker's replica is still being collected or moved."""
        unhandled = any(id(r) not in self.handled for _, r in self._returned_results())
        return not self.departing and not unhandled

    def _returned_results(self) -> list[tuple[int, dict[str, Any]]]:
        """The slots whose replica returned because its worker was leaving, with its result."""
        if not self.move_replicas:  # (a sparse replica's result is its push records)
            return []
        return [(i, r) for i, r in list(self.tasks.results.items()) if r.get("retired")]

    def active(self) -> int:
        """Replicas with a slot still training."""
        return len(training_replicas(self.tasks))

    # -- joins -----------------------------------------------------------------------------------
    def _grow(self) -> None:
        if self.max_replicas is None or self.add_replica is None:
            return
        if not self.joined or self.active() >= self.max_replicas:
            return
        hosting = {self.tasks.workers[i] for i in range(len(self.tasks.slots))}
        # Asked afresh (which also renews the list the supervisor reads): a replica on a worker
        # missing from a stale list would look like one whose worker left, and be restarted.
        alive = self.cluster.workers(fresh=True)
        ready = [w for w in self.joined if w in alive]
        self.joined = [w for w in self.joined if w not in alive]  # not listed yet: next time
        while ready and self.active() < self.max_replicas:
            worker = ready.pop(0)
            if worker in self.leaving or worker in hosting:
                continue
            replica = 1 + max((r for r, _ in self.tasks.slots), default=-1)
            rows = self.add_replica(replica, worker, self.active() + 1)
            if rows is None:  # nothing to share (each replica reads a single file)
                continue
            self.added.append({"replica": replica, "worker": worker, "rows": rows})
            self.recorder.event(
                "replica_added",
                f"replica {replica} on {worker}, which joined the cluster ({rows} rows)",
                replica=replica,
                worker=worker,
                rows=rows,
            )
        self.joined = ready + self.joined  # those that wait for room

    # -- departures ------------------------------------------------------------------------------
    def leave(self, worker: str, status: str = "") -> None:
        """``worker`` is going: move its shards, stop its replicas (collected later), and
        release it once nothing of the fit is left on it."""
        if worker in self.leaving:
            return
        self.leaving[worker] = time.monotonic() + COLLECT_WAIT
        self.joined = [w for w in self.joined if w != worker]
        staying = [w for w in self.cluster.workers() if w not in self.leaving]
        if staying:
            for shard, holder in enumerate(list(self.server.workers)):
                if holder == worker:
                    self._migrate(shard, worker, staying)
                    if status == "closing_gracefully":  # Dask aborted: an actor's worker
                        self.retire_again.add(worker)
        tasks = self.tasks
        running = [i for i, w in enumerate(tasks.workers) if w == worker and i not in tasks.results]
        if self.move_replicas and tasks.plan is None:
            # a split replica (model parallelism) moves as a whole: the supervisor's crash path
            self.departing.update({i: worker for i in running})
        pausing = running and not self.move_replicas  # (they pause until the worker goes)
        if pausing or any(w == worker for w in self.departing.values()):
            self.cluster.stop_replicas_on(worker)
        self._collect_departing()

    def _migrate(self, shard: int, worker: str, staying: list[str]) -> None:
        generation = self.server.generation(shard)
        reason = f"worker {worker} is leaving the cluster"
        self.recovery.recover(shard, reason, staying, leaving=True)
        last = self.recovery.retired[-1]
        if last.fenced and hasattr(self.server, "release_replaced"):
            self.server.release_replaced(shard, generation)  # nothing of it left to ask

    def _collect_departing(self) -> None:
        now, tasks = time.monotonic(), self.tasks
        alive = set(self.cluster.workers(fresh=False))
        returned: dict[str, dict[int, dict[str, Any]]] = {}  # worker -> replica -> result
        for i, worker in list(self.departing.items()):
            task, result = tasks.tasks[i], None
            if i in tasks.results or task.status == "finished":
                try:
                    result = tasks.results.get(i) or task.result(timeout=self.timeout)
                except Exception:  # noqa: BLE001 - lost with its worker: see below
                    result = None
            elif worker in alive:  # a closing worker cancelled the task: its registry has it
                if worker not in returned:
                    returned[worker] = {r["replica"]: r for r in self.cluster.returned(worker)}
                result = returned[worker].get(tasks.slots[i][0])
                if result is None and now <= self.leaving[worker]:
                    continue  # still finishing its step
            del self.departing[i]
            if result is not None and result.get("retired") and id(result) not in self.handled:
                self._retire_replica(i, worker, result)
            elif result is not None:
                tasks.results[i] = result  # it had finished its work: nothing to move
            elif tasks.slots[i][0] >= self.n_replicas:  # an added replica, gone with its result
                self._retire_replica(i, worker, self._lost_result(tasks.slots[i][0]))
            # an original replica whose result is lost: the supervisor's crash path restarts it
        for worker in self.leaving:
            if worker in self.released or worker in self.departing.values():
                continue
            if self.collect is not None:
                self.collect()  # its replicas' last rows, while it is still there
            self.cluster.release(worker)
            self.released.add(worker)
            if worker in self.retire_again:  # once the scheduler let go of the moved shards
                self.retire_due[worker] = now + RETIRE_AGAIN_AFTER
        for worker, due in list(self.retire_due.items()):
            if now >= due:
                del self.retire_due[worker]
                if worker in self.cluster.workers(fresh=False):
                    self.cluster.retire(worker)

    def _lost_result(self, replica: int) -> dict[str, Any]:
        """What stands for the result of an added replica that left with its worker: the
        pushes each shard accepted of it (its newest push-log rows are lost with the worker)
        and the steps they make."""
        accepted = {
            str(s): int(self.server.shard_status(s, self.timeout)["accepted_by_replica"].get(
                replica, 0))
            for s in range(len(self.server.ranges))
        }  # fmt: skip
        return {"replica": replica, "partition": 0, "steps": accepted["0"] * self.n_push,
                "acknowledged": {s: {"shards' count": [n, 0]} for s, n in accepted.items()},
                "retired": True, "result_lost": True}  # fmt: skip

    def _retire_replica(self, i: int, worker: str, result: dict[str, Any]) -> None:
        """Slot ``i``'s replica returned from leaving ``worker``: an original replica with work
        left continues on a staying worker, an added one ends."""
        tasks = self.tasks
        self.handled.add(id(result))
        replica = tasks.slots[i][0]
        steps = int(result.get("steps", 0))
        staying = [w for w in self.cluster.workers() if w not in self.leaving and w != worker]
        moved_to = None
        if result.get("retired") and replica < self.n_replicas and staying:
            self.returned.append(result)  # its acknowledgements count in the summary
            load = {w: 0 for w in staying}
            for j, w in enumerate(tasks.workers):
                if j not in tasks.results and j != i and w in load:
                    load[w] += 1
            moved_to = least_loaded(staying, load)
            tasks.stop_replica(replica, f"worker {worker} left")
            tasks.resume_replica(replica, [moved_to], steps)
        else:
            tasks.results[i] = result
        self.retired.append(
            {"replica": replica, "worker": worker, "steps": steps, "moved_to": moved_to}
        )
        where = f", continues on {moved_to}" if moved_to else ""
        self.recorder.event(
            "replica_retired",
            f"replica {replica} left {worker} after {steps} steps{where}",
            replica=replica,
            worker=worker,
            steps=steps,
            moved_to=moved_to,
        )

    def finish(self) -> None:
        """At the end of the fit (its shards let go of): retirements still to be asked again."""
        for worker in list(self.retire_due):
            del self.retire_due[worker]
            self.cluster.retire(worker)

    def summary(self, replicas: dict[str, Any]) -> dict[str, Any]:
        """For the experiment's config: replicas added, replicas retired (``{replica, worker,
        steps, moved_to}``), and ``replicas`` -- the tasks' summary of the replicas' final
        results -- with the pushes of the replicas that moved added in (acknowledged, lost)."""
        acked = dict(replicas.get("acknowledged_pushes", {}))
        lost = replicas.get("lost_pushes", 0)
        for result in self.returned:
            lost += result.get("lost_pushes", 0)
            for shard, by_generation in result.get("acknowledged", {}).items():
                acked[shard] = acked.get(shard, 0) + sum(n for n, _ in by_generation.values())
        return {
            **replicas,
            "acknowledged_pushes": acked,
            "lost_pushes": lost,
            "replicas_added": list(self.added),
            "replicas_retired": list(self.retired),
        }
