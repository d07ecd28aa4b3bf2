"""The sparse-model protocol, its three models, per-row update rules and the serial loop."""

from __future__ import annotations

import numpy as np
import pytest

from downpour_dask.core import optim
from downpour_dask.core.rows import RowState
from downpour_dask.core.sparse import (
    INIT_BLOCK,
    LOOKUP_SPAN,
    SparseBatch,
    TableSpec,
    all_unique,
    check_batch,
    check_sparse_model,
    positions,
    scatter_sum,
    table_rows,
    unique_rows,
)
from downpour_dask.core.sparse_models import (
    EmbeddingMLP,
    FactorizationMachine,
    SparseLogisticRegression,
)
from downpour_dask.core.sparse_serial import SparseState, serial_train

MODELS = [
    lambda: SparseLogisticRegression(50, 3, n_numeric=2),
    lambda: FactorizationMachine(50, 3, n_factors=4, n_numeric=2, init_scale=0.3),
    lambda: EmbeddingMLP(50, 3, n_numeric=2, dim=3, hidden=(5,), init_scale=0.3),
    lambda: EmbeddingMLP(50, 3, n_numeric=2, dim=2, hidden=(), init_scale=0.3),
]


def batch(n=16, seed=0, n_rows=50, fields=3, numeric=2):
    rng = np.random.default_rng(seed)
    return SparseBatch(
        rng.normal(size=(n, numeric)).astype(np.float32),
        rng.integers(0, n_rows, (n, fields)),
        rng.integers(0, 2, n),
    )


@pytest.mark.parametrize("make", MODELS)
def test_gradients_match_finite_differences(make):
    model = make()
    check_sparse_model(model)
    b = batch()
    (ids,) = model.touched(b)
    assert np.array_equal(ids, np.unique(b.ids))
    rng = np.random.default_rng(1)
    dense = model.init_dense(rng).astype(np.float64) + rng.normal(0, 0.1, model.n_dense)
    values = table_rows(model.tables[0], 0, 0, model.tables[0].n_rows, 3).astype(np.float64)
    values += rng.normal(0, 0.2, values.shape)
    rows = [(ids, values[ids])]
    loss, grad, ((gids, row_grad),) = model.loss_and_grad(dense, rows, b)
    assert np.array_equal(gids, ids) and row_grad.shape == (len(ids), model.tables[0].width)
    eps = 1e-6
    for i in range(model.n_dense):
        d = np.zeros_like(dense)
        d[i] = eps
        up = model.loss_and_grad(dense + d, rows, b)[0]
        down = model.loss_and_grad(dense - d, rows, b)[0]
        assert (up - down) / (2 * eps) == pytest.approx(grad[i], abs=1e-6)
    for r in range(len(ids)):
        for c in range(values.shape[1]):
            bumped = [v.copy() for v in (values[ids], values[ids])]
            bumped[0][r, c] += eps
            bumped[1][r, c] -= eps
            up = model.loss_and_grad(dense, [(ids, bumped[0])], b)[0]
            down = model.loss_and_grad(dense, [(ids, bumped[1])], b)[0]
            assert (up - down) / (2 * eps) == pytest.approx(row_grad[r, c], abs=1e-6)


def test_check_sparse_model_names_every_problem():
    class Half:
        n_dense = 0
        tables = (TableSpec(0, 4),)
        n_numeric, n_fields, is_classifier = 1, 2, True
        init_dense = touched = loss_and_grad = predict_proba = staticmethod(lambda *a: None)

    with pytest.raises(TypeError, match=r"n_dense \(must be an int >= 1.*tables\[0\]"):
        check_sparse_model(Half())
    with pytest.raises(TypeError, match="missing or invalid n_dense, tables"):
        check_sparse_model(object())


def test_check_batch_refuses_ids_out_of_the_table():
    model = SparseLogisticRegression(50, 3, n_numeric=2)
    good = batch()
    assert check_batch(model, good).ids.dtype == np.int64
    with pytest.raises(ValueError, match=r"row ids in \[0, 50\)"):
        check_batch(model, good._replace(ids=good.ids + 50))
    with pytest.raises(ValueError, match="numeric must have shape"):
        check_batch(model, good._replace(numeric=good.numeric[:, :1]))


def test_table_rows_are_the_same_whatever_range_is_asked():
    spec = TableSpec(3 * INIT_BLOCK + 5, 2, 0.1)
    whole = table_rows(spec, 1, 0, spec.n_rows, seed=7)
    cut = INIT_BLOCK + 17
    parts = [table_rows(spec, 1, 0, cut, 7), table_rows(spec, 1, cut, spec.n_rows, 7)]
    parts = np.concatenate(parts)
    assert np.array_equal(whole, parts)
    assert not np.array_equal(whole, table_rows(spec, 0, 0, spec.n_rows, 7))  # tables differ
    assert np.std(whole) == pytest.approx(0.1, rel=0.05)


