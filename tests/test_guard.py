"""core/guard.py in process: the finiteness check every push goes through, and the guarded update
that refuses a push which would make a shard non-finite without changing it."""

import warnings

import numpy as np
import pytest

from downpour_dask.core import optim
from downpour_dask.core.guard import HOLD_GIL_UP_TO, GuardedUpdate, all_finite, sum_of_squares


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1000, HOLD_GIL_UP_TO, HOLD_GIL_UP_TO + 1])
def test_the_norm_answers_alike_whether_it_holds_the_gil_or_lets_it_go(dtype, size):
    # up to HOLD_GIL_UP_TO elements scipy's BLAS takes the product, above it numpy's
    x = np.random.default_rng(0).standard_normal(size).astype(dtype)
    assert sum_of_squares(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-4)
    for bad, expected in ((np.inf, np.inf), (np.nan, None)):
        y = x.copy()
        y[size // 2] = bad
        result = sum_of_squares(y)
        assert result == expected if expected is not None else np.isnan(result)
    huge = np.full(size, np.finfo(dtype).max / 4, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow is an answer here, not a warning
        assert sum_of_squares(huge) == np.inf


def test_arrays_that_cannot_hold_non_finite_values_and_empty_ones_are_finite():
    assert all_finite(np.arange(10))
    assert all_finite(np.zeros(0, np.float32))
    assert all_finite(np.array(3.0))


RULES = [optim.sgd(1.0), optim.adagrad(0.1), optim.adam(0.1)]


@pytest.mark.parametrize("rule", RULES, ids=["sgd", "adagrad", "adam"])
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


@pytest.mark.parametrize(
    "rule", [optim.sgd(0.05), optim.adagrad(0.1), optim.adam(0.01)], ids=["sgd", "adagrad", "adam"]
)
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


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_the_bounds_an_unchecked_update_relies_on_hold_through_any_gradients(name):
    """The guard skips its check only while its bounds of each array's largest magnitude cover
    the arrays: pushes of every scale -- tiny ones that underflow Adam's second moment, huge
    ones, zero -- must keep every array within its bound (else an overflow could pass
    unchecked)."""
    rng = np.random.default_rng(5)
    rule = optim.make(name, 0.5)
    params, state = np.zeros(300, np.float32), rule.init(300)  # bounds of 0 to start from
    guard = GuardedUpdate(rule, params, state)
    for scale in [1e-30, 1.0, 1e4, 0.0, 1e-3, 1e12, 1e-25, 1.0] * 4:
        grad = (rng.standard_normal(300) * scale).astype(np.float32)
        assert guard.apply(params, grad, state) is None
        for key, array in {"": params, **state}.items():
            if array.dtype.kind == "f":  # (Adam's step count is an integer)
                assert np.abs(array).max() <= guard._bounds[key], (key, scale)
    assert guard.unchecked == 32


def test_an_adam_update_the_bounds_cannot_clear_is_checked_and_applied_when_finite():
    rule = optim.adam(1e27)  # the bound of a step, lr |m| / ((1 - beta1) eps), is 1e36 here
    params, state = np.full(100, 2.1e37, np.float32), rule.init(100)  # near float32's limit
    guard = GuardedUpdate(rule, params, state)
    assert guard.apply(params, np.ones(100, np.float32), state) is None  # moved by 1e27 only
    assert guard.unchecked == 0  # checked in full, and applied
    np.testing.assert_allclose(state["m"], 0.1, rtol=1e-6)
    assert int(state["t"]) == 1 and np.isfinite(params).all()


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
