"""Dask's worker profiler where it can deadlock a worker (``runtime/profiler.py``): the clusters
the library starts go without it, and a cluster a user brings with it is warned about once."""

from __future__ import annotations

import os
import signal
import warnings

import dask
import pytest
from conftest import newcomer_after_sigkill
from distributed import Client, LocalCluster

from downpour_dask.runtime import cluster as cluster_module
from downpour_dask.runtime import profiler
from downpour_dask.runtime.profiler import PROFILE_SETTING, profiler_can_deadlock

CONNECT = "distributed.comm.timeouts.connect"


@pytest.mark.parametrize(
    ("version", "implementation", "can"),
    [
        ((3, 10, 12), "cpython", True),
        ((3, 11, 7), "cpython", True),
        ((3, 11, 8), "cpython", True),
        ((3, 11, 9), "cpython", False),
        ((3, 12, 0), "cpython", False),
        ((3, 13, 1), "cpython", False),
        ((3, 10, 12), "pypy", False),
    ],
)
def test_the_profiler_can_deadlock_on_cpython_before_3_11_9(version, implementation, can):
    assert profiler_can_deadlock(version, implementation) is can


@pytest.mark.parametrize("can", [True, False], ids=["interpreter-with-the-bug", "without"])
def test_the_safe_settings_turn_the_profiler_off_only_where_it_can_deadlock(can, monkeypatch):
    monkeypatch.setattr(profiler, "profiler_can_deadlock", lambda: can)
    with dask.config.set({PROFILE_SETTING: True, CONNECT: "33s"}):
        options = profiler.without_unsafe_profiler()
        inside = dask.config.get(PROFILE_SETTING)
    assert inside is True  # Dask's own settings are left alone
    if not can:
        assert options == {}
        return
    # A copy, not a view: it keeps the profiler off after the block that was current ended.
    settings = options["config"]
    assert settings["distributed"]["worker"]["profile"]["enabled"] is False
    assert settings["distributed"]["comm"]["timeouts"]["connect"] == "33s"  # the rest as it was


def _profiling(dask_worker=None) -> bool:
    return "profile" in dask_worker.periodic_callbacks


def _profiling_cluster(n_workers: int) -> LocalCluster:
    """A local cluster whose workers run Dask's profiler (Dask's default; the suite turned it
    off), made outside the block that turns it on."""
    with dask.config.set({PROFILE_SETTING: True}):
        return LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        )


def _profile_warnings(caught) -> list:
    return [w for w in caught if w.category is RuntimeWarning and "gh-106883" in str(w.message)]


@pytest.mark.timeout(180)
def test_an_embedded_cluster_runs_its_workers_without_the_profiler_where_it_can_deadlock(
    monkeypatch,
):
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)  # not the suite's
    monkeypatch.setenv(cluster_module.PIN_VARIABLE, "0")
    with dask.config.set({PROFILE_SETTING: True}):  # Dask's default (the suite turned it off)
        with cluster_module.cluster_client(None) as client:
            running = set(client.run(_profiling).values())
    assert running == {not profiler_can_deadlock()}


@pytest.mark.slow  # starts a cluster whose worker runs the profiler
@pytest.mark.timeout(180)
def test_a_cluster_whose_workers_run_the_profiler_where_it_can_deadlock_is_warned_about_once(
    monkeypatch,
):
    monkeypatch.setattr(profiler, "_checked", set())
    with _profiling_cluster(1) as cluster, Client(cluster, timeout=60) as client:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with cluster_module.cluster_client(client):
                    pass
    said = _profile_warnings(caught)
    assert len(said) == (1 if profiler_can_deadlock() else 0)
    if said:
        text = str(said[0].message)
        assert PROFILE_SETTING + "=False" in text and "1 of the 1 workers that answered" in text


@pytest.mark.slow  # starts a cluster whose workers run the profiler, and stops one
@pytest.mark.timeout(180)
def test_a_stopped_worker_leaves_out_its_own_answer_not_the_advice_about_the_others(
    monkeypatch,
):
    monkeypatch.setattr(profiler, "_checked", set())
    with _profiling_cluster(2) as cluster, Client(cluster, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        pids = client.run(_pid)
        stopped = sorted(pids)[0]
        os.kill(pids[stopped], signal.SIGSTOP)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warned = profiler.warn_if_profiler_can_deadlock(client, timeout=3.0)
        finally:
            os.kill(pids[stopped], signal.SIGCONT)
    said = _profile_warnings(caught)
    assert warned is profiler_can_deadlock() and len(said) == int(warned)
    if said:  # the worker that answered, counted; the stopped one left out
        assert "1 of the 1 workers that answered run Dask's profiler" in str(said[0].message)


@pytest.mark.slow  # starts a cluster whose nanny would restart its worker with the profiler
@pytest.mark.timeout(180)
def test_a_cluster_whose_nannies_would_restart_workers_with_the_profiler_is_warned_about(
    monkeypatch,
):
    monkeypatch.setattr(profiler, "_checked", set())
    with dask.config.set({PROFILE_SETTING: True}):  # Dask's default (the suite turned it off)
        with dask.config.set({PROFILE_SETTING: False}):  # the block the README warns about
            cluster = LocalCluster(
                n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
            )
        with cluster, Client(cluster, timeout=60) as client:
            assert set(client.run(_profiling).values()) == {False}  # not now: after a restart
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warned = profiler.warn_if_profiler_can_deadlock(client)
    said = _profile_warnings(caught)
    assert warned is profiler_can_deadlock()
    assert len(said) == (1 if profiler_can_deadlock() else 0)
    if said:
        text = str(said[0].message)
        assert "0 of the 1 workers that answered" in text
        assert "1 of the 1 nannies that answered" in text


def _pid() -> int:
    return os.getpid()


@pytest.mark.slow  # kills a worker process and waits for its nanny to start another
@pytest.mark.timeout(180)
def test_a_worker_its_nanny_restarts_after_sigkill_still_goes_without_the_profiler(monkeypatch):
    # A nanny made inside a dask.config.set block restarts its worker with the settings current
    # at the restart, not at its making: here this block, which turns the profiler on as Dask's
    # default does (the suite turned it off).
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)  # not the suite's
    monkeypatch.setenv(cluster_module.PIN_VARIABLE, "0")
    with dask.config.set({PROFILE_SETTING: True}):
        with cluster_module.cluster_client(None) as client:
            pids = client.run(_pid)
            newcomer = newcomer_after_sigkill(client, pids, sorted(pids)[0])
            running = client.run(_profiling, workers=[newcomer])[newcomer]
    assert running is not profiler_can_deadlock()


def test_a_cluster_made_as_advised_is_not_warned_about(client, monkeypatch):
    # The suite's cluster is made as the warning advises where the profiler can deadlock.
    assert set(client.run(_profiling).values()) == {not profiler_can_deadlock()}
    monkeypatch.setattr(profiler, "_checked", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert profiler.warn_if_profiler_can_deadlock(client) is False
    assert not _profile_warnings(caught)
