"""A fit that follows its cluster, in-process: which worker gets a new replica, what a leaving
worker's shards and replicas become, how a new replica's data is drawn.

The fakes are those of ``tests/test_supervisor.py`` plus the membership calls of
:class:`~downpour_dask.downpour.dask_cluster.DaskCluster`; ``tests/test_elastic_cluster.py``
runs the same story on real local clusters (scale, retire_workers, adapt).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from test_supervisor import FakeCluster, _events, _kinds, _run

from downpour_dask.downpour import registry
from downpour_dask.downpour.dask_cluster import DaskCluster
from downpour_dask.downpour.elastic import Elastic, remaining
from downpour_dask.downpour.membership import HoldForMigration, MembershipPlugin, membership_topic


@dataclass
class MembershipCluster(FakeCluster):
    """A fake cluster that also reports membership events and records what the driver did."""

    heard: list[dict] = field(default_factory=list)
    stopped_on: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    kept: dict[str, list[dict]] = field(default_factory=dict)  # worker -> returned results

    def returned(self, worker: str) -> list[dict]:
        return self.kept.pop(worker, [])

    def membership(self) -> list[dict]:
        taken, self.heard = self.heard, []
        return taken

    def stop_replicas_on(self, worker: str) -> None:
        self.stopped_on.append(worker)

    def release(self, worker: str) -> None:
        self.released.append(worker)

    def retire(self, worker: str) -> None:
        self.retired.append(worker)


def _elastic(workers, shard_workers, replica_workers, max_replicas=None, move_replicas=True):
    """``_run``'s collaborators with a membership-aware cluster and an :class:`Elastic`."""
    run = _run(workers, shard_workers, replica_workers)
    cluster = MembershipCluster(run.cluster.alive, run.clock)
    for part in (run.tasks, run.supervisor, run.supervisor.recovery, run.loop):
        part.cluster = cluster
    added: list[tuple[int, str, int]] = []

    def add_replica(replica: int, worker: str, n_active: int) -> int:
        added.append((replica, worker, n_active))
        run.tasks.start_replica(replica, [worker], ("X", "y"), [], [run.tasks.configs[0]])
        return 100 // n_active

    elastic = Elastic(
        cluster, run.server, run.tasks, run.supervisor.recovery, run.recorder,
        n_replicas=len(replica_workers), max_replicas=max_replicas, add_replica=add_replica,
        move_replicas=move_replicas,
    )  # fmt: skip
    run.loop.elastic = elastic
    run.cluster, run.elastic, run.added = cluster, elastic, added
    return run


def _join(run: Any, worker: str) -> None:
    run.cluster.alive.append(worker)
    run.cluster.heard.append({"action": "joined", "worker": worker})


def test_a_limit_keeps_what_is_left_for_a_joined_replica():
    assert remaining(5, 2.4) == 3 and remaining(5, 4.9) == 1 and remaining(5, 7) == 1
    assert remaining(None, 3.0) is None


def test_a_joined_worker_gets_no_replica_when_there_is_no_data_to_share():
    run = _elastic(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], max_replicas=3)
    run.elastic.add_replica = lambda replica, worker, n_active: None  # one file per replica
    _join(run, "w2")
    run.elastic.check()
    assert run.elastic.added == [] and "replica_added" not in _kinds(run)
    assert run.elastic.active() == 2


def test_workers_that_join_get_a_replica_each_up_to_max_replicas():
    run = _elastic(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], max_replicas=3)
    _join(run, "w2")
    _join(run, "w3")
    run.elastic.check()
    assert run.added == [(2, "w2", 3)]  # a fair share among 3 replicas; w3 stays without one
    [added] = _events(run, "replica_added")
    assert added == {"replica": 2, "worker": "w2", "rows": 33}
    run.tasks.tasks[0].finish({"replica": 0, "partition": 0, "steps": 10})
    run.tasks.results[0] = run.tasks.tasks[0].outcome
    run.elastic.check()  # replica 0 is done: room for one more, on the worker that waited
    assert run.added[-1] == (3, "w3", 3)


def test_a_new_replica_is_started_only_once_the_fresh_worker_list_shows_its_worker():
    """The supervisor reads a cached worker list: a replica on a worker it does not list yet
    would look like one whose worker left and be started a second time."""
    run = _elastic(["w0", "w1"], ["w0", "w1"], ["w0", "w1"], max_replicas=3)
    asked = []
    listed = run.cluster.workers
    run.cluster.workers = lambda fresh=True: asked.append(fresh) or listed(fresh)
    run.cluster.heard.append({"action": "joined", "worker": "w2"})  # not listed yet
    run.elastic.check()
    assert run.added == [] and True in asked
    run.cluster.alive.append("w2")
    run.elastic.check()
    assert run.added == [(2, "w2", 3)]
    run.supervisor.check()
    assert "replica_failed" not in _kinds(run)


