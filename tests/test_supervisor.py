"""The Downpour driver's decisions, in-process: fake cluster, fake shards, fake clock, no Dask.

The supervision loop, the supervisor, shard recovery, the replica tasks and checkpoints talk to
the cluster and the shards only through :mod:`downpour_dask.downpour.protocols`; these fakes
implement those protocols, so every decision -- restart which replica where and from which
step, restore a shard from which copy, when to evaluate, when to stop -- is checked here
without a cluster.  ``tests/test_failures.py`` checks the same story for real, with SIGKILL.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from distributed import KilledWorker

from downpour_dask.base import RunRecorder
from downpour_dask.core import models
from downpour_dask.core.partition import PartitionPlan
from downpour_dask.downpour.checkpoints import Checkpoints
from downpour_dask.downpour.replica import ReplicaConfig
from downpour_dask.downpour.shard_recovery import ShardRecovery
from downpour_dask.downpour.supervision import Limits, SupervisionLoop
from downpour_dask.downpour.supervisor import MAX_REPLICA_RESTARTS, Supervisor
from downpour_dask.downpour.tasks import ReplicaTasks
from downpour_dask.log import Progress
from downpour_dask.ps.calls import Done
from downpour_dask.ps.protocol import ShardLostError

SHARD_SIZE = 4


class FakeClock:
    """Wall-clock seconds that move only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeTask:
    """A task with the status and outcome a test gives it."""

    key: str
    status: str = "pending"
    outcome: Any = None  # the result, or the error of an "error" task
    cancelled: bool = False

    def done(self) -> bool:
        return self.status != "pending"

    def result(self, timeout: float | None = None) -> Any:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.outcome if isinstance(self.outcome, BaseException) else None

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self, result: dict) -> None:
        self.status, self.outcome = "finished", result


@dataclass
class Submission:
    function: Any
    args: tuple
    worker: str
    task: FakeTask

    @property
    def config(self) -> ReplicaConfig:
        return next(a for a in self.args if isinstance(a, ReplicaConfig))


@dataclass
class FakeMailbox:
    """A model-parallel partition's mailbox; ``close`` makes waiting partitions give up."""

    worker: str
    closed: str | None = None

    def close(self, reason: str) -> FakeTask:
        self.closed = reason
        return FakeTask("close", "finished")


@dataclass
class FakeCluster:
    """Workers by name; ``wait`` advances the clock by its timeout, then calls ``on_wait``."""

    alive: list[str]
    clock: FakeClock
    submitted: list[Submission] = field(default_factory=list)
    scattered: list[tuple[str, int]] = field(default_factory=list)
    copies: dict[str, Any] = field(default_factory=dict)  # worker -> (version, values)
    rows: list[tuple] = field(default_factory=list)
    announced: list[tuple[int, Any]] = field(default_factory=list)
    on_wait: Any = None
    born_failed: set[int] = field(default_factory=set)  # replicas whose tasks die at once
    mailboxes: list[FakeMailbox] = field(default_factory=list)
    acked: dict[str, int] = field(default_factory=dict)  # shard key -> newest acknowledged
    silent: dict[str, float] = field(default_factory=dict)  # worker -> seconds not heard from
    stopped: set[str] = field(default_factory=set)  # workers a scatter to times out

    def workers(self, fresh: bool = True) -> list[str]:
        return sorted(self.alive)

    def silent_for(self, worker: str) -> float:
        return self.silent.get(worker, 0.0)

    def submit(self, function: Any, *args: Any, worker: str, key: str) -> FakeTask:
        task = FakeTask(key)
        replica = next(a for a in args if isinstance(a, ReplicaConfig)).replica
        if replica in self.born_failed:
            task.status, task.outcome = "error", KilledWorker(key, worker, 3)
        self.submitted.append(Submission(function, args, worker, task))
        return task

    def start_actor(self, cls: type, worker: str, *args, key: str) -> FakeTask:
        mailbox = FakeMailbox(worker)
        self.mailboxes.append(mailbox)
        return FakeTask(key, "finished", mailbox)

    def scatter(self, values: list[Any], worker: str) -> list[Any]:
        self.scattered.append((worker, len(values)))
        if worker in self.stopped:
            raise TimeoutError(f"sending a replica's data to worker {worker} did not finish")
        return [f"{worker}/{i}" for i in range(len(values))]

    def wait(self, tasks: list[FakeTask], timeout: float) -> None:
        self.clock.now += timeout
        if self.on_wait is not None:
            self.on_wait()

    def fetched_copies(self, shard: int, key: str, workers: list[str]) -> dict[str, Any]:
        return {w: self.copies.get(w) for w in workers}

    def drain_rows(self, last: bool = False) -> list[tuple]:
        rows, self.rows = self.rows, []
        return rows

    def announce_shard(self, shard: int, future: Any, generation: int = 0) -> None:
        self.announced.append((shard, future))

    def acknowledged(self, shard: int, key: str) -> int | None:
        return self.acked.get(key)


