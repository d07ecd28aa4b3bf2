"""Models: gradients against finite differences of an independent float64 reference loss,
the ``out=`` contract, predictions and scores on hand-checkable cases, data validation,
configs, pickling and initialisation."""

from __future__ import annotations

import importlib
import json
import pickle

import numpy as np
import pytest

from downpour_dask.core import dense, protocol, validation
from downpour_dask.core import model as model_module
from downpour_dask.core import models as core_models
from downpour_dask.core.models import (
    MLP,
    LinearRegression,
    LogisticRegression,
    SoftmaxRegression,
    from_config,
)

CASES = {
    "linear": lambda: LinearRegression(4),
    "linear-3out-l2": lambda: LinearRegression(4, 3, l2=0.3),
    "logistic": lambda: LogisticRegression(4),
    "logistic-l2": lambda: LogisticRegression(4, l2=0.3),
    "softmax": lambda: SoftmaxRegression(4, 3),
    "softmax-l2": lambda: SoftmaxRegression(4, 3, l2=0.3),
    "mlp-relu-softmax": lambda: MLP(4, (5,), 3),
    "mlp-tanh-softmax-l2": lambda: MLP(4, (5, 3), 3, activation="tanh", l2=0.3),
    "mlp-relu-linear-l2": lambda: MLP(4, (6, 5, 3), 2, output="linear", l2=0.3),
    "mlp-tanh-linear-1out": lambda: MLP(4, (5,), 1, activation="tanh", output="linear"),
}


def make_data(model, n=11, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, model.n_inputs)).astype(np.float32)
    if model.is_classifier:
        y = rng.integers(0, model.n_classes, n)
    elif model.n_outputs == 1:
        y = rng.normal(size=n).astype(np.float32)
    else:
        y = rng.normal(size=(n, model.n_outputs)).astype(np.float32)
    return X, y


def make_params(model, seed=1):
    """Initial parameters plus noise, so biases are non-zero and every term matters."""
    params = model.init(np.random.default_rng(seed))
    return params + np.random.default_rng(seed + 1).normal(0, 0.2, params.size).astype(np.float32)


def reference_loss(model, params, X, y):
    """The documented objective, written out plainly in float64 (independent of the engine)."""
    views = model.layout.views(np.asarray(params, np.float64))
    names = model.layout.names
    layers = [(views[w], views[b]) for w, b in zip(names[::2], names[1::2], strict=True)]
    a = np.asarray(X, np.float64)
    for i, (W, b) in enumerate(layers):
        z = a @ W + b
        if i < len(layers) - 1:
            a = np.maximum(z, 0) if model.activation == "relu" else np.tanh(z)
    if isinstance(model, LogisticRegression):
        p = 1 / (1 + np.exp(-z[:, 0]))
        data = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    elif model.is_classifier:
        log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        data = -np.mean(log_softmax[np.arange(len(y)), y])
    else:
        data = 0.5 * np.mean(((z - np.reshape(y, z.shape)) ** 2).sum(axis=1))
    return data + 0.5 * model.l2 * sum((W**2).sum() for W, _ in layers)


