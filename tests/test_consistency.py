"""Stale synchronous and bulk synchronous Downpour (core/consistency.py, ps/clock.py,
downpour/clocked_loop.py): the bound holds with a slowed replica, BSP is synchronous SGD.

In-process tests run real shards behind test_replica's fake channels, one thread per replica;
one test runs BSP on the session's real local cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import numpy as np
import pandas as pd
import pytest
from test_replica import LR, MODEL, Batches, FakeChannel, Sink, config, data, shards_for

from downpour_dask import DownpourSGD, cli, datasets, models, optim, runs
from downpour_dask.core.consistency import max_staleness, resolve
from downpour_dask.downpour.clocked_loop import ClockedReplicaLoop
from downpour_dask.downpour.replica_loop import ReplicaLoop
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.runtime.cluster import cluster_workers

INITIAL = MODEL.init(np.random.default_rng(1))


class Slow:
    """``model`` with ``delay`` seconds added to every gradient (a slow replica's machine); its
    first gradient also waits (at most ``patience`` s) for replica 1 to push ``ahead`` times."""

    def __init__(self, model, delay, shard=None, ahead=0, patience=0.3):
        self.model, self.delay, self.shard, self.ahead = model, delay, shard, ahead
        self.patience = patience

    def loss_and_grad(self, params, X, y, out=None, **kw):
        if self.ahead:
            target = self.shard.accepted_by_replica[1] + self.ahead
            deadline = time.monotonic() + self.patience
            while self.shard.accepted_by_replica[1] < target and time.monotonic() < deadline:
                time.sleep(0.001)
            self.ahead = 0
        time.sleep(self.delay)
        return self.model.loss_and_grad(params, X, y, out=out, **kw)


class Spy(ParameterServerShard):
    """A shard that notes, at every push, the pusher's count and the fewest of any replica."""

    def __init__(self, *args, n_replicas=2, **kw):
        super().__init__(*args, **kw)
        self.n_replicas, self.gaps = n_replicas, []

    def _apply_push(self, grad, fetched_version, replica, *args):
        reply = super()._apply_push(grad, fetched_version, replica, *args)
        pushes, _, finished = self._clocks()  # under the lock the push holds
        active = [r for r in range(self.n_replicas) if r not in finished]  # fakes: run ""
        self.gaps.append(pushes.get(replica, 0) - min(pushes.get(r, 0) for r in active))
        return reply


def run_replicas(shards, batches_of, loop_class=ClockedReplicaLoop, models=None, **cfg):
    """Run one loop per entry of ``batches_of`` in threads; return their results and sinks."""
    n = len(batches_of)
    results, sinks, errors = [None] * n, [Sink() for _ in range(n)], []
    ranges = [(shard.start, shard.stop) for shard in shards]

    def one(r):
        channels = [FakeChannel(shard, replica=r) for shard in shards]
        for channel in channels:
            channel.local = channel.shard_object  # ps/clock.py calls the shard in-process
        settings = dict(replica=r, n_replicas=n, timeout=30.0, **cfg)
        try:
            loop = loop_class(channels, ranges, (models or [MODEL] * n)[r], config(**settings),
                              sinks[r])  # fmt: skip
            results[r] = loop.run(Batches(batches_of[r]))
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results, sinks


@pytest.mark.parametrize("local_rate", [LR, 0.0])
def test_bsp_with_two_replicas_and_one_shard_is_synchronous_minibatch_sgd(local_rate):
    batches_a, batches_b = data(10, seed=1), data(10, seed=2)
    shards = shards_for(INITIAL, 1)
    results, sinks = run_replicas(
        shards, [batches_a, batches_b], staleness_bound=0, max_epochs=1,
        local_learning_rate=local_rate,
    )  # fmt: skip
    expected = INITIAL.copy()
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b):  # mean gradient of the combined batch
        g = MODEL.loss_and_grad(expected, np.concatenate([xa, xb]), np.concatenate([ya, yb]))[1]
        expected -= np.float32(2 * LR) * g  # each replica's push is applied at rate LR
    assert [r["steps"] for r in results] == [10, 10]
    assert np.abs(expected - INITIAL).max() > 0.05  # it trained
    np.testing.assert_allclose(shards[0].values, expected, rtol=1e-5, atol=1e-6)
    assert max(row.staleness for sink in sinks for row in sink.rows) <= max_staleness(0, 2)