class Later:
    """A call that completes when the test says so (a stopped worker that comes back)."""

    def __init__(self) -> None:
        self.value: Any = None

    def done(self) -> bool:
        return self.value is not None

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class FakeServer:
    """Shards on named workers, with versions and per-replica push counts a test sets."""

    def __init__(self, workers: list[str]):
        self.workers = list(workers)
        self.ranges = [(i * SHARD_SIZE, (i + 1) * SHARD_SIZE) for i in range(len(workers))]
        self.version = [0] * len(workers)
        self.accepted_by_replica: dict[int, int] = {}
        self.lost: set[int] = set()
        self.generations = [0] * len(workers)
        self.alive: list[str] = list(workers)  # the cluster's (a test's _run shares its list)
        self.retired: dict[tuple[int, int], int] = {}  # (shard, generation) -> version
        self.stalled: set[int] = set()  # shards whose worker is stopped: retiring them waits
        self.unplaceable: set[str] = set()  # workers that died unnoticed: a shard never starts
        self.later: dict[tuple[int, int], Later] = {}
        self.replaced: list[tuple[int, np.ndarray, str, dict]] = []
        self.stop_requests = 0
        self.releases = 0

    def _check(self) -> None:
        for i in sorted(self.lost):
            raise ShardLostError(f"shard {i} is gone", i)

    def shard_key(self, shard: int) -> str:
        return f"shard-{shard}-{self.generations[shard]}"

    def generation(self, shard: int) -> int:
        return self.generations[shard]

    def start_retire(self, shard: int, generation: int) -> Any:
        """Reachable (and retired) if the shard's worker is alive and the shard not lost; a
        ``stalled`` shard's retirement is a :class:`Later` the test completes."""
        if shard in self.stalled and (shard, generation) not in self.retired:
            return self.later.setdefault((shard, generation), Later())
        if generation == self.generations[shard]:
            if shard in self.lost or self.workers[shard] not in self.alive:
                return Done(error=ShardLostError(f"shard {shard} is gone", shard))
            self.retired[(shard, generation)] = self.version[shard]
        if (shard, generation) not in self.retired:
            return Done(error=ShardLostError(f"shard {shard} is gone", shard))
        version = self.retired[(shard, generation)]
        state = self.export_state(0)[shard] | {"version": version}
        return Done({"version": version, "state": state})

    def portable(self, first: int = 0, stop: int | None = None) -> Any:
        return ("server", first, stop)

    def versions(self, timeout: float) -> list[int]:
        self._check()
        return list(self.version)

    def pull(self, timeout: float) -> tuple[np.ndarray, list[int]]:
        self._check()
        return np.zeros(self.ranges[-1][1], np.float32), list(self.version)

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        if shard in self.lost:
            raise ShardLostError(f"shard {shard} is gone", shard)
        accepted = sum(self.accepted_by_replica.values())
        return {
            "examples": 32 * accepted,
            "accepted": accepted,
            "recent_loss": 1.0,
            "accepted_by_replica": dict(self.accepted_by_replica),
        }

    def lost_shards(self, timeout: float) -> list[int]:
        return sorted(self.lost)

    def request_stop(self, timeout: float) -> None:
        self.stop_requests += 1

    def release_warmstart(self, timeout: float) -> None:
        self.releases += 1

    def export_state(self, timeout: float) -> list[dict[str, Any]]:
        self._check()
        return [
            {"values": np.zeros(SHARD_SIZE, np.float32), "rule_state": {}, "version": v}
            | {"counters": {}}
            for v in self.version
        ]

    def replace_shard(
        self, shard: int, values: np.ndarray, worker: str, state: dict, timeout: float
    ) -> str:
        if worker in self.unplaceable:
            raise TimeoutError("timed out after 5 s.")
        self.replaced.append((shard, np.array(values), worker, state))
        self.workers[shard] = worker
        self.version[shard] = state["version"]
        self.generations[shard] += 1
        self.lost.discard(shard)
        return f"future-of-{self.shard_key(shard)}"


