"""The sparse-model protocol: dense parameters plus tables of which a batch touches few rows.

Click-through and recommendation models keep most of their parameters in large tables --
feature weights over hashed ids, embeddings -- of which one minibatch touches a tiny fraction.
A *sparse model* declares a small dense vector (trained as every other model's) and one or more
tables of ``rows x width`` float32 values (:class:`TableSpec`).  Given a batch
(:class:`SparseBatch`: numeric features, row ids per categorical field, labels) it names the
rows it touches (:meth:`SparseModel.touched`, sorted and deduplicated); its ``loss_and_grad``
takes the dense vector plus those rows only and returns the dense gradient and, per table,
``(row ids, row gradients)``.  So a replica pulls and pushes only the rows its batch touches.

Required members (:class:`SparseModel`):

``n_dense`` : int
    Length of the dense parameter vector (>= 1).
``tables`` : tuple of :class:`TableSpec`
    The tables, at least one.
``n_numeric``, ``n_fields`` : int
    Numeric features per row, and categorical fields per row (columns of ``batch.ids``).
``is_classifier`` : bool, ``n_classes`` : int
    The built-in models are binary classifiers (``n_classes == 2``, labels 0/1).
``init_dense(rng) -> ndarray``
    The first dense vector (float32, ``n_dense``); depends only on ``rng``.
``touched(batch) -> list of ndarray``
    Per table, the sorted unique int64 row ids ``batch`` reads.
``loss_and_grad(dense, rows, batch) -> (float, ndarray, list of (ids, grads))``
    ``rows`` holds per table ``(ids, values)`` with ``ids`` as ``touched`` returned them and
    ``values`` of shape ``(len(ids), width)``.  Returns the mean loss over the batch, the dense
    gradient and per table ``(ids, grads)`` with ``grads`` shaped like ``values``.
``predict_proba(dense, rows, batch) -> ndarray``
    The probability of class 1 per row.

Tables start from :func:`table_rows`: values drawn per block of :data:`INIT_BLOCK` rows from a
generator keyed by ``(seed, table, block)``, so any range of rows is initialised alike in any
process and for any number of shards -- a shard makes only its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from .params import DTYPE

#: Rows per block of :func:`table_rows`'s generator: the unit of deterministic initialisation.
INIT_BLOCK = 1 << 16


class TableSpec(NamedTuple):
    """One table of a sparse model: ``n_rows`` rows of ``width`` float32 values, initialised
    with a normal of standard deviation ``init_scale`` (0: zeros)."""

    n_rows: int
    width: int
    init_scale: float = 0.0


class SparseBatch(NamedTuple):
    """A minibatch for a sparse model: ``numeric`` float32 (n, n_numeric), ``ids`` int64
    (n, n_fields) row ids into the table(s), ``y`` labels (n,)."""

    numeric: np.ndarray
    ids: np.ndarray
    y: np.ndarray

    def take(self, index: Any) -> SparseBatch:
        """The rows ``index`` (a slice or an index array) of each part."""
        return SparseBatch(self.numeric[index], self.ids[index], self.y[index])

    @staticmethod
    def concat(parts: Sequence[SparseBatch]) -> SparseBatch:
        """The rows of ``parts``, one after the other."""
        return SparseBatch(*(np.concatenate(a) for a in zip(*parts)))


@runtime_checkable
class SparseModel(Protocol):
    """What the sparse path needs of a model (see the module docstring)."""

    n_dense: int
    tables: tuple[TableSpec, ...]
    n_numeric: int
    n_fields: int
    is_classifier: bool

    def init_dense(self, rng: np.random.Generator) -> np.ndarray: ...

    def touched(self, batch: SparseBatch) -> list[np.ndarray]: ...

    def loss_and_grad(
        self, dense: np.ndarray, rows: Sequence[tuple[np.ndarray, np.ndarray]], batch: SparseBatch
    ) -> tuple[float, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]: ...

    def predict_proba(
        self, dense: np.ndarray, rows: Sequence[tuple[np.ndarray, np.ndarray]], batch: SparseBatch
    ) -> np.ndarray: ...


#: Members every sparse model needs, and what each is (for error messages).
REQUIRED = {
    "n_dense": "int >= 1, length of the dense parameter vector",
    "tables": "tuple of TableSpec(n_rows, width, init_scale), at least one",
    "n_numeric": "int >= 0, numeric features per row",
    "n_fields": "int >= 1, categorical fields per row",
    "is_classifier": "bool",
    "init_dense": "method init_dense(rng) -> float32 vector of n_dense",
    "touched": "method touched(batch) -> per table sorted unique int64 row ids",
    "loss_and_grad": "method loss_and_grad(dense, rows, batch) -> (loss, dense grad, row grads)",
    "predict_proba": "method predict_proba(dense, rows, batch) -> P(class 1) per row",
}
_METHODS = ("init_dense", "touched", "loss_and_grad", "predict_proba")


def _bad_int(value: Any, low: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low


def check_sparse_model(model: Any, what: str = "model") -> None:
    """Raise TypeError unless ``model`` satisfies the sparse protocol, naming every problem."""
    problems = [name for name in REQUIRED if not hasattr(model, name)]
    problems += [f"{m} (not callable)" for m in _METHODS if m not in problems
                 and not callable(getattr(model, m))]
    if not problems:
        for name, low in (("n_dense", 1), ("n_numeric", 0), ("n_fields", 1)):
            if _bad_int(getattr(model, name), low):
                problems.append(f"{name} (must be an int >= {low}, got {getattr(model, name)!r})")
        tables = model.tables
        if not isinstance(tables, (tuple, list)) or not tables:
            problems.append(f"tables (must be a non-empty tuple of TableSpec, got {tables!r})")
        else:
            for t, spec in enumerate(tables):
                ok = isinstance(spec, tuple) and len(spec) == 3
                if not ok or _bad_int(spec[0], 1) or _bad_int(spec[1], 1) or not (
                    isinstance(spec[2], (int, float)) and 0 <= spec[2] < np.inf
                ):
                    problems.append(
                        f"tables[{t}] (must be TableSpec(n_rows >= 1, width >= 1, "
                        f"init_scale >= 0), got {spec!r})"
                    )
    if problems:
        required = "; ".join(f"{k}: {v}" for k, v in REQUIRED.items())
        raise TypeError(
            f"{what} of type {type(model).__name__} does not satisfy the sparse-model protocol: "
            f"missing or invalid {', '.join(problems)}.  A sparse model needs {required}.  See "
            f"downpour_dask.core.sparse"
        )


def check_batch(model: Any, batch: Any) -> SparseBatch:
    """``batch`` as a :class:`SparseBatch` of the model's widths, or a ValueError/TypeError
    naming the part that is wrong and what is allowed."""
    if not isinstance(batch, tuple) or len(batch) != 3:
        raise TypeError(f"a sparse batch is (numeric, ids, y), got {type(batch).__name__}")
    numeric = np.ascontiguousarray(batch[0], dtype=DTYPE)
    ids, y = np.asarray(batch[1]), np.asarray(batch[2])
    n = len(y)
    if numeric.shape != (n, model.n_numeric):
        raise ValueError(f"numeric must have shape ({n}, {model.n_numeric}), got {numeric.shape}")
    if ids.shape != (n, model.n_fields) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"ids must be integers of shape ({n}, {model.n_fields}), got {ids.dtype} {ids.shape}"
        )
    n_rows = min(spec.n_rows for spec in model.tables)
    if n and (ids.min() < 0 or ids.max() >= n_rows):
        raise ValueError(f"ids must be row ids in [0, {n_rows}), got [{ids.min()}, {ids.max()}]")
    if model.is_classifier and n and not np.isin(y, (0, 1)).all():
        raise ValueError("y must hold labels 0 and 1 for a binary classifier")
    return SparseBatch(numeric, ids.astype(np.int64, copy=False), y.astype(np.int64, copy=False))


def table_rows(spec: TableSpec, table: int, lo: int, hi: int, seed: int) -> np.ndarray:
    """Initial values of rows ``[lo, hi)`` of table number ``table``: the same in every process
    and whatever range is asked (blocks of :data:`INIT_BLOCK` rows, each from its own key)."""
    n_rows, width, scale = int(spec.n_rows), int(spec.width), float(spec.init_scale)
    if not 0 <= lo <= hi <= n_rows:
        raise ValueError(f"rows [{lo}, {hi}) are not within the table's [0, {n_rows})")
    out = np.zeros((hi - lo, width), DTYPE)
    if scale == 0 or hi == lo:
        return out
    for block in range(lo // INIT_BLOCK, (hi - 1) // INIT_BLOCK + 1):
        start = block * INIT_BLOCK
        rng = np.random.Generator(np.random.Philox(key=[int(seed), table * 2**32 + block]))
        count = min(INIT_BLOCK, n_rows - start)
        a, b = max(lo, start), min(hi, start + count)
        values = rng.standard_normal((count, width), dtype=np.float32)
        out[a - lo : b - lo] = values[a - start : b - start] * np.float32(scale)
    return out


#: :func:`unique_rows` and :func:`positions` use a bitmap or a lookup table over the ids' range
#: while the range is at most this many times their count (so its bytes stay a small multiple
#: of the ids').
LOOKUP_SPAN = 64


def unique_rows(ids: np.ndarray) -> np.ndarray:
    """Sorted unique int64 row ids of ``ids`` (any shape).

    Marked in a bitmap over the ids' range while that is at most :data:`LOOKUP_SPAN` times
    their count, else sorted and compared with their neighbours: ``np.unique`` hashes integer
    values first and then sorts the result, several times slower on a batch's ids (see
    ``benchmarks/README.md``, "A sparse step's row bookkeeping")."""
    flat = np.asarray(ids, dtype=np.int64).ravel()
    if flat.size < 2:
        return flat.copy()
    lo = int(flat.min())
    span = int(flat.max()) - lo + 1
    if span <= LOOKUP_SPAN * flat.size:
        marked = np.zeros(span, bool)
        marked[flat - lo] = True
        return np.flatnonzero(marked) + lo
    flat = np.sort(flat)
    keep = np.empty(flat.size, bool)
    keep[0] = True
    np.not_equal(flat[1:], flat[:-1], out=keep[1:])
    return flat[keep]


def all_unique(ids: np.ndarray) -> bool:
    """Whether no id occurs twice in ``ids`` (1-D); at once for strictly increasing ids, the
    order replicas send them in."""
    ids = np.asarray(ids)
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return True
    ordered = np.sort(ids)
    return bool((ordered[1:] != ordered[:-1]).all())


def positions(row_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Where each of ``ids`` (any shape) sits in the sorted unique ``row_ids``.

    Through a lookup table over ``row_ids``' range when that is at most :data:`LOOKUP_SPAN`
    times their count, else a binary search, which is many times slower on a batch's ids: its
    branches cannot be predicted.

    Raises
    ------
    ValueError
        If an id is not among ``row_ids``.
    """
    row_ids, ids = np.asarray(row_ids), np.asarray(ids)
    if row_ids.size == 0 or ids.size == 0:
        if ids.size:
            raise ValueError(f"{ids.size} ids looked up among no row ids")
        return np.zeros(ids.shape, np.intp)
    lo = int(row_ids[0])
    span = int(row_ids[-1]) - lo + 1
    if span <= LOOKUP_SPAN * row_ids.size:
        table = np.empty(span, np.intp)  # only the entries of row_ids are set, and checked below
        table[row_ids - lo] = np.arange(row_ids.size)
        found = table.take(ids - lo, mode="clip")  # (an id outside the range: a wrong entry)
    else:
        found = np.searchsorted(row_ids, ids)
    missing = row_ids.take(found, mode="clip") != ids
    if missing.any():
        raise ValueError(
            f"{int(missing.sum())} of {ids.size} ids are not among the row ids, e.g. "
            f"{int(ids[missing].ravel()[0])}"
        )
    return found


def scatter_sum(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``out[index[i]] += values[i]`` summed into ``n`` rows (``values`` is (len(index), w)).

    One ``np.bincount`` over the flattened (row, column) cells, summed in float64 and returned
    in ``values``' dtype: faster than ``np.add.at``, which goes element by element."""
    index = np.asarray(index, dtype=np.intp).ravel()
    width = values.shape[1]
    cells = (index[:, None] * width + np.arange(width)).ravel()
    summed = np.bincount(cells, weights=values.reshape(-1), minlength=n * width)
    return summed.reshape(n, width).astype(values.dtype, copy=False)
