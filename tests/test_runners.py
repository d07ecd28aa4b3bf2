"""Portions sent straight to the worker holding their block (``sandblaster/runners.py``).

What a pass reads of a runner's answer (:class:`RunnerCall`) and how it waits for the first copy
to finish (:class:`Arrivals`) are pinned with plain ``concurrent.futures`` here; on a real
cluster, a runner asked for a block its worker does not hold answers so (the pass then runs the
portion as a Dask task), a worker with two threads runs two portions at once, and the first
pass's wait for the blocks ends when one fails.  ``test_sandblaster_files.py`` shows every portion
of a fit going to the runners, and ``test_sandblaster.py`` workers killed, stopped and retired
under them.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
from distributed import Client, Event, LocalCluster

from downpour_dask import SandblasterLBFGS, models
from downpour_dask.runtime.cluster import cluster_workers
from downpour_dask.sandblaster.runners import Arrivals, RunnerCall, Runners
from downpour_dask.sandblaster.tasks import PortionResult

RESULT = PortionResult(3, 2, "done", 1.5, 10, "tcp://w1")


def _call(outcome: object = None, *, pending: bool = False) -> RunnerCall:
    """A runner's answer: ``outcome`` is what the worker answered, or the error of the call."""
    reply: concurrent.futures.Future = concurrent.futures.Future()
    if not pending:
        if isinstance(outcome, BaseException):
            reply.set_exception(outcome)
        else:
            reply.set_result(outcome)
    return RunnerCall(reply)


def test_a_runner_call_reads_as_the_pass_reads_a_dask_future():
    waiting = _call(pending=True)
    assert waiting.status == "pending" and not waiting.done()
    finished = _call(("ok", RESULT))
    assert finished.status == "finished" and finished.result(timeout=1) == RESULT
    failed = _call(("error", ValueError("the model raised")))  # the pass raises it, names it
    assert failed.status == "error"
    assert isinstance(failed.exception(timeout=1), ValueError)
    with pytest.raises(ValueError, match="the model raised"):
        failed.result(timeout=1)


def test_a_runner_call_whose_worker_went_away_or_had_no_block_is_lost_not_failed():
    """Both are run again elsewhere (``Portions._collect`` on a None result), never raised."""
    unreachable = _call(OSError("Timed out trying to connect"))
    no_block = _call(("ok", None))  # the worker did not hold the portion's block
    for call in (unreachable, no_block):
        assert call.status == "lost" and call.result(timeout=1) is None
        assert call.exception(timeout=1) is None


@pytest.mark.timeout(30)  # a missed wake-up waits out the 60 s below: this fails first
def test_arrivals_returns_what_finished_and_wakes_when_a_copy_finishes():
    arrivals = Arrivals()
    early, late = _call(("ok", RESULT)), _call(pending=True)
    for call in (early, late):
        arrivals.watch(call)
    assert arrivals.first([early, late], timeout=5) == {early}  # no wait: one is done
    assert arrivals.first([late], timeout=0.01) == set()  # none finished in time
    finisher = threading.Timer(0.05, lambda: late.reply.set_result(("ok", RESULT)))
    finisher.start()
    try:
        assert arrivals.first([late], timeout=60) == {late}  # woken by its finish
    finally:
        finisher.join(timeout=5)


@pytest.mark.timeout(60)
def test_a_runner_asked_for_a_block_its_worker_does_not_hold_says_so(client):
    runners = Runners(client, 30)
    worker = sorted(cluster_workers(client))[0]
    call = runners.call(worker, "sandblaster-block-not-here", None, "test", 2, 3)
    assert call is not None and call.reply.result(timeout=30) == ("ok", None)
    assert call.status == "lost"  # the pass sends the portion as a task instead


def test_a_client_that_does_not_reach_the_workers_keeps_dask_tasks(client, monkeypatch):
    monkeypatch.setattr(client, "direct_to_workers", False)
    runners = Runners(client, 30)
    assert runners.call("tcp://127.0.0.1:1", "block", None, "test", 2, 3) is None


def _fails() -> None:
    raise ValueError("this block could not be read")


@pytest.mark.timeout(30)  # the wait below would last 120 s if a failed block did not end it
def test_the_first_pass_stops_waiting_for_blocks_once_one_failed(client):
    runners = Runners(client, 30)
    release = Event()
    held = client.submit(release.wait, 60, pure=False)  # a block still being read
    failed = client.submit(_fails, pure=False)
    try:
        runners.wait([held, failed], timeout=120)
        assert failed.status == "error" and held.status == "pending"
    finally:
        release.set()
        held.result(timeout=30)
        client.cancel([held, failed])


def _runner_portions(dask_worker) -> list[str]:
    return [str(key) for key in dask_worker.active_threads.values() if "-runner" in str(key)]


@pytest.mark.slow  # a cluster of its own
@pytest.mark.timeout(120)
def test_a_worker_with_two_threads_runs_two_of_its_portions_at_once():
    """A runner computes in its worker's thread pool: with two threads, the worker's two
    portions (each sleeping 0.5 s first) run at once, and both show where Dask lists its
    threads' work."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 8)).astype(np.float32)
    y = (X @ rng.standard_normal(8) > 0).astype(int)
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0")
        as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        (worker,) = cluster_workers(client)
        est = SandblasterLBFGS(models.LogisticRegression(8), max_iter=0, random_state=0)
        done: dict = {}
        delay = {worker: 0.5}
        fit = threading.Thread(
            target=lambda: done.update(est=est.fit(X, y, client=client, portion_delay=delay))
        )
        fit.start()
        most = 0  # the most runner portions seen running at once
        while fit.is_alive() and most < 2:
            most = max(most, len(client.run(_runner_portions)[worker]))
        fit.join(timeout=60)
        assert "est" in done and most == 2
        assert len(est.experiment_.pushes) == 2  # one portion per worker thread, each once


def test_a_runner_call_given_up_is_lost_at_once():
    """A worker that left the cluster: its calls are lost now (and run again), not after
    Dask's connect timeout."""
    call = _call(pending=True)
    call.abandon()
    assert call.done() and call.status == "lost" and call.result(timeout=1) is None


@pytest.mark.timeout(30)  # an unbounded wait would hang here: this fails first
def test_waiting_for_a_runners_answer_ends_at_its_timeout():
    """A score whose worker is stopped must not hold the fit past ``timeout``."""
    call = _call(pending=True)
    with pytest.raises(TimeoutError):
        call.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        call.exception(timeout=0.05)
