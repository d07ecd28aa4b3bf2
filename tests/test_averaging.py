"""The moving average a shard publishes as the model (core/averaging.py), in-process."""

import asyncio

import numpy as np
import pytest

from downpour_dask import DownpourSGD, optim
from downpour_dask.core.averaging import Averaged, published
from downpour_dask.core.compensation import DelayCompensated
from downpour_dask.core.guard import GuardedUpdate
from downpour_dask.ps.shard import ParameterServerShard

SIZE = 8


def gradients(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(n)]


def by_hand(start, grads, lr, decay):
    """SGD's iterates and their bias-corrected exponential average, step by step."""
    params, average = start.astype(np.float64), np.zeros(SIZE)
    for g in grads:
        params = params - lr * g
        average = decay * average + (1 - decay) * params
    return params, average / (1 - decay ** len(grads))


def test_the_published_model_is_the_bias_corrected_average_of_the_iterates():
    rule = Averaged(optim.sgd(0.1), 0.9)
    params = np.linspace(-1, 1, SIZE, dtype=np.float32)
    start, state = params.copy(), rule.init(SIZE)
    assert published(rule, params, state) is params  # nothing averaged yet: the values
    grads = gradients(5)
    for g in grads:
        rule.update(params, g, state)
    expected_params, expected_model = by_hand(start, grads, 0.1, 0.9)
    np.testing.assert_allclose(params, expected_params, atol=1e-6)
    np.testing.assert_allclose(published(rule, params, state), expected_model, atol=1e-6)
    assert int(state["averaged"]) == 5
    assert not np.allclose(published(rule, params, state), params)  # it is not the last iterate


def test_a_plain_rule_publishes_its_values():
    rule, params = optim.adam(0.1), np.ones(SIZE, np.float32)
    assert published(rule, params, rule.init(SIZE)) is params


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5, float("nan")])
def test_a_decay_outside_zero_to_one_is_refused_naming_ema_decay(decay):
    with pytest.raises(ValueError, match="ema_decay must be strictly between 0 and 1"):
        Averaged(optim.sgd(0.1), decay)


@pytest.mark.parametrize("decay", [True, "0.9", None])
def test_a_decay_that_is_not_a_number_is_refused(decay):
    with pytest.raises(TypeError, match="ema_decay must be a number"):
        Averaged(optim.sgd(0.1), decay)


def test_the_guard_keeps_its_fast_path_and_a_refused_update_leaves_the_average_alone():
    rule = Averaged(optim.adam(0.01), 0.9)
    params = np.ones(SIZE, np.float32)
    state = rule.init(SIZE)
    guard = GuardedUpdate(rule, params, state)
    for g in gradients(3):
        assert guard.apply(params, g, state) is None
    assert guard.unchecked == 3  # Adam's bounds still prove these safe: no copies, no checks
    before = {k: np.array(v, copy=True) for k, v in state.items()}
    model = published(rule, params, state)
    huge = np.full(SIZE, 3e38, np.float32)  # Adam's second moment would overflow
    with np.errstate(over="ignore"):
        assert guard.apply(params, huge, state) == "v"
    for key, array in state.items():
        np.testing.assert_array_equal(array, before[key], err_msg=key)
    np.testing.assert_array_equal(published(rule, params, state), model)


def shard(rule, values=None):
    values = np.linspace(-1, 1, SIZE, dtype=np.float32) if values is None else values
    return ParameterServerShard(0, 0, SIZE, values, rule)


def test_a_shard_serves_replicas_its_values_and_the_driver_the_average():
    ps = shard(Averaged(optim.sgd(0.1), 0.5))
    start = ps.values.copy()
    grads = gradients(4)
    for g in grads:
        assert ps.apply_push(g, ps.version, replica=0).accepted
    expected_params, expected_model = by_hand(start, grads, 0.1, 0.5)
    replica_view = asyncio.run(ps.pull(0))
    driver_view = asyncio.run(ps.pull(model=True))
    np.testing.assert_allclose(replica_view.values, expected_params, atol=1e-6)
    np.testing.assert_allclose(driver_view.values, expected_model, atol=1e-6)
    np.testing.assert_allclose(ps.snapshot_model().values, expected_model, atol=1e-6)
    assert driver_view.version == replica_view.version == 4


def test_the_average_travels_with_the_shards_state_to_a_replacement():
    ps = shard(Averaged(optim.adam(0.05), 0.8))
    for g in gradients(6):
        ps.apply_push(g, ps.version, replica=0)
    saved = asyncio.run(ps.export_state())
    assert set(saved["rule_state"]) == {"m", "v", "t", "average", "averaged"}
    replacement = ParameterServerShard(0, 0, SIZE, saved["values"], ps.rule, restore=saved)
    np.testing.assert_array_equal(replacement.snapshot_model().values, ps.snapshot_model().values)
    with pytest.raises(ValueError, match="'average' does not match the rule Adam"):
        ParameterServerShard(0, 0, SIZE, saved["values"], optim.adam(0.05), restore=saved)


def test_an_averaged_delay_compensated_rule_still_compensates():
    """DC-ASGD's copies of what each replica fetched are kept under the average's wrapper."""
    plain = shard(DelayCompensated(optim.sgd(0.1), lam=1.0))
    averaged = shard(Averaged(DelayCompensated(optim.sgd(0.1), lam=1.0), 0.9))
    for ps in (plain, averaged):
        ps.snapshot(replica=0)  # replica 0 fetched the start
        ps.apply_push(gradients(1, seed=1)[0], 0, replica=1)  # the values moved since
        ps.apply_push(gradients(1, seed=2)[0], 0, replica=0)  # compensated for that move
    np.testing.assert_array_equal(averaged.values, plain.values)
    assert averaged._fetched is not None


def test_the_estimator_takes_ema_decay_as_a_parameter_and_checks_it_before_any_cluster():
    assert DownpourSGD().get_params()["ema_decay"] is None
    X, y = np.zeros((8, 2), np.float32), np.array([0, 1] * 4)
    with pytest.raises(ValueError, match="ema_decay must be strictly between 0 and 1"):
        DownpourSGD("logistic", ema_decay=1.0).fit(X, y)
    with pytest.raises(ValueError, match="elastic_alpha .* takes only ema_decay=None"):
        DownpourSGD("logistic", optimizer="sgd", elastic_alpha=0.5, ema_decay=0.9).fit(X, y)
