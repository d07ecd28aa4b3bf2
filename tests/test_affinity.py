"""Workers pinned to CPUs of their own (``pin_workers``): every thread of each worker process,
threads started later, a worker its nanny restarts; given back by ``unpin_workers``."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster

from downpour_dask import DownpourSGD, datasets, pin_workers, unpin_workers
from downpour_dask.runtime.affinity import PLUGIN_NAME, split_cpus, thread_cpus
from downpour_dask.runtime.dask_internals import scheduler_workers

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning 2 workers needs 2 CPUs")


def test_cpus_are_split_into_disjoint_runs_covering_them_all():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus(range(8), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cpus([5, 3, 3, 9], 1) == [[3, 5, 9]]  # sorted, each CPU once


def test_more_workers_than_cpus_is_refused_naming_both_counts():
    with pytest.raises(ValueError, match=r"cannot pin 3 workers.*only 2 CPU\(s\) \[0, 1\]"):
        split_cpus([0, 1], 3)
    with pytest.raises(ValueError, match="n_workers must be at least 1"):
        split_cpus([0, 1], 0)


@pytest.fixture
def fresh_pair():
    """A client of a fresh 2-worker cluster: pinning changes its processes for good."""
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        yield client


def _thread_started_now() -> list[int]:
    """The CPUs a thread started at this moment may use (it inherits its starter's)."""
    seen = []
    thread = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    thread.start()
    thread.join(timeout=30)
    return seen


def _every_thread_on(client: Client, pinned: dict[str, list[int]]) -> None:
    for address, threads in client.run(thread_cpus).items():
        assert threads and all(cpus == pinned[address] for cpus in threads.values()), address


@needs_two_cpus
@pytest.mark.timeout(120)
def test_each_worker_runs_on_cpus_of_its_own_until_unpinned(fresh_pair):
    client = fresh_pair
    before = client.run(thread_cpus)
    pinned = pin_workers(client, timeout=30)
    assert sorted(pinned) == sorted(before)
    runs = sorted(pinned.values())
    assert runs == split_cpus(CPUS, 2)  # disjoint, and together every CPU the workers had
    _every_thread_on(client, pinned)
    # threads a worker starts later (a task's, the wire's) inherit the worker's CPUs
    assert client.run(_thread_started_now) == pinned
    assert client.submit(_thread_started_now, pure=False).result(timeout=30) in runs
    assert unpin_workers(client, timeout=30)
    for address, threads in client.run(thread_cpus).items():
        assert set(map(tuple, threads.values())) == set(map(tuple, before[address].values()))
    assert not unpin_workers(client, timeout=30)  # nothing left to undo


@needs_two_cpus
@pytest.mark.timeout(120)
def test_a_pinning_that_cannot_be_made_changes_nothing(fresh_pair):
    client = fresh_pair
    before = client.run(thread_cpus)
    with pytest.raises(ValueError, match=r"cannot pin 2 workers.*only 1 CPU"):
        pin_workers(client, cpus=CPUS[:1], timeout=30)
    with pytest.raises(ValueError, match="names no CPU the workers on"):
        pin_workers(client, cpus=[max(CPUS) + 1000], timeout=30)
    assert client.run(thread_cpus) == before
    assert not unpin_workers(client, timeout=30)


@needs_two_cpus
@pytest.mark.timeout(180)
def test_a_fit_on_pinned_workers_trains_and_the_pinning_is_given_back(fresh_pair):
    client = fresh_pair
    train, test = datasets.load("digits")
    pinned = pin_workers(client, timeout=30)
    try:
        est = DownpourSGD(
            "mlp", n_replicas=2, n_shards=2, max_epochs=6, random_state=0, timeout=60
        ).fit(train, client=client)
        _every_thread_on(client, pinned)  # the fit's threads too (wire, shard service)
    finally:
        unpin_workers(client, timeout=30)
    assert est.score(test.X, test.y) > 0.85
    assert all(
        np.array_equal(cpus, CPUS) for threads in client.run(thread_cpus).values()
        for cpus in threads.values()
    )  # fmt: skip


def _pid() -> int:
    return os.getpid()


def _plugins(dask_worker) -> list[str]:
    return list(dask_worker.plugins)


@pytest.mark.slow
@needs_two_cpus
@pytest.mark.timeout(180)
def test_a_worker_its_nanny_restarts_after_sigkill_is_pinned_again(fresh_pair):
    client = fresh_pair
    pinned = pin_workers(client, timeout=30)
    victim = sorted(pinned)[0]
    pids = client.run(_pid)
    name = scheduler_workers(client)[victim]["name"]
    os.kill(pids[victim], signal.SIGKILL)
    end = time.monotonic() + 90  # the nanny starts a new worker: a new address, the same name
    workers = scheduler_workers(client)
    while time.monotonic() < end and (victim in workers or len(workers) < 2):
        time.sleep(0.2)
        workers = scheduler_workers(client)
    (newcomer,) = set(workers) - set(pinned)
    assert workers[newcomer]["name"] == name
    threads = client.run(thread_cpus, workers=[newcomer])[newcomer]
    assert all(cpus == pinned[victim] for cpus in threads.values())
    assert PLUGIN_NAME in client.run(_plugins)[newcomer]
    assert unpin_workers(client, timeout=30)