def _run(
    workers: list[str],
    shard_workers: list[str],
    replica_workers: list[Any],
    n_push: int = 1,
    limits: Limits | None = None,
    score: Any = None,
    partitions: int = 1,
) -> SimpleNamespace:
    """A fit's collaborators over fakes, every replica started (in-memory data); with
    ``partitions``, ``replica_workers[r]`` lists the workers of replica r's partitions."""
    clock = FakeClock()
    recorder = RunRecorder("accuracy", clock=clock)
    cluster = FakeCluster(list(workers), clock)
    server = FakeServer(shard_workers)
    server.alive = cluster.alive
    states = [
        {"values": np.zeros(SHARD_SIZE, np.float32), "rule_state": {}, "version": 0, "counters": {}}
        for _ in shard_workers
    ]
    checkpoints = Checkpoints(server, states, recorder, every=3600.0, timeout=5.0)
    model = models.MLP(2, (4,), 2)
    plan = PartitionPlan(model, partitions) if partitions > 1 else None
    bounds = [0, 1, 2] if plan is not None else None  # partition p owns shard p
    arrays = [(np.zeros((8, 2), np.float32), np.zeros(8, np.int64)) for _ in replica_workers]
    tasks = ReplicaTasks(cluster, server, model, "run", 5.0, plan, bounds, arrays)
    for r, where in enumerate(replica_workers):
        configs = [
            ReplicaConfig(
                replica=r, batch_size=4, n_fetch=1, n_push=n_push, local_learning_rate=0.1,
                seed=0, t0=0, partition=p,
            )
            for p in range(partitions)
        ]  # fmt: skip
        tasks.start_replica(
            r, [where] if partitions == 1 else where, (f"X{r}", f"y{r}"), [], configs
        )
    recovery = ShardRecovery(
        cluster, server, checkpoints, recorder, timeout=5.0, reported_acks=tasks.acked_version
    )
    supervisor = Supervisor(cluster, server, tasks, recovery, recorder, n_push, timeout=5.0)
    loop = SupervisionLoop(
        cluster,
        server,
        tasks,
        supervisor,
        checkpoints,
        recorder,
        limits or Limits(eval_every=0.5, timeout=5.0),
        score,
    )
    return SimpleNamespace(
        clock=clock, recorder=recorder, cluster=cluster, server=server, tasks=tasks,
        checkpoints=checkpoints, supervisor=supervisor, loop=loop,
    )  # fmt: skip


def _events(run: SimpleNamespace, kind: str) -> list[dict]:
    return [e.data for e in run.recorder.events if e.kind == kind]


def _kinds(run: SimpleNamespace) -> list[str]:
    return [e.kind for e in run.recorder.events]


def _finish_all(run: SimpleNamespace) -> None:
    for r, task in enumerate(run.tasks.tasks):
        if task.status == "pending":
            task.finish({"replica": r, "partition": 0, "steps": 10})


# -- replicas --------------------------------------------------------------------------------------


def test_a_replica_killed_with_its_worker_restarts_on_the_least_loaded_survivor_after_its_pushes():
    # shards on w0 and w3; replicas 0..3 on w0, w1, w2, w1: w2 dies with replica 2
    run = _run(["w0", "w1", "w2", "w3"], ["w0", "w3"], ["w0", "w1", "w2", "w1"], n_push=2)
    run.server.accepted_by_replica = {0: 30, 1: 25, 2: 17, 3: 20}
    old = run.tasks.tasks[2]
    old.status, old.outcome = "error", KilledWorker(old.key, "w2", 3)
    run.cluster.alive.remove("w2")
    run.supervisor.check()

    failed, restarted = _events(run, "replica_failed"), _events(run, "replica_restarted")
    assert [f["replica"] for f in failed] == [2] and "KilledWorker" in failed[0]["reason"]
    # w3 holds a shard but runs no replica: the least loaded (w0 runs one, w1 two)
    assert restarted == [{"replica": 2, "workers": ["w3"], "step": 34}]  # 17 pushes x n_push 2
    new = run.cluster.submitted[-1]
    assert new.worker == "w3" and new.config.replica == 2 and new.config.start_step == 34
    assert new.task.key != old.key and old.cancelled
    assert run.tasks.tasks[2] is new.task and run.tasks.workers[2] == "w3"
    assert run.cluster.scattered == [("w3", 2)]  # its data died with w2: sent again, to w3
    assert new.args[2] == ("w3/0", "w3/1")
    assert run.supervisor.restarts == 1 and run.server.stop_requests == 0


