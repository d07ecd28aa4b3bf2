"""Update rules: hand-computed steps, in-place semantics, staleness scaling, state, configs."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from downpour_dask import optim
from downpour_dask.core import optim as optim_module
from downpour_dask.core.optim import OPTIMIZERS, from_config, make


def run(rule, p0, grads, **kwargs):
    """Apply ``grads`` in order from ``p0``; return (params after each step, final state)."""
    params = np.array(p0, dtype=np.float32)
    state = rule.init(params.size)
    history = []
    for g in grads:
        rule.update(params, np.array(g, dtype=np.float32), state, **kwargs)
        history.append(params.copy())
    return history, state


def test_sgd_by_hand():
    # lr 0.1: [1, -2, 0.5] - 0.1 * [0.5, 1, 0] = [0.95, -2.1, 0.5]
    #         [0.95, -2.1, 0.5] - 0.1 * [-1, 2, 4] = [1.05, -2.3, 0.1]
    (p1, p2), state = run(optim.sgd(0.1), [1.0, -2.0, 0.5], [[0.5, 1.0, 0.0], [-1.0, 2.0, 4.0]])
    np.testing.assert_allclose(p1, [0.95, -2.1, 0.5], rtol=1e-6)
    np.testing.assert_allclose(p2, [1.05, -2.3, 0.1], rtol=1e-6)
    assert state == {}


def test_momentum_by_hand():
    # lr 0.1, momentum 0.9
    # v1 = g1 = [0.5, 1, 0]                                 p1 = [0.95, -2.1, 0.5]
    # v2 = 0.9 v1 + g2 = [0.45 - 1, 0.9 + 2, 0 + 4]
    #    = [-0.55, 2.9, 4]                                  p2 = [1.005, -2.39, 0.1]
    # v3 = 0.9 v2 + 0 = [-0.495, 2.61, 3.6]                 p3 = [1.0545, -2.651, -0.26]
    grads = [[0.5, 1.0, 0.0], [-1.0, 2.0, 4.0], [0.0, 0.0, 0.0]]
    (p1, p2, p3), state = run(optim.momentum(0.1, momentum=0.9), [1.0, -2.0, 0.5], grads)
    np.testing.assert_allclose(p1, [0.95, -2.1, 0.5], rtol=1e-6)
    np.testing.assert_allclose(p2, [1.005, -2.39, 0.1], rtol=1e-6)
    np.testing.assert_allclose(p3, [1.0545, -2.651, -0.26], rtol=1e-6)
    np.testing.assert_allclose(state["velocity"], [-0.495, 2.61, 3.6], rtol=1e-6)


@pytest.mark.parametrize(
    "layout",
    ["float32", "float64", "strided", "2-d", "float64 grad on float32 params"],
)
@pytest.mark.parametrize("rule", [optim.sgd(0.1), optim.momentum(0.1, momentum=0.9)])
def test_sgd_and_momentum_step_in_place_for_every_layout(rule, layout):
    """The step goes into the caller's array itself (a shard's values, a view of a bigger
    vector), whether BLAS takes it (contiguous float32/float64) or numpy does (the rest)."""
    rng = np.random.default_rng(3)
    dtype = np.float64 if layout == "float64" else np.float32
    base = rng.standard_normal(24).astype(dtype)
    grad = rng.standard_normal(24).astype(np.float64 if "float64" in layout else dtype)
    params = base.copy()
    if layout == "strided":
        params, grad = params[::2], grad[::2]  # a view into a bigger vector
    elif layout == "2-d":
        params, grad = params.reshape(4, 6), grad.reshape(4, 6)
    expected = params.astype(np.float64)
    state = rule.init(params.size)
    if state:
        state = {"velocity": np.zeros(params.shape, np.float32)}
    for _ in range(2):
        rule.update(params, grad, state)
    velocity = grad if not state else grad * (1 + 0.9)
    expected = expected - 0.1 * grad - 0.1 * velocity if state else expected - 0.2 * grad
    assert params.dtype == dtype
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)


def test_adagrad_by_hand():
    # lr 0.1; the third coordinate never sees a gradient (eps only guards its 0/0)
    # acc1 = [9, 16, 0]   step1 = 0.1 * [3/3, 4/4, 0] = [0.1, 0.1, 0]     p1 = [0.9, -2.1, 0.5]
    # acc2 = [25, 25, 0]  step2 = 0.1 * [4/5, -3/5, 0] = [0.08, -0.06, 0] p2 = [0.82, -2.04, 0.5]
    grads = [[3.0, 4.0, 0.0], [4.0, -3.0, 0.0]]
    (p1, p2), state = run(optim.adagrad(0.1), [1.0, -2.0, 0.5], grads)
    np.testing.assert_allclose(p1, [0.9, -2.1, 0.5], rtol=1e-6)
    np.testing.assert_allclose(p2, [0.82, -2.04, 0.5], rtol=1e-6)
    np.testing.assert_array_equal(state["sum_sq"], [25.0, 25.0, 0.0])


def test_adam_by_hand():
    # lr 0.1, beta1 0.9, beta2 0.999; g1 = [1, -4], g2 = [0, -4]
    # step 1: m = [0.1, -0.4], v = [0.001, 0.016]; m_hat = [1, -4], v_hat = [1, 16]
    #         step = 0.1 * [1/1, -4/4] = [0.1, -0.1]                       p1 = [0.9, -1.9]
    # step 2: m = 0.9 m + 0.1 g2 = [0.09, -0.76]; v = 0.999 v + 0.001 g2^2 = [0.000999, 0.031984]
    #         m_hat = m / 0.19 = [9/19, -4]; v_hat = v / 0.001999 = [999/1999, 16]
    #         coordinate 0: (9/19) / sqrt(999/1999) = 0.4736842 / 0.7069299 = 0.6700583
    #         p2 = [0.9 - 0.06700583, -1.9 + 0.1] = [0.83299417, -1.8]
    (p1, p2), state = run(optim.adam(0.1), [1.0, -2.0], [[1.0, -4.0], [0.0, -4.0]])
    np.testing.assert_allclose(p1, [0.9, -1.9], rtol=1e-6)
    np.testing.assert_allclose(p2, [0.83299417, -1.8], rtol=1e-6)
    np.testing.assert_allclose(state["m"], [0.09, -0.76], rtol=1e-6)
    np.testing.assert_allclose(state["v"], [0.000999, 0.031984], rtol=1e-6)
    assert state["t"].shape == () and state["t"].dtype == np.int64 and int(state["t"]) == 2


def _reference(name: str, params: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """AdaGrad's or Adam's steps (lr 0.1, default hyperparameters) on whole vectors in
    float64, written from the formulas."""
    p, acc, m, v = (params.astype(np.float64), *(np.zeros(params.shape) for _ in range(3)))
    for t, g in enumerate(grads, start=1):
        if name == "adagrad":
            acc += g * g
            p -= 0.1 * g / (np.sqrt(acc) + 1e-8)
        else:
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            p -= 0.1 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return p


@pytest.mark.parametrize("layout", ["float32", "strided", "2-d", "float64 grad on float32 params"])
@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_adagrad_and_adam_in_blocks_match_the_formula(name, layout, monkeypatch):
    """AdaGrad and Adam go through a shard's slice a cache-sized block at a time (here 7
    elements, so 50 elements make whole blocks and a partial last one): every block, the last
    one too, gets the formula's step, in the caller's array, for every layout."""
    monkeypatch.setattr(optim_module, "BLOCK", 7)
    rng = np.random.default_rng(4)
    size = 100 if layout == "strided" else 50
    params = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size) for _ in range(3)]
    grads = [g.astype(np.float64 if "float64" in layout else np.float32) for g in grads]
    if layout == "strided":
        params, grads = params[::2], [g[::2] for g in grads]
    elif layout == "2-d":
        params, grads = params.reshape(5, 10), [g.reshape(5, 10) for g in grads]
    expected = _reference(name, params, grads)
    rule = make(name, 0.1)
    state = {k: a.reshape(params.shape) if a.ndim else a for k, a in rule.init(params.size).items()}
    for g in grads:
        rule.update(params, g, state)
    assert params.dtype == np.float32
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_is_in_place(name):
    rule = make(name, 0.1)
    params = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    grad = np.array([0.5, 1.0, -1.0], dtype=np.float32)
    state = rule.init(3)
    arrays_before = {k: v for k, v in state.items()}
    grad_before = grad.copy()
    assert rule.update(params, grad, state) is None
    assert params.dtype == np.float32
    assert not np.array_equal(params, [1.0, -2.0, 0.5])
    np.testing.assert_array_equal(grad, grad_before)  # the gradient is left alone
    for key, arr in arrays_before.items():
        assert state[key] is arr  # same arrays, updated in place
    for arr in state.values():
        assert arr.dtype in (np.float32, np.int64)


def test_base_rules_ignore_staleness_but_honour_rate_scale():
    (fresh,), _ = run(optim.sgd(0.1), [0.0, 0.0], [[1.0, -2.0]])
    (stale,), _ = run(optim.sgd(0.1), [0.0, 0.0], [[1.0, -2.0]], staleness=7)
    (half,), _ = run(optim.sgd(0.1), [0.0, 0.0], [[1.0, -2.0]], rate_scale=0.5)
    np.testing.assert_allclose(fresh, [-0.1, 0.2], rtol=1e-6)
    np.testing.assert_array_equal(stale, fresh)
    np.testing.assert_allclose(half, [-0.05, 0.1], rtol=1e-6)


@pytest.mark.parametrize(
    "staleness, expected",
    [
        (0, [-0.1, 0.2]),  # staleness 0 and 1: the plain sgd step
        (1, [-0.1, 0.2]),
        (4, [-0.025, 0.05]),  # a quarter step
    ],
)
def test_staleness_aware_sgd_divides_the_rate(staleness, expected):
    rule = optim.staleness_aware(optim.sgd(0.1))
    assert rule.name == "staleness_aware_sgd" and rule.learning_rate == 0.1
    (p,), _ = run(rule, [0.0, 0.0], [[1.0, -2.0]], staleness=staleness)
    np.testing.assert_allclose(p, expected, rtol=1e-6)


def test_staleness_aware_combines_with_rate_scale_and_stateful_rules():
    # sgd: 0.1 * 0.5 / 2 = 0.025 per unit of gradient
    (p,), _ = run(make("staleness_aware_sgd", 0.1), [0.0], [[2.0]], staleness=2, rate_scale=0.5)
    np.testing.assert_allclose(p, [-0.05], rtol=1e-6)
    # adagrad, staleness 2: acc = [9, 16], step = (0.1 / 2) * [3/3, 4/4] = [0.05, 0.05]
    (p,), state = run(make("staleness_aware_adagrad", 0.1), [1.0, -2.0], [[3.0, 4.0]], staleness=2)
    np.testing.assert_allclose(p, [0.95, -2.05], rtol=1e-6)
    assert set(state) == {"sum_sq"}  # the inner rule's state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_survives_savez_without_pickle(name):
    rule = make(name, 0.05)
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(3, 5)).astype(np.float32)
    params = rng.normal(size=5).astype(np.float32)
    state = rule.init(5)
    rule.update(params, grads[0], state, staleness=3)
    buffer = io.BytesIO()
    np.savez(buffer, **state)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as saved:
        loaded = {key: saved[key] for key in saved.files}
    assert sorted(loaded) == sorted(state)
    for key, arr in state.items():
        assert loaded[key].dtype == arr.dtype and loaded[key].shape == arr.shape
        np.testing.assert_array_equal(loaded[key], arr)
    # carrying on from the reloaded state matches carrying on from the original
    a, b = params.copy(), params.copy()
    for g in grads[1:]:
        rule.update(a, g, state, staleness=3)
        rule.update(b, g, loaded, staleness=3)
    np.testing.assert_array_equal(a, b)


def test_init_sizes_and_errors():
    assert optim.adam(0.1).init(4)["m"].shape == (4,)
    with pytest.raises(ValueError, match="size must be an int >= 0"):
        optim.adam(0.1).init(-1)
    with pytest.raises(ValueError, match="grad must have the shape of params"):
        optim.sgd(0.1).update(np.zeros(3, np.float32), np.zeros(4, np.float32), {})


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: make("rmsprop", 0.1), ValueError, r"one of sgd, momentum.*got 'rmsprop'"),
        (lambda: make("SGD", 0.1), ValueError, r"got 'SGD'"),
        (lambda: make("sgd", 0.0), ValueError, r"learning_rate must be a finite number > 0, got 0"),
        (lambda: make("adam", -1), ValueError, r"learning_rate must be .*> 0"),
        (lambda: make("sgd", float("nan")), ValueError, r"learning_rate .* got nan"),
        (lambda: make("sgd", float("inf")), ValueError, r"learning_rate"),
        (lambda: make("sgd", "0.1"), TypeError, r"learning_rate must be a real number, got str"),
        (lambda: make("sgd", True), TypeError, r"learning_rate"),
        (lambda: make("sgd", 0.1, momentum=0.9), TypeError, r"unknown option.*'momentum'.*none"),
        (lambda: make("momentum", 0.1, momentum=1.0), ValueError, r"momentum must be .*< 1"),
        (lambda: make("adam", 0.1, beta2=-0.1), ValueError, r"beta2 must be"),
        (lambda: make("adagrad", 0.1, eps=0), ValueError, r"eps must be a finite number > 0"),
        (
            lambda: optim.staleness_aware(optim.staleness_aware(optim.sgd(0.1))),
            TypeError,
            r"not already staleness-aware",
        ),
        (lambda: from_config({"learning_rate": 0.1}), ValueError, r"'name' and 'learning_rate'"),
    ],
)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_config_round_trip(name):
    rule = make(name, 0.05)
    config = json.loads(json.dumps(rule.get_config()))
    assert config["name"] == name and config["learning_rate"] == 0.05
    rebuilt = from_config(config)
    assert rebuilt == rule and type(rebuilt) is type(rule) and rebuilt.name == name
    assert hash(rebuilt) == hash(rule)


def test_config_keeps_hyperparameters():
    rule = make("staleness_aware_adam", 0.01, beta1=0.8, eps=1e-6)
    assert rule.get_config() == {
        "name": "staleness_aware_adam",
        "learning_rate": 0.01,
        "beta1": 0.8,
        "beta2": 0.999,
        "eps": 1e-6,
    }
    assert from_config(rule.get_config()) == rule
    assert make("adam", 0.01) != make("adam", 0.02)
    assert OPTIMIZERS == (
        "sgd",
        "momentum",
        "adagrad",
        "adam",
        "staleness_aware_sgd",
        "staleness_aware_momentum",
        "staleness_aware_adagrad",
        "staleness_aware_adam",
    )
