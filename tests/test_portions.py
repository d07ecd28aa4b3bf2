"""The coordinator's bookkeeping of portion copies (``Portions._collect``, ``_backups``), driven
directly.

The cluster tests in ``test_sandblaster.py`` show the whole path works; these pin the races a
killed worker produces, which a cluster run hits only now and then: a copy that finished but whose
result died with its worker, and a lost copy while an older batch's copy of the same portion is
still running.
"""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import numpy as np
from distributed.client import FutureCancelledError

from downpour_dask.core.params import split_range
from downpour_dask.core.vectors import VectorStore
from downpour_dask.sandblaster import scheduling
from downpour_dask.sandblaster.portions import PortionCopy, Portions
from downpour_dask.sandblaster.runners import RunnerCall
from downpour_dask.sandblaster.shard import Finished, SandblasterShard
from downpour_dask.sandblaster.tasks import (
    _CACHE,
    STALE_AFTER,
    PortionResult,
    _newest,
    forget_run,
)


class _FakeFuture:
    """What ``_collect`` reads of a Dask future: ``status`` and ``result``."""

    def __init__(self, status: str, result: PortionResult | None = None):
        self.status, self._result = status, result

    def result(self, timeout: float | None = None) -> PortionResult:
        if self._result is None:  # the result lived on the worker that died
            raise FutureCancelledError("portion-0", "lost with its worker")
        return self._result