def test_a_replica_whose_worker_falls_silent_for_the_timeout_moves_to_a_worker_still_heard():
    # Dask keeps a stopped (SIGSTOP) worker listed and its task running: only its heartbeats
    # stop.  Replicas 0..2 on w0, w1, w2; the fit's timeout is 5 s, but a silence is only
    # believed from 10 s on (SILENT_AFTER): w1 silent for 9.9 s is waited for, at 10 s not.
    run = _run(["w0", "w1", "w2"], ["w0", "w2"], ["w0", "w1", "w2"])
    run.server.accepted_by_replica = {1: 12}
    run.cluster.silent = {"w1": 9.9}
    run.supervisor.check()
    assert _events(run, "replica_failed") == []
    run.cluster.silent = {"w1": 10.0, "w2": 10.5}  # w2, silent too, is no place to move it to
    run.supervisor.check()
    failed = _events(run, "replica_failed")
    assert [f["replica"] for f in failed] == [1, 2]
    assert failed[0]["reason"] == "worker w1 has not been heard from for 10 s (stopped or hung)"
    assert [r["workers"] for r in _events(run, "replica_restarted")] == [["w0"], ["w0"]]
    assert run.tasks.workers[1] == run.tasks.workers[2] == "w0"
    assert run.cluster.scattered == [("w0", 2), ("w0", 2)]  # their data, again, to w0


def test_a_replica_whose_new_worker_stops_before_it_starts_there_starts_on_the_next_one():
    # w2 dies with replica 2; w3, the least loaded, was stopped (SIGSTOP) after the check that
    # chose it, so Dask still lists it and the replica's data never reaches it
    run = _run(["w0", "w1", "w2", "w3"], ["w0", "w3"], ["w0", "w1", "w2", "w1"])
    run.server.accepted_by_replica = {2: 9}
    old = run.tasks.tasks[2]
    old.status, old.outcome = "error", KilledWorker(old.key, "w2", 3)
    run.cluster.alive.remove("w2")
    run.cluster.stopped.add("w3")
    run.supervisor.check()

    failed = _events(run, "replica_failed")
    assert [f["replica"] for f in failed] == [2, 2]
    assert failed[1]["reason"].startswith("its start on w3 did not finish: sending a replica's")
    assert _events(run, "replica_restarted") == [{"replica": 2, "workers": ["w0"], "step": 9}]
    assert run.cluster.scattered == [("w3", 2), ("w0", 2)]
    new = run.cluster.submitted[-1]
    assert new.worker == "w0" and new.config.start_step == 9 and run.tasks.workers[2] == "w0"
    assert [s.worker for s in run.cluster.submitted].count("w3") == 0
    assert run.supervisor.restarts == 1


def test_a_restart_that_no_surviving_worker_takes_ends_the_fit_with_the_named_timeout():
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1", "w2"])
    old = run.tasks.tasks[2]
    old.status, old.outcome = "error", KilledWorker(old.key, "w2", 3)
    run.cluster.alive.remove("w2")
    run.cluster.stopped.update({"w0", "w1"})
    with pytest.raises(TimeoutError, match="sending a replica's data to worker w1"):
        run.supervisor.check()
    assert run.cluster.scattered == [("w0", 2), ("w1", 2)]  # each tried once
    assert "replica_restarted" not in _kinds(run)


def test_among_equally_loaded_survivors_a_worker_without_a_shard_is_preferred():
    run = _run(["w0", "w1", "w2", "w3"], ["w0", "w1"], ["w0", "w1", "w2", "w3"])
    run.tasks.tasks[0].finish({"replica": 0, "partition": 0, "steps": 10})  # w0: nothing runs
    run.tasks.tasks[1].finish({"replica": 1, "partition": 0, "steps": 10})  # w1: nothing runs
    run.tasks.tasks[3].finish({"replica": 3, "partition": 0, "steps": 10})  # w3: nothing runs
    run.cluster.alive.remove("w2")  # replica 2's task stays pending: its worker is gone
    run.supervisor.check()
    assert _events(run, "replica_restarted") == [{"replica": 2, "workers": ["w3"], "step": 0}]
    assert sorted(run.tasks.results) == [0, 1, 3]  # finished results gathered, not restarted


def test_a_finished_replica_whose_result_died_with_its_worker_runs_again_from_its_pushes():
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1", "w2"])
    run.server.accepted_by_replica = {2: 40}
    task = run.tasks.tasks[2]
    task.status, task.outcome = "finished", OSError("worker w2 is gone")  # gathering fails
    run.supervisor.check()
    assert _events(run, "replica_restarted") == [{"replica": 2, "workers": ["w2"], "step": 40}]
    assert "result was lost" in _events(run, "replica_failed")[0]["reason"]


