"""A process's CPUs and its helper threads (``runtime/cpus.py``), in this process: how CPUs are
split among workers, and helper threads that run as batch threads while the process is pinned."""

import os
import threading

import pytest

from downpour_dask.runtime import cpus
from downpour_dask.runtime.cpus import helper_thread, helpers_as_batch, split_cpus

linux_policies = pytest.mark.skipif(
    not hasattr(os, "sched_getscheduler"), reason="Linux's scheduling policies"
)


def test_cpus_are_split_into_disjoint_runs_covering_them_all():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(range(8), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cpus([5, 3, 3, 9], 1) == [[3, 5, 9]]  # sorted, each CPU once


def test_more_workers_than_cpus_is_refused_naming_both_counts():
    with pytest.raises(ValueError, match=r"cannot pin 3 workers.*only 2 CPU\(s\) \[0, 1\]"):
        split_cpus([0, 1], 3)
    with pytest.raises(ValueError, match="n_workers must be at least 1"):
        split_cpus([0, 1], 0)


def _policy_seen_by(name: str, release: threading.Event, seen: list) -> threading.Thread:
    """A started helper thread that records its own policy, then waits for ``release``."""

    def body() -> None:
        seen.append(os.sched_getscheduler(0))
        release.wait(timeout=30)

    thread = helper_thread(body, name)
    thread.start()
    return thread


@linux_policies
def test_helper_threads_are_batch_threads_only_while_the_process_is_pinned():
    release, seen = threading.Event(), []
    try:
        before = _policy_seen_by("downpour-wire-test-before", release, seen)
        helpers_as_batch(True)  # what pinning a worker does
        started_pinned = _policy_seen_by("downpour-wire-test-pinned", release, seen)
        for thread in (before, started_pinned):
            assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH
        helpers_as_batch(False)  # unpinned: the running helpers are ordinary threads again
        for thread in (before, started_pinned):
            assert os.sched_getscheduler(thread.native_id) == os.SCHED_OTHER
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # other threads were never touched
    finally:
        helpers_as_batch(False)
        release.set()
    before.join(timeout=30)
    started_pinned.join(timeout=30)
    assert seen == [os.SCHED_OTHER, os.SCHED_BATCH]  # as each one started


def test_a_helper_threads_name_must_mark_it_as_one():
    with pytest.raises(ValueError, match="must begin with 'downpour-wire'"):
        helper_thread(lambda: None, "replica-helper")
    assert not cpus._helpers_batch


def test_a_replica_gives_up_its_cpu_to_ready_helpers_only_while_pinned(monkeypatch):
    yields = []
    monkeypatch.setattr(cpus.os, "sched_yield", lambda: yields.append(1))
    cpus.let_helpers_run()  # unpinned: the helpers run on another core, nothing to give up
    assert yields == []
    try:
        helpers_as_batch(True)
        cpus.let_helpers_run()
        cpus.let_helpers_run()
    finally:
        helpers_as_batch(False)
    assert yields == [1, 1]
