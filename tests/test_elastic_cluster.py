"""A fit that follows a real local cluster: workers added by ``cluster.scale``, a shard's worker
retired with ``client.retire_workers`` (a dense fit's and a sparse fit's), ``cluster.adapt``.
Each test starts its own cluster of worker processes (with nannies) and closes it: all are
slow.  ``tests/test_elastic.py`` pins the same decisions in-process, with fakes.

Where things run (``Driver``): replica r starts on worker r and shard i on worker i (sorted
addresses, round robin), so with three workers worker 1 holds shard 1 and replica 1.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from distributed import Client, LocalCluster

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.core.sparse import SparseBatch
from downpour_dask.core.sparse_models import SparseLogisticRegression
from downpour_dask.downpour.sparse_fit import fit_sparse
from downpour_dask.runtime.cluster import cluster_workers

TIMEOUT = 60


@pytest.fixture(scope="module")
def mnist():
    return datasets.load("mnist5k")


def _cluster(n: int) -> LocalCluster:
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0")


def _estimator(**kw) -> DownpourSGD:
    settings = dict(
        n_replicas=2, n_shards=2, batch_size=32, warmstart_steps=20, random_state=0,
        eval_every=0.25, timeout=TIMEOUT,
    )  # fmt: skip
    settings.update(kw)
    return DownpourSGD(models.MLP(784, (64,), 10), **settings)


def _once_at(pushes: int, action: Callable[[], None], asked: list[int]) -> Callable:
    """A fit's progress callback that runs ``action`` once the fit has made ``pushes`` pushes,
    noting when in ``asked``."""

    def callback(progress) -> None:
        if not asked and progress.pushes >= pushes:
            asked.append(progress.pushes)
            action()

    return callback


def _retire_in_the_background(client: Client, worker: str) -> Callable[[], None]:
    """``client.retire_workers([worker])``, started on a thread of its own: not from the
    driver's thread, which must go on supervising the fit meanwhile."""
    return threading.Thread(target=client.retire_workers, args=([worker],)).start


