"""Workers pinned to CPUs of their own (``pin_workers``): every thread of each worker process,
threads started later, a worker its nanny restarts; given back by ``unpin_workers``."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from distributed import Client

from downpour_dask import DownpourSGD, datasets, pin_workers, unpin_workers
from downpour_dask.runtime import cluster as cluster_module
from downpour_dask.runtime.affinity import PLUGIN_NAME
from downpour_dask.runtime.cpus import HELPER_PREFIX, split_cpus, thread_cpus, thread_policies
from downpour_dask.runtime.dask_client_calls import scheduler_workers

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning 2 workers needs 2 CPUs")


def _thread_started_now() -> list[int]:
    """The CPUs a thread started at this moment may use (it inherits its starter's)."""
    seen = []
    thread = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    thread.start()
    thread.join(timeout=30)
    return seen


def _helper_policies(client: Client) -> set[int]:
    """The scheduling policies of the cluster's helper threads (``downpour-wire-*``)."""
    found = client.run(thread_policies)
    policies = {
        policy
        for threads in found.values()
        for name, each in threads.items()
        if name.startswith(HELPER_PREFIX)
        for policy in each
    }
    assert policies, "no helper thread on any worker"
    return policies


def _every_thread_on(client: Client, pinned: dict[str, list[int]]) -> None:
    for address, threads in client.run(thread_cpus).items():
        assert threads and all(cpus == pinned[address] for cpus in threads.values()), address


@needs_two_cpus
@pytest.mark.timeout(120)
def test_each_worker_runs_on_cpus_of_its_own_until_unpinned(two_workers):
    client = two_workers
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
def test_a_pinning_that_cannot_be_made_changes_nothing(two_workers):
    client = two_workers
    before = client.run(thread_cpus)
    with pytest.raises(ValueError, match=r"cannot pin 2 workers.*only 1 CPU"):
        pin_workers(client, cpus=CPUS[:1], timeout=30)
    with pytest.raises(ValueError, match="names no CPU the workers on"):
        pin_workers(client, cpus=[max(CPUS) + 1000], timeout=30)
    assert client.run(thread_cpus) == before
    assert not unpin_workers(client, timeout=30)


@needs_two_cpus
@pytest.mark.timeout(180)
def test_a_fit_on_pinned_workers_trains_and_the_pinning_is_given_back(two_workers):
    client = two_workers
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
def test_a_worker_its_nanny_restarts_after_sigkill_is_pinned_again(two_workers):
    client = two_workers
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


def _one_run_each(threads_by_worker: dict[str, dict[int, list[int]]]) -> list[list[int]]:
    """Each worker's CPUs, asserting that all the threads of a worker have the same."""
    runs = []
    for threads in threads_by_worker.values():
        (run,) = {tuple(cpus) for cpus in threads.values()}
        runs.append(list(run))
    return sorted(runs)


@needs_two_cpus
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("busy_threads", "variable", "pinned"),
    [(99, None, True), (1, None, False), (99, "0", False)],
    ids=["every-worker-busy", "fewer-replicas-than-workers", "turned-off"],
)
def test_an_embedded_cluster_is_pinned_only_when_its_fit_keeps_every_worker_busy(
    busy_threads, variable, pinned, monkeypatch, capsys
):
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)  # not the suite's
    if variable is None:
        monkeypatch.delenv(cluster_module.PIN_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cluster_module.PIN_VARIABLE, variable)
    with cluster_module.cluster_client(None, announce=True, busy_threads=busy_threads) as client:
        line = capsys.readouterr().err
        runs = _one_run_each(client.run(thread_cpus))
    if pinned:
        assert runs == split_cpus(CPUS, len(runs))
        assert f"{len(runs)} workers pinned to CPUs" in line
    else:
        assert all(run == CPUS for run in runs)
        assert "pinned" not in line


#: The workers of an embedded cluster: one per core, 2 to 8 (runtime/cluster.py).
EMBEDDED = max(2, min(os.cpu_count() or 2, 8))


@pytest.mark.slow  # starts (and closes) two embedded clusters
@pytest.mark.skipif(len(CPUS) < EMBEDDED, reason="fewer CPUs to use than embedded workers")
@pytest.mark.timeout(240)
def test_a_fit_pins_its_embedded_cluster_when_it_has_a_replica_for_every_worker(
    monkeypatch, capsys
):
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)
    monkeypatch.delenv(cluster_module.PIN_VARIABLE, raising=False)
    train, test = datasets.load("digits")
    lines = {}
    for replicas in (1, EMBEDDED):
        est = DownpourSGD("mlp", n_replicas=replicas, max_epochs=4, random_state=0, verbose=1)
        est.fit(train)  # client=None: an embedded cluster
        err = capsys.readouterr().err
        lines[replicas] = next(x for x in err.splitlines() if "started a local Dask" in x)
        assert est.score(test) > 0.8
    assert "pinned" not in lines[1]
    assert f"{EMBEDDED} workers pinned to CPUs" in lines[EMBEDDED]
