"""Failures for real: SIGKILL the worker of a replica or of a shard mid-run; resume from
checkpoints.  Each test starts its own three-worker local cluster (worker processes with nannies,
which start a fresh worker after a kill) and closes it, or a CLI process: all are marked slow.
``tests/test_supervisor.py`` pins the same decisions in-process, with fakes.

Where things run (``Driver``): replica r starts on worker r and shard i on worker i (sorted
addresses, round robin), so with three workers worker 2 holds replica 2 only and worker 1 holds
shard 1 and replica 1.  A kill is triggered from the fit's progress callback, which the driver
calls between its supervision steps, a few times a second: on a busy machine a replica may have
finished -- and the driver gathered its result -- before the callback sees the push count that
triggers the kill.  So the tests assert what holds either way, and that a replica still running
on the killed worker (as the scheduler saw it just before the kill) was restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from conftest import assert_no_split_brain_and_exact_accounting, while_stopped
from distributed import Client

from downpour_dask import DownpourSGD, Experiment, cli, datasets, models, runs
from downpour_dask.checkpoint import CheckpointError, ShardState, read_checkpoint, write_checkpoint
from downpour_dask.runtime.cluster import cluster_workers

TIMEOUT = 60
#: Epochs of the runs a worker is killed in: long enough (a few seconds) that the replicas are
#: most likely still training when the callback, called a few times a second, sees the push
#: count that triggers the kill.  The assertions hold either way (see the module docstring).
KILL_EPOCHS = 40


@pytest.fixture(scope="module")
def mnist():
    return datasets.load("mnist5k")


def _estimator(**kw) -> DownpourSGD:
    settings = dict(
        n_replicas=3,
        n_shards=2,
        optimizer="adagrad",
        learning_rate=0.05,
        batch_size=32,
        warmstart_steps=50,
        max_epochs=3,
        random_state=0,
        eval_every=0.25,
        timeout=TIMEOUT,
    )
    settings.update(kw)
    return DownpourSGD(models.MLP(784, (64,), 10), **settings)


def _executing(dask_worker) -> list[str]:
    """Keys of the tasks running in a worker's threads right now (asked of the worker itself)."""
    return [str(key) for key in dask_worker.active_threads.values()]


class _KillAt:
    """A fit callback that SIGKILLs one worker process once the server applied ``pushes``.

    Just before the kill it asks the worker itself which replica tasks are executing in its
    threads (``running``): those die mid-loop, and the driver -- inside this callback, so it
    cannot gather anything first -- must restart them.  (The scheduler's ``processing`` view
    would also list a task that just finished and whose result is still on its way: whether
    that one is restarted or its result read depends on timing, so it is not asserted.)
    """

    def __init__(self, client: Client, address: str, pushes: int):
        self.client, self.address = client, address
        self.pid = client.run(os.getpid, workers=[address])[address]
        self.pushes, self.killed_at = pushes, None
        self.running: set[int] = set()

    def __call__(self, progress) -> None:
        if self.killed_at is None and progress.pushes >= self.pushes:
            keys = self.client.run(_executing, workers=[self.address])[self.address]
            # task keys are "replica-<r>-<run>-<n>" (see downpour/tasks.py)
            self.running = {int(k.split("-")[1]) for k in map(str, keys) if k.startswith("replica")}
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = progress.pushes