def _data(est: DownpourSGD, kind: str) -> list[dict]:
    events = est.experiment_.events
    return list(events.loc[events["kind"] == kind, "data"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_retiring_a_shards_worker_migrates_the_shard_with_no_lost_update(mnist):
    train, test = mnist
    with _cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=TIMEOUT)
        workers = sorted(cluster_workers(client))
        asked: list[int] = []
        retire = _once_at(50, _retire_in_the_background(client, workers[1]), asked)
        est = _estimator(n_replicas=3, max_epochs=15).fit(
            train, eval_data=test, client=client, callback=retire
        )
        assert asked
        kinds = list(est.experiment_.events["kind"])
        print(f"retirement asked at {asked[0]} pushes; events {kinds}")
        [migrated] = _data(est, "shard_migrated")
        assert migrated["shard"] == 1 and migrated["from_worker"] == workers[1]
        assert migrated["worker"] != workers[1] and migrated["lost_updates"] == 0
        assert "shard_lost" not in set(est.experiment_.events["kind"])
        [old] = est.experiment_.config["shard_incarnations"]
        assert old["fenced"] and old["restored_from"] == old["acknowledged"]  # exact: 0 lost
        status = est.server_status_
        assert list(status["lost_updates"]) == [0, 0]
        acked = est.experiment_.config["acknowledged_pushes"]
        for shard in (0, 1):  # every push a replica saw acknowledged is in the final state
            assert acked[str(shard)] <= status["version"].iloc[shard]
        rows = train.n_rows // 3
        assert set(est.experiment_.config["replica_steps"]) <= {
            15 * -(-(rows + extra) // 32) for extra in (0, 1)
        }  # every replica trained all its steps, replica 1 wherever it went
        assert est.experiment_.events["kind"].iloc[-1] == "stop"
        deadline = time.monotonic() + 30  # the retirement Dask aborted for the shard completes
        while workers[1] in cluster_workers(client) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers[1] not in cluster_workers(client)
        print(f"migrated: {migrated}; retired replicas: {_data(est, 'replica_retired')}")


def _clicks(n: int = 2000, n_rows: int = 3000, fields: int = 4) -> SparseBatch:
    rng = np.random.default_rng(0)
    effect = rng.normal(0, 1.5, n_rows)
    ids = rng.integers(0, n_rows, (n, fields))
    clicked = rng.random(n) < 1 / (1 + np.exp(-effect[ids].sum(axis=1)))
    return SparseBatch(rng.normal(size=(n, 2)).astype(np.float32), ids, clicked.astype(np.int64))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["retire_workers", "scale_down"])
def test_a_sparse_shards_worker_that_leaves_hands_over_its_rows_with_no_lost_update(how):
    """Every worker holds a table shard and a replica.  ``retire_workers`` on worker 1: Dask
    aborts it (the worker holds an actor), the fit moves the shard -- rows, rule state and
    counters -- and retires the worker again.  ``cluster.scale(2)``: the nanny closes a worker,
    whose plugin holds it while its shard moves.  Either way the leaving worker's replica
    pauses, goes down with it and is restarted after the steps it pushed."""
    with _cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=TIMEOUT)
        workers = sorted(cluster_workers(client))
        asked: list[int] = []
        if how == "retire_workers":
            leave = _retire_in_the_background(client, workers[1])
        else:
            leave = functools.partial(cluster.scale, 2)  # returns at once
        fit = fit_sparse(SparseLogisticRegression(3000, 4, n_numeric=2), _clicks(), client=client,
                         n_replicas=3, n_shards=3, batch_size=16, max_epochs=10_000,
                         max_steps=500, timeout=TIMEOUT, callback=_once_at(120, leave, asked))
        try:
            assert asked
            kinds = list(fit.events["kind"])
            print(f"{how} at {asked[0]} pushes; events {kinds}")
            [migrated] = list(fit.events.loc[fit.events["kind"] == "shard_migrated", "data"])
            gone = workers.index(migrated["from_worker"])
            assert how == "scale_down" or gone == 1
            assert migrated["shard"] == gone and migrated["worker"] != workers[gone]
            assert migrated["lost_updates"] == 0
            assert "shard_lost" not in kinds and fit.lost_updates == [0, 0, 0]
            [failed] = list(fit.events.loc[fit.events["kind"] == "replica_failed", "data"])
            assert failed["replica"] == gone  # restarted elsewhere (crash path), once
            for shard, counters in enumerate(fit.counters()):
                accepted = counters["accepted_by_replica"]
                print(f"shard {shard}: version {counters['version']}, accepted {accepted}")
                assert counters["version"] == sum(accepted.values())  # one update per push
                # each replica pushed each step once; a push in flight at the fence is refused
                # (the migrated shard), as is one the close cut between shards (its replica)
                moved = [0, 1, 2] if shard == gone else [gone]
                for r in range(3):
                    assert accepted[r] in ((499, 500) if r in moved else (500,))
            pushes = fit.pushes
            assert pushes.loc[pushes["replica"] != gone, "step"].max() == 499  # to the end
            dense, (table,) = fit.state()
            assert np.isfinite(dense).all() and np.isfinite(table).all()
        finally:
            fit.close()
        deadline = time.monotonic() + 30  # a retirement Dask aborted for the shard completes
        while workers[gone] in cluster_workers(client) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers[gone] not in cluster_workers(client)
        print(f"migrated: {migrated}")


