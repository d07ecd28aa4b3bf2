"""A sparse fit's replicas under the dense path's supervisor, in-process: fake cluster, fake
tasks, no Dask (``test_sparse_cluster.py`` kills a replica's worker for real)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from test_sparse_ps import click_batches, shards_for

from downpour_dask.base import RunRecorder
from downpour_dask.core import optim
from downpour_dask.core.sparse_models import FactorizationMachine
from downpour_dask.downpour import registry, sparse_task
from downpour_dask.downpour.sparse_accrual import AccruingReplica
from downpour_dask.downpour.sparse_checkpoints import write_increment
from downpour_dask.downpour.sparse_loop import run_sparse_replica
from downpour_dask.downpour.sparse_recovery import SparseSaved
from downpour_dask.downpour.sparse_replicas import (
    SparseTasks,
    fill_gap,
    forget_records,
    keep_records,
    records_after,
)
from downpour_dask.downpour.supervisor import Supervisor
from downpour_dask.ps.calls import Done
from downpour_dask.ps.protocol import ShardLostError
from downpour_dask.ps.rows import RowsLink
from downpour_dask.ps.table import SparseShard


@dataclass
class FakeTask:
    key: str
    status: str = "pending"
    outcome: Any = None
    cancelled: bool = False

    def done(self) -> bool:
        return self.status != "pending"

    def result(self, timeout=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def exception(self, timeout=None):
        return self.outcome if isinstance(self.outcome, BaseException) else None

    def cancel(self) -> None:
        self.cancelled = True


class FakeCluster:
    """Workers by name; what runs "on the workers" runs here (the registry is this process's)."""

    run = "fake-run"

    def __init__(self, alive):
        self.alive, self.scattered = list(alive), []
        self.late = 0  # how many of the next collections' answers arrive too late (are lost)

    def workers(self, fresh=True):
        return list(self.alive)

    def silent_for(self, worker):
        return 0.0  # every worker heard from

    def scatter(self, values, worker):
        self.scattered.append((values[0], worker))
        return [f"{values[0]}@{worker}"]

    def everywhere(self, function, *args):
        function(*args)

    def collect(self, function, *args):
        found = {"w": function(*args)}
        if self.late:
            self.late -= 1
            return {"w": TimeoutError("no answer in time")}
        return found


class FakeServer:
    workers = ["w0"]  # shard 0 lives there

    def __init__(self, accepted):
        self.accepted, self.stopped = accepted, False

    def shard_status(self, shard, timeout):
        return {"accepted_by_replica": dict(self.accepted[shard])}

    def request_stop(self, timeout):
        self.stopped = True


class FakeRecovery:
    def poll_fences(self):
        pass

    def recover(self, shard, reason, alive):
        raise AssertionError("no shard is lost here")


def fit_of(accepted, alive=("w0", "w1", "w2"), remembered=None):
    cluster, submitted = FakeCluster(alive), []

    def start(replica, data, step, worker, key):
        submitted.append((replica, data, step, worker))
        return FakeTask(key)

    replicas = SparseTasks(cluster, start, ["share0@w1", "share1@w2"], ["share0", "share1"],
                           ["w1", "w2"], n_shards=len(accepted),
                           recent=None if remembered is None else remembered.get, n_push=2,
                           started=1000.0)
    server, recorder = FakeServer(accepted), RunRecorder("accuracy")
    supervisor = Supervisor(cluster, server, replicas, FakeRecovery(), recorder, 2, 1.0)
    return cluster, replicas, supervisor, submitted, recorder, server


def test_a_replica_whose_worker_left_restarts_after_its_pushes_with_its_share_and_its_log():
    # shard 1 was restored from a checkpoint: it counts fewer of the replicas' pushes, and
    # remembers none of replica 1's pushes; shard 0 remembers all three
    pushes = [{"time": 1000.5 + seq, "session": "s0", "seq": seq, "examples": 32,
               "loss": 0.5 - seq / 10, "staleness": 0, "version": 7 + seq, "accepted": True,
               "rows": 9, "bytes": 400, "generation": 0} for seq in range(3)]
    cluster, replicas, supervisor, submitted, recorder, _ = fit_of(
        [{0: 4, 1: 3}, {0: 2, 1: 1}], remembered={1: [pushes, []]})
    assert submitted == [(0, "share0@w1", 0, "w1"), (1, "share1@w2", 0, "w2")]
    first = replicas.tasks[1]
    records = [{"replica": 1, "step": 2 * seq + 1, "shard": shard, "seq": seq,
                "session": f"s{shard}", "transport": "wire", "bytes": 500}
               for seq in range(2) for shard in (0, 1)]
    keep_records(cluster.run, first.key, records)  # what the task on w2 does
    replicas.collect(force=True)
    records.append({"replica": 1, "step": 5})  # made after the last collection: dies with w2
    forget_records(cluster.run)  # (so does what w2 kept)
    supervisor.check()  # nothing wrong yet
    assert recorder.events == []
    cluster.alive = ["w0", "w1"]  # w2 died with replica 1
    supervisor.check()
    assert [(e.kind, e.data) for e in recorder.events] == [
        ("replica_failed", {"replica": 1, "reason": "worker w2 left the cluster"}),
        # shard 0 accepted 3 pushes of 2 steps: it goes on at step 6, on the worker running
        # no other replica (w0 holds a shard, w1 replica 0: the fewest other replicas first)
        ("replica_restarted", {"replica": 1, "workers": ["w0"], "step": 6}),
    ]
    assert first.cancelled and replicas.workers == ["w1", "w0"]
    # its share of the data, scattered again to its new worker, and the steps to skip
    assert cluster.scattered[-1] == ("share1", "w0")
    assert submitted[-1] == (1, "share1@w0", 6, "w0")
    replicas.tasks[0].status, replicas.tasks[0].outcome = "finished", [{"replica": 0, "step": 1}]
    replicas.tasks[1].status, replicas.tasks[1].outcome = "finished", [{"replica": 1, "step": 7}]
    supervisor.check()
    assert replicas.all_gathered()
    log = replicas.records()
    assert [(r["replica"], r["step"], r.get("shard")) for r in log] == [
        (0, 1, None), (1, 1, 0), (1, 1, 1), (1, 3, 0), (1, 3, 1),
        (1, 5, 0),  # rebuilt from shard 0's memory of push 2 (shard 1 remembers nothing)
        (1, 7, None)]
    assert log[5] == {"replica": 1, "step": 5, "shard": 0, "seq": 2, "session": "s0",
                      "transport": "wire", **{k: v for k, v in pushes[2].items() if k not in (
                          "session", "seq")}, "time": 2.5}
    replicas.release()
    assert records_after(cluster.run, {}) == {}  # released: nothing kept on the workers


def test_records_in_a_collections_answer_that_came_too_late_are_collected_at_the_next():
    cluster, replicas, _, _, _, _ = fit_of([{0: 0, 1: 0}])
    key = replicas.tasks[0].key
    records = [{"replica": 0, "step": 1, "shard": 0, "seq": 0}]
    keep_records(cluster.run, key, records)
    try:
        cluster.late = 1
        replicas.collect(force=True)  # it ran on the worker; its answer was lost
        records.append({"replica": 0, "step": 2, "shard": 0, "seq": 1})
        replicas.collect(force=True)
        replicas.collect(force=True)
        assert [r["step"] for r in replicas.kept[key]] == [1, 2]  # each once
    finally:
        forget_records(cluster.run)


def test_an_error_of_the_replica_itself_stops_the_shards_and_fails_the_fit():
    _, replicas, supervisor, _, recorder, server = fit_of([{}])
    replicas.tasks[0].status = "error"
    replicas.tasks[0].outcome = ValueError("a bad batch")
    with pytest.raises(RuntimeError, match="failed: ValueError\\('a bad batch'\\)"):
        supervisor.check()
    assert server.stopped and recorder.events == []


def test_a_shard_restored_from_a_checkpoint_counts_the_pushes_it_had_accepted(tmp_path):
    model = FactorizationMachine(200, 4, n_factors=2)
    layout, shards = shards_for(model, 2, optim.adagrad(0.1))
    links = [RowsLink(s, i, 3, 10.0) for i, s in enumerate(shards)]  # replica 3
    run_sparse_replica(model, links, layout, click_batches(5, n_rows=200, numeric=0), replica=3)
    write_increment(tmp_path, [asyncio.run(s.export_changed()) for s in shards], layout, 0)
    initial = [{"values": s.values, "rule_state": {}, "version": 0} for s in shards]
    state = SparseSaved(layout, initial, tmp_path).state(1)
    assert state["version"] == 5 and state["counters"] == {"accepted_by_replica": {"3": 5}}
    # so its replacement counts them, and a replica restarted with it goes on after them
    lo, hi = layout.dense[1]
    again = SparseShard(1, lo, hi, state["values"], optim.adagrad(0.1),
                        tables=layout.shard_tables(1), seed=0, restore=state, generation=1)
    assert again.counters()["accepted_by_replica"] == {3: 5}


def test_a_replica_streaming_files_restarts_with_the_same_files_and_nothing_scattered():
    cluster, submitted = FakeCluster(["w0", "w1"]), []
    files = (["a.parquet", "b.parquet"], "spec")

    def start(replica, data, step, worker, key):
        submitted.append((replica, data, step, worker))
        return FakeTask(key)

    replicas = SparseTasks(cluster, start, [files], None, ["w1"], n_shards=1)
    supervisor = Supervisor(cluster, FakeServer([{0: 7}]), replicas, FakeRecovery(),
                            RunRecorder("accuracy"), 1, 1.0)
    replicas.tasks[0].status = "cancelled"  # (w1 lives on: it holds no shard, so it is chosen)
    supervisor.check()
    assert submitted[-1] == (0, files, 7, "w1") and cluster.scattered == []


@pytest.mark.parametrize(("n_fetch", "n_push"), [(1, 1), (2, 3)])
def test_the_records_a_dead_replica_lacks_are_rebuilt_from_the_shards_memory(n_fetch, n_push):
    model = FactorizationMachine(200, 4, n_factors=2)
    layout, shards = shards_for(model, 2, optim.adagrad(0.1))
    links = [RowsLink(s, i, 1, 10.0) for i, s in enumerate(shards)]
    # (a whole number of pushes: a replica killed mid-run made no short last push)
    batches = click_batches(12, n_rows=200, numeric=0)
    if (n_fetch, n_push) == (1, 1):
        records = run_sparse_replica(model, links, layout, batches, replica=1, started=0.0)
    else:
        records = AccruingReplica(model, layout, iter(batches), 1, n_fetch, n_push, 0.1,
                                  started=0.0).run(links)
    remembered = [asyncio.run(s.recent_pushes(1)) for s in shards]
    assert [e["seq"] for e in remembered[0]] == sorted({r["seq"] for r in records})
    collected = records[:4]  # the driver's last collection; the rest died with the worker
    rebuilt = fill_gap(collected, remembered, n_push, started=0.0)
    assert len(rebuilt) == len(records)
    for got, want in zip(rebuilt, records):  # the same, but the clock and the pulls' bytes
        assert {k: v for k, v in got.items() if k not in ("time", "bytes")} == {
            k: v for k, v in want.items() if k not in ("time", "bytes")}
        assert 0 < got["bytes"] <= want["bytes"] and got["time"] == pytest.approx(
            want["time"], abs=1.0)


@pytest.mark.parametrize(("n_fetch", "n_push"), [(1, 1), (2, 3)])
@pytest.mark.parametrize("start_step", [0, 6])
def test_a_dead_replica_none_of_whose_records_was_collected_is_rebuilt_from_the_shards_memory(
        n_fetch, n_push, start_step):
    # killed before the driver's first collection: its task's first session says its start
    model = FactorizationMachine(200, 4, n_factors=2)
    layout, shards = shards_for(model, 2, optim.adagrad(0.1))
    links = [RowsLink(s, i, 1, 10.0, first_step=start_step) for i, s in enumerate(shards)]
    batches = click_batches(12, n_rows=200, numeric=0)
    if (n_fetch, n_push) == (1, 1):  # (a restarted task numbers its pushes from 0: first_seq)
        records = run_sparse_replica(model, links, layout, batches, replica=1, started=0.0,
                                     start_step=start_step, first_seq=0 if start_step else None)
    else:
        records = AccruingReplica(model, layout, iter(batches), 1, n_fetch, n_push, 0.1,
                                  start_step=start_step, started=0.0).run(links)
    remembered = [asyncio.run(s.recent_pushes(1)) for s in shards]
    rebuilt = fill_gap([], remembered, n_push, 0.0, replica=1, first_step=start_step)
    assert len(rebuilt) == len(records) == 2 * 12 // n_push
    for got, want in zip(rebuilt, records):  # the same, but the clock, the pulls' bytes and
        assert {k: v for k, v in got.items() if k not in ("time", "bytes")} == {  # the transport
            k: v for k, v in want.items() if k not in ("time", "bytes", "transport")}
    # an earlier incarnation's session (it started elsewhere) is not this one's to rebuild
    assert fill_gap([], remembered, n_push, 0.0, replica=1, first_step=start_step + 1) == []


@pytest.mark.parametrize("cancelled_while_paused", [True, False], ids=["worker-went", "stayed"])
def test_on_a_leaving_worker_a_replica_pauses_before_its_next_batch(
        monkeypatch, cancelled_while_paused):
    # its worker is leaving: no batch (so no push) until the task is cancelled, when the worker
    # goes and the driver restarts the replica elsewhere; a worker still there after the pause
    # did not leave after all, and the replica trains on
    run = "test-pause"
    looks: list[int] = []

    def task_cancelled() -> bool:
        looks.append(len(taken))
        return cancelled_while_paused and len(looks) >= 3

    monkeypatch.setattr(sparse_task, "task_cancelled", task_cancelled)
    monkeypatch.setattr(sparse_task, "CANCEL_CHECK_EVERY", 0.01)
    taken: list[int] = []
    batches = sparse_task._until_cancelled(iter(range(5)), run, pause=0.5)
    try:
        taken.append(next(batches))
        taken.append(next(batches))
        registry.mark_leaving(run)
        taken.extend(batches)
    finally:
        registry.forget_run(run)
    if cancelled_while_paused:
        assert taken == [0, 1] and len(looks) >= 3  # nothing after the mark
    else:
        assert taken == [0, 1, 2, 3, 4] and set(looks) == {2}  # paused before the third only


@pytest.mark.parametrize(("n_fetch", "n_push"), [(1, 1), (2, 2)])
def test_a_push_the_other_shards_applied_is_recorded_when_one_shard_is_lost(n_fetch, n_push):
    # shard 0 is lost at the replica's third push; shard 1 applied it.  Its record must be kept:
    # the replica task goes on after the last step it recorded, and pushing that step to shard
    # 1 again (in a fresh push session) would apply it twice
    model = FactorizationMachine(200, 4, n_factors=2)
    layout, shards = shards_for(model, 2, optim.adagrad(0.1))
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    push, pushes = links[0].push, []

    def lost_at_the_third(*args, **kwargs):
        pushes.append(args)
        if len(pushes) == 3:
            return Done(error=ShardLostError("shard 0's worker left", 0))
        return push(*args, **kwargs)

    links[0].push = lost_at_the_third
    batches = click_batches(12, n_rows=200, numeric=0)
    records: list[dict] = []
    with pytest.raises(ShardLostError):
        if (n_fetch, n_push) == (1, 1):
            run_sparse_replica(model, links, layout, batches, records=records)
        else:
            AccruingReplica(model, layout, iter(batches), 0, n_fetch, n_push, 0.1,
                            records=records).run(links)
    third = 3 * n_push - 1  # the step the third push ended
    assert [(r["shard"], r["step"]) for r in records if r["step"] == third] == [(1, third)]
    assert asyncio.run(shards[1].status())["version"] == 3  # what its records say it applied
    assert len([r for r in records if r["shard"] == 1]) == 3