@pytest.mark.parametrize("bound", [0, 2])
def test_with_a_slowed_replica_no_push_exceeds_the_bound_and_async_does(bound):
    batches = [data(20, seed=1), data(40, seed=2)]  # replica 0 is the slow one

    def spy():
        return Spy(0, 0, INITIAL.size, INITIAL, optim.sgd(LR), n_replicas=2)

    shard = spy()
    models = [Slow(MODEL, 0.003, shard, ahead=10), MODEL]
    _, sinks = run_replicas([shard], batches, models=models, staleness_bound=bound, max_epochs=1)
    staleness = [row.staleness for sink in sinks for row in sink.rows]
    assert len(staleness) == 60
    assert max(shard.gaps) <= bound + 1  # a push at clock c+1 after a fetch within s
    assert max(staleness) <= max_staleness(bound, 2)
    free = spy()  # the same replicas asynchronously: the fast one runs away
    models = [Slow(MODEL, 0.003, free, ahead=10), MODEL]
    _, sinks = run_replicas([free], batches, ReplicaLoop, models=models, max_epochs=1)
    assert max(free.gaps) > bound + 1
    assert max(row.staleness for row in sinks[0].rows) > max_staleness(bound, 2)


def test_a_replica_whose_peers_never_come_times_out_naming_the_clocks():
    shards = shards_for(INITIAL, 1)
    channels = [FakeChannel(shards[0])]
    channels[0].local = shards[0]
    cfg = config(staleness_bound=0, n_replicas=2, timeout=0.2, max_steps=3)
    loop = ClockedReplicaLoop(channels, [(0, INITIAL.size)], MODEL, cfg, Sink())
    with pytest.raises(TimeoutError, match=r"clock is 0, the slowest replica's 0 \(read at -1\)"):
        loop.run(Batches(data(3)))
    assert shards[0].version == 0  # BSP: no push before every replica read the step's values


def test_a_finished_replica_holds_nobody_back_and_clocks_survive_a_restore():
    shards = shards_for(INITIAL, 1)
    # replica 0 has 3 steps, replica 1 has 9: with s=0, replica 1 goes on once 0 finished
    results, _ = run_replicas(shards, [data(3), data(9)], staleness_bound=0, max_epochs=1)
    assert [r["steps"] for r in results] == [3, 9]
    saved = shards[0].clock_state(1, 2)
    counters = asyncio.run(shards[0].export_state())["counters"]  # checkpoints keep these
    copy = ParameterServerShard(
        0, 0, INITIAL.size, INITIAL, optim.sgd(LR), restore={"version": 5, "counters": counters}
    )
    assert copy.clock_state(1, 2) == saved == (9, 9, 9, False)  # both finished: nobody waits
    assert copy.clock_state(1, 3) == (9, 0, -1, False)  # a third replica would hold it back
    assert copy.clock_state(1, 2, run="resumed") == (9, 3, 2, False)  # a new fit: none finished


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(consistency="strict"), "consistency must be one of 'async', 'ssp', 'bsp'"),
        (dict(staleness_bound=2), "staleness_bound=2 needs consistency='ssp'"),
        (dict(consistency="bsp", staleness_bound=1), "consistency='bsp' is staleness_bound=0"),
        (dict(consistency="ssp", staleness_bound=-1), "staleness_bound must be >= 0"),
        (dict(consistency="ssp", warmstart_steps=5), "cannot be combined with warmstart_steps"),
        (dict(consistency="bsp", partitions=2), "cannot be combined with partitions=2"),
    ],
)
def test_bad_consistency_arguments_are_refused_before_any_cluster_work(kw, match):
    X, y = np.zeros((8, 5), np.float32), np.arange(8) % 2
    with pytest.raises(ValueError, match=match):
        DownpourSGD(**kw).fit(X, y)
    with pytest.raises(TypeError, match="staleness_bound must be an int"):
        resolve("ssp", 1.5)