def test_a_replica_that_raises_its_own_error_fails_the_run_with_that_error():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"])
    task = run.tasks.tasks[1]
    task.status, task.outcome = "error", ValueError("row 7 of part-3.parquet has 5 features")
    with pytest.raises(RuntimeError, match="replica task replica-1-run-0 failed: ValueError") as e:
        run.supervisor.check()
    assert isinstance(e.value.__cause__, ValueError)
    assert run.server.stop_requests == 1  # the other replicas are told to stop
    assert _events(run, "replica_restarted") == [] and len(run.cluster.submitted) == 2


def test_restarts_beyond_max_replica_restarts_give_up_and_stop_the_replicas():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"])
    run.cluster.born_failed.add(1)  # every task of replica 1 dies at once
    task = run.tasks.tasks[1]
    task.status, task.outcome = "error", KilledWorker(task.key, "w1", 3)
    for _ in range(MAX_REPLICA_RESTARTS):
        run.supervisor.check()
    assert run.supervisor.restarts == MAX_REPLICA_RESTARTS
    assert run.server.stop_requests == 0
    with pytest.raises(RuntimeError, match=f"after {MAX_REPLICA_RESTARTS} replica restarts"):
        run.supervisor.check()
    assert run.server.stop_requests == 1
    assert len(_events(run, "replica_failed")) == MAX_REPLICA_RESTARTS + 1
    assert len(_events(run, "replica_restarted")) == MAX_REPLICA_RESTARTS
    assert len({s.task.key for s in run.cluster.submitted}) == len(run.cluster.submitted)


def test_a_split_replica_moves_as_a_whole_to_distinct_workers_with_new_mailboxes():
    # replica 0's partitions on w0, w1 (with the shards), replica 1's on w2, w3: w3 dies
    run = _run(["w0", "w1", "w2", "w3"], ["w0", "w1"], [["w0", "w1"], ["w2", "w3"]], partitions=2)
    run.server.accepted_by_replica = {1: 12}
    old_tasks, old_boxes = run.tasks.tasks[2:], run.cluster.mailboxes[2:]
    run.cluster.alive.remove("w3")
    run.supervisor.check()

    failed = _events(run, "replica_failed")
    assert [(f["replica"], f["partition"]) for f in failed] == [(1, 1)]
    # w2 runs nothing else; w0 and w1 one partition each and a shard each: the first by name
    assert _events(run, "replica_restarted") == [
        {"replica": 1, "workers": ["w2", "w0"], "step": 12}
    ]
    assert all(t.cancelled for t in old_tasks)  # both partitions go, the live one too
    assert all(box.closed and "replica 1 is restarted" in box.closed for box in old_boxes)
    new_boxes = run.tasks.mailboxes[1]
    assert [box.result().worker for box in new_boxes] == ["w2", "w0"]
    moved = run.cluster.submitted[-2:]
    assert [(m.worker, m.config.partition, m.config.start_step) for m in moved] == [
        ("w2", 0, 12),
        ("w0", 1, 12),
    ]
    assert [m.args[0] for m in moved] == [("server", 0, 1), ("server", 1, 2)]  # its own shards


# -- shards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "copy_version,source,version,lost",
    [(12, "fetched_copy", 12, 3), (8, "checkpoint", 10, 5)],
)
def test_a_shard_whose_worker_left_is_restored_from_the_fresher_of_checkpoint_and_copy(
    copy_version, source, version, lost
):
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w2", "w2"])
    checkpointed = np.full(SHARD_SIZE, 10, np.float32)
    run.checkpoints.replaced(1, {"values": checkpointed, "rule_state": {"s": 1}, "version": 10})
    run.checkpoints.observe([0, 15])  # the driver saw shard 1 at version 15
    fetched = np.full(SHARD_SIZE, copy_version, np.float32)
    run.cluster.copies = {"w2": (copy_version, fetched)}
    run.cluster.alive.remove("w1")
    run.supervisor.check()

    assert _events(run, "shard_lost") == [
        {"shard": 1, "worker": "w1", "reason": "worker w1 left the cluster", "generation": 0}
    ]
    assert _events(run, "shard_restored") == [
        {"shard": 1, "worker": "w2", "source": source, "version": version, "lost_updates": lost}
        | {"generation": 1, "fenced": False, "acknowledged": 15}
    ]  # w2 holds no other shard; w0 holds shard 0
    shard, values, worker, state = run.server.replaced[0]
    assert (shard, worker, state["version"], state["rule_state"]) == (1, "w2", version, {"s": 1})
    np.testing.assert_array_equal(values, np.full(SHARD_SIZE, version, np.float32))
    assert run.cluster.announced == [(1, "future-of-shard-1-1")]  # replicas switch to it
    assert run.checkpoints.saved[1]["version"] == version  # the next loss restores from here
    assert run.checkpoints.known_versions[1] == version
    assert _events(run, "replica_failed") == []  # no replica ran on w1


