"""A sparse model's whole state in one process, and the serial reference loop over it.

:class:`SparseState` holds the dense vector with its rule state and every table as a
:class:`~downpour_dask.core.rows.RowState`; :func:`serial_train` is the plain loop a run with one
replica, one shard and ``n_fetch = n_push = 1`` must equal: for each batch, gather the touched
rows, compute the loss and gradients, apply the rule to the dense vector and to those rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .optim import UpdateRule
from .params import DTYPE
from .rows import RowState
from .sparse import SparseBatch, check_sparse_model, table_rows


class SparseState:
    """Dense parameters and every table of ``model``, initialised from ``seed``.

    The dense vector comes from ``model.init_dense(np.random.default_rng(seed))`` and the tables
    from :func:`~downpour_dask.core.sparse.table_rows` with the same seed, as the shards make
    them, so a distributed run and this state start alike.
    """

    def __init__(self, model: Any, rule: UpdateRule, seed: int = 0):
        check_sparse_model(model)
        self.model, self.rule = model, rule
        self.dense = np.asarray(model.init_dense(np.random.default_rng(seed)), DTYPE).copy()
        self.dense_state = rule.init(len(self.dense))
        self.tables = [
            RowState(table_rows(spec, t, 0, spec.n_rows, seed), 0, rule)
            for t, spec in enumerate(model.tables)
        ]

    def rows(self, touched: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids, values)`` of the rows ``touched`` names, per table."""
        return [(ids, table.gather(ids)) for ids, table in zip(touched, self.tables)]

    def step(self, batch: SparseBatch) -> float:
        """One SGD step on ``batch``; the mean loss before it."""
        rows = self.rows(self.model.touched(batch))
        loss, grad, row_grads = self.model.loss_and_grad(self.dense, rows, batch)
        self.rule.update(self.dense, np.asarray(grad, DTYPE), self.dense_state)
        for table, (ids, grads) in zip(self.tables, row_grads):
            table.apply(ids, grads)
        return float(loss)

    def predict_proba(self, batch: SparseBatch) -> np.ndarray:
        """P(class 1) for each row of ``batch``."""
        return self.model.predict_proba(self.dense, self.rows(self.model.touched(batch)), batch)


def serial_train(
    model: Any, batches: Iterable[SparseBatch], rule: UpdateRule, seed: int = 0
) -> tuple[SparseState, list[float]]:
    """Train ``model`` serially on ``batches`` in order; the final state and the losses."""
    state = SparseState(model, rule, seed)
    return state, [state.step(batch) for batch in batches]
