"""Sparse models over hashed categorical features: logistic regression, a factorisation
machine and an embedding + MLP network (numpy), all through :mod:`~downpour_dask.core.sparse`'s
protocol.

Every model reads one table indexed by row ids (one id per categorical field of a row, as
:mod:`downpour_dask.data.hashing` makes them: the hashing trick puts every field in one id
space) plus a small dense vector, and returns gradients of the **mean** binary cross-entropy
for the rows the batch touched only.  Computation runs in the dtype of ``dense`` (float32
normally, float64 for finite-difference checks).

- :class:`SparseLogisticRegression`: ``z = b + x.w + sum_f t[id_f]`` (a table of width 1).
- :class:`FactorizationMachine` (Rendle, 2010): each row is ``[w, v_1..v_k]``;
  ``z = b + x.w + sum_f w_f + sum_{f<g} <v_f, v_g>``, computed in ``O(F k)`` as
  ``0.5 * sum_d ((sum_f v_fd)^2 - sum_f v_fd^2)``.
- :class:`EmbeddingMLP`: the numeric features and the fields' embeddings, concatenated, feed a
  ReLU network with a sigmoid output (the passes of :mod:`~downpour_dask.core.dense`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dense import Workspace, backward, forward, output_loss
from .params import DTYPE
from .sparse import SparseBatch, TableSpec, positions, scatter_sum, unique_rows
from .validation import require_int

Rows = Sequence[tuple[np.ndarray, np.ndarray]]
#: What ``loss_and_grad`` returns: mean loss, dense gradient, per table (ids, row gradients).
Result = tuple[float, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]


def _scale(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
        raise ValueError(f"{name} must be a number in [0, 10), got {value!r}")
    return float(value)


def _sigmoid_loss(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean binary cross-entropy of logits ``z`` and d(mean)/dz (stable for any z)."""
    sp = np.logaddexp(0, z)
    loss = float(np.mean(sp - y * z))
    return loss, (np.exp(z - sp) - y) / len(z)


