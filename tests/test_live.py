"""Live view of a running fit: publish by name, attach from another process, ``watch`` command.

Most tests train on their own real local cluster (worker processes) in a background thread of
the test process, and look at it from a second process (``python -c`` or the ``downpour-dask``
command) that knows only the scheduler address and the published name: those are marked slow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from distributed import Actor, Client, LocalCluster

import downpour_dask
from downpour_dask import DownpourSGD, cli, datasets, live, models, optim
from downpour_dask.ps.server import ParameterServer
from downpour_dask.ps.shard import ParameterServerShard

SCRIPT = Path(sys.executable).with_name("downpour-dask")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "downpour_dask"]
    return subprocess.run(
        command + list(args), capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        yield cluster


class Background:
    """A fit running in a thread; ``join`` re-raises what it raised."""

    def __init__(
        self, est: DownpourSGD, client: Client, name: str, data, eval_data=None, callback=None
    ):
        self.error: BaseException | None = None

        def target() -> None:
            try:
                est.fit(data, eval_data=eval_data, client=client, publish=name, callback=callback)
            except BaseException as err:  # noqa: BLE001 - handed to the test thread
                self.error = err

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "fit did not end in time"
        if self.error is not None:
            raise self.error


def wait_published(client: Client, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while name not in client.list_datasets():
        assert time.monotonic() < deadline, f"{name!r} was never published"
        time.sleep(0.05)


class Watcher:
    """``downpour-dask watch NAME --wait`` started before the run, so that the process's start
    (seconds on a busy machine) is behind it when the run is published.  ``attached`` is set
    when it printed its ``watching`` line: it holds the run's topic from then on."""

    def __init__(self, address: str, name: str, *extra: str):
        command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "downpour_dask"]
        self.process = subprocess.Popen(
            [*command, "watch", name, "--scheduler", address, "--wait", "120", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.waiting, self.attached = threading.Event(), threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.err: list[str] = []

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("watching"):
                self.attached.set()

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self.err.append(line.rstrip("\n"))
            if line.startswith("waiting up to"):
                self.waiting.set()

    def wait_ready(self, timeout: float = 90) -> None:
        """Until the command is connected and polling for the name."""
        assert self.waiting.wait(timeout), f"watch never started waiting: {self.err}"

    def finish(self, timeout: float = 90) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def softmax_estimator(train, seconds: float) -> DownpourSGD:
    model = models.SoftmaxRegression(train.n_features, 10)
    return DownpourSGD(model, n_replicas=2, n_shards=2, max_seconds=seconds, random_state=0)


ATTACH_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from distributed import Client
    import downpour_dask
    from downpour_dask import datasets
    with Client(sys.argv[1], timeout=30) as client:
        run = downpour_dask.attach(sys.argv[2], client)
        first = run.status()
        time.sleep(2.0)  # generous: on a loaded 2-core machine pushes may pause for a moment
        second = run.status()
        test = datasets.load("digits")[1]
        print(json.dumps({
            "first": first["version"].tolist(),
            "second": second["version"].tolist(),
            "columns": list(second.columns),
            "rate": float(second["examples_per_s"].iloc[0]),
            "by_replica": {str(k): v for k, v in second["accepted_by_replica"].iloc[0].items()},
            "n_params": len(run.params()),
            "evaluation": run.evaluate(test),
            "read_only": [m for m in ("push", "request_stop", "close") if hasattr(run, m)],
        }))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_process_attaches_by_name_and_sees_versions_advance(own_cluster, digits):
    train, test = digits
    est = softmax_estimator(train, seconds=4.0)
    looked = threading.Event()

    def until_looked(progress) -> None:
        # The driver waits here (the replicas train on) until the other process has looked:
        # the run outlives the subprocess's start however slow the machine is.
        looked.wait(90)

    with Client(own_cluster, timeout=30) as client:
        fit = Background(est, client, "live-x", train, test, callback=until_looked)
        wait_published(client, "live-x")
        try:
            done = subprocess.run(
                [sys.executable, "-c", ATTACH_SCRIPT, own_cluster.scheduler_address, "live-x"],
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )
        finally:
            looked.set()
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(seen["first"]) == 2
        assert all(b > a for a, b in zip(seen["first"], seen["second"])), seen
        for column in ("version", "accepted_by_replica", "recent_loss", "staleness_mean"):
            assert column in seen["columns"]
        assert seen["rate"] > 0 and set(seen["by_replica"]) <= {"0", "1"}
        assert seen["n_params"] == est.model.layout.size
        assert 0.0 <= seen["evaluation"]["accuracy"] <= 1.0 and seen["evaluation"]["loss"] > 0
        assert seen["read_only"] == []
        fit.join(timeout=60)
        # the run is over: unpublished, and a view attached earlier says so
        assert "live-x" not in client.list_datasets()
        events = client.get_events(live.topic("live-x"))
        assert events[-1][1] == {"kind": "end"}
        assert any(m.get("phase") == "done" for _, m in events if m.get("kind") == "progress")
        # the replicas log their own metrics on the topic too, about once a second each
        by_replicas = [m for _, m in events if m.get("kind") == "replica"]
        assert {m["replica"] for m in by_replicas} == {0, 1}
        assert all(m["loss"] > 0 and m["examples"] > 0 for m in by_replicas)
        with pytest.raises(ValueError, match="no run is published as 'live-x'"):
            downpour_dask.attach("live-x", client)
    assert est.score(test) > 0.8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_attached_view_in_the_same_process_and_after_the_end(own_cluster, digits):
    train, test = digits
    est = softmax_estimator(train, seconds=4.0)
    with Client(own_cluster, timeout=30) as client, Client(own_cluster, timeout=30) as other:
        fit = Background(est, client, "live-y", train)
        wait_published(client, "live-y")
        run = downpour_dask.attach("live-y", other)
        assert run.running and "live-y" in repr(run)
        params = run.params()
        assert params.dtype == np.float32 and params.shape == (est.model.layout.size,)
        fit.join(timeout=60)
        assert not run.running
        with pytest.raises(RuntimeError, match="has ended"):
            run.status()
        # the name is free again; the actors are gone once the run is over
        assert "live-y" not in other.list_datasets()


class Crafted:
    """Unpickling it creates a file: what a crafted published record could do to a watcher."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.timeout(60)
def test_attach_and_watch_never_unpickle_what_is_published(client, tmp_path):
    marker = tmp_path / "ran"
    client.publish_dataset(crafted={"kind": "downpour-dask run", "futures": Crafted(marker)})
    try:
        with pytest.raises(ValueError, match="no valid downpour-dask run record"):
            downpour_dask.attach("crafted", client)
        client.log_event(live.topic("crafted"), {"kind": "run", "json": "{not json"})
        with pytest.raises(ValueError, match="no valid downpour-dask run record"):
            downpour_dask.attach("crafted", client)
        end = threading.Timer(1.0, client.log_event, (live.topic("crafted"), {"kind": "end"}))
        end.start()  # while ``watch`` follows the name
        assert live.follow(client, "crafted", sys.stderr, interval=0.1) is False
    finally:
        client.unpublish_dataset("crafted")
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_attached_view_cannot_change_parameters_or_stop_the_run(own_cluster, digits):
    """The view holds no actor handle; even a handle made from the published key cannot stop
    the run without the run's secret, and the refusal is in the run's events."""
    train, test = digits
    est = softmax_estimator(train, seconds=5.0)
    with Client(own_cluster, timeout=30) as client, Client(own_cluster, timeout=30) as other:
        fit = Background(est, client, "live-ro", train, test)
        wait_published(client, "live-ro")
        view = downpour_dask.attach("live-ro", other)
        before = view.params()
        assert not any(isinstance(v, Actor) for v in vars(view).values())
        assert [m for m in ("push", "request_stop", "stop", "close") if hasattr(view, m)] == []
        key, worker, _ = view._shards[0]
        handle = Actor(ParameterServerShard, worker, key)
        with pytest.raises(PermissionError, match="without the run's token"):
            handle.request_stop(b"", "a watcher").result(timeout=30)
        assert view.running
        fit.join(timeout=60)
        del handle
    events = est.experiment_.events
    [refused] = events.loc[events["kind"] == "stop_refused", "data"]
    assert "a watcher" in refused["what"]
    assert "max_seconds=5.0" in events.loc[events["kind"] == "stop_requested", "detail"].iloc[0]
    assert not np.array_equal(before, est.params_)  # it trained on to its own end
    assert est.score(test) > 0.8


@pytest.mark.timeout(60)
def test_publish_is_checked_before_cluster_work(digits):
    train, _ = digits
    est = softmax_estimator(train, seconds=1.0)
    with pytest.raises(TypeError, match="publish must be a non-empty str"):
        est.fit(train, publish=3)
    with pytest.raises(ValueError, match="publish must be a non-empty str"):
        est.fit(train, publish=" ")


@pytest.mark.timeout(120)
def test_a_taken_name_is_refused_and_left_alone(client, digits):
    train, _ = digits
    client.publish_dataset(taken=[1, 2, 3])
    try:
        est = softmax_estimator(train, seconds=1.0)
        with pytest.raises(ValueError, match="already published"):
            est.fit(train, client=client, publish="taken")
        # not unpublished by the failed fit (read from a fresh client: get_dataset re-announces
        # every key a client holds, and the session client holds keys of finished runs' actors)
        with Client(client.scheduler.address, timeout=30) as other:
            assert other.get_dataset("taken") == [1, 2, 3]
    finally:
        client.unpublish_dataset("taken")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_watch_prints_progress_until_the_run_ends(own_cluster, digits):
    train, test = digits
    est = softmax_estimator(train, seconds=6.0)
    watcher = Watcher(own_cluster.scheduler_address, "live-w", "--interval", "1")
    watcher.wait_ready()

    def after_attach(progress) -> None:  # the driver goes on once the watcher follows it
        assert watcher.attached.wait(90), "watch never attached"

    with Client(own_cluster, timeout=30) as client:
        est.fit(train, eval_data=test, client=client, callback=after_attach, publish="live-w")
    assert watcher.finish() == 0, watcher.err
    lines = watcher.lines
    assert lines[0].startswith("watching 'live-w': DownpourSGD, 2 replicas, 2 shards")
    progress = [line for line in lines if "examples" in line and "loss" in line]
    assert progress, lines  # lines at most every second, and the final one
    assert "100%" in progress[-1] and "test accuracy" in progress[-1]
    assert lines[-1] == "run 'live-w' finished"


@pytest.mark.slow  # waits for a connection timeout
@pytest.mark.timeout(120)
def test_watch_errors_are_one_line(client, capsys):
    """In-process (the command's own ``main``): where it connects, then one line of error."""
    assert cli.main(["watch", "nothing-here", "--scheduler", client.scheduler.address]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 2 and "Traceback" not in stderr  # connecting, error
    assert "no run is published as 'nothing-here'" in stderr.splitlines()[-1]
    with socket.socket() as s:  # a port where no scheduler listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    assert cli.main(["watch", "x", "--scheduler", address, "--connect-timeout", "2"]) == 2
    said, error = capsys.readouterr().err.splitlines()  # where it connects, then the error
    assert said == f"connecting to {address} (timeout 2 s)"  # unreachable: bad input (README)
    assert "cannot reach the Dask scheduler" in error


@pytest.mark.slow  # waits for a connection timeout
@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer", ["silent", "banner"])
def test_a_port_that_does_not_speak_dask_is_one_line_of_error_within_the_timeout(capsys, peer):
    """A port that accepts but never answers (a web server) held the command for ever; one
    that speaks first (an SSH server) failed it deep in Dask's frame reader.  Loopback, one
    connection at a time, for at most 30 s."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    done = threading.Event()

    def serve() -> None:
        with server:
            while not done.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:  # (30 s without a connection: the test is over)
                    return
                with conn:
                    if peer == "banner":
                        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + b"\xff" * 64)
                    done.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        status = cli.main(["watch", "x", "--scheduler", address, "--connect-timeout", "2"])
    finally:
        done.set()
    said, error = capsys.readouterr().err.splitlines()
    assert status == 2 and said == f"connecting to {address} (timeout 2 s)"
    assert error.startswith("downpour-dask watch: error: cannot reach the Dask scheduler at ")
    assert "Traceback" not in error


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_view_follows_a_shard_recreated_after_its_worker_died(own_cluster):
    """What DownpourSGD does when it restores a lost shard: replace it, re-publish (override)."""
    model = models.SoftmaxRegression(64, 10)
    initial = model.init(np.random.default_rng(0))
    rule = optim.make("sgd", 0.1)
    with Client(own_cluster, timeout=30) as client, Client(own_cluster, timeout=30) as other:
        client.wait_for_workers(2, timeout=60)
        server = ParameterServer.create(client, initial, 2, rule, timeout=30)
        info = {"model": model.get_config(), "t0": time.time()}
        try:
            live.publish(client, "live-r", server, info)
            view = downpour_dask.attach("live-r", other, timeout=10)
            assert view.status()["version"].tolist() == [0, 0]
            lost, survivor = server.workers
            state = server.shards[0].export_state().result(timeout=10)
            client.run(os._exit, 1, workers=[lost], on_error="ignore")
            deadline = time.monotonic() + 30
            with pytest.raises(RuntimeError, match="lost a shard"):  # before re-publishing
                while time.monotonic() < deadline:
                    view.status()
                    time.sleep(0.1)
            restore = {**{k: state[k] for k in ("rule_state", "counters")}, "version": 7}
            lo, hi = server.ranges[0]
            server.replace_shard(client, 0, initial[lo:hi], rule, survivor, restore, 30)
            live.publish(client, "live-r", server, info, override=True)
            status = view.status()  # the view re-reads the publication after the failed call
            assert status["version"].tolist() == [7, 0]
            assert status["worker"].tolist() == [survivor, survivor]
        finally:
            live.unpublish(client, "live-r")
            server.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_watch_exits_non_zero_when_the_run_fails(own_cluster, digits):
    train, _ = digits
    watcher = Watcher(own_cluster.scheduler_address, "live-f")
    watcher.wait_ready()

    def fail_once_watched(progress) -> None:  # an ordering, not a time: fail after the attach
        assert watcher.attached.wait(90), "watch never attached"
        raise KeyboardInterrupt("stopped by the test")

    est = softmax_estimator(train, seconds=60.0)
    with Client(own_cluster, timeout=30) as client:
        with pytest.raises(KeyboardInterrupt):
            est.fit(train, client=client, callback=fail_once_watched, publish="live-f")
        assert "live-f" not in client.list_datasets()
    assert watcher.finish() == 1, watcher.lines + watcher.err
    assert watcher.err[-1] == "downpour-dask watch: failed: run 'live-f' ended without " \
        "finishing (its fit failed)"  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cli_training_job_published_by_name_is_watched_from_another_command(
    own_cluster, tmp_path
):
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "downpour_dask"]
    address = own_cluster.scheduler_address
    watcher = Watcher(address, "cli-job", "--interval", "1")  # waits for the job to publish
    watcher.wait_ready()
    train = subprocess.Popen(
        command + ["train", "--dataset", "digits", "--model", "softmax", "--n-replicas", "2",
                   "--max-epochs", "none", "--max-seconds", "5", "--scheduler", address,
                   "--publish", "cli-job", "--out", str(tmp_path), "--name", "job", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = train.communicate(timeout=120)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 0, err
    assert watcher.finish() == 0, watcher.err
    assert watcher.lines[-1] == "run 'cli-job' finished"
    assert (tmp_path / "job" / "pushes.parquet").is_file()
    bad = run_cli("train", "--algorithm", "sandblaster", "--publish", "x", "--out", str(tmp_path))
    assert bad.returncode == 2 and "publish works with algorithm downpour only" in bad.stderr
