"""Shared fixtures: one real local Dask cluster (two single-threaded worker processes) per test
process (pytest-xdist runs three, each with its own cluster).

Tests that kill workers or need a different topology start their own cluster (for instance with
``three_workers``); they, and tests that run the command as a subprocess or execute notebooks,
are marked ``@pytest.mark.slow`` so that ``pytest -m "not slow"`` is a quick inner loop.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils import get_mp_context
from distributed.versions import optional_packages, required_packages

from downpour_dask import DownpourSGD, optim
from downpour_dask.ps import frames
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.runtime.dask_client_calls import scheduler_workers
from downpour_dask.runtime.profiler import PROFILE_SETTING, profiler_can_deadlock

# The worker processes of the clusters the tests start come from a fork server that imported
# Dask, numpy and pandas once, instead of each importing them anew (Dask's own test suite does
# the same): this process's clusters through Dask's config, those of the commands and notebook
# kernels the tests run as subprocesses through its environment variable (:func:`_fork_server`).
# Users' clusters spawn (Dask's default); tests marked ``spawn`` keep that for their
# subprocesses, so the path users take is covered end to end.
dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
METHOD_VARIABLE = "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"
# This process's fork server also imports what its workers run: the library's worker-side
# modules, and scikit-learn and SciPy, which the tests' own functions (pickled by reference, so
# imported on the worker with their test module) pull in.  Each new worker imported them anew:
# a fifth of the suite's CPU in a profile of 2026-11-29.  Dask's own list is kept (it sets it
# the first time it asks for the context, which is why it is asked first).
WORKER_IMPORTS = [
    "distributed",
    *required_packages,
    *optional_packages,
    "scipy.linalg",
    "sklearn.base",
    "sklearn.metrics",
    "downpour_dask.downpour.estimator",
    "downpour_dask.downpour.sparse_estimator",
    "downpour_dask.downpour.tasks",
    "downpour_dask.downpour.sparse_task",
    "downpour_dask.sandblaster.estimator",
    "downpour_dask.sandblaster.tasks",
]
get_mp_context().set_forkserver_preload(
    [name for name in WORKER_IMPORTS if importlib.util.find_spec(name.split(".")[0])]
)

# Every test process keeps its shared cluster while it runs the tests that start their own, so
# three idle clusters share the 2 cores with the work.  An idle 2-worker cluster took 10% of a
# core (its processes' CPU over 10 s), most of it the event loops' 20 ms latency tick and the
# nannies' 100 ms memory monitor; once a second each, it takes 3%.  The system monitor's
# psutil reads every 500 ms (for the dashboard's plots) took 0.7-1% more; every 2 s, 2% is left.
# None is a behaviour a test relies on: the tick only measures how late the loop runs, the
# memory monitor enforces limits, which no test sets.
dask.config.set(
    {
        "distributed.admin.tick.interval": "1s",
        "distributed.worker.memory.monitor-interval": "1s",
        "distributed.admin.system-monitor.interval": "2s",
    }
)

# On an interpreter where Dask's worker profiler can deadlock a worker (CPython before 3.11.9,
# see downpour_dask/runtime/profiler.py), the clusters the tests start themselves -- here, and in
# the commands and notebooks they run -- are made without it, as a user is advised to; the
# clusters the library starts leave it out on their own.
UNSAFE_PROFILER = profiler_can_deadlock()
PROFILE_VARIABLE = "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"
if UNSAFE_PROFILER:
    dask.config.set({PROFILE_SETTING: False})


@pytest.fixture(autouse=True)
def _fork_server(request, monkeypatch):
    """Subprocesses a test starts use the fork server too, unless it is marked ``spawn``; and
    where Dask's worker profiler can deadlock, the clusters they start go without it."""
    if request.node.get_closest_marker("spawn") is None:
        monkeypatch.setenv(METHOD_VARIABLE, "forkserver")
    else:
        monkeypatch.delenv(METHOD_VARIABLE, raising=False)
    if UNSAFE_PROFILER:
        monkeypatch.setenv(PROFILE_VARIABLE, "False")