def _zero_states(size: int) -> list[ShardState]:
    """Two shards' worth of a valid Adagrad checkpoint for a model of ``size`` parameters."""
    cut = [0, size // 2, size]
    return [
        ShardState(
            i, lo, hi, np.zeros(hi - lo, np.float32), {"sum_sq": np.zeros(hi - lo, np.float32)}, 3
        )
        for i, (lo, hi) in enumerate(zip(cut[:-1], cut[1:]))
    ]


def _kinds(est: DownpourSGD) -> list[str]:
    return list(est.experiment_.events["kind"])


def _data(est: DownpourSGD, kind: str) -> list[dict]:
    """The data of every event of ``kind``, in time order."""
    events = est.experiment_.events
    return list(events.loc[events["kind"] == kind, "data"])


def _replicas(est: DownpourSGD, kind: str) -> list[int]:
    return [d["replica"] for d in _data(est, kind)]


def _assert_restarts_only_on_the_killed_worker(est: DownpourSGD, kill: _KillAt, there: set[int]):
    """Replicas fail only if they were on the killed worker (``there``), each failed one is
    restarted, and each one running there at the kill failed."""
    failed = _replicas(est, "replica_failed")
    assert set(failed) <= there
    assert _replicas(est, "replica_restarted") == failed
    assert kill.running <= set(failed), (kill.running, failed)
    assert est.experiment_.config["replica_restarts"] == len(failed)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killing_a_replicas_worker_restarts_it_and_the_run_finishes(three_workers, mnist):
    client = three_workers
    train, test = mnist
    clean = _estimator(max_epochs=KILL_EPOCHS).fit(train, eval_data=test, client=client)
    workers = sorted(cluster_workers(client))
    kill = _KillAt(client, workers[2], pushes=150)  # worker 2 holds replica 2 only
    est = _estimator(max_epochs=KILL_EPOCHS).fit(
        train, eval_data=test, client=client, callback=kill
    )
    assert kill.killed_at is not None
    kinds = _kinds(est)
    assert "shard_lost" not in kinds
    _assert_restarts_only_on_the_killed_worker(est, kill, there={2})
    # restarted or not, every replica trained all its steps, none twice
    assert est.experiment_.config["replica_steps"] == clean.experiment_.config["replica_steps"]
    print(f"running on the killed worker: {kill.running}; events {kinds}")
    print(f"clean {clean.score(test):.4f}, with a replica killed {est.score(test):.4f}")
    assert abs(est.score(test) - clean.score(test)) <= 0.02
    assert kinds[-1] == "stop"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["auto", "one-sided"])
def test_a_replica_whose_worker_is_stopped_moves_and_the_run_finishes_while_it_stays_stopped(
    three_workers, mnist, transport
):
    """SIGSTOP, never undone during the fit: Dask keeps the worker listed and its task running,
    so only the worker's silence says it; the replica moves after ``timeout`` seconds of it.
    One-sided, the stopped replica may hold a shard's lock: the shard takes its state back
    after the lease, and the fit finishes all the same."""
    client = three_workers
    train, test = mnist
    workers = sorted(cluster_workers(client))
    pid = client.run(os.getpid, workers=[workers[2]])[workers[2]]  # holds replica 2 only
    stopped = []

    def stop_at_150_pushes(progress) -> None:
        if not stopped and progress.pushes >= 150:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(progress.pushes)

    est = _estimator(max_epochs=KILL_EPOCHS, timeout=5, transport=transport)
    fit = lambda: est.fit(train, eval_data=test, client=client, callback=stop_at_150_pushes)  # noqa: E731
    outcome = while_stopped(pid, fit, 150, stop_first=False)
    assert stopped and outcome["finished"], "the fit waited for the stopped worker"
    assert "error" not in outcome, outcome.get("error")
    assert "shard_lost" not in _kinds(est) and _kinds(est)[-1] == "stop"
    (failed,) = _data(est, "replica_failed")
    assert failed["replica"] == 2
    assert failed["reason"].startswith(f"worker {workers[2]} has not been heard from for ")
    (moved,) = _data(est, "replica_restarted")
    assert moved["replica"] == 2 and moved["workers"][0] in workers[:2]
    assert est.score(test) > 0.85


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replica_whose_new_worker_stops_before_it_starts_there_starts_on_the_next_one(
    three_workers, mnist
):
    """Worker 1 dies (SIGKILL) with replica 1; worker 2, which runs nothing and so is where
    the replica would go, was stopped (SIGSTOP) just before.  Dask still lists it, so the
    replica's data is sent there and never arrives: after ``timeout`` the replica starts on
    worker 0 instead, and the fit finishes.  Worker 1's nanny is told not to start a worker
    in its place, which the replica would go to instead."""
    client = three_workers
    train, test = mnist
    workers = sorted(cluster_workers(client))  # shard 0, replica 0 on 0; replica 1 on 1
    pids = client.run(os.getpid)
    client.run(lambda dask_worker: dask_worker.close_gracefully(), workers=[workers[1]],
               nanny=True)  # fmt: skip
    done: list[int] = []

    def stop_then_kill(progress) -> None:
        if not done and progress.pushes >= 150:
            os.kill(pids[workers[2]], signal.SIGSTOP)
            os.kill(pids[workers[1]], signal.SIGKILL)
            done.append(progress.pushes)

    est = _estimator(n_replicas=2, n_shards=1, max_epochs=KILL_EPOCHS, timeout=5)
    try:
        est.fit(train, eval_data=test, client=client, callback=stop_then_kill)
    finally:
        os.kill(pids[workers[2]], signal.SIGCONT)
    assert done, "the fit ended before 150 pushes"
    first, again = _data(est, "replica_failed")
    assert first["replica"] == again["replica"] == 1
    assert again["reason"].startswith(
        f"its start on {workers[2]} did not finish: sending a replica's data to worker {workers[2]}"
    )
    (moved,) = _data(est, "replica_restarted")
    assert moved["replica"] == 1 and moved["workers"] == [workers[0]]
    assert "shard_lost" not in _kinds(est) and _kinds(est)[-1] == "stop"
    assert est.score(test) > 0.85


