"""Model parallelism on a real cluster: DownpourSGD(partitions=P) splits each replica's MLP over
P workers (model_parallel.py, partition.py, and the driver's slots in downpour/tasks.py)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest

from downpour_dask import DownpourSGD, attach, datasets, models
from downpour_dask.core.partition import PartitionPlan
from downpour_dask.downpour.model_parallel import MailboxLink
from downpour_dask.runtime.cluster import cluster_workers

TIMEOUT = 60


@pytest.fixture(scope="module")
def mnist():
    return datasets.load("mnist5k")


def _sgd(partitions: int, **kw) -> DownpourSGD:
    settings = dict(
        n_replicas=1,
        n_shards=2,
        optimizer="sgd",
        learning_rate=0.05,
        batch_size=32,
        n_fetch=1,
        n_push=1,
        max_steps=40,
        random_state=3,
        timeout=TIMEOUT,
        partitions=partitions,
    )
    settings.update(kw)
    return DownpourSGD(models.MLP(784, (48, 24), 10), **settings)


def _parquet(tmp_path, train) -> datasets.ShardedDataset:
    frame = pd.DataFrame(train.X, columns=[f"x{i}" for i in range(train.X.shape[1])])
    frame["label"] = train.y
    paths = []
    for i, rows in enumerate(np.array_split(np.arange(len(frame)), 2)):
        paths.append(str(tmp_path / f"part-{i}.parquet"))
        frame.iloc[rows].to_parquet(paths[-1], index=False)
    return datasets.from_parquet(paths, label="label")


def _direct(on: bool) -> None:
    """Let partitions send over direct sockets (on a worker, through ``Client.run``) or not."""
    MailboxLink.direct = on


@pytest.mark.parametrize(
    "kind, transport", [("arrays", "wire"), ("parquet", "wire"), ("arrays", "actor")]
)
def test_two_partitions_train_exactly_like_one(client, mnist, tmp_path, kind, transport):
    """Partitioning changes where the work runs, not the mathematics: 1 replica, plain SGD,
    n_fetch = n_push = 1 gives the same parameters with P = 2 as with P = 1, whether the
    partitions' messages travel over direct sockets or as actor calls."""
    train, _ = mnist
    data = train if kind == "arrays" else _parquet(tmp_path, train)
    whole = _sgd(1).fit(data, client=client)
    client.run(_direct, transport == "wire")
    try:
        split = _sgd(2).fit(data, client=client)
    finally:
        client.run(_direct, True)
    peers = [slot["peers"] for slot in split.experiment_.config["partition_slots"]]
    assert peers == [{"1": transport}, {"0": transport}]
    assert split.params_.shape == whole.params_.shape
    moved = np.abs(whole.params_ - whole.model.init(np.random.default_rng(3))).max()
    assert moved > 1e-2  # it trained
    np.testing.assert_allclose(split.params_, whole.params_, rtol=1e-4, atol=2e-5)
    pushes = split.experiment_.pushes
    assert sorted(pushes["partition"].unique()) == [0, 1]
    assert (pushes.groupby("partition").size() == 40).all()  # one row per partition push
    assert split.experiment_.summary()["examples"] == 40 * 32  # each example counted once


def test_partitions_run_on_different_workers_and_touch_only_their_own_shards(client, mnist):
    train, _ = mnist
    est = _sgd(2, n_replicas=2, n_shards=4, optimizer="adagrad", max_steps=30)
    est.fit(train, client=client)
    config = est.experiment_.config
    plan = PartitionPlan(est.model, 2)
    slots = config["partition_slots"]
    assert len(slots) == 4
    for r in (0, 1):
        workers = [s["worker"] for s in slots if s["replica"] == r]
        assert len(set(workers)) == 2  # a replica's two partitions on two workers
    status = est.server_status_
    for slot in slots:
        lo, hi = plan.offsets[slot["partition"]]
        for shard in slot["shards"]:  # its shards hold only its own parameters
            assert lo <= status["start"].iloc[shard] and status["stop"].iloc[shard] <= hi
    for _, shard in status.iterrows():  # and no other partition pulled from or pushed to them
        touched_by = {s["partition"] for s in slots if set(s["sessions"]) & set(shard["sessions"])}
        owner = next(p for p, (lo, hi) in enumerate(plan.offsets) if lo <= shard["start"] < hi)
        assert touched_by == {owner}
    # 2 replicas x 2 partitions x 30 steps, each partition pushing its own range
    assert len(est.experiment_.pushes) == 2 * 2 * 30
    assert config["partition_bytes_sent"] > 0