def test_a_shard_that_stopped_answering_but_can_be_retired_is_restored_from_itself():
    """A timeout is not a loss until the old incarnation is fenced: here it can be reached,
    so it is retired and its own final state continues -- nothing is lost."""
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w2"])
    run.server.version = [5, 9]
    run.supervisor.recovery.recover(1, "shard 1 did not answer within 5 s", run.cluster.workers())
    [restored] = _events(run, "shard_restored")
    assert restored["source"] == "retired_shard" and restored["fenced"] is True
    assert (restored["version"], restored["lost_updates"], restored["generation"]) == (9, 0, 1)
    assert run.server.retired == {(1, 0): 9}  # retired before the replacement started
    assert run.server.replaced[0][3]["version"] == 9


def test_acknowledgements_a_finished_replica_reported_count_when_its_worker_dies_with_the_shard():
    """A replica that finished on the lost shard's worker took the worker-side record of what
    the shard acknowledged along; its result, already in the driver's hands, still counts."""
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w1", "w2"])
    run.checkpoints.replaced(1, {"values": np.zeros(SHARD_SIZE), "rule_state": {}, "version": 10})
    run.checkpoints.observe([0, 12])  # the driver's last poll
    run.tasks.tasks[0].finish(
        {"replica": 0, "partition": 0, "steps": 10, "acknowledged": {"1": {"0": [20, 19]}}}
    )
    run.supervisor.check()  # the result is gathered
    run.cluster.alive.remove("w1")  # shard 1 and replica 0's worker
    run.supervisor.check()
    [restored] = _events(run, "shard_restored")
    assert (restored["acknowledged"], restored["lost_updates"]) == (19, 9)


def test_acknowledgements_a_late_answer_missed_at_the_loss_count_at_the_end_from_the_results():
    """When shard 1's worker dies, the worker of the replica that saw it acknowledge version 19
    answers too late (``cluster.acked`` has nothing): the loss is first estimated from the
    driver's last poll.  The replica's result, in hand at the end, corrects it."""
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w2"])
    run.checkpoints.replaced(1, {"values": np.zeros(SHARD_SIZE), "rule_state": {}, "version": 10})
    run.checkpoints.observe([0, 12])  # the driver's last poll
    run.cluster.alive.remove("w1")
    run.supervisor.check()
    [restored] = _events(run, "shard_restored")
    assert (restored["acknowledged"], restored["lost_updates"]) == (12, 2)
    run.tasks.tasks[0].finish(
        {"replica": 0, "partition": 0, "steps": 10, "acknowledged": {"1": {"0": [20, 19]}}}
    )
    run.supervisor.check()  # the result is gathered
    run.supervisor.recovery.settle(wait=0)
    assert run.supervisor.recovery.lost_updates(2) == [0, 9]
    [record] = run.supervisor.recovery.incarnations()
    assert (record["acknowledged"], record["lost_updates"]) == (19, 9)


def test_a_stopped_shard_is_replaced_then_fenced_when_it_comes_back_and_the_count_corrected():
    """Split brain: shard 1's worker is stopped, so its replacement starts from the checkpoint
    while the old copy cannot be retired.  The retirement goes on being tried; when the worker
    comes back it lands, and the old copy's own version -- it had acknowledged more than
    anyone reported -- gives the exact count of updates lost."""
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w2"])
    run.server.stalled.add(1)
    run.checkpoints.replaced(1, {"values": np.zeros(SHARD_SIZE), "rule_state": {}, "version": 10})
    run.checkpoints.observe([0, 12])
    run.cluster.acked = {"shard-1-0": 14}  # the newest acknowledgement a replica noted
    run.supervisor.recovery.recover(1, "shard 1 did not answer within 5 s", run.cluster.workers())
    [restored] = _events(run, "shard_restored")
    assert (restored["source"], restored["fenced"], restored["acknowledged"]) == (
        "checkpoint",
        False,
        14,
    )
    assert restored["lost_updates"] == 4 and run.supervisor.recovery.lost_updates(2) == [0, 4]
    run.supervisor.check()  # still stopped: nothing changes
    assert _events(run, "shard_fenced") == []
    run.server.retired[(1, 0)] = 17
    run.server.later[(1, 0)].value = {"version": 17, "state": {}}  # the worker came back
    run.supervisor.check()
    assert _events(run, "shard_fenced") == [
        {"shard": 1, "generation": 0, "version": 17, "lost_updates": 7}
    ]
    run.supervisor.recovery.settle(wait=0)
    assert run.supervisor.recovery.lost_updates(2) == [0, 7]
    [record] = run.supervisor.recovery.incarnations()
    assert record["fenced"] and record["final_version"] == 17 and record["restored_from"] == 10


