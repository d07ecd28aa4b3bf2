"""Delay-compensated ASGD (core/compensation.py, hooked into ps/shard.py): no delay is plain SGD,
a delay is corrected by ``lam * g * g * (w_now - w_fetched)``, and a fit runs on a cluster."""

from __future__ import annotations

import numpy as np
import pytest
from test_replica import INITIAL, LR, MODEL, config, data, run, server_values, shards_for

from downpour_dask import DownpourSGD, optim
from downpour_dask.core.compensation import DelayCompensated
from downpour_dask.ps.shard import ParameterServerShard


@pytest.mark.parametrize("n_shards", [1, 2])
def test_with_no_delay_dc_asgd_is_plain_sgd(n_shards):
    batches = data()
    plain = shards_for(INITIAL, n_shards)
    run(MODEL, plain, batches, config(max_epochs=2))
    compensated = shards_for(INITIAL, n_shards, DelayCompensated(optim.sgd(LR), lam=10.0))
    run(MODEL, compensated, batches, config(max_epochs=2))
    assert np.abs(server_values(plain) - INITIAL).max() > 0.05  # it trained
    np.testing.assert_array_equal(server_values(compensated), server_values(plain))
    assert compensated[0]._fetched.nbytes == compensated[0].values.nbytes  # one replica's copy


def test_a_delayed_gradient_is_compensated_for_the_parameters_moving_since_its_fetch():
    lam, rng = 0.5, np.random.default_rng(3)
    w0 = rng.normal(size=6).astype(np.float32)
    g0, g1 = rng.normal(size=(2, 6)).astype(np.float32)
    shard = ParameterServerShard(0, 0, 6, w0, DelayCompensated(optim.sgd(LR), lam=lam))
    shard.snapshot(replica=0)  # replica 0 fetches w0 ...
    shard.snapshot(replica=1)
    shard.apply_push(g1, 0, 1)  # ... replica 1's push lands first ...
    w1 = w0 - np.float32(LR) * g1
    reply = shard.apply_push(g0.copy(), 0, 0)  # ... then replica 0's, one update stale
    expected = w1 - np.float32(LR) * (g0 + np.float32(lam) * g0 * g0 * (w1 - w0))
    assert reply.staleness == 1
    np.testing.assert_allclose(shard.values, expected, rtol=1e-6)
    plain = w1 - np.float32(LR) * g0
    assert np.abs(shard.values - plain).max() > 1e-4  # the compensation did something


def test_lam_must_be_non_negative_and_a_rule_is_compensated_once():
    rule = DelayCompensated(optim.adagrad(0.1))
    with pytest.raises(ValueError, match="lam must be a number >= 0"):
        DelayCompensated(optim.sgd(0.1), lam=-1)
    with pytest.raises(TypeError, match="not already compensated"):
        DelayCompensated(rule)


def test_dc_asgd_fits_on_a_real_cluster(client):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 5)).astype(np.float32)
    y = (X[:, 0] - X[:, 2] > 0).astype(int)
    est = DownpourSGD(
        "softmax", n_replicas=2, n_shards=2, optimizer="dc_sgd", learning_rate=0.1,
        batch_size=20, max_epochs=2, random_state=0, timeout=30,
    ).fit(X, y, client=client)  # fmt: skip
    assert est.experiment_.config["optimizer"] == "dc_sgd"
    assert est.server_status_["accepted"].sum() == 2 * 2 * 30
    assert est.score(X, y) > 0.8
