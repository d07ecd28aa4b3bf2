"""Portions sent straight to a worker's runner actor (``sandblaster/runners.py``).

What a pass reads of a runner's reply (:class:`RunnerCall`) and how it waits for the first copy
to finish (:class:`Arrivals`) are pinned with plain ``concurrent.futures`` here; a runner on a
real worker that does not hold the block it is asked for answers None, so that the pass runs the
portion again as a Dask task.  ``test_sandblaster_files.py`` shows every portion of a fit going
to the runners, and ``test_sandblaster.py`` a worker killed under them.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
from distributed import Client, Event, LocalCluster

from downpour_dask import SandblasterLBFGS, models
from downpour_dask.runtime.cluster import cluster_workers
from downpour_dask.sandblaster.runners import Arrivals, RunnerCall, RunnerPool
from downpour_dask.sandblaster.tasks import PortionResult

RESULT = PortionResult(3, 2, "done", 1.5, 10, "tcp://w1")


def _call(outcome: object = None, *, pending: bool = False) -> RunnerCall:
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
    finished = _call(RESULT)
    assert finished.status == "finished" and finished.result(timeout=1) == RESULT
    failed = _call(ValueError("the model raised"))  # a bug: the pass raises it, names it
    assert failed.status == "error"
    assert isinstance(failed.exception(timeout=1), ValueError)


def test_a_runner_call_whose_worker_went_away_or_had_no_block_is_lost_not_failed():
    """Both are run again elsewhere (``Portions._collect`` on a None result), never raised."""
    unreachable = _call(OSError("Unable to contact Actor's worker"))
    no_block = _call(None)  # the runner did not hold the portion's block
    for call in (unreachable, no_block):
        assert call.status == "lost" and call.result(timeout=1) is None


@pytest.mark.timeout(30)  # a missed wake-up waits out the 60 s below: this fails first
def test_arrivals_returns_what_finished_and_wakes_when_a_copy_finishes():
    arrivals = Arrivals()
    early, late = _call(RESULT), _call(pending=True)
    for call in (early, late):
        arrivals.watch(call)
    assert arrivals.first([early, late], timeout=5) == {early}  # no wait: one is done
    assert arrivals.first([late], timeout=0.01) == set()  # none finished in time
    finisher = threading.Timer(0.05, lambda: late.reply.set_result(RESULT))
    finisher.start()
    try:
        assert arrivals.first([late], timeout=60) == {late}  # woken by its finish
    finally:
        finisher.join(timeout=5)


@pytest.mark.timeout(60)
def test_a_runner_asked_for_a_block_its_worker_does_not_hold_answers_none(client, cluster_keys):
    before = cluster_keys()
    workers = sorted(cluster_workers(client))
    pool = RunnerPool(client, workers, "test")
    pool.wait([], timeout=30)
    call = pool.call(workers[0], "sandblaster-block-not-here", None, "test", 2, 3)
    assert call is not None  # the runner started: the call went to it
    assert call.reply.result(timeout=30) is None and call.status == "lost"
    pool.close()
    assert cluster_keys(beyond=before) == set()  # the runners are gone with the pool


def _runner_portions(dask_worker) -> list[str]:
    return [str(key) for key in dask_worker.active_threads.values() if "-runner" in str(key)]


@pytest.mark.slow  # a cluster of its own
@pytest.mark.timeout(120)
def test_a_worker_with_two_threads_runs_two_of_its_runners_portions_at_once():
    """A runner computes in its worker's thread pool, not in the one thread Dask keeps for
    actors: with two threads, the worker's two portions (each sleeping 0.5 s first) run at
    once, and both show where Dask lists its threads' work."""
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


def _fails() -> None:
    raise ValueError("this block could not be read")


@pytest.mark.timeout(30)  # the wait below would last 120 s if a failed block did not end it
def test_the_first_pass_stops_waiting_for_blocks_once_one_failed(client, cluster_keys):
    before = cluster_keys()
    workers = sorted(cluster_workers(client))
    pool = RunnerPool(client, workers, "test")
    release = Event()
    held = client.submit(release.wait, 60, pure=False)  # a block still being read
    failed = client.submit(_fails, pure=False)
    try:
        pool.wait([held, failed], timeout=120)
        assert failed.status == "error" and held.status == "pending"
    finally:
        release.set()
        held.result(timeout=30)
        pool.close()
    client.cancel([held, failed])
    assert not [k for k in cluster_keys(beyond=before) if "portion-runner" in k]