def test_a_replacement_whose_worker_died_unnoticed_is_started_on_the_next_worker():
    """Two workers killed a moment apart: the second still looked alive when the first's
    shard was placed on it."""
    run = _run(["w0", "w1", "w2", "w3"], ["w0", "w1"], ["w0", "w2"])
    run.server.unplaceable.add("w2")  # the least-loaded survivor, but dead
    run.cluster.alive.remove("w1")
    run.supervisor.check()
    [restored] = _events(run, "shard_restored")
    assert restored["worker"] == "w3" and run.server.workers[1] == "w3"


def test_a_shard_lost_with_every_worker_ends_the_fit_saying_no_worker_is_left():
    """``cluster.scale(0)`` mid-fit: the last survivor goes while the shard is placed on it."""
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"])
    run.cluster.alive.remove("w1")

    def replace_shard(*args: Any) -> str:
        run.cluster.alive.clear()
        raise TimeoutError("timed out after 5 s.")

    run.server.replace_shard = replace_shard
    with pytest.raises(RuntimeError, match="the cluster has no workers left"):
        run.supervisor.check()


def test_a_lost_shard_is_restored_before_a_replica_on_its_worker_is_restarted():
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1", "w2"])
    run.cluster.alive.remove("w1")
    run.supervisor.check()
    assert _kinds(run) == ["shard_lost", "shard_restored", "replica_failed", "replica_restarted"]
    # not the dead w1: w0 and w2 run one replica each and hold a shard each (shard 1 moved to
    # w2), so the first by name
    assert _events(run, "replica_restarted")[0]["workers"] == ["w0"]


def test_a_shard_lost_during_a_tick_is_restored_and_the_loop_goes_on():
    run = _run(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w2"])
    run.server.lost.add(0)  # its worker still looks alive: the failed call tells
    waits = []

    def on_wait() -> None:
        waits.append(run.clock.now)
        if len(waits) == 3:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    assert _events(run, "shard_restored")[0]["shard"] == 0
    assert "shard 0 is gone" in _events(run, "shard_lost")[0]["reason"]
    assert run.tasks.all_gathered()


def test_a_call_that_fails_for_another_reason_than_a_lost_shard_is_raised():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"])
    with pytest.raises(TimeoutError, match="slow"):
        run.supervisor.recover_lost_shards(TimeoutError("slow, but every shard answers"))
    assert run.server.replaced == []


# -- the loop --------------------------------------------------------------------------------------


def _score(params: np.ndarray) -> dict[str, float]:
    return {"loss": 1.0, "accuracy": 0.5}


def test_evaluations_keep_to_eval_every_instead_of_drifting_late():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], score=_score)

    def on_wait() -> None:
        run.clock.now += 0.01  # every round of the loop takes a little time
        if run.recorder.elapsed() > 3.0:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    times = np.array([e["time"] for e in run.recorder.evals[:-1]])  # (the last: the final one)
    assert len(times) >= 5
    late = times - 0.5 * np.arange(len(times))  # each against its multiple of eval_every
    assert (late >= 0).all() and (late <= 0.015).all()  # due, about one round late, and the
    # rounds do not add up: one that took 0.01 s more per evaluation would be 0.05 s late by now


def test_scoring_slower_than_eval_every_skips_a_multiple_instead_of_evaluating_back_to_back():
    def slow_score(params: np.ndarray) -> dict[str, float]:
        run.clock.now += 0.7  # longer than eval_every
        return {"loss": 1.0, "accuracy": 0.5}

    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], score=slow_score)

    def on_wait() -> None:
        run.clock.now += 0.01
        if run.recorder.elapsed() > 4.0:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    times = np.array([e["time"] for e in run.recorder.evals[:-1]])
    assert len(times) >= 3
    assert (np.diff(times) >= 0.7).all()  # never one right after another
    assert np.allclose(times % 0.5, 0, atol=0.015)  # and each on a multiple of eval_every


