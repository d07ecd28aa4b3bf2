"""core/guard.py in process: the finiteness check every push goes through, and the guarded update
that refuses a push which would make a shard non-finite without changing it."""

import numpy as np
import pytest

from downpour_dask.core import optim
from downpour_dask.core.guard import GuardedUpdate, all_finite


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_finds_one_non_finite_element_anywhere(dtype, bad):
    for where in (0, 1234, 99_999):
        x = np.random.default_rng(0).standard_normal(100_000).astype(dtype)
        assert all_finite(x)
        x[where] = bad
        assert not all_finite(x)
        assert not all_finite(x[::2] if where % 2 == 0 else x[1::2])  # not contiguous
        assert not all_finite(x.reshape(100, 1000))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_finite_values_are_finite_although_their_sum_of_squares_overflows(dtype):
    big = np.finfo(dtype).max / 4
    x = np.full(1000, big, dtype=dtype)
    x[::2] *= -1
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(x, x))  # the fast check overflows: the exact one decides
    assert all_finite(x)
    x[7] = np.nan
    assert not all_finite(x)


def test_arrays_that_cannot_hold_non_finite_values_and_empty_ones_are_finite():
    assert all_finite(np.arange(10))
    assert all_finite(np.zeros(0, np.float32))
    assert all_finite(np.array(3.0))


@pytest.mark.parametrize("rule", [optim.sgd(1.0), optim.adagrad(0.1)], ids=["sgd", "adagrad"])
def test_a_guarded_update_that_would_overflow_leaves_parameters_and_state_as_they_were(rule):
    params = np.full(1000, 3e38, dtype=np.float32)
    state = rule.init(1000)
    guard = GuardedUpdate(rule, params, state)
    before = params.copy(), {k: v.copy() for k, v in state.items()}
    grad = np.full(1000, -3e38, dtype=np.float32)  # finite, but params - grad overflows
    with np.errstate(over="ignore", invalid="ignore"):
        assert guard.apply(params, grad, state) in ("parameters", *state)
    np.testing.assert_array_equal(params, before[0])
    for key, value in state.items():
        np.testing.assert_array_equal(value, before[1][key])
    assert guard.apply(params, np.full(1000, 1.0, np.float32), state) is None  # and goes on


@pytest.mark.parametrize("rule", [optim.sgd(0.05), optim.adagrad(0.1)], ids=["sgd", "adagrad"])
def test_updates_the_bounds_prove_safe_skip_the_check_and_equal_the_bare_rule(rule):
    rng = np.random.default_rng(0)
    params = rng.standard_normal(5000).astype(np.float32)
    state = rule.init(5000)
    bare_params, bare_state = params.copy(), {k: v.copy() for k, v in state.items()}
    guard = GuardedUpdate(rule, params, state)
    for _ in range(20):
        grad = rng.standard_normal(5000).astype(np.float32)
        assert guard.apply(params, grad, state, grad_sq=float(np.dot(grad, grad))) is None
        rule.update(bare_params, grad, bare_state)
    assert guard.unchecked == 20  # no copy, no check: the bounds proved every update finite
    np.testing.assert_array_equal(params, bare_params)
    for key, value in state.items():
        np.testing.assert_array_equal(value, bare_state[key])


def test_a_learning_rate_whose_steps_could_overflow_is_checked_and_refused_when_they_do():
    params = np.ones(1000, dtype=np.float32)
    rule = optim.sgd(1e30)
    guard = GuardedUpdate(rule, params, {})
    grad = np.full(1000, 1e3, dtype=np.float32)
    assert guard.apply(params, grad, {}) is None  # moves by 1e33: far from overflowing
    assert guard.unchecked == 1
    rule.learning_rate = 1e36  # moves by 1e39 would overflow float32: checked, refused
    before = params.copy()
    with np.errstate(over="ignore"):
        assert guard.apply(params, grad, {}) == "parameters"
    assert guard.unchecked == 1
    np.testing.assert_array_equal(params, before)


def test_a_wrapped_rule_is_always_checked():
    rule = optim.staleness_aware(optim.sgd(0.1))
    params = np.zeros(100, np.float32)
    guard = GuardedUpdate(rule, params, rule.init(100))
    assert guard.apply(params, np.ones(100, np.float32), {}, staleness=3) is None
    assert guard.unchecked == 0