class _Observer:
    """A PassObserver that keeps what the pass reports."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.counted: list[PortionResult] = []

    def event(self, kind: str, detail: str = "", **data) -> None:
        self.events.append((kind, data))

    def portion_counted(self, result: PortionResult) -> None:
        self.counted.append(result)


def _portions(restored: list[int], observer: _Observer | None = None) -> Portions:
    portions = Portions.__new__(Portions)  # no cluster: only the bookkeeping is exercised
    portions.timeout = 5.0
    portions.observer = observer or _Observer()
    portions.inflight, portions.load, portions.where = {}, {"w1": 0, "w2": 0}, {}
    portions.retired, portions._lead, portions._before_submit = [], [], []
    portions.capacity, portions.freed = {"w1": Portions.DEPTH, "w2": Portions.DEPTH}, {}
    portions._restore_blocks = lambda: restored.append(1)
    portions.blocks = [SimpleNamespace(key=f"block-{pid}", status="pending") for pid in range(10)]
    portions.nbytes, portions.metrics = {}, {}  # blocks of 0 bytes unless a test says otherwise
    portions.finished, portions.task_only = {}, set()
    return portions


def _add(
    portions: Portions, future: _FakeFuture, version: int, portion: int, worker: str, ago=0.0
) -> PortionCopy:
    copy = portions.inflight[future] = PortionCopy(version, portion, worker, time.time() - ago)
    portions.load[worker] += 1
    return copy


def test_a_finished_copy_whose_result_died_with_its_worker_is_run_again():
    restored: list[int] = []
    portions = _portions(restored)
    lost = _FakeFuture("finished")  # finished, then its worker died before the gather
    _add(portions, lost, version=3, portion=7, worker="w1")
    todo, done, durations = [], {}, []
    assert portions._collect(lost, 3, todo, done, durations) is False
    assert todo == [7] and not done and restored  # its data block is re-sent, the portion re-run
    assert portions.load["w1"] == 0 and not portions.inflight


def test_a_lost_copy_is_run_again_even_while_an_older_batch_copy_still_runs():
    portions = _portions([])
    straggler = _FakeFuture("pending")  # portion 7 of the previous batch, still running
    lost = _FakeFuture("cancelled")
    _add(portions, straggler, version=2, portion=7, worker="w2")
    _add(portions, lost, version=3, portion=7, worker="w1")
    todo: list[int] = []
    portions._collect(lost, 3, todo, {}, [])
    assert todo == [7]  # the old copy's gradient would be discarded: it cannot stand in


def test_a_lost_copy_is_not_run_again_while_a_copy_of_the_same_batch_runs():
    portions = _portions([])
    backup = _FakeFuture("pending")
    lost = _FakeFuture("cancelled")
    _add(portions, backup, version=3, portion=7, worker="w2")
    _add(portions, lost, version=3, portion=7, worker="w1")
    todo: list[int] = []
    portions._collect(lost, 3, todo, {}, [])
    assert todo == []  # the backup will count; a third copy would only duplicate work


def test_a_finished_copy_counts_once_and_the_other_is_reported_discarded():
    observer = _Observer()
    portions = _portions([], observer)
    result = PortionResult(7, 3, "done", 2.5, 10, "w1")
    backup = PortionResult(7, 3, "done", 2.5, 10, "w2")
    first, second = _FakeFuture("finished", result), _FakeFuture("finished", backup)
    _add(portions, first, version=3, portion=7, worker="w1")
    _add(portions, second, version=3, portion=7, worker="w2")
    done: dict = {}
    assert portions._collect(first, 3, [], done, []) is True
    assert portions._collect(second, 3, [], done, []) is False
    assert done == {7: result} and observer.counted == [result]
    assert observer.events == [
        (
            "duplicate_discarded",
            {"portion": 7, "version": 3, "status": "done", "worker": "w2"},
        )
    ]


def test_a_copy_of_an_earlier_batch_is_discarded_not_counted():
    observer = _Observer()
    portions = _portions([], observer)
    stale = _FakeFuture("finished", PortionResult(4, 2, "stale", 0.0, 0, "w1"))
    _add(portions, stale, version=2, portion=4, worker="w1")
    done: dict = {}
    assert portions._collect(stale, 3, [], done, []) is False
    assert not done and not observer.counted
    assert observer.events == [
        ("duplicate_discarded", {"portion": 4, "version": 2, "status": "stale", "worker": "w1"})
    ]


def test_a_queued_copy_is_a_straggler_only_when_the_copy_ahead_of_it_is_slow():
    observer = _Observer()
    portions = _portions([], observer)
    portions.backup_tasks, submitted = True, []
    portions._submit = lambda version, pid, worker, backup: submitted.append((pid, worker))
    durations = [0.1]  # a portion takes 0.1 s; every copy below was submitted 1 s ago
    running, queued = _FakeFuture("pending"), _FakeFuture("pending")
    first = _add(portions, running, version=3, portion=0, worker="w1", ago=1.0)
    second = _add(portions, queued, version=3, portion=1, worker="w1", ago=0.99)
    portions.freed["w1"] = time.time() - 0.05  # w1 began its current copy 0.05 s ago
    portions._backups(3, {0: [first], 1: [second]}, {}, durations)
    assert submitted == []  # healthy: the queued copy waits its turn, no backup
    portions.freed["w1"] = time.time() - 0.5  # w1 has now been on its copy for 0.5 s
    portions._backups(3, {0: [first], 1: [second]}, {}, durations)
    assert submitted == [(0, "w2"), (1, "w2")]  # slow: the queued copy is as late
    kinds = [kind for kind, _ in observer.events]
    assert kinds == ["backup_launched", "backup_launched"]
    assert all(0.5 <= data["running"] < 1.0 for _, data in observer.events)


def test_a_late_workers_portion_not_started_yet_goes_to_a_free_worker():
    """A portion waits for the worker holding its block (moving a block costs more than a
    normal wait), but not for a straggler: once that worker is late as a backup would judge
    it, a free worker takes the portion (and moves its block), so that backups can start."""
    observer = _Observer()
    portions = _portions([], observer)
    submitted = []

    def submit(version, pid, worker, backup):
        submitted.append((pid, worker, backup))
        portions.load[worker] += 1
        return PortionCopy(version, pid, worker, time.time())

    portions._submit = submit
    portions.capacity = {"w1": 1, "w2": 1}  # w1 runs portion 0; portion 1's block is on w1 too
    portions.where = {0: {"w1"}, 1: {"w1"}}
    running = _add(portions, _FakeFuture("pending"), version=3, portion=0, worker="w1", ago=1.0)
    copies, todo = {0: [running]}, [1]

    def dispatch_after(busy: float, durations: list) -> list:
        submitted.clear()
        portions.freed["w1"] = time.time() - busy  # w1 began its copy this long ago
        portions._dispatch(3, todo, copies, durations)
        return list(submitted)

    assert dispatch_after(0.01, [0.1]) == []  # on time: portion 1 waits for w1
    assert dispatch_after(0.5, []) == []  # no portion finished yet: no measure of late
    portions.nbytes["block-1"] = 50_000_000  # moving it to w2 at 100 MB/s: 0.5 s
    portions.metrics["w2"] = {"bandwidth": {"total": 100_000_000}}
    assert dispatch_after(0.5, [0.1]) == []  # late, but not by the move's 0.5 s on top
    assert dispatch_after(0.8, [0.1]) == [(1, "w2", False)]  # late by more: w2 takes it
    assert todo == [] and copies[1][0].worker == "w2"
    assert [(kind, data["portion"], data["holders"]) for kind, data in observer.events] == [
        ("portion_reassigned", 1, ["w1"])
    ]


def test_a_portion_waits_for_its_blocks_worker_when_that_one_has_a_free_slot():
    portions = _portions([])
    submitted = []

    def submit(version, pid, worker, backup):
        submitted.append((pid, worker))
        portions.load[worker] += 1
        return PortionCopy(version, pid, worker, time.time())

    portions._submit = submit
    portions.capacity = {"w1": 2, "w2": 1}
    portions.where = {0: {"w1"}, 1: {"w1"}}
    _add(portions, _FakeFuture("pending"), version=3, portion=0, worker="w1", ago=1.0)
    portions.freed["w1"] = time.time() - 0.5  # late by far, yet a slot of its own is free
    portions._dispatch(3, [1], {}, [0.1])
    assert submitted == [(1, "w1")]  # it runs where its block is


def test_a_backup_that_would_move_a_large_block_waits_for_the_move_as_dask_estimates_it():
    portions = _portions([])
    portions.backup_tasks, submitted = True, []
    portions._submit = lambda version, pid, worker, backup: submitted.append((pid, worker))
    portions.nbytes["block-0"] = 50_000_000  # on w1 only; w2 moves it at 100 MB/s: 0.5 s
    portions.metrics["w2"] = {"bandwidth": {"total": 100_000_000}}
    durations = [0.1]
    copy = _add(portions, _FakeFuture("pending"), version=3, portion=0, worker="w1", ago=1.0)

    def backups_after(running: float) -> list:
        submitted.clear()
        portions.freed["w1"] = time.time() - running  # w1 began the copy this long ago
        portions._backups(3, {0: [copy]}, {}, durations)
        return list(submitted)

    assert backups_after(0.3) == []  # 3x the median, but copying it means moving 50 MB first
    assert backups_after(0.8) == [(0, "w2")]  # later than the median and the move together
    portions.where[0] = {"w1", "w2"}  # w2 holds a replica: nothing to move
    assert backups_after(0.3) == [(0, "w2")]


def test_a_block_read_after_the_last_refresh_is_sized_before_a_backup_would_move_it():
    """A worker reads its block while the pass starts: the refresh before the pass saw it still
    pending, so its size comes from the scheduler when a backup would first move it."""
    portions = _portions([])
    portions.backup_tasks, submitted, asked = True, [], []
    portions._submit = lambda version, pid, worker, backup: submitted.append((pid, worker))

    def nbytes(keys, summary):
        asked.append(list(keys))
        return dict.fromkeys(keys, 50_000_000)

    portions.client = SimpleNamespace(nbytes=nbytes)
    portions.blocks[0].status = "finished"  # read since the refresh: not in portions.nbytes
    portions.metrics["w2"] = {"bandwidth": {"total": 100_000_000}}  # moving it takes 0.5 s
    copy = _add(portions, _FakeFuture("pending"), version=3, portion=0, worker="w1", ago=1.0)
    portions.freed["w1"] = time.time() - 0.3  # 3x the median of 0.1 s
    for _ in range(2):
        portions._backups(3, {0: [copy]}, {}, [0.1])
    assert submitted == []  # not worth moving 50 MB yet
    assert asked == [["block-0"]]  # asked once, then known


class _StoresServer:
    """A ParameterServer's ``call_all`` over in-process vector stores, counting the calls."""

    def __init__(self, x: np.ndarray, n_shards: int = 3):
        self.stores = []
        for lo, hi in split_range(len(x), n_shards):
            self.stores.append(VectorStore(hi - lo))
            self.stores[-1].set("x", x[lo:hi])
            self.stores[-1].set("d", np.ones(hi - lo))
        self.calls: list[str] = []

    def call_all(self, method, *args, timeout):
        self.calls.append(method.__name__)
        replies = []
        for store in self.stores:
            shard = SimpleNamespace(store=store)
            coroutine = method(shard, *args)
            try:
                coroutine.send(None)  # the shard's methods never await
            except StopIteration as done:
                replies.append(done.value)
        return replies