def test_every_evaluation_is_reported_at_once_even_when_scoring_takes_time():
    """With ``eval_every`` equal to REPORT_EVERY and a score that takes 30 ms, a report that
    waited to be due came 30 ms short at every other evaluation: half the scores reached the
    callback one interval late."""
    scores: list[float] = []
    limits = Limits(eval_every=SupervisionLoop.REPORT_EVERY, timeout=5.0)

    def slow_score(params: np.ndarray) -> dict[str, float]:
        run.clock.now += 0.03  # scoring the evaluation data takes a while
        scores.append(len(scores) / 100)
        return {"loss": 1.0, "accuracy": scores[-1]}

    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], limits=limits, score=slow_score)
    reports: list[Progress] = []
    run.loop.report_to = reports.append

    def on_wait() -> None:
        if run.recorder.elapsed() > 3.0:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    evals = run.recorder.evals
    assert len(evals) >= 10
    reported = {p.score: p.time for p in reports}
    for row in evals[:-1]:  # (the last one is the final evaluation, reported by the caller)
        assert row["accuracy"] in reported  # each score was handed on ...
        assert reported[row["accuracy"]] - row["time"] < 0.05  # ... in the same tick


def test_max_seconds_sends_one_stop_request():
    limits = Limits(eval_every=0.1, timeout=5.0, max_seconds=1.0)
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], limits=limits)

    def on_wait() -> None:  # the replicas take a while to see the stop flag
        if run.server.stop_requests and run.recorder.elapsed() > 2.0:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    assert run.server.stop_requests == 1
    requested = [e for e in run.recorder.events if e.kind == "stop_requested"]
    assert len(requested) == 1 and requested[0].data == {"max_seconds": 1.0}
    assert requested[0].time >= 1.0


@pytest.mark.parametrize("score", [_score, None])
def test_max_seconds_ends_the_fit_on_time_when_evaluations_are_rarer(score):
    limits = Limits(eval_every=100.0, timeout=5.0, max_seconds=1.0)
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], limits=limits, score=score)

    def on_wait() -> None:
        if run.server.stop_requests:
            _finish_all(run)

    run.cluster.on_wait = on_wait
    run.loop.run()
    (requested,) = [e for e in run.recorder.events if e.kind == "stop_requested"]
    assert 1.0 <= requested.time < 1.1  # not at the next evaluation, 100 s in


def test_the_warmstart_ends_when_replica_0_has_made_its_pushes_and_releases_the_others():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], score=_score)

    def on_wait() -> None:
        run.server.version = [v + 5 for v in run.server.version]

    run.cluster.on_wait = on_wait
    run.loop.warmstart(20, steps=40)
    assert min(run.server.version) >= 20 and run.server.releases == 1
    assert _events(run, "warmstart_done") == [{"steps": 40}]
    assert run.loop.phase == "training"


def test_the_stop_is_recorded_after_finish_with_its_versions_and_the_rows_are_collected():
    run = _run(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], score=_score)
    run.server.version = [7, 9]
    run.cluster.rows = [(0.5, 0, 0, 1.0, 32, 0, 1, True), (0.6, 1, 0, 1.0, 32, 1, 2, True, 0)]
    params, versions = run.loop.finish()
    assert _events(run, "stop") == []  # the driver's own last shard calls come first
    run.loop.collect_rows(force=True)
    run.loop.record_stop(versions)
    assert versions == [7, 9] and params.shape == (2 * SHARD_SIZE,)
    assert _events(run, "stop") == [{"versions": [7, 9]}]
    assert run.recorder.evals[-1]["version"] == 7
    assert [row.partition for row in run.recorder.pushes] == [0, 0]  # 8- and 9-field rows
    assert not math.isnan(run.recorder.last_score())


# -- the end of a fit ------------------------------------------------------------------------------


def test_a_failed_fit_stops_its_replicas_and_lets_them_go_only_once_they_ended():
    """A stopping replica still takes its last acknowledgements, which need the shards and the
    variables naming their replacements: the fit lets its tasks go (and then deletes those)
    only once they ended, or once ``wait`` seconds passed."""
    run = _run(["w0", "w1"], ["w0"], ["w0", "w1"])
    ended_when_let_go = []
    for task in run.tasks.tasks:
        task.cancel = lambda task=task: ended_when_let_go.append(task.done())

    def stop() -> None:  # the shards stop the replicas; they end a moment later
        threading.Timer(0.1, _finish_all, [run]).start()

    run.tasks.end(stop, wait=60)
    assert ended_when_let_go == [True, True]

    stuck = _run(["w0", "w1"], ["w0"], ["w0", "w1"])  # replicas that never end
    stuck.tasks.end(lambda: None, wait=0.1)
    assert stuck.tasks.running() and all(task.cancelled for task in stuck.tasks.tasks)

    done = _run(["w0", "w1"], ["w0"], ["w0", "w1"])  # a fit that ended: nothing to stop
    _finish_all(done)
    stops = []
    done.tasks.end(lambda: stops.append(1))
    assert stops == [] and all(task.cancelled for task in done.tasks.tasks)