def test_bsp_on_a_real_cluster_keeps_replicas_in_step(client):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 5)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(int)
    est = DownpourSGD(
        "softmax", n_replicas=2, n_shards=2, optimizer="sgd", learning_rate=0.1,
        batch_size=20, max_epochs=1, consistency="bsp", random_state=0, timeout=30,
    ).fit(X, y, client=client)  # fmt: skip
    pushes = est.experiment_.pushes
    assert len(pushes) == 30 and set(pushes["replica"]) == {0, 1}
    assert pushes["staleness"].max() <= max_staleness(0, 2)
    assert est.experiment_.config["consistency"] == "bsp"
    assert est.experiment_.config["staleness_bound"] == 0
    assert est.score(X, y) > 0.8


def test_an_ssp_fit_resumes_from_its_checkpoint_within_the_bound(client, tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    kw = dict(model="softmax", n_replicas=2, n_shards=2, batch_size=20, consistency="ssp",
              staleness_bound=1, random_state=0, timeout=30)  # fmt: skip
    DownpourSGD(max_steps=5, checkpoint_dir=tmp_path, **kw).fit(X, y, client=client)
    est = DownpourSGD(max_steps=10, **kw).fit(X, y, client=client, resume_from=tmp_path)
    pushes = est.experiment_.pushes
    assert sorted(pushes.groupby("replica")["step"].max()) == [9, 9]  # it went on from step 5
    assert pushes["staleness"].max() <= max_staleness(1, 2)
    assert est.server_status_["accepted"].sum() == 2 * 2 * 10  # each shard: every replica's step


def test_a_job_with_ssp_takes_no_default_warmstart(tmp_path):
    settings = {"dataset": "digits", "out": str(tmp_path)}
    assert runs.prepare(settings).estimator.warmstart_steps == 100  # the async default
    job = runs.prepare({**settings, "consistency": "ssp", "staleness_bound": 1})
    assert (job.estimator.warmstart_steps, job.estimator.staleness_bound) == (0, 1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_train_command_runs_bsp_and_records_it(tmp_path, capsys):
    argv = ["train", "--dataset", "digits", "--model", "softmax", "--n-replicas", "2",
            "--max-steps", "10", "--consistency", "bsp", "--out", str(tmp_path), "--name", "bsp"]
    assert cli.main(argv) == 0, capsys.readouterr().err  # the command, in-process
    config = json.loads((tmp_path / "bsp" / "config.json").read_text())
    assert (config["consistency"], config["staleness_bound"]) == ("bsp", 0)
    pushes = pd.read_parquet(tmp_path / "bsp" / "pushes.parquet")
    assert len(pushes) == 20 and pushes["staleness"].max() <= max_staleness(0, 2)


ALGORITHMS = {
    "ssp": dict(consistency="ssp", staleness_bound=2),
    "easgd": dict(optimizer="sgd", learning_rate=0.1, elastic_alpha=0.3, n_push=2, n_fetch=2),
    "dc+top-k": dict(optimizer="dc_adagrad", top_k=0.05),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_each_algorithm_survives_a_killed_shard_worker(three_workers, algorithm):
    client = three_workers
    train, test = datasets.load("mnist5k")
    workers = sorted(cluster_workers(client))
    pid = client.run(os.getpid, workers=[workers[1]])[workers[1]]  # shard 1 and replica 1
    killed = []

    def kill(progress):
        if not killed and progress.pushes >= 150:
            os.kill(pid, signal.SIGKILL)
            killed.append(progress.pushes)

    est = DownpourSGD(
        models.MLP(784, (64,), 10), n_replicas=3, n_shards=2, batch_size=32, max_epochs=6,
        random_state=0, checkpoint_every=0.5, timeout=60, **ALGORITHMS[algorithm],
    ).fit(train, eval_data=test, client=client, callback=kill)  # fmt: skip
    kinds = list(est.experiment_.events["kind"])
    assert killed and "shard_restored" in kinds and kinds[-1] == "stop"
    steps = -(-(train.n_rows // 3) // 32) * 6
    assert set(est.experiment_.config["replica_steps"]) <= {steps, steps + 6}  # all trained
    if algorithm == "ssp":
        assert est.experiment_.pushes["staleness"].max() <= max_staleness(2, 3)
    assert est.score(test) >= 0.8