def test_sparse_adagrad_equals_dense_adagrad_on_the_touched_rows():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(40, 3)).astype(np.float32)
    rule = optim.adagrad(0.1)
    sparse = RowState(values.copy(), 0, rule)
    dense, state = values.reshape(-1).copy(), rule.init(values.size)
    for step in range(5):
        ids = np.unique(rng.integers(0, 40, 8))
        grads = rng.normal(size=(len(ids), 3)).astype(np.float32)
        sparse.apply(ids, grads)
        full = np.zeros((40, 3), np.float32)
        full[ids] = grads
        rule.update(dense, full.reshape(-1), state)
        assert np.allclose(sparse.values.reshape(-1), dense, rtol=1e-6, atol=1e-7), step
        assert np.allclose(sparse.state["sum_sq"].reshape(-1), state["sum_sq"])


def test_untouched_rows_keep_values_state_and_version_and_bad_pushes_change_nothing():
    rule = optim.staleness_aware(optim.adagrad(0.1))
    values = np.arange(30, dtype=np.float32).reshape(10, 3)
    block = RowState(values.copy(), 100, rule)
    block.apply(np.array([101, 105]), np.ones((2, 3), np.float32), staleness=2)
    untouched = [i for i in range(10) if i not in (1, 5)]
    assert np.array_equal(block.values[untouched], values[untouched])
    assert not block.state["sum_sq"][untouched].any()
    assert block.versions.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    before = (block.values.copy(), block.state["sum_sq"].copy(), block.versions.copy())
    with pytest.raises(ValueError, match=r"1 row id\(s\) out of this block's range \[100, 110\)"):
        block.apply(np.array([102, 110]), np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="row gradients must have shape"):
        block.apply(np.array([102]), np.ones((2, 3), np.float32))
    after = (block.values, block.state["sum_sq"], block.versions)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_adam_is_refused_for_tables():
    with pytest.raises(ValueError, match="not per coordinate.*use sgd, momentum, adagrad"):
        RowState(np.zeros((3, 2), np.float32), 0, optim.adam(0.1))


@pytest.mark.parametrize("make", MODELS[:3])
def test_serial_loop_learns_a_hashed_click_signal(make):
    model = make()
    rng = np.random.default_rng(0)
    effect = rng.normal(0, 2, 50)
    batches = []
    for _ in range(150):
        ids = rng.integers(0, 50, (32, 3))
        p = 1 / (1 + np.exp(-effect[ids].sum(axis=1)))
        batches.append(SparseBatch(np.zeros((32, 2), np.float32), ids, (rng.random(32) < p) * 1))
    state, losses = serial_train(model, batches, optim.adagrad(0.1), seed=0)
    assert np.mean(losses[-30:]) < np.mean(losses[:10]) - 0.1
    again, losses2 = serial_train(model, batches, optim.adagrad(0.1), seed=0)
    assert losses == losses2 and isinstance(again, SparseState)


ID_SETS = {
    "batch-like": np.random.default_rng(1).integers(0, 1 << 18, (512, 26)),
    "dense range": np.random.default_rng(2).integers(0, 300, (64, 3)),
    "huge range": np.random.default_rng(3).integers(0, 1 << 40, (64, 3)),
    "one id": np.array([[7]]),
}


@pytest.mark.parametrize("name", sorted(ID_SETS))
def test_the_row_helpers_agree_with_numpys_own(name):
    """unique_rows, positions and scatter_sum are the sparse step's hot spots, rewritten for
    speed: they must give what np.unique, np.searchsorted and np.add.at give."""
    ids = ID_SETS[name]
    rows = unique_rows(ids)
    assert rows.dtype == np.int64 and np.array_equal(rows, np.unique(ids))
    at = positions(rows, ids)
    assert at.shape == ids.shape and np.array_equal(at, np.searchsorted(rows, ids))
    for width in (1, 8):
        values = np.random.default_rng(width).normal(size=(ids.size, width)).astype(np.float32)
        expected = np.zeros((len(rows), width), np.float32)
        np.add.at(expected, at.ravel(), values)
        summed = scatter_sum(at.ravel(), values, len(rows))
        assert summed.dtype == np.float32 and summed.shape == expected.shape
        np.testing.assert_allclose(summed, expected, rtol=1e-5, atol=1e-5)
    assert all_unique(rows) and all_unique(rows[::-1])
    assert all_unique(ids.ravel()) == (len(rows) == ids.size)


def test_unique_rows_of_nothing_and_scatter_sum_into_untouched_rows():
    assert unique_rows(np.array([], np.int64)).shape == (0,)
    assert positions(np.array([], np.int64), np.array([], np.int64)).shape == (0,)
    summed = scatter_sum(np.array([2, 2, 0]), np.ones((3, 2), np.float32), 4)
    assert summed.tolist() == [[1, 1], [0, 0], [2, 2], [0, 0]]
    assert not all_unique(np.array([3, 1, 3])) and not all_unique(np.array([1, 2, 2]))


@pytest.mark.parametrize("span", [10, LOOKUP_SPAN * 100])  # the lookup table, a binary search
def test_positions_refuses_ids_that_are_not_among_the_rows(span):
    rows = np.array([0, 5, span])
    for missing in (3, span + 1, -1):
        message = f"1 of 3 ids are not among the row ids, e.g. {missing}"
        with pytest.raises(ValueError, match=message):
            positions(rows, np.array([5, missing, 0]))
    with pytest.raises(ValueError, match="2 ids looked up among no row ids"):
        positions(np.array([], np.int64), np.array([1, 2]))
