"""What workers keep for the driver reaches it once, even when an answer comes too late (and
what the driver tells them is not skipped for it).

The driver reads push-log rows and leaving replicas' results off the workers with a bounded wait
(``client.run``, :data:`~downpour_dask.downpour.dask_cluster.RUN_TIMEOUT`).  On a busy machine
an answer can arrive after the driver stopped waiting; the worker had already handed the items
over.  These tests lose answers on purpose, in-process (a fake client runs the function here)
and on the shared cluster.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from downpour_dask.downpour import dask_cluster
from downpour_dask.downpour.dask_cluster import DaskCluster
from downpour_dask.downpour.outbox import PROCESS, Outbox, Taken, answer
from downpour_dask.downpour.registry import (
    assigned_share,
    forget_run,
    keep_returned,
    keep_row,
    rows_after,
)


def test_an_answer_lost_on_the_way_is_given_again_and_what_the_driver_holds_is_dropped():
    box, taken = Outbox(), Taken()
    for i in range(3):
        box.put(i)
    answer(box, *taken.of("w"))  # the driver stopped waiting: this answer is lost
    box.put(3)
    assert taken.receive("w", answer(box, *taken.of("w"))) == [0, 1, 2, 3]
    box.put(4)
    assert taken.receive("w", answer(box, *taken.of("w"))) == [4]
    assert box.items == [4] and box.first == 4  # what the driver holds is no longer kept
    assert taken.receive("w", answer(box, *taken.of("w"))) == []
    assert taken.receive("w", TimeoutError()) == [] and taken.of("w") == (PROCESS, 5)


def test_a_worker_restarted_at_the_same_address_is_read_from_its_first_item():
    old, taken = Outbox(), Taken()
    for i in range(5):
        old.put(i)
    taken.receive("w", answer(old, *taken.of("w")))
    taken.held["w"] = ("an earlier process", 5)  # what the driver holds of the old process
    new = Outbox()
    new.put("first of the new process")
    assert taken.receive("w", answer(new, *taken.of("w"))) == ["first of the new process"]
    assert answer(None, *taken.of("w")) == (PROCESS, 0, [])


class LateClient:
    """Runs a function "on worker w" here; the answers of the calls in ``late`` arrive after
    the driver stopped waiting (the function ran, its answer is lost)."""

    def __init__(self, late: set[int]):
        self.late, self.calls = late, 0

    def run(self, function, *args, workers, on_error, callback_timeout):
        self.calls += 1
        found = {workers[0]: function(*args)}
        if self.calls in self.late:
            raise TimeoutError(f"no answer within {callback_timeout} s")
        return found


@pytest.fixture
def one_worker(monkeypatch):
    monkeypatch.setattr(dask_cluster, "cluster_workers", lambda client: {"w": {}})
    monkeypatch.setattr(dask_cluster, "SKIP_FOR", 0.0)  # ask the late worker again at once


def test_the_fits_last_reading_asks_a_late_worker_again_even_one_skipped_for_lateness(
        monkeypatch):
    monkeypatch.setattr(dask_cluster, "cluster_workers", lambda client: {"w": {}})
    run = "outbox-last"
    client = LateClient(late={1, 2})
    cluster = DaskCluster(client, run, 30)
    try:
        keep_row(run, ("push", 1))
        assert cluster.drain_rows() == []  # late: w is skipped for a while (SKIP_FOR)
        keep_row(run, ("push", 2))
        assert cluster.drain_rows() == [] and client.calls == 1  # not asked meanwhile
        assert cluster.drain_rows(last=True) == [("push", 1), ("push", 2)]  # late once more
        assert client.calls == 3
        keep_row(run, ("push", 3))
        cluster._skip["w"] = float("inf")  # (as if it had been late again)
        cluster.forget()  # what w keeps for the run goes even so
        assert client.calls == 4 and rows_after(run, "", 0)[2] == []
    finally:
        forget_run(run)


def test_the_push_log_rows_of_a_late_answer_reach_the_log_at_the_next_collection(one_worker):
    run = "outbox-rows"
    cluster = DaskCluster(LateClient(late={1}), run, 30)
    try:
        keep_row(run, ("push", 1))
        keep_row(run, ("push", 2))
        assert cluster.drain_rows() == []  # the answer came too late
        keep_row(run, ("push", 3))
        assert cluster.drain_rows() == [("push", 1), ("push", 2), ("push", 3)]
        assert cluster.drain_rows() == []  # each row once
        keep_row(run, ("push", 4))
        assert cluster.drain_rows() == [("push", 4)]
    finally:
        forget_run(run)


def test_the_results_a_leaving_worker_kept_are_handed_over_once_even_after_a_late_answer(
        one_worker):
    run = "outbox-returned"
    cluster = DaskCluster(LateClient(late={1}), run, 30)
    try:
        keep_returned(run, {"replica": 0, "retired": True})
        assert cluster.returned("w") == []  # too late
        assert cluster.returned("w") == [{"replica": 0, "retired": True}]
        assert cluster.returned("w") == []
    finally:
        forget_run(run)


def test_on_a_cluster_every_worker_hands_each_row_over_once_though_answers_come_late(
        client, monkeypatch):
    """Rows kept in the worker processes; every other answer is dropped after the function
    ran there (the driver stopped waiting)."""
    run = "outbox-cluster"
    workers = sorted(client.scheduler_info()["workers"])
    cluster, run_each, readings = DaskCluster(client, run, 30), DaskCluster._run_each, Counter()

    def half_of_them_late(self, function, *args, workers=None):
        found = run_each(self, function, *args, workers=workers)
        readings.update(list(found))
        return {w: TimeoutError("late") if readings[w] % 2 else v for w, v in found.items()}

    monkeypatch.setattr(DaskCluster, "_run_each", half_of_them_late)
    try:
        rows = []
        for i in range(4):
            client.run(keep_row, run, ("push", i))  # one row per worker per round
            rows.extend(cluster.drain_rows())
        for _ in range(len(workers)):  # what the last round's late answers carried
            rows.extend(cluster.drain_rows())
        assert sorted(rows) == sorted(("push", i) for i in range(4) for _ in workers)
    finally:
        client.run(forget_run, run)


@pytest.mark.parametrize("command", ["assign_share", "stop_replicas_on", "release", "retire"])
def test_a_worker_skipped_for_a_late_answer_is_still_told_what_the_driver_decided(
        command, monkeypatch):
    """Not only what workers hand over: a command skipped would leave the worker acting on what
    it was told before (e.g. a new share skipped: the old replica reads the rows the joined one
    reads too, ``downpour/shares.py``)."""
    monkeypatch.setattr(dask_cluster, "cluster_workers", lambda client: {"w": {}})
    run = "outbox-tell"
    client = LateClient(late={1})
    cluster = DaskCluster(client, run, 30)
    try:
        assert cluster.drain_rows() == []  # late: w is skipped for SKIP_FOR seconds
        if command == "assign_share":
            cluster.assign_share("w", 0, np.array([0, 2, 4]))
            np.testing.assert_array_equal(assigned_share(run, 0), [0, 2, 4])
        elif command == "retire":
            monkeypatch.setattr(dask_cluster, "finish_retirement", lambda: None)  # (no Worker)
            cluster.retire("w")
        else:
            getattr(cluster, command)("w")
        assert client.calls == 2
    finally:
        forget_run(run)