class _Base:
    """What the three models share: sizes, the one table, ``touched``, ``get_config``."""

    is_classifier = True
    n_classes = 2
    kind = ""

    def _sizes(self, n_rows: int, n_fields: int, n_numeric: int) -> None:
        self.n_rows = require_int("n_rows", n_rows, 1)
        self.n_fields = require_int("n_fields", n_fields, 1)
        self.n_numeric = require_int("n_numeric", n_numeric, 0)

    def touched(self, batch: SparseBatch) -> list[np.ndarray]:
        """The one table's sorted unique row ids read by ``batch``."""
        return [unique_rows(batch.ids)]

    def get_config(self) -> dict[str, Any]:
        """JSON-able constructor arguments with ``"type"``."""
        return {"type": self.kind, **self._args}

    def _gathered(self, rows: Rows, batch: SparseBatch, dtype) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)`` of the one table and each batch id's position among ``ids``."""
        ((ids, values),) = rows
        return positions(ids, batch.ids), np.asarray(values, dtype)

    def predict_proba(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> np.ndarray:
        """P(click) per row of ``batch``."""
        z = self._logits(dense, rows, batch)[0]
        return np.exp(z - np.logaddexp(0, z))

    def loss(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> float:
        """Mean binary cross-entropy over ``batch``."""
        return _sigmoid_loss(self._logits(dense, rows, batch)[0], batch.y)[0]


class SparseLogisticRegression(_Base):
    """Logistic regression on ``n_fields`` hashed ids into a table of ``n_rows`` weights, plus
    ``n_numeric`` dense weights and a bias (``n_dense = n_numeric + 1``); weights start at 0."""

    kind = "sparse_logistic"

    def __init__(self, n_rows: int, n_fields: int, n_numeric: int = 0):
        self._sizes(n_rows, n_fields, n_numeric)
        self._args = {"n_rows": n_rows, "n_fields": n_fields, "n_numeric": n_numeric}
        self.n_dense = self.n_numeric + 1
        self.tables = (TableSpec(self.n_rows, 1, 0.0),)

    def init_dense(self, rng: np.random.Generator) -> np.ndarray:
        """Zeros (the loss is convex)."""
        return np.zeros(self.n_dense, DTYPE)

    def _logits(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> tuple:
        pos, values = self._gathered(rows, batch, dense.dtype)
        z = batch.numeric.astype(dense.dtype) @ dense[:-1] + dense[-1]
        return z + values[pos, 0].sum(axis=1), pos

    def loss_and_grad(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> Result:
        """Mean loss, dense gradient and the table's ``(ids, grads)``."""
        z, pos = self._logits(dense, rows, batch)
        loss, d = _sigmoid_loss(z, batch.y)
        grad = np.empty_like(dense)
        grad[:-1] = batch.numeric.astype(dense.dtype).T @ d
        grad[-1] = d.sum()
        ids = rows[0][0]
        row_grad = np.bincount(pos.ravel(), np.repeat(d, self.n_fields), len(ids))
        return loss, grad, [(ids, row_grad.astype(dense.dtype).reshape(-1, 1))]


class FactorizationMachine(_Base):
    """A factorisation machine of ``n_factors`` factors over hashed ids (rows ``[w, v]`` of
    width ``1 + n_factors``, drawn with std ``init_scale``), numeric features linear."""

    kind = "factorization_machine"

    def __init__(
        self, n_rows: int, n_fields: int, n_factors: int = 8, n_numeric: int = 0,
        init_scale: float = 0.01,
    ):
        self._sizes(n_rows, n_fields, n_numeric)
        self.n_factors = require_int("n_factors", n_factors, 1)
        self._args = {"n_rows": n_rows, "n_fields": n_fields, "n_factors": n_factors,
                      "n_numeric": n_numeric, "init_scale": init_scale}
        self.n_dense = self.n_numeric + 1
        self.tables = (TableSpec(self.n_rows, 1 + n_factors, _scale("init_scale", init_scale)),)

    def init_dense(self, rng: np.random.Generator) -> np.ndarray:
        """Zeros."""
        return np.zeros(self.n_dense, DTYPE)

    def _logits(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> tuple:
        pos, values = self._gathered(rows, batch, dense.dtype)
        r = values[pos]  # (n, F, 1 + k)
        v = r[:, :, 1:]
        s = v.sum(axis=1)  # (n, k)
        pair = 0.5 * ((s * s).sum(axis=1) - (v * v).sum(axis=(1, 2)))
        z = batch.numeric.astype(dense.dtype) @ dense[:-1] + dense[-1] + r[:, :, 0].sum(1) + pair
        return z, pos, v, s

    def loss_and_grad(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> Result:
        """Mean loss, dense gradient and the table's ``(ids, grads)``."""
        z, pos, v, s = self._logits(dense, rows, batch)
        loss, d = _sigmoid_loss(z, batch.y)
        grad = np.empty_like(dense)
        grad[:-1] = batch.numeric.astype(dense.dtype).T @ d
        grad[-1] = d.sum()
        per = np.empty(v.shape[:2] + (1 + self.n_factors,), dense.dtype)
        per[:, :, 0] = d[:, None]
        per[:, :, 1:] = d[:, None, None] * (s[:, None, :] - v)
        ids = rows[0][0]
        flat = per.reshape(-1, per.shape[2])
        return loss, grad, [(ids, scatter_sum(pos.ravel(), flat, len(ids)))]


class EmbeddingMLP(_Base):
    """Embeddings of ``dim`` values per hashed id (std ``init_scale``) and the numeric features,
    concatenated into a ReLU network of widths ``hidden`` with a sigmoid output."""

    kind = "embedding_mlp"

    def __init__(
        self, n_rows: int, n_fields: int, n_numeric: int = 0, dim: int = 8,
        hidden: Sequence[int] = (32,), init_scale: float = 0.05,
    ):
        self._sizes(n_rows, n_fields, n_numeric)
        self.dim = require_int("dim", dim, 1)
        self.hidden = tuple(require_int("hidden width", h, 1) for h in hidden)
        self._args = {"n_rows": n_rows, "n_fields": n_fields, "n_numeric": n_numeric,
                      "dim": dim, "hidden": list(self.hidden), "init_scale": init_scale}
        self.tables = (TableSpec(self.n_rows, self.dim, _scale("init_scale", init_scale)),)
        widths = [self.n_numeric + self.n_fields * self.dim, *self.hidden, 1]
        self.shapes = list(zip(widths[:-1], widths[1:]))
        self.n_dense = sum(a * b + b for a, b in self.shapes)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _local=threading.local())

    def init_dense(self, rng: np.random.Generator) -> np.ndarray:
        """Glorot-uniform weights, zero biases."""
        parts = []
        for a, b in self.shapes:
            limit = np.sqrt(6.0 / (a + b))
            parts += [rng.uniform(-limit, limit, a * b), np.zeros(b)]
        return np.concatenate(parts).astype(DTYPE)

    def _layers(self, vector: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        layers, at = [], 0
        for a, b in self.shapes:
            w_end = at + a * b
            layers.append((vector[at:w_end].reshape(a, b), vector[w_end : w_end + b]))
            at = w_end + b
        return layers

    def _workspace(self, n: int, dtype) -> Workspace:
        ws = getattr(self._local, "ws", None)
        if ws is None or ws.capacity < n or ws.acts[0].dtype != dtype:
            ws = self._local.ws = Workspace([b for _, b in self.shapes], max(n, 256), dtype, 1)
        return ws

    def _logits(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> tuple:
        pos, values = self._gathered(rows, batch, dense.dtype)
        n = len(batch.y)
        x = np.empty((n, self.shapes[0][0]), dense.dtype)
        x[:, : self.n_numeric] = batch.numeric
        x[:, self.n_numeric :] = values[pos].reshape(n, -1)
        ws = self._workspace(n, dense.dtype)
        z = forward(self._layers(dense), x, ws, "relu")
        return z[:, 0].copy(), pos, x, ws, z

    def loss_and_grad(self, dense: np.ndarray, rows: Rows, batch: SparseBatch) -> Result:
        """Mean loss, dense gradient and the table's ``(ids, grads)``."""
        _, pos, x, ws, z = self._logits(dense, rows, batch)
        n = len(batch.y)
        loss = output_loss("sigmoid", z, batch.y, ws, delta=True) / n
        z *= 1.0 / n
        grad = np.empty_like(dense)
        layers = self._layers(dense)
        backward(layers, self._layers(grad), x, ws, z, "relu")
        delta0 = ws.deltas[0][:n] if len(layers) > 1 else z
        dx = delta0 @ layers[0][0].T  # (n, n_numeric + F * dim)
        emb = dx[:, self.n_numeric :].reshape(-1, self.dim)
        ids = rows[0][0]
        return loss, grad, [(ids, scatter_sum(pos.ravel(), emb, len(ids)))]