def test_a_program_that_writes_a_kept_vector_brings_it_back_in_the_same_call():
    x = np.arange(7, dtype=np.float64)
    portions = _portions([])
    portions.server, portions.keep, portions.kept = _StoresServer(x), ("x",), {}
    dots = portions.run([("dot", "x", "x")])  # reads x only: nothing to keep
    assert dots.tolist() == [x @ x] and portions.kept == {}
    dots = portions.run([("axpy", 0.5, "d", "x"), ("dot", "x", "d")])
    assert dots.tolist() == [(x + 0.5).sum()]
    np.testing.assert_array_equal(portions.kept["x"], x + 0.5)  # the whole vector, as written
    assert portions.server.calls == ["run", "run_and_copy"]  # one round trip each


def test_a_led_program_runs_first_in_the_next_program_and_only_there():
    x = np.arange(7, dtype=np.float64)
    portions = _portions([])
    portions.server, portions.keep, portions.kept = _StoresServer(x), (), {}
    portions.lead([("copy", "x", "xe")])  # a snapshot of x, before the step below moves x
    portions.run([("axpy", 1.0, "d", "x")])
    np.testing.assert_array_equal(portions.run([("dot", "xe", "xe")]), [x @ x])
    assert portions.run([]).size == 0  # nothing led and nothing to run: no call
    assert portions.server.calls == ["run", "run"]