def test_without_max_replicas_a_joined_worker_gets_no_replica():
    run = _elastic(["w0", "w1"], ["w0", "w1"], ["w0", "w1"])
    _join(run, "w2")
    run.elastic.check()
    assert run.added == [] and "replica_added" not in _kinds(run)


def test_a_leaving_workers_shard_migrates_with_its_exact_state_and_its_replica_moves_on():
    run = _elastic(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1"])
    run.server.version = [7, 11]
    run.cluster.heard.append({"action": "leaving", "worker": "w1", "status": "closing_gracefully"})
    run.elastic.check()
    [migrated] = _events(run, "shard_migrated")
    assert migrated["shard"] == 1 and migrated["from_worker"] == "w1"
    assert migrated["worker"] == "w2"  # the staying worker holding no shard
    assert (migrated["version"], migrated["lost_updates"], migrated["generation"]) == (11, 0, 1)
    assert "shard_lost" not in _kinds(run) and run.server.retired == {(1, 0): 11}
    assert run.cluster.stopped_on == ["w1"]  # its replica stops after its next push
    assert run.cluster.released == []  # not before the replica returned
    # replica 1 finishes its step, pushes and returns: it continues elsewhere after its steps
    run.tasks.tasks[1].finish({"replica": 1, "partition": 0, "steps": 42, "retired": True})
    run.elastic.check()
    [retired] = _events(run, "replica_retired")
    assert retired == {"replica": 1, "worker": "w1", "steps": 42, "moved_to": "w2"}
    assert run.cluster.submitted[-1].worker == "w2"
    assert run.cluster.submitted[-1].config.start_step == 42
    assert run.cluster.released == ["w1"]
    run.clock.now += 1  # the retirement Dask aborted (the worker held a shard) is asked again
    run.elastic.retire_due = {w: 0.0 for w in run.elastic.retire_due}
    run.elastic.check()
    assert run.cluster.retired == ["w1"]


def test_replicas_not_moved_pause_and_their_worker_is_let_go_once_its_shard_moved():
    # a sparse fit's replicas: paused on the leaving worker, restarted by the crash path
    run = _elastic(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1"], move_replicas=False)
    run.tasks.results[0] = [{"step": 0}]  # a sparse replica's result is its push records
    run.server.version = [7, 11]
    run.cluster.heard.append({"action": "leaving", "worker": "w1", "status": "closing_gracefully"})
    run.elastic.check()
    [migrated] = _events(run, "shard_migrated")
    assert (migrated["shard"], migrated["worker"], migrated["lost_updates"]) == (1, "w2", 0)
    assert run.cluster.stopped_on == ["w1"]  # its replica pauses before its next batch
    assert run.elastic.departing == {} and run.elastic.settled()  # not collected here
    assert run.cluster.released == ["w1"]  # at once: nothing to wait for
    assert "replica_retired" not in _kinds(run)
    run.clock.now += 1
    run.elastic.retire_due = {w: 0.0 for w in run.elastic.retire_due}
    run.elastic.check()
    assert run.cluster.retired == ["w1"]  # the retirement Dask aborted, asked again


def test_a_leaving_worker_without_replicas_of_the_fit_is_not_told_to_stop_any():
    run = _elastic(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w0"], move_replicas=False)
    run.cluster.heard.append({"action": "leaving", "worker": "w1", "status": "closing"})
    run.elastic.check()
    assert run.cluster.stopped_on == [] and run.cluster.released == ["w1"]


def test_an_added_replica_whose_worker_left_with_its_result_ends_without_a_restart():
    run = _elastic(["w0", "w1"], ["w0", "w0"], ["w0", "w1"], max_replicas=3)
    _join(run, "w2")
    run.elastic.check()
    run.cluster.heard.append({"action": "leaving", "worker": "w2", "status": "closing"})
    run.elastic.check()
    run.cluster.alive.remove("w2")  # gone before the replica's result could be read
    run.tasks.tasks[2].status = "lost"
    run.loop.supervisor.check = lambda: None  # only the elastic part is under test here
    run.server.accepted_by_replica[2] = 6
    run.elastic.check()
    [retired] = _events(run, "replica_retired")
    assert retired["replica"] == 2 and retired["moved_to"] is None
    assert retired["steps"] == 6  # the pushes shard 0 counted of it
    assert 2 in run.tasks.results and "replica_restarted" not in _kinds(run)
    summary = run.tasks.summary([run.tasks.results[2]])
    assert summary["replica_steps"] == [6] and summary["acknowledged_pushes"] == {"0": 6, "1": 6}


def test_a_replica_whose_closing_worker_cancelled_its_task_is_read_from_the_worker():
    run = _elastic(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w1"])
    run.cluster.heard.append({"action": "leaving", "worker": "w1", "status": "closing"})
    run.elastic.check()
    run.tasks.tasks[1].status = "cancelled"  # Worker.close cancels what it runs
    run.cluster.kept["w1"] = [{"replica": 1, "partition": 0, "steps": 17, "retired": True}]
    run.elastic.check()
    [retired] = _events(run, "replica_retired")
    assert retired == {"replica": 1, "worker": "w1", "steps": 17, "moved_to": "w2"}
    assert run.cluster.submitted[-1].config.start_step == 17
    assert "replica_failed" not in _kinds(run) and run.cluster.released == ["w1"]


def test_a_migration_whose_fence_does_not_land_falls_back_to_the_crash_path():
    run = _elastic(["w0", "w1", "w2"], ["w0", "w1"], ["w0", "w2"])
    run.server.version = [3, 5]
    run.server.lost.add(1)  # the leaving worker's shard does not answer: no exact state
    run.cluster.heard.append({"action": "leaving", "worker": "w1", "status": "closing"})
    run.elastic.check()
    assert "shard_migrated" not in _kinds(run)
    assert [e["shard"] for e in _events(run, "shard_lost")] == [1]
    [restored] = _events(run, "shard_restored")
    assert restored["fenced"] is False and restored["worker"] == "w2"


# -- the Dask hooks, in-process ---------------------------------------------------------------


class _Scheduler:
    def __init__(self) -> None:
        self.logged: list[tuple[str, dict]] = []

    def log_event(self, topic: str, msg: dict) -> None:
        self.logged.append((topic, msg))


def test_the_scheduler_plugin_reports_a_retirement_as_it_starts_and_joins_and_departures():
    scheduler = _Scheduler()
    plugin = MembershipPlugin("run1")
    asyncio.run(plugin.start(scheduler))
    plugin.add_worker(scheduler, "w9")
    # what Scheduler.retire_workers logs on the worker's own topic when it starts
    plugin.log_event("w1", {"action": "worker-status-change", "status": "closing_gracefully"})
    plugin.log_event("w1", {"action": "worker-status-change", "status": "running"})
    plugin.log_event(plugin.topic, {"action": "leaving", "worker": "w1"})  # its own: ignored
    plugin.remove_worker(scheduler, "w1")
    assert [(t, m["action"], m["worker"]) for t, m in scheduler.logged] == [
        (membership_topic("run1"), "joined", "w9"),
        (membership_topic("run1"), "leaving", "w1"),
        (membership_topic("run1"), "left", "w1"),
    ]


@pytest.mark.timeout(60)
def test_a_closing_worker_waits_for_the_driver_a_running_one_does_not():
    worker = SimpleNamespace(
        status=SimpleNamespace(name="closing"), address="w1", log_event=lambda t, m: None
    )
    plugin = HoldForMigration("run2", wait=3600.0)  # only the release can end the wait

    async def close_and_release() -> None:
        closing = asyncio.ensure_future(plugin.teardown(worker))
        await asyncio.sleep(0.1)
        assert not closing.done() and registry.is_leaving("run2")  # its replicas stop now
        registry.release("run2")  # what the driver does once it moved the shards
        await closing

    try:
        asyncio.run(close_and_release())
        worker.status.name = "running"  # the plugin is unregistered at the end of the fit
        registry.forget_run("run2")
        asyncio.run(plugin.teardown(worker))
        assert not registry.is_leaving("run2")
    finally:
        registry.forget_run("run2")


def test_a_cluster_that_refuses_the_scheduler_plugin_keeps_the_worker_plugin_and_warns():
    class RefusingClient:
        registered: list = []

        def subscribe_topic(self, topic: str, handler: Any) -> None:
            self.topic = topic

        def register_plugin(self, plugin: Any) -> None:
            if isinstance(plugin, MembershipPlugin):
                raise ModuleNotFoundError("No module named 'downpour_dask'")
            self.registered.append(plugin)

        # a worker plugin goes through Client.sync, bounded (runtime/dask_client_calls.py)
        def sync(self, function: Any, *args: Any, callback_timeout: float, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        def _register_worker_plugin(self, plugin: Any, name: str, idempotent: bool) -> None:
            self.register_plugin(plugin)

    client = RefusingClient()
    with pytest.warns(RuntimeWarning, match="MembershipPlugin.*no replica"):
        DaskCluster(client, "run3", 30).watch_membership()
    assert [type(p) for p in client.registered] == [HoldForMigration]
