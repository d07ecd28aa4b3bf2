"""Chaos on a real three-worker cluster: a shard's worker stopped (SIGSTOP) for longer than
``timeout`` then resumed, two workers killed 0.3 s apart, a kill during checkpoints.  All share
one cluster (nannies start a fresh worker after a kill) and are marked slow.

What every scenario checks, besides the fit finishing:

- **No split brain**: every replaced incarnation that could be asked again after the fit had not
  moved past its fence (``final_version`` equals what it had acknowledged when retired), so
  exactly one incarnation per shard advanced past the fence.
- **Exact accounting**: each replaced incarnation's lost updates are what it acknowledged minus
  the version its replacement started from; the per-shard sum is ``server_status_``'s
  ``lost_updates``; and every push a shard acknowledged to a replica (the replicas' own count)
  is either in the final state (the shard's version counts every update it holds) or counted
  as lost.

Where things run: shard i starts on worker i and replica r on worker r (sorted addresses).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import assert_no_split_brain_and_exact_accounting, fresh_client
from distributed import Client

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.checkpoint import read_checkpoint
from downpour_dask.runtime.cluster import cluster_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Seconds a shard's worker stays stopped: longer than the fits' ``timeout`` (5) plus the time
#: the driver takes to replace the shard, so the replacement serves while the old copy is
#: frozen, and the old copy resumes during the fit.
STOPPED_FOR = 12.0


@pytest.fixture(scope="module")
def chaos_client():
    yield from fresh_client(3)


@pytest.fixture(scope="module")
def mnist():
    return datasets.load("mnist5k")


def _workers(client: Client) -> list[str]:
    client.wait_for_workers(3, timeout=60)
    return sorted(cluster_workers(client))


def _pid(client: Client, worker: str) -> int:
    return client.run(os.getpid, workers=[worker])[worker]


def _estimator(**kw) -> DownpourSGD:
    settings = dict(
        n_replicas=3, n_shards=2, optimizer="adagrad", learning_rate=0.05, batch_size=32,
        warmstart_steps=20, max_epochs=12, random_state=0, eval_every=0.5, timeout=5,
    )  # fmt: skip
    settings.update(kw)
    return DownpourSGD(models.MLP(784, (32,), 10), **settings)


def _data(est: DownpourSGD, kind: str) -> list[dict]:
    events = est.experiment_.events
    return list(events.loc[events["kind"] == kind, "data"])


@pytest.mark.parametrize("transport", ["auto", "one-sided"])
def test_a_shard_worker_stopped_longer_than_timeout_is_fenced_when_it_resumes(
    chaos_client, mnist, transport
):
    """One-sided, replicas 1 and 2 write shard 0's memory themselves: they must stop doing so
    while its worker is stopped, and whatever they wrote there is counted, not lost unseen."""
    client = chaos_client
    train, test = mnist
    workers = _workers(client)
    pid = _pid(client, workers[0])  # shard 0 and replica 0
    stopped = threading.Event()

    def stop_then_resume(progress) -> None:
        if not stopped.is_set() and progress.pushes >= 100:
            stopped.set()
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(STOPPED_FOR, os.kill, (pid, signal.SIGCONT)).start()

    est = _estimator(max_epochs=25, transport=transport).fit(
        train, eval_data=test, client=client, callback=stop_then_resume
    )
    assert stopped.is_set()
    transports = est.experiment_.config["replica_transports"].values()
    routes = [kind for kinds in transports for kind in kinds]
    assert ("one-sided" in routes) == (transport == "one-sided"), routes
    [lost] = _data(est, "shard_lost")
    assert lost["shard"] == 0 and lost["generation"] == 0
    [restored] = _data(est, "shard_restored")
    assert restored["generation"] == 1 and restored["worker"] != workers[0]
    assert restored["fenced"] is False  # frozen: the replacement started without it
    [record] = est.experiment_.config["shard_incarnations"]
    # the stopped worker came back during the fit: its incarnation was retired, and did not
    # move past the fence; what it acknowledged and the replacement lacks is counted
    assert record["fenced"] and record["final_version"] == record["acknowledged"]
    assert record["lost_updates"] == record["acknowledged"] - record["restored_from"]
    fenced = _data(est, "shard_fenced")
    latest = fenced[-1]["lost_updates"] if fenced else restored["lost_updates"]
    assert latest == record["lost_updates"] == est.server_status_["lost_updates"].iloc[0]
    assert_no_split_brain_and_exact_accounting(est)
    print(f"stopped shard: {restored}; {fenced}; {record}; score {est.score(test):.3f}")
    assert est.score(test) >= 0.8


def test_two_workers_killed_a_moment_apart(chaos_client, mnist):
    client = chaos_client
    train, test = mnist
    workers = _workers(client)
    pids = [_pid(client, w) for w in workers[1:]]  # shard 1 + replica 1, then replica 2
    killed = []

    def kill_two(progress) -> None:
        if not killed and progress.pushes >= 100:
            killed.append(progress.pushes)
            os.kill(pids[0], signal.SIGKILL)
            time.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)

    est = _estimator().fit(train, eval_data=test, client=client, callback=kill_two)
    assert killed
    assert 1 in [d["shard"] for d in _data(est, "shard_restored")]
    assert_no_split_brain_and_exact_accounting(est)
    assert est.score(test) >= 0.8


def test_a_shard_worker_killed_while_checkpoints_are_taken(tmp_path, chaos_client, mnist):
    client = chaos_client
    train, test = mnist
    workers = _workers(client)
    pid = _pid(client, workers[1])
    killed = []

    def kill(progress) -> None:
        if not killed and progress.pushes >= 100:
            killed.append(progress.pushes)
            os.kill(pid, signal.SIGKILL)

    est = _estimator(checkpoint_dir=str(tmp_path), checkpoint_every=0.05).fit(
        train, eval_data=test, client=client, callback=kill
    )
    assert killed and _data(est, "shard_restored")
    assert_no_split_brain_and_exact_accounting(est)
    saved = read_checkpoint(tmp_path)  # the last checkpoint is whole and is the final state
    assert saved.versions == est.server_status_["version"].tolist()
    assert est.score(test) >= 0.8


def test_a_shard_worker_killed_after_the_replicas_finished(chaos_client, mnist):
    """The final evaluation, report and status still need the shards: the lost one is
    restored, no replica is restarted (they had finished), and ``stop`` stays the log's last
    event."""
    client = chaos_client
    train, test = mnist
    workers = _workers(client)
    pid = _pid(client, workers[1])

    def kill_when_done(progress) -> None:
        if progress.phase == "done":
            os.kill(pid, signal.SIGKILL)

    est = _estimator(max_epochs=3).fit(
        train, eval_data=test, client=client, callback=kill_when_done
    )
    kinds = list(est.experiment_.events["kind"])
    assert "shard_restored" in kinds and kinds[-1] == "stop"
    assert est.experiment_.config["replica_restarts"] == 0
    assert_no_split_brain_and_exact_accounting(est)
    assert est.score(test) >= 0.8