def test_a_task_given_its_point_computes_only_if_its_worker_saw_no_later_version():
    point = np.zeros(3, np.float32)
    assert _newest("run-a", 3, point)
    assert _newest("run-a", 3, point)  # a second portion of the same batch
    assert not _newest("run-a", 2, point)  # a copy of an earlier batch: its batch is over
    assert _newest("run-a", 4, point) and _newest("run-b", 1, point)  # runs are apart
    forget_run("run-a"), forget_run("run-b")


def test_a_point_cached_by_a_run_whose_driver_died_goes_once_another_run_caches(monkeypatch):
    point = np.zeros(3, np.float32)
    assert _newest("run-killed", 5, point) and _newest("run-live", 2, point)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + STALE_AFTER / 2)
    assert _newest("run-live", 3, point)  # used since
    monkeypatch.setattr(time, "monotonic", lambda: now + STALE_AFTER + 1)
    assert _newest("run-new", 1, point)
    assert set(_CACHE) == {"run-live", "run-new"}  # not forgotten, but unused for too long
    forget_run("run-live"), forget_run("run-new")


class _FinishedServer:
    """The shards' side of ``_finish_results``: what each shard's finish program gave."""

    def __init__(self, results: list) -> None:
        self.results, self.asked = results, 0
        self.n_shards = len(results)

    def call_all(self, method, version, timeout):
        assert method is SandblasterShard.finished
        self.asked += 1
        return self.results