@pytest.mark.parametrize("case", CASES)
def test_loss_matches_reference(case):
    model = CASES[case]()
    X, y = make_data(model)
    params = make_params(model)
    expected = reference_loss(model, params, X, y)
    loss32, _ = model.loss_and_grad(params, X, y)
    assert loss32 == pytest.approx(expected, rel=1e-5)
    assert model.loss(params, X, y) == pytest.approx(expected, rel=1e-5)
    loss64, _ = model.loss_and_grad(params.astype(np.float64), X.astype(np.float64), y)
    assert loss64 == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_gradient_matches_finite_differences(case):
    model = CASES[case]()
    X, y = make_data(model)
    p64 = make_params(model).astype(np.float64)
    h = 1e-6
    numeric = np.empty_like(p64)
    for i in range(p64.size):
        step = np.zeros_like(p64)
        step[i] = h
        numeric[i] = (
            reference_loss(model, p64 + step, X, y) - reference_loss(model, p64 - step, X, y)
        ) / (2 * h)
    _, grad64 = model.loss_and_grad(p64, X.astype(np.float64), y)
    assert grad64.dtype == np.float64
    np.testing.assert_allclose(grad64, numeric, rtol=1e-6, atol=1e-8)
    _, grad32 = model.loss_and_grad(p64.astype(np.float32), X, y)
    assert grad32.dtype == np.float32 and grad32.shape == (model.layout.size,)
    np.testing.assert_allclose(grad32, numeric, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_a_batch_of_several_gradient_blocks_gives_the_whole_batchs_loss_and_gradient(
    case, monkeypatch
):
    """A large batch's gradient is summed block by block (``GRAD_BLOCK_BYTES`` of features, at
    least ``_CHUNK`` rows): 5,000 rows in blocks of 2,048, 2,048 and 904 give the loss and the
    (scaled) gradient of the batch taken whole."""
    model = CASES[case]()
    X, y = make_data(model, n=5000)
    p64 = make_params(model).astype(np.float64)
    X64 = X.astype(np.float64)
    monkeypatch.setattr(model_module, "GRAD_BLOCK_BYTES", 2**40)  # the whole batch at once
    whole_loss, whole = model.loss_and_grad(p64, X64, y, scale=0.5)
    whole32 = model.loss_and_grad(p64.astype(np.float32), X, y)[1]
    monkeypatch.setattr(model_module, "GRAD_BLOCK_BYTES", 1)  # blocks of _CHUNK rows
    assert model_module._CHUNK == 2048
    loss, grad = model.loss_and_grad(p64, X64, y, scale=0.5)
    assert loss == pytest.approx(whole_loss, rel=1e-12)
    assert loss == pytest.approx(reference_loss(model, p64, X, y), rel=1e-12)
    np.testing.assert_allclose(grad, whole, rtol=1e-10, atol=1e-13)
    out = np.empty(p64.size, np.float32)
    assert model.loss_and_grad(p64.astype(np.float32), X, y, out=out)[1] is out
    np.testing.assert_allclose(out, whole32, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["linear-3out-l2", "logistic-l2", "mlp-tanh-softmax-l2"])
def test_l2_adds_l2_times_weights_and_spares_biases(case):
    model = CASES[case]()
    plain = from_config({**model.get_config(), "l2": 0.0})
    X, y = make_data(model)
    params = make_params(model)
    loss, grad = model.loss_and_grad(params, X, y)
    plain_loss, plain_grad = plain.loss_and_grad(params, X, y)
    views, diff = model.layout.views(params), model.layout.views(grad - plain_grad)
    penalty = 0.0
    for name in model.layout.names:
        if name.startswith("W"):
            np.testing.assert_allclose(diff[name], 0.3 * views[name], rtol=1e-4, atol=1e-6)
            penalty += 0.5 * 0.3 * float((views[name].astype(np.float64) ** 2).sum())
        else:
            np.testing.assert_allclose(diff[name], 0.0, atol=1e-6)
    assert loss - plain_loss == pytest.approx(penalty, rel=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_out_is_filled_and_returned_and_params_untouched(case):
    model = CASES[case]()
    X, y = make_data(model)
    params = make_params(model)
    before = params.copy()
    loss, fresh = model.loss_and_grad(params, X, y)
    out = np.full(model.layout.size, np.nan, dtype=np.float32)
    loss_out, returned = model.loss_and_grad(params, X, y, out=out)
    assert returned is out and loss_out == loss
    np.testing.assert_array_equal(out, fresh)
    np.testing.assert_array_equal(params, before)


@pytest.mark.parametrize("case", CASES)
def test_scale_multiplies_the_gradient_and_leaves_the_loss(case):
    """A replica asks for ``alpha * grad`` so that its local step is one pass; the penalty's
    gradient is scaled too, the reported loss is not."""
    model = CASES[case]()
    X, y = make_data(model)
    params = make_params(model)
    loss, grad = model.loss_and_grad(params, X, y)
    scaled_loss, scaled = model.loss_and_grad(params, X, y, scale=0.05)
    assert scaled_loss == loss
    np.testing.assert_allclose(scaled, 0.05 * grad, rtol=1e-5, atol=1e-8)


def test_out_must_fit():
    model = MLP(4, (5,), 3)
    X, y = make_data(model)
    params = model.init(np.random.default_rng(0))
    for bad in (
        np.empty(3, np.float32),
        np.empty(model.layout.size, np.float64),
        np.empty(2 * model.layout.size, np.float32)[::2],
        params,
    ):
        with pytest.raises(ValueError, match="out must be a contiguous float32 vector"):
            model.loss_and_grad(params, X, y, out=bad)
    with pytest.raises(ValueError, match=r"X must have shape \(n_samples >= 1, 4\)"):
        model.loss_and_grad(params, X[:, :3], y)


def test_workspaces_are_reused_across_batch_sizes():
    """A model that saw a big batch must still be right on smaller and larger ones."""
    model = MLP(4, (6, 5), 3, activation="tanh", l2=0.1)
    X, y = make_data(model, n=40)
    params = make_params(model)
    for n in (40, 7, 1, 23, 40):
        loss, grad = model.loss_and_grad(params, X[:n], y[:n])
        fresh = MLP(4, (6, 5), 3, activation="tanh", l2=0.1)
        loss_f, grad_f = fresh.loss_and_grad(params, X[:n], y[:n])
        assert loss == loss_f
        np.testing.assert_array_equal(grad, grad_f)


def test_regression_accepts_column_targets():
    model = LinearRegression(4)
    X, y = make_data(model)
    params = make_params(model)
    loss, grad = model.loss_and_grad(params, X, y)
    loss_col, grad_col = model.loss_and_grad(params, X, y[:, None])
    assert loss == loss_col
    np.testing.assert_array_equal(grad, grad_col)


@pytest.mark.parametrize("case", ["softmax-l2", "logistic", "mlp-relu-linear-l2"])
def test_evaluation_in_row_blocks_matches_one_block(case, monkeypatch):
    model = CASES[case]()
    X, y = make_data(model, n=10)
    params = make_params(model)
    loss, _ = model.loss_and_grad(params, X, y)
    pred = model.predict(params, X)
    monkeypatch.setattr(model_module, "_CHUNK", 3)
    assert model.loss(params, X, y) == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(model.predict(params, X), pred, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_loss_and_score_in_one_pass_equal_loss_and_score(case, monkeypatch):
    """A fit's evaluations take both from one forward pass (across row blocks too)."""
    model = CASES[case]()
    X, y = make_data(model, n=10)
    params = make_params(model)
    monkeypatch.setattr(model_module, "_CHUNK", 3)
    loss, score = model.loss_and_score(params, X, y)
    assert loss == pytest.approx(reference_loss(model, params, X, y), rel=1e-5)
    assert score == model.score(params, X, y)
    assert protocol.loss_and_score(model, params, X, y) == (loss, score)


def test_a_model_without_loss_and_score_is_evaluated_by_its_loss_and_score():
    class Plain:  # a user's model: the protocol's methods only
        is_classifier, n_params = True, 1

        def loss(self, params, X, y):
            return 0.25

        def score(self, params, X, y):
            return 0.5

    assert protocol.loss_and_score(Plain(), np.zeros(1), np.zeros((2, 1)), np.zeros(2)) == (
        0.25, 0.5,
    )  # fmt: skip


def test_softmax_predict_proba_and_accuracy_by_hand():
    model = SoftmaxRegression(3, 3)
    params = model.layout.zeros()
    model.layout.views(params)["W"][:] = np.eye(3)  # logits = X
    X = np.array([[1, 0, 0], [0, 2, 1], [0, 0, 5], [3, 1, 0]], dtype=np.float32)
    y = np.array([0, 1, 1, 0])
    pred = model.predict(params, X)
    assert pred.dtype == np.int64
    np.testing.assert_array_equal(pred, [0, 1, 2, 0])
    assert model.score(params, X, y) == 0.75  # 3 of 4 right
    proba = model.predict_proba(params, X)
    assert proba.shape == (4, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    # softmax([1, 0, 0])[0] = e / (e + 2)
    assert proba[0, 0] == pytest.approx(0.5761168847658291, rel=1e-6)


def test_logistic_predict_proba_and_accuracy_by_hand():
    model = LogisticRegression(2)
    params = model.layout.zeros()
    views = model.layout.views(params)
    views["W"][:, 0] = [1.0, -1.0]
    views["b"][:] = 0.5
    X = np.array([[2, 1], [0, 3], [1, 1]], dtype=np.float32)  # z = [1.5, -2.5, 0.5]
    np.testing.assert_array_equal(model.predict(params, X), [1, 0, 1])
    assert model.score(params, X, np.array([1, 1, 1])) == pytest.approx(2 / 3)
    proba = model.predict_proba(params, X)
    assert proba.shape == (3, 2)
    assert proba[0, 1] == pytest.approx(0.8175744761936437, rel=1e-6)  # 1 / (1 + e^-1.5)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softplus_matches_logaddexp_down_to_sqrt_tiny_and_never_returns_a_subnormal(dtype):
    """From underflow to overflow; below ``sqrt(tiny)`` (log_floor) it returns ``sqrt(tiny)``:
    a subnormal result (float32's softplus(-88)) would cost many times a normal one."""
    edges = [-1e4, -800.0, -200.0, -88.0, -20.0, -1e-7, 0.0, 1e-7, 20.0, 88.0, 200.0, 1e4]
    z = np.concatenate([edges, np.linspace(-50, 50, 1001)]).astype(dtype).reshape(-1, 1)
    out, tmp = np.empty_like(z), np.empty_like(z)
    got = dense.softplus(z, out=out, tmp=tmp)
    assert got is out and np.isfinite(got).all()
    floor = np.exp(dense.log_floor(np.dtype(dtype)))
    expected = np.maximum(np.logaddexp(0, z.astype(np.float64)), floor).astype(dtype)
    np.testing.assert_allclose(got, expected, rtol=4 * np.finfo(dtype).eps, atol=0)
    assert not ((got != 0) & (np.abs(got) < np.finfo(dtype).tiny)).any()


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_confident_rows_leave_no_subnormal_number_in_the_output_gradient(kind):
    """A fitted model's wrong-class probabilities fall below float32's normal range; as
    subnormal numbers they would slow every product of the backward pass (``exp_flushed``).
    The output gradient holds exact zeros there instead, and equals float64's to 1e-18."""
    margins = np.array([0.0, 5.0, 50.0, 90.0, 95.0, 100.0, 120.0])  # 88 and up underflow
    if kind == "softmax":  # class 0 is right by the margin, class 2 by twice it
        z64 = np.stack([margins, np.zeros_like(margins), -margins], axis=1)
        y = np.zeros(len(margins), np.int64)
        p = np.exp(z64 - z64.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        expected = p - np.eye(3)[y]
        loss = -np.log(p[:, 0]).sum()
    else:  # label 0, sigmoid output: right by the margin
        z64 = -margins.reshape(-1, 1)
        y = np.zeros(len(margins), np.int64)
        expected = 1 / (1 + np.exp(-z64))
        loss = np.logaddexp(0, z64).sum()
    z = z64.astype(np.float32)
    ws = dense.Workspace([z.shape[1]], len(z), np.dtype(np.float32), 1)
    assert dense.output_loss(kind, z, y, ws, delta=True) == pytest.approx(loss, rel=1e-6)
    subnormal = (z != 0) & (np.abs(z) < np.finfo(np.float32).tiny)
    assert not subnormal.any(), z[subnormal]
    np.testing.assert_allclose(z, expected, rtol=1e-6, atol=1e-18)


@pytest.mark.parametrize(("n", "k"), [(11, 2), (11, 3), (40, 10), (256, 10), (64, 64)])
def test_the_softmax_loss_and_gradient_match_float64_by_either_way_of_taking_row_maxima(n, k):
    """Few columns take each row's maximum column by column, many take numpy's reduction
    (``row_max``); the loss and its gradient are the same either way."""
    rng = np.random.default_rng(n * k)
    z64, y = rng.normal(0, 4, (n, k)), rng.integers(0, k, n)
    p = np.exp(z64 - z64.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ws = dense.Workspace([k], n, np.dtype(np.float32), 1)
    maxima = dense.row_max(z64.astype(np.float32), np.empty((n, 1), np.float32))
    np.testing.assert_array_equal(maxima[:, 0], z64.astype(np.float32).max(axis=1))
    z = ws.acts[0][:n]
    z[...] = z64
    loss = dense.output_loss("softmax", z, y, ws, delta=True)
    assert loss == pytest.approx(-np.log(p[np.arange(n), y]).sum(), rel=1e-5)
    np.testing.assert_allclose(z, p - np.eye(k)[y], atol=1e-6)


def test_the_softmax_loss_refuses_logits_it_cannot_view_flat():
    ws = dense.Workspace([3], 8, np.dtype(np.float32), 1)
    z = np.zeros((8, 6), np.float32)[:, :3]  # every other column block: not contiguous
    with pytest.raises(ValueError, match="C-contiguous"):
        dense.output_loss("softmax", z, np.zeros(8, np.int64), ws, delta=True)


def test_a_confident_models_float32_gradient_matches_its_float64_gradient():
    model = MLP(3, (4,), 3)
    params = model.init(np.random.default_rng(0)) * 40  # logits hundreds apart
    X = np.random.default_rng(1).normal(size=(64, 3)).astype(np.float32)
    y = np.argmax(model.predict_proba(params.astype(np.float64), X.astype(np.float64)), axis=1)
    y[:4] = (y[:4] + 1) % 3  # a few rows wrong, so the gradient is not all zeros
    _, grad64 = model.loss_and_grad(params.astype(np.float64), X.astype(np.float64), y)
    _, grad32 = model.loss_and_grad(params, X, y)
    np.testing.assert_allclose(grad32, grad64, rtol=1e-4, atol=1e-4 * np.abs(grad64).max())


def test_logistic_loss_and_gradient_stay_exact_for_huge_logits():
    """Logits of +-1000 overflow exp() in a naive sigmoid: loss and gradient stay finite and
    equal the stable float64 formulas (loss |z| per wrong row, gradient sigmoid - y)."""
    model = LogisticRegression(1)
    params = model.layout.zeros()
    model.layout.views(params)["W"][:] = 1000.0
    X = np.array([[1.0], [-1.0], [1.0], [-1.0]], np.float32)  # z = 1000, -1000, 1000, -1000
    y = np.array([1, 0, 0, 1])  # two right with certainty, two wrong by 1000
    loss, grad = model.loss_and_grad(params, X, y)
    assert loss == pytest.approx((0 + 0 + 1000 + 1000) / 4)
    residual = np.array([0.0, 0.0, 1.0, -1.0])  # sigmoid(z) - y
    np.testing.assert_allclose(grad, [residual @ X[:, 0] / 4, residual.sum() / 4], atol=1e-7)


def test_r2_by_hand():
    model = LinearRegression(1, 2)
    params = model.layout.zeros()
    views = model.layout.views(params)
    views["W"][:] = [[2.0, 0.0]]
    views["b"][:] = [1.0, 3.0]
    X = np.array([[0], [1], [2], [3]], dtype=np.float32)  # predictions [1, 3, 5, 7] and 3s
    y = np.array([[1, 2], [2, 4], [5, 3], [8, 3]], dtype=np.float32)
    pred = model.predict(params, X)
    assert pred.shape == (4, 2) and pred.dtype == np.float32
    # column 0: SSE = 0 + 1 + 0 + 1 = 2, mean 4, SST = 9 + 4 + 1 + 16 = 30 -> 1 - 2/30
    # column 1: SSE = 1 + 1 + 0 + 0 = 2, mean 3, SST = 1 + 1 + 0 + 0 = 2 -> 0
    assert model.score(params, X, y) == pytest.approx((1 - 2 / 30 + 0.0) / 2)
    single = LinearRegression(1)
    p1 = single.layout.zeros()
    single.layout.views(p1)["W"][:] = 2.0
    single.layout.views(p1)["b"][:] = 1.0
    assert single.predict(p1, X).shape == (4,)
    assert single.score(p1, X, y[:, 0]) == pytest.approx(1 - 2 / 30)
    # constant targets: perfect fit scores 1, anything else 0 (as scikit-learn)
    assert single.score(p1, X[:1], np.array([1.0])) == 1.0
    assert single.score(p1, X[:2], np.array([0.0, 0.0])) == 0.0


def test_predict_proba_needs_a_classifier():
    model = LinearRegression(2)
    with pytest.raises(TypeError, match="predict_proba needs a classifier"):
        model.predict_proba(model.layout.zeros(), np.zeros((1, 2), np.float32))


def test_check_data_converts():
    model = MLP(3, (4,), 3)
    X = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    Xc, yc = model.check_data(X, [2.0, 0.0])
    assert Xc.dtype == np.float32 and Xc.flags.c_contiguous
    assert yc.dtype == np.int64
    np.testing.assert_array_equal(yc, [2, 0])
    assert model.check_data(X)[1] is None
    _, yb = LogisticRegression(3).check_data(X, np.array([True, False]))
    np.testing.assert_array_equal(yb, [1, 0])
    _, yr = LinearRegression(3).check_data(X, [[1], [2]])
    assert yr.shape == (2,) and yr.dtype == np.float32
    _, yr2 = LinearRegression(3, 2).check_data(X, np.ones((2, 2), np.int64))
    assert yr2.shape == (2, 2) and yr2.dtype == np.float32


def _with(value, row, col, base=None):
    X = np.zeros((5, 4)) if base is None else base.copy()
    X[row, col] = value
    return X


CLF, REG, REG2 = MLP(4, (3,), 3), LinearRegression(4), LinearRegression(4, 2)
GOOD_X = np.zeros((5, 4))


@pytest.mark.parametrize(
    "model, X, y, exc, match",
    [
        (CLF, np.zeros(4), None, ValueError, r"X must be a 2-D array .* 1-D array of shape \(4,\)"),
        (CLF, np.zeros((0, 4)), None, ValueError, r"X is empty: got 0 samples"),
        (
            MLP(784),
            np.zeros((2, 10)),
            None,
            ValueError,
            r"X has 10 features, but MLP expects 784 features \(n_inputs\)",
        ),
        (
            CLF,
            _with(np.nan, 2, 1),
            None,
            ValueError,
            r"X contains 1 NaN or infinite value\(s\), first in row 2",
        ),
        (
            CLF,
            _with(np.inf, 3, 0, _with(-np.inf, 4, 2)),
            None,
            ValueError,
            r"2 NaN .* first in row 3",
        ),
        (CLF, _with(1e39, 1, 1), None, ValueError, r"X contains 1 NaN or infinite .*float32"),
        (
            CLF,
            [["a", "b", "c", "d"]],
            None,
            TypeError,
            r"X must contain real numbers .* got dtype <U1",
        ),
        (CLF, [[1, None, 2, 3]], None, ValueError, r"X contains 1 NaN"),  # None is missing
        (CLF, [[1, object(), 2, 3]], None, TypeError, r"X must contain real numbers"),
        (CLF, [[1, 2, 3, 4], [1, 2]], None, ValueError, r"X must be a rectangular array"),
        (CLF, GOOD_X, [0, 1, 2, 0], ValueError, r"X has 5 rows, y has 4 rows"),
        (CLF, GOOD_X, 1, ValueError, r"y has a scalar"),
        (
            CLF,
            GOOD_X,
            [0, 10, 12, 1, 10],
            ValueError,
            r"y contains labels \[10, 12\] outside the model's classes 0\.\.2",
        ),
        (CLF, GOOD_X, [0, -1, 1, 1, 2], ValueError, r"labels \[-1\] outside"),
        (LogisticRegression(4), GOOD_X, [0, 1, 2, 1, 0], ValueError, r"classes 0\.\.1"),
        (
            CLF,
            GOOD_X,
            [0, 0.5, 1, 1, 2],
            ValueError,
            r"integer class labels 0\.\.2, got .*\[0\.5\]",
        ),
        (CLF, GOOD_X, [0, np.nan, 1, 1, 2], ValueError, r"integer class labels"),
        (CLF, GOOD_X, ["a", "b", "a", "a", "b"], TypeError, r"y must contain real numbers"),
        (CLF, GOOD_X, np.eye(5, 3), ValueError, r"y must be a 1-D array of class labels.*one-hot"),
        (REG, GOOD_X, [0, np.nan, 1, 1, 2], ValueError, r"y contains 1 NaN or infinite .* row 1"),
        (
            REG,
            GOOD_X,
            np.zeros((5, 2)),
            ValueError,
            r"y has shape \(5, 2\), but LinearRegression expects 1 target.*\(n_samples,\)",
        ),
        (REG2, GOOD_X, np.zeros((5, 3)), ValueError, r"expects 2 target.*\(n_samples, 2\)"),
        (REG2, GOOD_X, np.zeros(5), ValueError, r"y has shape \(5,\), but .* expects 2"),
    ],
)
def test_check_data_errors(model, X, y, exc, match):
    with pytest.raises(exc, match=match):
        model.check_data(X, y)


def test_large_finite_features_whose_float32_sum_overflows_are_accepted():
    """The check sums the features (a NaN or infinity makes the sum non-finite); a sum that
    overflowed on finite values must not refuse them, and a NaN in a later block is still found."""
    X = np.full((20_000, 4), 3e38, np.float32)  # more rows than one block of the fallback
    X[7, 2] = -3e38
    with np.errstate(over="ignore"):
        assert not np.isfinite(X.sum())
    assert validation.all_finite(X)
    assert CLF.check_data(X)[0] is not None
    X[19_999, 3] = np.nan
    assert not validation.all_finite(X)
    with pytest.raises(ValueError, match="X contains 1 NaN .* first in row 19999"):
        CLF.check_data(X)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("order", ["C", "F"])
def test_one_non_finite_feature_anywhere_is_found(dtype, bad, order):
    """The check sums the rows by BLAS (a C-contiguous matrix) or by numpy (anything else):
    either way one NaN or infinity in the first, a middle or the last row and column shows."""
    X = np.asarray(np.random.default_rng(0).standard_normal((3000, 7)), dtype, order=order)
    assert validation.all_finite(X) and validation.all_finite(X[:, :1])
    for row, col in [(0, 0), (1234, 3), (2999, 6)]:
        bad_X = X.copy(order=order)
        bad_X[row, col] = bad
        assert not validation.all_finite(bad_X)
        assert not validation.all_finite(bad_X[:, col : col + 1])  # one column
        assert not validation.all_finite(bad_X[row])  # one row


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: MLP(0), ValueError, r"n_inputs must be >= 1, got 0"),
        (lambda: MLP(2.5), TypeError, r"n_inputs must be an int, got float"),
        (lambda: LinearRegression(True), TypeError, r"n_inputs must be an int, got bool"),
        (lambda: MLP(4, (8, 0)), ValueError, r"hidden\[1\] must be >= 1, got 0"),
        (lambda: MLP(4, "12"), TypeError, r"hidden must be a sequence"),
        (lambda: MLP(4, activation="sigmoid"), ValueError, r"activation must be one of \('relu'"),
        (lambda: MLP(4, output="sigmoid"), ValueError, r"output must be one of \('softmax'"),
        (lambda: MLP(4, n_outputs=1), ValueError, r"n_outputs must be >= 2, got 1"),
        (lambda: LinearRegression(4, 0), ValueError, r"n_outputs must be >= 1"),
        (lambda: SoftmaxRegression(4, 1), ValueError, r"n_classes must be >= 2, got 1"),
        (lambda: LogisticRegression(4, l2=-0.1), ValueError, r"l2 must be a finite number >= 0"),
        (lambda: SoftmaxRegression(4, 3, l2=float("nan")), ValueError, r"l2 must be a finite"),
        (lambda: LinearRegression(4, l2="0.1"), TypeError, r"l2 must be a real number, got str"),
    ],
)
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_structure_and_names():
    mlp = MLP(784, (256, 64), 10)
    assert mlp.layout.names == ["W0", "b0", "W1", "b1", "W2", "b2"]
    assert mlp.layout.shapes["W1"] == (256, 64) and mlp.n_classes == 10 and mlp.is_classifier
    assert MLP(4, 8).hidden == (8,) and MLP(4, np.array([3, 2])).hidden == (3, 2)
    logistic = LogisticRegression(5)
    assert (logistic.n_outputs, logistic.n_classes, logistic.layout.shapes["W"]) == (1, 2, (5, 1))
    softmax = SoftmaxRegression(5, 4)
    assert softmax.n_outputs == softmax.n_classes == 4
    regression = MLP(3, (2,), 2, output="linear")
    assert not regression.is_classifier and not hasattr(regression, "n_classes")
    assert LinearRegression(3).layout.names == ["W", "b"]


@pytest.mark.parametrize("case", CASES)
def test_config_round_trip(case):
    model = CASES[case]()
    config = json.loads(json.dumps(model.get_config()))
    assert config["type"] == type(model).__name__
    rebuilt = from_config(config)
    assert rebuilt == model and type(rebuilt) is type(model) and hash(rebuilt) == hash(model)
    assert rebuilt.layout == model.layout


def test_config_errors_and_inequality():
    with pytest.raises(ValueError, match=r"config\['type'\] must be one of .*'MLP'.*got 'CNN'"):
        from_config({"type": "CNN", "n_inputs": 3})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['depth'\]"):
        from_config({"type": "LinearRegression", "n_inputs": 3, "depth": 2})
    assert MLP(4, (5,), 3) != MLP(4, (5,), 3, l2=0.1)
    assert MLP(4, (5,), 3) != SoftmaxRegression(4, 3)


def test_pickle_drops_workspaces():
    model = MLP(784, (256,), 10, l2=1e-4)
    X, y = make_data(model, n=64)
    params = model.init(np.random.default_rng(0))
    loss, grad = model.loss_and_grad(params, X, y)
    assert model._ws  # populated: activations, deltas and the l2 scratch (~1 MB)
    blob = pickle.dumps(model)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone._ws == {} and model._ws and clone == model
    loss_c, grad_c = clone.loss_and_grad(params, X, y)
    assert loss_c == loss
    np.testing.assert_array_equal(grad_c, grad)


def test_init_is_deterministic_and_scaled():
    model = MLP(784, (256,), 10)
    a, b = model.init(np.random.default_rng(7)), model.init(np.random.default_rng(7))
    assert a.dtype == np.float32 and a.shape == (model.layout.size,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, model.init(np.random.default_rng(8)))
    views = model.layout.views(a)
    assert not views["b0"].any() and not views["b1"].any()
    assert views["W0"].std() == pytest.approx(np.sqrt(2 / 784), rel=0.05)  # He normal (ReLU)
    limit = np.sqrt(6 / (256 + 10))  # Glorot uniform output layer
    assert np.abs(views["W1"]).max() <= limit and np.abs(views["W1"]).max() > 0.9 * limit
    tanh = MLP(20, (30,), 5, activation="tanh").init(np.random.default_rng(0))
    assert np.abs(tanh[: 20 * 30]).max() <= np.sqrt(6 / 50)


def test_downpour_dask_models_is_the_core_module_with_every_public_name():
    public = importlib.import_module("downpour_dask.models")
    assert public is core_models
    for name in ("Model", "MLP", "SoftmaxRegression", "LogisticRegression", "LinearRegression"):
        assert issubclass(getattr(public, name), model_module.Model)
    assert public.from_config is from_config
    assert public.ACTIVATIONS == ("relu", "tanh") and public.OUTPUTS == ("softmax", "linear")