@pytest.fixture(scope="session")
def cluster():
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client(cluster):
    with Client(cluster, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


#: The shard of the direct-connection tests: its size, and the run secret it is served under.
WIRE_SIZE = 100
WIRE_SECRET = b"s" * 32


def wire_shard() -> ParameterServerShard:
    """A shard of WIRE_SIZE values from -1 to 1, plain SGD at rate 0.5."""
    values = np.linspace(-1, 1, WIRE_SIZE, dtype=np.float32)
    return ParameterServerShard(0, 0, WIRE_SIZE, values, optim.make("sgd", 0.5))


@pytest.fixture
def served():
    """A fresh service on loopback with one :func:`wire_shard` registered under WIRE_SECRET:
    ``(service, shard, endpoint)``."""
    service = ShardService("127.0.0.1")
    shard = wire_shard()
    endpoint = service.register(shard, WIRE_SECRET)
    yield service, shard, endpoint
    service.close()


def said_hello(endpoint: tuple[str, int, str], secret: bytes, timeout: float = 10.0):
    """A raw connection to a direct-connection endpoint ``(host, port, id)`` that said its
    hello with ``secret``, and the size the endpoint answered: ``(socket, size)``."""
    host, port, key = endpoint
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.sendall(frames.hello(key, secret))
    frames.check_status(sock)
    (size,) = frames.SIZE.unpack(frames.recv(sock, frames.SIZE.size))
    return sock, size


def fresh_client(n_workers: int) -> Iterator[Client]:
    """Yield a client of a fresh cluster of ``n_workers`` single-threaded worker processes,
    every one of them up; the cluster is closed afterwards (a fixture's body)."""
    with (
        LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        client.wait_for_workers(n_workers, timeout=60)
        yield client


@pytest.fixture
def three_workers():
    """A client of a fresh three-worker cluster, for tests that kill workers (nannies start a
    new worker after a kill); a test using it is a slow one."""
    yield from fresh_client(3)


@pytest.fixture
def two_workers():
    """A client of a fresh two-worker cluster, for tests that change its worker processes for
    good (the shared one must stay as it is)."""
    yield from fresh_client(2)


def _running_on_workers(dask_worker) -> list[str]:
    """Tasks (and actor calls) running in a worker's threads right now."""
    return [str(key) for key in dask_worker.active_threads.values()]


def _kill_during_fit(client: Client, victim: str, fit: Callable[[], Any]) -> dict:
    """Run ``fit`` in a thread and SIGKILL the worker ``victim`` once a portion runs there, so
    the kill lands inside a batch; wait for the fit.  Returns ``{"est": ...}`` (what ``fit``
    returned) or ``{"error": ...}`` (what it raised)."""
    pid = client.run(os.getpid, workers=[victim])[victim]
    done: dict = {}

    def run_fit() -> None:
        try:
            done["est"] = fit()
        except Exception as err:  # shown by the caller's assertions, not lost in a thread
            done["error"] = err

    thread = threading.Thread(target=run_fit)
    thread.start()
    deadline = time.monotonic() + 90
    while not any(
        "portion" in key for key in client.run(_running_on_workers, workers=[victim])[victim]
    ):
        assert thread.is_alive() and time.monotonic() < deadline, done.get("error")
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=150)
    assert not thread.is_alive(), "the fit did not end after the kill"
    return done


@pytest.fixture
def kill_during_fit() -> Callable[[Client, str, Callable[[], Any]], dict]:
    """``kill_during_fit(client, victim, fit)``: run ``fit`` and SIGKILL ``victim`` inside a
    batch (a test using it is a slow one)."""
    return _kill_during_fit


class _RaceNextClients(SchedulerPlugin):
    """Makes Dask's handshake race for the next ``n`` clients to connect: a broadcast to all
    clients (what a client cancelling futures sends) queued behind each one's greeting, so
    the two leave in one batch -- what a cancel arriving in the same turn of the scheduler's
    loop does by chance (see ``runtime/dask_connect.worker_client``)."""

    def __init__(self, n: int, name: str):
        self.n, self.raced, self.name = n, 0, name

    def add_client(self, scheduler: Any, client: str) -> None:
        if self.raced < self.n:
            self.raced += 1
            cancelled = {"op": "cancelled-keys", "keys": [], "reason": None, "msg": None}
            scheduler.loop.add_callback(scheduler.report, cancelled)


def _clients_raced(dask_scheduler, name: str) -> int:
    return dask_scheduler.plugins[name].raced


@pytest.fixture
def race_next_clients() -> Callable[[Client, int], Callable[[], int]]:
    """``race_next_clients(client, n)``: the next ``n`` clients to connect to ``client``'s
    scheduler (a worker's, the first time a task asks for one) meet Dask's handshake race;
    returns a function telling how many did.  The scheduler must run in the test's process
    (a ``LocalCluster``'s does)."""

    def arm(client: Client, n: int) -> Callable[[], int]:
        armed = next(names)
        client.register_plugin(_RaceNextClients(n, armed))
        return lambda: client.run_on_scheduler(_clients_raced, name=armed)

    names = (f"race-next-clients-{i}" for i in itertools.count())

    return arm


@pytest.fixture
def no_cycle_collector():
    """Python's cyclic garbage collector off for the test (collected once first): what a fit
    lets go of must go because it let go, not because the collector happened to run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _held_keys(dask_scheduler) -> list[str]:
    return [str(key) for key in dask_scheduler.tasks]


def _scheduler_keys(client: Client) -> set[str]:
    return set(client.run_on_scheduler(_held_keys))


@pytest.fixture
def cluster_keys(client) -> Callable[..., set[str]]:
    """``cluster_keys()``: every key the shared cluster's scheduler holds (data, tasks, actors);
    ``cluster_keys(beyond=before)``: the keys held beyond ``before``, once none are or after
    20 s (releases travel asynchronously)."""

    def keys(beyond: set[str] | None = None) -> set[str]:
        if beyond is None:
            return _scheduler_keys(client)
        deadline = time.monotonic() + 20
        while (extra := _scheduler_keys(client) - beyond) and time.monotonic() < deadline:
            time.sleep(0.1)
        return extra

    return keys


@pytest.fixture(autouse=True)
def _shared_cluster_left_idle(request):
    """A test on the shared cluster must leave no work running in its workers' threads.

    Dask cannot interrupt a running task, so a replica or portion a test leaves behind would
    occupy a worker thread of every later test and show up there as a mysterious slowdown or
    stall.  Catch it at the test that caused it instead.
    """
    yield
    if "client" not in request.fixturenames:
        return
    client = request.getfixturevalue("client")
    deadline = time.monotonic() + 30
    while True:
        running = {w: keys for w, keys in client.run(_running_on_workers).items() if keys}
        if not running:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"work still running on the shared cluster 30 s after the test: {running}")
        time.sleep(0.05)


def while_stopped(pid: int, call: Callable[[], Any], wait: float, stop_first: bool = True) -> dict:
    """Run ``call`` in a thread while the process ``pid`` is stopped -- by SIGSTOP now, or by
    ``call`` itself (a fit's callback) without ``stop_first`` -- for up to ``wait`` seconds;
    SIGCONT it whatever happens.  Returns ``{"finished": whether ``call`` returned or raised
    before the SIGCONT, "result": ... or "error": ...}``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as err:  # handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    if stop_first:
        os.kill(pid, signal.SIGSTOP)
    try:
        thread.start()
        thread.join(wait)
        outcome["finished"] = not thread.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(60)
    return outcome


def newcomer_after_sigkill(client: Client, pids: dict[str, int], victim: str) -> str:
    """SIGKILL worker ``victim`` (of the workers ``pids``) and return the address of the worker
    its nanny starts instead, at a new address (waited for up to 90 s)."""
    os.kill(pids[victim], signal.SIGKILL)
    end = time.monotonic() + 90
    workers = set(scheduler_workers(client))
    while time.monotonic() < end and (victim in workers or len(workers) < len(pids)):
        time.sleep(0.2)
        workers = set(scheduler_workers(client))
    (newcomer,) = workers - set(pids)
    return newcomer


def assert_no_split_brain_and_exact_accounting(est: DownpourSGD) -> None:
    """No split brain and exact accounting of a fit that lost shards (test_chaos.py's
    module docstring): every acknowledged push is in the final state or counted as lost."""
    status = est.server_status_
    config = est.experiment_.config
    records = config["shard_incarnations"]
    lost = [0] * len(status)
    for record in records:
        assert record["lost_updates"] == max(0, record["acknowledged"] - record["restored_from"])
        if record["fenced"] and record["final_version"] is not None:
            assert record["final_version"] == record["acknowledged"], record  # did not move on
        lost[record["shard"]] += record["lost_updates"]
    assert status["lost_updates"].tolist() == lost
    for shard, row in status.iterrows():
        generations = [r for r in records if r["shard"] == shard]
        assert row["generation"] == len(generations)  # one replacement per retired incarnation
        if generations:
            assert row["started_at"] == generations[-1]["restored_from"]
        # every acknowledged push is in the final state or counted as lost
        acknowledged = config["acknowledged_pushes"].get(str(shard), 0)
        assert acknowledged <= row["version"] + lost[shard], (shard, acknowledged, row, lost)
    assert "stop" in list(est.experiment_.events["kind"])