@pytest.mark.slow  # its own cluster: workers that have not made their client yet
@pytest.mark.timeout(240)
def test_replicas_whose_workers_client_meets_dasks_handshake_race_train_all_the_same(
    three_workers, race_next_clients, mnist
):
    # A broadcast to all clients (a cancel: the driver restarting a replica, another user)
    # in the same turn of the scheduler's loop as a worker's client connects made a
    # model-parallel replica's task fail in CI, and with it the fit.
    client = three_workers
    train, test = mnist
    raced = race_next_clients(client, 2)
    est = _estimator(n_replicas=2, partitions=2, max_epochs=1).fit(train, client=client)
    assert raced() == 2
    assert "replica_failed" not in _kinds(est)
    assert est.score(test) > 0.8


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_streaming_replica_restarts_from_its_files_on_another_worker(
    tmp_path, three_workers, mnist
):
    train, test = mnist
    frame = pd.DataFrame(train.X, columns=[f"x{i}" for i in range(train.X.shape[1])])
    frame["label"] = train.y
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(frame)), 3)):
        paths.append(str(tmp_path / f"part-{i}.parquet"))
        frame.iloc[part].to_parquet(paths[-1], index=False)
    data = datasets.from_parquet(paths, label="label")
    client = three_workers
    workers = sorted(cluster_workers(client))
    kill = _KillAt(client, workers[2], pushes=150)
    est = _estimator(max_epochs=KILL_EPOCHS).fit(data, eval_data=test, client=client, callback=kill)
    assert kill.killed_at is not None
    kinds = _kinds(est)
    _assert_restarts_only_on_the_killed_worker(est, kill, there={2})
    assert kinds[-1] == "stop"
    assert est.score(test) >= 0.85


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["auto", "one-sided"])
def test_killing_a_shards_worker_restores_the_shard_and_the_run_finishes(
    three_workers, mnist, transport
):
    """One-sided, replicas 0 and 2 write shard 1's memory themselves, and replica 1, killed
    with the worker, writes shard 0's (a push it was in the middle of counts once, a
    ``torn_push``): the others go to the replacement, and the fit's accounting holds
    (test_chaos.py)."""
    client = three_workers
    train, test = mnist
    workers = sorted(cluster_workers(client))
    kill = _KillAt(client, workers[1], pushes=200)  # shard 1 and replica 1 start there
    est = _estimator(max_epochs=KILL_EPOCHS, checkpoint_every=0.5, transport=transport).fit(
        train, eval_data=test, client=client, callback=kill
    )
    assert_no_split_brain_and_exact_accounting(est)
    if transport == "one-sided":
        routes = est.experiment_.config["replica_transports"].values()
        assert any("one-sided" in kinds for kinds in routes), routes
    assert kill.killed_at is not None
    kinds = _kinds(est)
    assert _data(est, "shard_lost")[0]["shard"] == 1
    assert _data(est, "shard_lost")[0]["worker"] == workers[1]
    restored = _data(est, "shard_restored")[0]
    assert restored["shard"] == 1 and restored["worker"] != workers[1]
    assert restored["source"] in ("checkpoint", "fetched_copy")
    assert restored["version"] > 0 and restored["lost_updates"] >= 0
    assert est.server_status_["worker"].iloc[1] == restored["worker"] != workers[1]
    # replica 1 is restarted if it was still training there (see the module docstring)
    _assert_restarts_only_on_the_killed_worker(est, kill, there={1})
    rows = train.n_rows // 3
    assert set(est.experiment_.config["replica_steps"]) <= {
        KILL_EPOCHS * -(-(rows + extra) // 32) for extra in (0, 1)
    }  # every replica trained all its steps
    print(f"shard 1 restored: {restored}; running on the killed worker: {kill.running}")
    print(f"accuracy after a shard loss: {est.score(test):.4f}; events {kinds}")
    assert est.score(test) >= 0.85
    assert kinds[-1] == "stop"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fit_resumes_from_a_checkpoint_and_continues_the_log(tmp_path, three_workers, mnist):
    client = three_workers
    train, test = mnist
    first = _estimator(max_epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=0.3)
    first.fit(train, eval_data=test, client=client)
    saved = read_checkpoint(tmp_path)
    assert min(saved.versions) > 0 and saved.meta["evals"]
    assert "sum_sq" in saved.shards[0].rule_state
    est = _estimator(max_epochs=2, checkpoint_every=0.3)
    est.fit(train, eval_data=test, client=client, resume_from=tmp_path)
    run = est.experiment_
    kinds = list(run.events["kind"])
    assert kinds.count("start") == 2 and "resumed" in kinds
    assert run.evals["time"].is_monotonic_increasing
    assert len(run.evals) > len(saved.meta["evals"])
    assert run.evals["time"].iloc[len(saved.meta["evals"])] >= saved.elapsed
    assert min(est.server_status_["version"]) > max(saved.versions)  # versions continued
    assert est.score(test) >= 0.8  # asynchronous: a loaded machine measured 0.847 once
    # the push log is one log too: the pushes made before the checkpoint are in it
    assert len(saved.meta["pushes"]) > 0
    assert len(run.pushes) > len(saved.meta["pushes"])
    assert run.pushes["time"].min() < saved.elapsed < run.pushes["time"].max()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fit_shorter_than_checkpoint_every_still_leaves_its_final_checkpoint(
    tmp_path, three_workers, mnist
):
    train, _ = mnist
    est = _estimator(max_epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=3600)
    est.fit(train, client=three_workers)
    saved = read_checkpoint(tmp_path)
    assert saved.versions == est.server_status_["version"].tolist()


def test_a_corrupt_checkpoint_fails_resume_before_any_cluster_work(tmp_path, mnist):
    est = _estimator()
    size = est.model.layout.size
    states = _zero_states(size)
    path = write_checkpoint(tmp_path, states, elapsed=1.0)
    shard = path / "shard-0.npz"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    train, test = mnist
    with pytest.raises(CheckpointError, match="shard-0.npz.*corrupt or truncated"):
        est.fit(train, client=object(), resume_from=tmp_path)  # never reaches the "client"
    with pytest.raises(ValueError, match="n_shards=3"):
        (path / "shard-0.npz").unlink()
        write_checkpoint(tmp_path, states, elapsed=1.0)
        _estimator(n_shards=3).fit(train, client=object(), resume_from=tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cli_run_killed_after_a_checkpoint_resumes_and_finishes(tmp_path, capsys):
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "downpour_dask", "train", "--quiet"]
    settings = ["--dataset", "digits", "--model", "mlp:32", "--n-replicas", "2", "--out", str(out)]
    # 8 s: the kill (1 s after the first checkpoint) must leave the resumed run time to push;
    # with 6 s, a start slowed by other jobs once left it none (the versions did not move)
    settings += ["--name", "job", "--max-epochs", "none", "--max-seconds", "8"]
    settings += ["--checkpoint-every", "0.5", "--seed", "1"]
    partial = out / ".job.partial"
    # its own session: SIGKILL takes the driver and its embedded cluster down together
    driver = subprocess.Popen(
        command + settings, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (partial / "checkpoints" / "LATEST").exists():
            assert driver.poll() is None, driver.communicate()[1].decode()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        time.sleep(1.0)
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate(timeout=30)
    assert not (out / "job").exists()  # no run directory from the killed driver
    before = read_checkpoint(partial / "checkpoints")
    assert min(before.versions) > 0 and json.loads((partial / "job.json").read_text())["name"]

    # a resume that also gives settings is refused before anything is touched (in-process:
    # the refusal comes before any cluster, so a third interpreter would only cost start-up)
    assert cli.main(["train", "--quiet", "--resume", str(out / "job"), "--n-replicas", "3"]) == 2
    assert "--resume continues a job" in capsys.readouterr().err
    assert read_checkpoint(partial / "checkpoints").versions == before.versions

    done = subprocess.run(
        [*command, "--resume", str(out / "job")],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not partial.exists()
    run = Experiment.load(out / "job")
    events = run.events
    kinds = list(events["kind"])
    assert kinds.count("start") == 2 and "resumed" in kinds and kinds[-1] == "stop"
    resumed = events.loc[events["kind"] == "resumed", "data"].iloc[0]
    assert resumed["versions"] == before.versions
    final = events["data"].iloc[-1]["versions"]  # the stop event's
    assert all(f > b for f, b in zip(final, before.versions))  # the version counters continued
    assert events["time"].is_monotonic_increasing and run.evals["time"].is_monotonic_increasing
    assert len(run.evals) > len(before.meta["evals"]) > 0  # one experiment: old rows kept
    assert run.evals["time"].iloc[-1] >= 5.0  # the time axis continued to max_seconds
    assert run.pushes["time"].min() < before.elapsed < run.pushes["time"].max()
    assert len(run.pushes) >= len(before.meta["pushes"]) > 0  # pushes before the kill are kept
    assert run.evals["accuracy"].iloc[-1] >= 0.85


@pytest.mark.slow
def test_resume_of_a_corrupt_cli_checkpoint_is_one_clear_line(tmp_path):
    out = tmp_path / "runs"
    job = runs.prepare({"dataset": "digits", "model": "mlp:32", "out": str(out), "name": "job"})
    job.partial.mkdir(parents=True)
    (job.partial / "job.json").write_text(json.dumps({**job.settings, "name": "job"}))
    size = job.estimator.model.layout.size
    states = _zero_states(size)
    path = write_checkpoint(job.partial / "checkpoints", states, elapsed=1.0)
    (path / "checkpoint.json").write_text("{truncated")
    done = subprocess.run(
        [sys.executable, "-m", "downpour_dask", "train", "--resume", str(out / "job")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "checkpoint.json" in done.stderr, done.stderr
    assert not (out / "job").exists()
