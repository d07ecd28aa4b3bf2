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

import pytest

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
    return RunnerCall(reply, "runner-w1-3-v2")


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
