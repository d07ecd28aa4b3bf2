"""Asynchronous EASGD (downpour/easgd_loop.py): one replica matches the serial elastic rule,
bad combinations are refused, and a fit on a real cluster trains the centre."""

from __future__ import annotations

import numpy as np
import pytest
from test_replica import INITIAL, LR, MODEL, Batches, FakeChannel, Sink, config, data, shards_for

from downpour_dask import DownpourSGD
from downpour_dask.downpour.easgd_loop import ElasticReplicaLoop

ALPHA = 0.3


def serial_easgd(batches, tau, epochs=1):
    """Algorithm 1 of Zhang et al. for one worker: local SGD, an elastic exchange every tau."""
    x, centre, step = INITIAL.copy(), INITIAL.copy(), 0
    for _ in range(epochs):
        for Xb, yb in batches:
            x -= np.float32(LR) * MODEL.loss_and_grad(x, Xb, yb)[1]
            step += 1
            if step % tau == 0 or step == epochs * len(batches):
                d = np.float32(ALPHA) * (x - centre)
                x -= d
                centre += d
    return x, centre


@pytest.mark.parametrize("tau, n_shards", [(1, 1), (1, 2), (3, 2)])
def test_one_replica_matches_the_serial_elastic_rule(tau, n_shards):
    batches = data(10)
    shards = shards_for(INITIAL, n_shards)  # plain SGD at LR, the centre's rate
    channels = [FakeChannel(shard) for shard in shards]
    cfg = config(max_epochs=2, n_push=tau, n_fetch=tau, elastic_alpha=ALPHA, centre_rate=LR)
    loop = ElasticReplicaLoop(channels, [(s.start, s.stop) for s in shards], MODEL, cfg, Sink())
    result = loop.run(Batches(batches))
    x, centre = serial_easgd(batches, tau, epochs=2)
    assert result["steps"] == 20
    assert np.abs(centre - INITIAL).max() > 0.01  # the centre moved
    np.testing.assert_allclose(np.concatenate([s.values for s in shards]), centre, atol=1e-5)
    np.testing.assert_allclose(loop.params, x, atol=1e-5)  # the replica's own variable


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(elastic_alpha=1.5), r"elastic_alpha must be a number in \(0, 1\)"),
        (dict(elastic_alpha=0.5), "needs optimizer='sgd'"),
        (dict(elastic_alpha=0.5, optimizer="sgd", top_k=0.1), "takes only top_k=None"),
        (dict(elastic_alpha=0.5, optimizer="sgd", consistency="bsp"), "only consistency='async'"),
    ],
)
def test_bad_easgd_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DownpourSGD(**kw).fit(np.zeros((8, 3), np.float32), np.arange(8) % 2)


def test_easgd_trains_the_centre_on_a_real_cluster(client):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 5)).astype(np.float32)
    y = (X[:, 0] + X[:, 3] > 0).astype(int)
    est = DownpourSGD(
        "softmax", n_replicas=2, n_shards=2, optimizer="sgd", learning_rate=0.1, batch_size=20,
        max_epochs=3, n_push=4, n_fetch=4, elastic_alpha=0.45, random_state=0, timeout=30,
    ).fit(X, y, client=client)  # fmt: skip
    assert est.experiment_.config["elastic_alpha"] == 0.45
    assert len(est.experiment_.pushes) == 2 * 45 // 4 + 2  # an exchange every 4 steps, and last
    assert est.score(X, y) > 0.8


def test_easgd_resumes_from_its_checkpoint(client, tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 5)).astype(np.float32)
    y = (X[:, 1] > 0).astype(int)
    kw = dict(
        model="softmax",
        n_replicas=2,
        n_shards=2,
        optimizer="sgd",
        learning_rate=0.1,
        batch_size=20,
        n_push=2,
        n_fetch=2,
        elastic_alpha=0.4,
        random_state=0,
        timeout=30,
    )
    DownpourSGD(max_steps=6, checkpoint_dir=tmp_path, **kw).fit(X, y, client=client)
    est = DownpourSGD(max_steps=12, **kw).fit(X, y, client=client, resume_from=tmp_path)
    pushes = est.experiment_.pushes
    assert sorted(pushes.groupby("replica")["step"].max()) == [11, 11]
    assert est.server_status_["accepted"].sum() == 2 * 2 * 6  # an exchange every 2 steps
