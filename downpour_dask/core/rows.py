"""Update rules applied to some rows of a table: the optimizer state kept per row.

A parameter-server shard (and the serial reference loop) holds a block of table rows, the
update rule's state for each of them -- Adagrad's sums of squared gradients, momentum's
velocity -- and a per-row *version* counting the updates that row received.  A push carries
``(row ids, row gradients)``: :class:`RowState` gathers those rows and their state, applies the
very rule of :mod:`~downpour_dask.core.optim` to the gathered copy (so sparse SGD, Adagrad and
the staleness-aware wrapper are the dense rules, not copies of them) and scatters the result
back.  Rows no push names keep their values, state and version.

Adam's state holds one step counter for the whole slice (``t``), which has no per-row meaning,
so tables refuse it with a clear error.
"""

from __future__ import annotations

import numpy as np

from .optim import UpdateRule
from .params import DTYPE
from .sparse import all_unique


def row_state_shapes(rule: UpdateRule) -> list[str]:
    """The names of ``rule``'s per-coordinate state arrays; ValueError for a rule whose state
    is not per coordinate (Adam's step counter)."""
    names = []
    for name, array in rule.init(0).items():
        if array.ndim != 1:
            raise ValueError(
                f"optimizer {rule.name!r} keeps a state {name!r} that is not per coordinate, so "
                f"it cannot update table rows; use sgd, momentum, adagrad or their "
                f"staleness_aware_ variants for sparse tables"
            )
        names.append(name)
    return names


class RowState:
    """Rows ``[lo, hi)`` of one table, the rule's per-row state and per-row versions.

    Parameters
    ----------
    values : ndarray
        The rows' initial values, (hi - lo, width) float32 (kept, not copied).
    lo : int
        The table row id of ``values[0]``.
    rule : UpdateRule
    """

    def __init__(self, values: np.ndarray, lo: int, rule: UpdateRule):
        self.values = values
        self.lo, self.hi = int(lo), int(lo) + len(values)
        self.rule = rule
        self.state = {
            name: np.zeros(values.shape, DTYPE) for name in row_state_shapes(rule)
        }
        self.versions = np.zeros(len(values), np.int64)

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as local row indices, or a ValueError naming the ids out of ``[lo, hi)``."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"row ids must be a 1-d integer array, got {ids.dtype} {ids.shape}")
        bad = (ids < self.lo) | (ids >= self.hi)
        if bad.any():
            shown = ids[bad][:5].tolist()
            raise ValueError(
                f"{int(bad.sum())} row id(s) out of this block's range [{self.lo}, {self.hi}): "
                f"{shown}{' ...' if bad.sum() > 5 else ''}"
            )
        return ids.astype(np.int64) - self.lo

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """A copy of rows ``ids`` (table row ids), (len(ids), width)."""
        return self.values[self.check_ids(ids)]

    def apply(
        self, ids: np.ndarray, grads: np.ndarray, *, staleness: int = 0, rate_scale: float = 1.0
    ) -> None:
        """Apply the rule to rows ``ids`` (unique) with gradients ``grads`` (len(ids), width).

        Checks everything before changing anything: a bad id or shape changes no row."""
        self.commit(self.prepare(ids, grads, staleness=staleness, rate_scale=rate_scale))

    def prepare(
        self, ids: np.ndarray, grads: np.ndarray, *, staleness: int = 0, rate_scale: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The update of :meth:`apply` computed on copies of the rows and their state, not yet
        written back (:meth:`commit` does): a caller can look at it -- e.g. refuse an update
        that makes a value non-finite (:meth:`finite`) -- with nothing changed."""
        local = self.check_ids(ids)
        if grads.shape != (len(local), self.values.shape[1]):
            raise ValueError(
                f"row gradients must have shape ({len(local)}, {self.values.shape[1]}), "
                f"got {grads.shape}"
            )
        if not all_unique(local):
            raise ValueError("row ids of one push must be unique")
        rows = self.values[local]
        state = {name: array[local].reshape(-1) for name, array in self.state.items()}
        grad = np.ascontiguousarray(grads, dtype=DTYPE).reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is looked at by finite()
            self.rule.update(rows.reshape(-1), grad, state, staleness=staleness,
                             rate_scale=rate_scale)
        return local, rows, state

    @staticmethod
    def finite(pending: tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]) -> bool:
        """Whether a prepared update leaves every value and state element finite."""
        _, rows, state = pending
        return bool(np.isfinite(rows).all()) and all(np.isfinite(a).all() for a in state.values())

    def commit(self, pending: tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]) -> None:
        """Write a prepared update back and count it in the rows' versions."""
        local, rows, state = pending
        self.values[local] = rows
        for name, array in state.items():
            self.state[name][local] = array.reshape(rows.shape)
        self.versions[local] += 1
