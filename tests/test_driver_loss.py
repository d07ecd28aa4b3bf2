"""A fit whose driver dies leaves nothing on the cluster (downpour/driver_loss.py).

In-process: the scheduler-side calls (runtime/dask_scheduler_state.py) on the installed
``distributed``, a worker's end of the run, and the plugin acting on its driver's departure
only.  On a real cluster
(slow): a driver process SIGKILLed mid-fit, whose shards, published name, variables, plugins
and worker records all go, so the name can be used again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
from distributed import Client, LocalCluster, Variable

from downpour_dask import DownpourSGD, datasets, live, models, optim
from downpour_dask.downpour import registry
from downpour_dask.downpour.dask_cluster import DaskCluster
from downpour_dask.downpour.driver_loss import TOPIC, DriverLoss, driver_loss_name, end_run_here
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.runtime.dask_scheduler_state import (
    delete_variables,
    release_keys,
    run_on_workers,
    withdraw_dataset,
)

WAIT = 30.0  # seconds a test waits for the cluster to let go


def until(condition: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (looked at every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def in_process():
    """A client of an in-process cluster (one worker thread): scheduler calls at no cost."""
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
        as cluster,
        Client(cluster, timeout=30) as client,
    ):  # fmt: skip
        yield client


def _plugins(dask_scheduler) -> list[str]:
    return sorted(dask_scheduler.plugins)


def _ours(plugins: list[str]) -> list[str]:
    return [name for name in plugins if name.startswith("downpour-")]


def _variables(dask_scheduler) -> list[str]:
    return sorted(dask_scheduler.extensions["variables"].variables)


def _wanted_by(dask_scheduler, key: str) -> list[str]:
    state = dask_scheduler.tasks.get(key)
    return [] if state is None else sorted(c.client_key for c in state.who_wants)


def test_scheduler_calls_let_go_of_variables_datasets_and_futures(in_process):
    client = in_process
    kept, other = client.scatter(np.arange(3)), client.scatter(np.arange(4))
    Variable("downpour-abc-shard-0", client=client).set(kept)
    Variable("downpour-abc-shard-0-generation", client=client).set(1)
    Variable("downpour-abcd-shard-0", client=client).set(other)  # another run's
    client.publish_dataset(mine={"futures": [kept]}, theirs={"futures": [other]})
    key = kept.key

    async def delete(dask_scheduler):
        return await delete_variables(dask_scheduler, "downpour-abc-")

    found = client.run_on_scheduler(delete)
    assert found == {"downpour-abc-shard-0": key, "downpour-abc-shard-0-generation": None}
    assert client.run_on_scheduler(_variables) == ["downpour-abcd-shard-0"]

    def withdraw(dask_scheduler, name):
        return withdraw_dataset(dask_scheduler, name, [key])

    assert client.run_on_scheduler(withdraw, name="theirs") is False  # not holding ours
    assert client.run_on_scheduler(withdraw, name="mine") is True
    assert client.run_on_scheduler(withdraw, name="mine") is False  # already gone
    assert sorted(client.list_datasets()) == ["theirs"]

    assert client.run_on_scheduler(_wanted_by, key=key) == [client.id]  # ours alone now
    released = client.run_on_scheduler(lambda dask_scheduler: release_keys(dask_scheduler, [key]))
    assert released == [client.id]
    assert until(lambda: client.run_on_scheduler(_wanted_by, key=key) == [])
    del kept  # the client's own release afterwards changes nothing
    assert client.run_on_scheduler(_wanted_by, key=other.key)  # still held


def _twice(x):
    return 2 * x


def _fails(x):
    raise ValueError(f"no {x}")


def test_run_on_workers_answers_per_worker_and_returns_failures(in_process):
    client = in_process
    (worker,) = client.scheduler_info()["workers"]

    async def run(dask_scheduler, run_this):
        return await run_on_workers(dask_scheduler, run_this, 21, timeout=10)

    assert client.run_on_scheduler(run, run_this=_twice) == {worker: 42}
    (failure,) = client.run_on_scheduler(run, run_this=_fails).values()
    assert isinstance(failure, ValueError) and "no 21" in str(failure)


def test_a_worker_ends_a_run_once_its_replicas_ended_and_drops_its_records():
    registry.keep_acked("run-x", 0, "shard-key", 3)
    registry.keep_acked("run-y", 0, "shard-key", 4)
    with registry.replica_running("run-x"):
        assert asyncio.run(end_run_here("run-x", [], b"", 0.05)) is False  # waited in vain
    registry.keep_acked("run-x", 0, "shard-key", 5)
    assert asyncio.run(end_run_here("run-x", [], b"", 5.0)) is True
    assert registry.acked_version("run-x", 0, "shard-key") is None
    assert registry.acked_version("run-y", 0, "shard-key") == 4  # another run's stays
    registry.forget_run("run-y")


def test_a_worker_ends_a_run_by_stopping_its_own_shards_of_it_with_the_run_secret():
    def shard(i):
        return ParameterServerShard(i, 0, 3, np.zeros(3, np.float32), optim.sgd(0.1),
                                    wire_secret=b"run-secret")  # fmt: skip

    ours, other_run = shard(0), shard(1)
    worker = SimpleNamespace(state=SimpleNamespace(actors={"ours": ours, "theirs": other_run}))
    ended = end_run_here("run-z", ["ours", "elsewhere"], b"run-secret", 1.0, dask_worker=worker)
    assert asyncio.run(ended) is True
    assert ours.stopped and not other_run.stopped  # replicas reading ours are told to stop
    wrong = end_run_here("run-z", ["theirs"], b"not-it", 1.0, dask_worker=worker)
    with pytest.raises(PermissionError):  # a stop still needs the run's secret
        asyncio.run(wrong)
    assert not other_run.stopped


def test_the_plugin_acts_on_its_driver_leaving_and_on_no_other_client(in_process):
    client = in_process
    address = client.scheduler.address
    with Client(address, timeout=30) as driver:
        shard = driver.scatter(np.ones(5))
        Variable("downpour-run1-shard-0", client=driver).set(shard)
        driver.publish_dataset(running={"futures": [shard]})
        driver.register_plugin(DriverLoss("run1", driver.id, [shard.key], "running"))
        with Client(address, timeout=30):  # a watcher that comes and goes
            pass
        time.sleep(0.5)
        assert driver_loss_name("run1") in client.run_on_scheduler(_plugins)
        assert client.run_on_scheduler(_variables) == ["downpour-run1-shard-0"]
        assert list(client.list_datasets()) == ["running"]
        key = shard.key
    # the driver's client went: everything it left goes
    assert until(lambda: not client.list_datasets())
    assert until(lambda: not client.run_on_scheduler(_variables))
    assert until(lambda: driver_loss_name("run1") not in client.run_on_scheduler(_plugins))
    assert until(lambda: client.run_on_scheduler(_wanted_by, key=key) == [])
    ends = [m for _, m in client.get_events(live.topic("running")) if m.get("kind") == "end"]
    assert ends == [{"kind": "end", "reason": "driver lost"}]


def test_a_scheduler_that_refuses_the_plugin_leaves_the_fit_going_with_a_warning():
    class Refusing:  # a scheduler without downpour-dask cannot unpickle the plugin
        id = "Client-driver"
        unregistered: list[str] = []

        def register_plugin(self, plugin):
            raise ModuleNotFoundError("No module named 'downpour_dask'")

        def unregister_scheduler_plugin(self, name):
            self.unregistered.append(name)

    refusing = Refusing()
    cluster = DaskCluster(refusing, "run-r", timeout=5)
    with pytest.warns(RuntimeWarning, match="refused DriverLoss.*stay on the cluster"):
        cluster.let_go_if_driver_lost([], "name", b"secret")
    cluster.everywhere = lambda *args: None  # (no workers to tell)
    cluster.forget()
    assert refusing.unregistered == []  # nothing was registered, nothing to unregister


def test_a_fit_that_ends_leaves_no_plugin_behind(client):
    train, _ = datasets.load("digits")
    est = DownpourSGD(models.SoftmaxRegression(64, 10), n_replicas=2, n_shards=2, max_steps=20)
    est.fit(train.X[:400], train.y[:400], client=client, publish="ends-cleanly")
    assert not _ours(client.run_on_scheduler(_plugins))
    assert "ends-cleanly" not in client.list_datasets()


DRIVER = textwrap.dedent(
    """
    import sys
    from distributed import Client
    from downpour_dask import DownpourSGD, datasets, models
    train, _ = datasets.load("mnist5k")
    partitions = int(sys.argv[3])
    with Client(sys.argv[1], timeout=60) as client:
        est = DownpourSGD(models.MLP(784, (32,), 10), n_replicas=3 - partitions, n_shards=2,
                          max_epochs=10**4, partitions=partitions)
        est.fit(train.X, train.y, client=client, publish=sys.argv[2])
    """
)


def kill_driver_once(
    client: Client, name: str, training: Callable[[], bool], script: str, *args: str
) -> None:
    """Run ``script`` (given the scheduler's address and ``args``) as a driver process, wait
    until it published ``name`` and ``training()`` holds (which may start watchers), and
    SIGKILL it."""
    driver = subprocess.Popen(
        [sys.executable, "-c", script, client.scheduler.address, *args], start_new_session=True
    )
    try:
        assert until(lambda: name in client.list_datasets(), timeout=120)
        assert until(training)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)


def _actors(dask_worker) -> list[str]:
    return sorted(map(str, dask_worker.state.actors))


def _records(dask_worker) -> list[str]:
    """The registry dicts of this worker process holding anything."""
    kept = (registry._FETCHED, registry._ACKED, registry._ROWS, registry._RUNNING)
    return [str(k) for store in kept for k in store]


@pytest.mark.slow
@pytest.mark.parametrize("partitions", [1, 2])
def test_a_killed_driver_leaves_nothing_and_its_name_is_free_again(two_workers, partitions):
    client = two_workers
    name = "killed-driver"

    command = ["watch", name, "--scheduler", client.scheduler.address, "--wait", "120"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "downpour_dask", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    heard: list[str] = []
    threading.Thread(target=lambda: heard.extend(watcher.stdout), daemon=True).start()

    def training() -> bool:  # and watched
        trained = any(client.run(_records).values()) and all(client.run(_actors).values())
        return trained and any(line.startswith("watching") for line in heard)

    try:
        kill_driver_once(client, name, training, DRIVER, name, str(partitions))
        watcher.wait(timeout=WAIT)  # the watch command ends by itself
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=WAIT)
    said = watcher.stderr.read()
    assert watcher.returncode == 1 and "its driver died" in said, said
    assert until(lambda: name not in client.list_datasets())
    assert until(lambda: not any(client.run(_actors).values())), client.run(_actors)
    assert until(lambda: not any(client.run(_records).values())), client.run(_records)
    assert until(lambda: not client.run_on_scheduler(_variables))
    assert until(lambda: not _ours(client.run_on_scheduler(_plugins)))
    (cleanup,) = [message for _, message in client.get_events(TOPIC)]
    assert "records on 2 of 2 workers" in cleanup["let_go"]  # every replica stopped first
    with open(os.devnull, "w") as stream:
        assert live.follow(client, name, stream) is False  # a watcher ends
    train, _ = datasets.load("digits")
    again = DownpourSGD(models.SoftmaxRegression(64, 10), n_replicas=2, max_steps=10)
    again.fit(train.X[:400], train.y[:400], client=client, publish=name)  # the name is free
    assert len(again.experiment_.pushes) > 0


SPARSE_DRIVER = textwrap.dedent(
    """
    import sys
    from distributed import Client
    from downpour_dask.core.sparse_models import SparseLogisticRegression
    from downpour_dask.data.criteo import criteo_spec, write_criteo
    from downpour_dask.downpour.sparse_fit import fit_sparse
    paths = write_criteo(sys.argv[3], 40_000, rows_per_file=20_000)
    model = SparseLogisticRegression(2**12, n_fields=26, n_numeric=13)
    with Client(sys.argv[1], timeout=60) as client:
        fit_sparse(model, (paths, criteo_spec(n_rows=2**12)), client=client, n_replicas=2,
                   n_shards=2, batch_size=32, max_epochs=10**4, publish=sys.argv[2])
    """
)


def _replicas_running(dask_worker) -> list[str]:
    return [str(key) for key in dask_worker.state.long_running]


@pytest.mark.slow
def test_a_killed_sparse_driver_leaves_no_shard_replica_or_name(two_workers, tmp_path):
    client = two_workers
    name = "killed-sparse-driver"

    def training() -> bool:
        return all(client.run(_replicas_running).values())

    kill_driver_once(client, name, training, SPARSE_DRIVER, name, str(tmp_path))
    assert until(lambda: name not in client.list_datasets())
    assert until(lambda: not any(client.run(_actors).values())), client.run(_actors)
    # its replicas stop too, not at their lost shards' timeout (120 s)
    assert until(lambda: not any(client.run(_replicas_running).values()))
    assert until(lambda: not _ours(client.run_on_scheduler(_plugins)))