def test_a_batch_whose_completing_copy_was_not_collected_asks_the_shards_for_its_finish():
    """A shard's finish result comes with the copy that completed its batch; when that copy is
    a backup the pass has not collected (it counted the other copy), the shards are asked."""
    results = [
        Finished([1.0, 2.0], [np.array([0.0, 1.0])]),
        Finished([10.0, 20.0], [np.array([2.0])]),
    ]
    portions = _portions([])
    portions.server, portions.kept = _FinishedServer(results), {}
    portions.finished = {0: results[0], 1: results[1]}  # both came with collected copies
    assert portions._finish_results(3, ("x",)).tolist() == [11.0, 22.0]
    assert portions.server.asked == 0
    portions.finished = {1: results[1]}  # shard 0's completing copy is still out
    assert portions._finish_results(3, ("x",)).tolist() == [11.0, 22.0]
    assert portions.server.asked == 1
    np.testing.assert_array_equal(portions.kept["x"], [0.0, 1.0, 2.0])  # in shard order


def test_a_copy_of_the_current_batch_brings_its_finish_results_counted_or_not():
    portions = _portions([])
    done = Finished([1.0], [])
    counted: dict = {}
    for shard, worker in enumerate(["w1", "w2"]):  # the copy on w2 is a discarded duplicate
        result = PortionResult(7, 3, "done", 2.5, 10, worker, ((shard, done),))
        future = _FakeFuture("finished", result)
        _add(portions, future, version=3, portion=7, worker=worker)
        assert portions._collect(future, 3, [], counted, []) is (worker == "w1")
    assert portions.finished == {0: done, 1: done}


def test_a_runner_call_that_is_lost_is_run_again_as_a_task():
    """A runner whose worker went away, or that did not hold the block, gives no result: the
    portion runs again, and from then on as a Dask task, which brings the block wherever it is
    (a runner would be asked again for a block it does not hold)."""
    restored: list[int] = []
    portions = _portions(restored)
    reply: concurrent.futures.Future = concurrent.futures.Future()
    reply.set_exception(OSError("Unable to contact Actor's worker"))
    lost = RunnerCall(reply)
    _add(portions, lost, version=3, portion=7, worker="w1")
    todo: list[int] = []
    assert portions._collect(lost, 3, todo, {}, []) is False
    assert todo == [7] and portions.task_only == {7} and restored


def test_a_runner_call_to_a_worker_that_left_is_given_up_at_the_next_look(monkeypatch):
    """A Dask task on a worker that left is re-run by Dask; a runner's call would wait out
    Dask's connect timeout (30 s) before failing, so the pass gives it up when it sees the
    worker gone, and runs the portion again."""
    observer = _Observer()
    portions = _portions([], observer)
    portions.client = SimpleNamespace(who_has=lambda blocks: {}, nbytes=lambda *a, **k: {})
    portions.server = SimpleNamespace(workers=["w1"])
    portions.data = SimpleNamespace(homes={})
    stays, gone = concurrent.futures.Future(), concurrent.futures.Future()
    on_w1, on_w2 = RunnerCall(stays), RunnerCall(gone)
    _add(portions, on_w1, version=3, portion=1, worker="w1")
    _add(portions, on_w2, version=3, portion=7, worker="w2")
    monkeypatch.setattr(scheduling, "cluster_workers", lambda client: {"w1": {"nthreads": 1}})
    portions._refresh()
    assert on_w2.status == "lost" and on_w1.status == "pending"
    assert ("worker_lost", {"worker": "w2"}) in observer.events
    todo: list[int] = []
    portions._collect(on_w2, 3, todo, {}, [])
    assert todo == [7] and portions.task_only == {7}