def test_two_replicas_of_two_partitions_learn_mnist5k(client, mnist):
    train, test = mnist
    est = DownpourSGD(
        models.MLP(784, (128,), 10),
        n_replicas=2,
        n_shards=2,
        partitions=2,
        batch_size=32,
        max_epochs=3,
        warmstart_steps=50,
        random_state=0,
        timeout=TIMEOUT,
    )
    seen = []

    def look(progress):  # what another process attached to the run would see
        if not seen and progress.pushes >= 100:
            view = attach("split-mnist", client)
            seen.append((view.params().shape, view.evaluate(test)["accuracy"]))

    est.fit(train, eval_data=test, client=client, publish="split-mnist", callback=look)
    accuracy = est.score(test)
    print(f"R=2 x P=2 on mnist5k: test accuracy {accuracy:.4f}; live view saw {seen}")
    assert seen and seen[0][0] == (est.model.layout.size,) and seen[0][1] > 0.5
    assert accuracy >= 0.90
    assert est.experiment_.evals["accuracy"].iloc[-1] == pytest.approx(accuracy)
    assert est.predict(test.X).shape == (len(test.y),)  # params_ are the whole model's
    # only the 10 logits (and a stop vote) cross partitions with one hidden layer
    examples = est.experiment_.summary()["examples"]
    per_example = est.experiment_.config["partition_bytes_sent"] / examples
    assert 80 <= per_example < 100, per_example


@pytest.mark.parametrize(
    ("model", "settings", "error", "match"),
    [
        (models.SoftmaxRegression(784, 10), {}, TypeError, "SoftmaxRegression has no hidden"),
        (models.MLP(784, (64, 2), 10), {"partitions": 3}, ValueError, "between 1 and 2"),
        (models.MLP(784, (64,), 10), {"n_shards": 1}, ValueError, "n_shards must be at least"),
        (models.MLP(784, (64,), 10), {"partitions": 0}, ValueError, "partitions"),
    ],
)
def test_models_and_settings_that_cannot_be_split_fail_before_any_work(
    mnist, model, settings, error, match
):
    train, _ = mnist
    est = DownpourSGD(model, partitions=settings.pop("partitions", 2), **settings)
    with pytest.raises(error, match=match):
        est.fit(train, client=object())  # raises before it ever uses the "client"


def test_more_partitions_than_workers_is_refused_before_training(client, mnist):
    train, _ = mnist
    est = DownpourSGD(models.MLP(784, (64,), 10), n_shards=3, partitions=3, timeout=TIMEOUT)
    with pytest.raises(ValueError, match="partitions=3 .* the cluster has 2; use partitions <= 2"):
        est.fit(train, client=client)


@pytest.mark.slow  # its own cluster, a worker killed
@pytest.mark.timeout(240)
def test_losing_a_partitions_worker_restarts_that_replica_and_the_others_go_on(
    three_workers, mnist
):
    train, test = mnist
    client = three_workers
    workers = sorted(cluster_workers(client))
    # replica r's partitions start on workers r and r+1; shards sit with replica 0's
    # partitions on workers 0 and 1; so worker 2 holds partition 1 of replica 1 and
    # partition 0 of replica 2, and no shard
    pid = client.run(os.getpid, workers=[workers[2]])[workers[2]]
    running: set[int] = set()  # replicas with a partition task on worker 2 at the kill

    def kill(progress):
        if pid and not running and progress.pushes >= 150:
            # the driver is inside this callback: it cannot gather results before the kill
            keys = map(str, client.processing(workers=[workers[2]])[workers[2]])
            running.update(int(k.split("-")[1]) for k in keys if k.startswith("replica"))
            os.kill(pid, signal.SIGKILL)

    est = DownpourSGD(
        models.MLP(784, (64,), 10),
        n_replicas=3,
        n_shards=2,
        partitions=2,
        batch_size=32,
        max_epochs=10,  # long enough that replicas 1 and 2 still run at 150 pushes
        warmstart_steps=50,
        random_state=0,
        eval_every=0.25,
        timeout=TIMEOUT,
    )
    est.fit(train, eval_data=test, client=client, callback=kill)
    assert running, "the kill came after the replicas on worker 2 had finished"
    events = est.experiment_.events
    kinds = list(events["kind"])
    assert "shard_lost" not in kinds
    failed = [d["replica"] for d in events.loc[events["kind"] == "replica_failed", "data"]]
    restarted = [d["replica"] for d in events.loc[events["kind"] == "replica_restarted", "data"]]
    assert running <= set(failed) <= {1, 2}  # replica 0 went on
    assert restarted == failed
    slots = est.experiment_.config["partition_slots"]
    for r in range(3):
        placed = [s["worker"] for s in slots if s["replica"] == r]
        assert workers[2] not in placed or r == 0  # restarted replicas left the dead worker
        assert len(set(placed)) == 2  # still on two distinct workers
    assert est.experiment_.config["replica_restarts"] == len(restarted)
    assert kinds[-1] == "stop"
    print(f"accuracy after losing a partition's worker: {est.score(test):.4f}; events {kinds}")
    assert est.score(test) >= 0.85