class _GatedLogistic(SparseLogisticRegression):
    """A sparse logistic model whose replicas, at their ``after``-th step, wait until the file
    ``gate`` exists (at most ``TIMEOUT`` s): holds a fit mid-run, with no CPU spent, until the
    test has changed the cluster (however slow the machine is to start a worker)."""

    def __init__(self, *args, gate: str, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.after, self.steps = gate, after, 0

    def loss_and_grad(self, *args, **kwargs):
        self.steps += 1
        deadline = time.monotonic() + TIMEOUT
        while self.steps == self.after and not os.path.exists(self.gate):
            assert time.monotonic() < deadline, f"{self.gate} was not made in {TIMEOUT} s"
            time.sleep(0.05)
        return super().loss_and_grad(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sparse_fit_adds_a_replica_on_a_worker_that_joins_and_each_row_is_read_once_an_epoch(
    tmp_path,
):
    """Two workers, two replicas of 1,000 rows each, ``max_replicas=3``; after their 40th step
    (of 63 an epoch) the replicas wait while ``cluster.scale(3)`` adds a worker.  It gets
    replica 2 with a third of each share (666 rows); the two others read their 667 rows from
    their next epoch on."""
    gate = tmp_path / "joined"

    def join() -> None:
        cluster.scale(3)
        client.wait_for_workers(3, timeout=TIMEOUT)
        time.sleep(1.0)  # the driver hears of the join (.membership) and starts replica 2
        gate.touch()

    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)
        before = set(cluster_workers(client))
        epochs, joining = 6, threading.Thread(target=join)
        model = _GatedLogistic(3000, 4, n_numeric=2, gate=str(gate), after=40)
        # (a worker that joined before the fit started is one of those it started on)
        fit = fit_sparse(model, _clicks(), client=client, n_replicas=2, n_shards=2,
                         batch_size=16, max_epochs=epochs, max_replicas=3, timeout=TIMEOUT,
                         callback=_once_at(1, joining.start, []))
        joining.join(timeout=TIMEOUT)
        try:
            kinds = list(fit.events["kind"])
            print(f"events {kinds}")
            [new] = list(fit.events.loc[fit.events["kind"] == "replica_added", "data"])
            assert new["replica"] == 2 and new["worker"] not in before and new["rows"] == 666
            assert "replica_failed" not in kinds and fit.lost_updates == [0, 0]
            for counters in fit.counters():
                accepted = counters["accepted_by_replica"]
                assert counters["version"] == sum(accepted.values()) and accepted[2] > 0
            pushes = fit.pushes
            assert not pushes.duplicated(["replica", "step", "shard"]).any()
            examples = pushes[pushes["shard"] == 0].groupby("replica")["examples"].sum()
            print(f"examples read by each replica: {dict(examples)}")
            # the newcomer reads its 666 rows in each of its epochs (all six: the others had
            # made 0.64 of one); the others 1,000 rows in the epoch under way, then 667
            assert examples[2] == epochs * 666
            assert examples[0] == examples[1] == 1000 + (epochs - 1) * 667
        finally:
            fit.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scaling_down_closes_a_shards_worker_only_after_its_shard_and_replica_moved(mnist):
    """``cluster.scale`` down closes a worker through its nanny, which cancels its tasks: the
    worker plugin holds it while the shard migrates and the replica's result is read back."""
    train, test = mnist
    with _cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=TIMEOUT)
        asked: list[int] = []
        # cluster.scale returns at once: every worker holds a shard and a replica
        scale_down = _once_at(50, functools.partial(cluster.scale, 2), asked)
        est = _estimator(n_replicas=3, n_shards=3, max_epochs=15).fit(
            train, eval_data=test, client=client, callback=scale_down
        )
        kinds = list(est.experiment_.events["kind"])
        print(f"scaled down at {asked[0]} pushes; events {kinds}")
        [migrated] = _data(est, "shard_migrated")
        assert migrated["lost_updates"] == 0 and list(est.server_status_["lost_updates"]) == [0] * 3
        assert "shard_lost" not in kinds and "replica_failed" not in kinds
        [retired] = _data(est, "replica_retired")  # it had work left: it continues elsewhere
        assert retired["worker"] == migrated["from_worker"] and retired["moved_to"] is not None
        assert kinds[-1] == "stop" and len(cluster_workers(client)) == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_that_join_mid_run_get_replicas_that_train(mnist):
    train, test = mnist
    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)
        scaled: list[float] = []

        def scale_up(progress) -> None:
            if not scaled:
                scaled.append(progress.time)
                cluster.scale(4)  # returns at once; the workers join seconds later

        est = _estimator(max_replicas=4, max_epochs=None, max_seconds=12).fit(
            train, eval_data=test, client=client, callback=scale_up
        )
        start = _data(est, "start")[0]
        assert start["n_replicas"] == 2 and start["n_workers"] == 2
        added = _data(est, "replica_added")
        assert added and {a["replica"] for a in added} <= {2, 3}
        assert all(a["rows"] > 0 for a in added)
        pushes = est.experiment_.pushes
        new = pushes[pushes["replica"] >= 2]
        assert len(new) > 0  # the added replicas trained
        assert "replica_failed" not in set(est.experiment_.events["kind"])
        assert not pushes.duplicated(["replica", "step"]).any()  # each replica ran once
        assert new["version"].min() > 0  # ... from the current parameters (a warm start)
        assert est.experiment_.config["replicas_added"] == added
        shares = est.experiment_.config["rows_per_epoch"]  # re-split: a row read once an epoch
        assert sum(shares.values()) == est.experiment_.config["n_rows"]
        assert set(shares) >= {"0", "1", "2"}
        joined = est.experiment_.events.query("kind == 'replica_added'")["time"].min()
        before, after = pushes[pushes["time"] < joined], pushes[pushes["time"] >= joined]
        rate = [
            part["examples"].sum() / max(1e-9, part["time"].max() - part["time"].min())
            for part in (before, after)
        ]
        print(f"added {added}; examples/s before the join {rate[0]:.0f}, after {rate[1]:.0f}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_adaptive_cluster_grows_for_queued_work_and_lets_a_worker_without_replica_go(mnist):
    """``adapt`` sizes the cluster by the work queued on it; replicas leave the thread pool, so
    they count for nothing: a burst of other tasks makes it add two workers, one of which gets a
    replica (``max_replicas=3``).  Once the burst's results are let go of, adapt retires the
    other one while the fit goes on -- never a worker running a replica:
    ``Scheduler.workers_to_close`` skips workers with long-running (seceded) tasks, so under
    adapt a replica's worker leaves only after the fit."""
    train, test = mnist
    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)
        cluster.adapt(minimum=2, maximum=4, interval="200ms", wait_count=3)
        burst: list = []
        sizes: list[int] = []
        replicas: set[str] = set()  # the replicas' task keys seen running

        def queue_a_burst(progress) -> None:
            sizes.append(len(cluster_workers(client)))
            replicas.update(str(k).split("-")[1] for ks in client.processing().values()
                            for k in ks if str(k).startswith("replica-"))  # fmt: skip
            if not burst and progress.pushes >= 20:  # ~20 s of 0.5 s tasks: 4 workers' worth
                burst.extend(client.map(time.sleep, [0.5] * 40, pure=False))
            if burst and burst[0] is not None and all(f.status == "finished" for f in burst):
                burst[:] = [None]  # its results let go of: nothing left on the 4th worker
            if burst == [None] and sizes[-1] == 3:
                raise StopIteration  # adapt let the worker without a replica go: done

        with pytest.raises(StopIteration):  # a callback's exception stops the fit, and goes up
            _estimator(max_replicas=3, max_epochs=None, max_seconds=90).fit(
                train, eval_data=test, client=client, callback=queue_a_burst
            )
        assert max(sizes) == 4 and sizes[-1] == 3  # grew to 4, shrank to 3 during the fit
        assert replicas == {"0", "1", "2"}  # a replica on a joined worker, and no more
        assert len(cluster_workers(client)) == 3  # the replicas' workers stayed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fit_on_an_adaptive_cluster_finishes(mnist):
    train, test = mnist
    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)
        cluster.adapt(minimum=2, maximum=4, interval="200ms", wait_count=2)
        est = _estimator(max_replicas=4, max_epochs=None, max_seconds=4).fit(
            train, eval_data=test, client=client
        )
        kinds = list(est.experiment_.events["kind"])
        assert kinds[-1] == "stop" and "replica_failed" not in kinds
        assert list(est.server_status_["lost_updates"]) == [0, 0]
        assert est.score(test) > 0.8
        print(f"events: {kinds}")
