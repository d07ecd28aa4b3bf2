"""Guarded updates: a pushed gradient that would make a shard's parameters or its update
rule's state non-finite is refused, and a gradient's norm can be capped.

Used by the parameter-server shards (:mod:`downpour_dask.ps.shard`) on every push.  Numpy only.
"""

from __future__ import annotations

import math

import numpy as np

from .optim import UpdateRule

_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def all_finite(array: np.ndarray) -> bool:
    """Whether every element of ``array`` is finite: one fast reduction, which is NaN or inf if
    any element is; only when it overflows (huge finite values) is every element checked.

    For a contiguous float32/float64 array the reduction is the BLAS dot product of the array
    with itself (a sum of squares: NaN if any element is NaN, inf if any is inf): it runs at
    memory speed, 2-4x faster than numpy's pairwise ``add.reduce``, and it is on the path of
    every push a shard applies (twice: the gradient, then the updated parameters).  It
    overflows for elements above ~1e19, where the element-wise check decides.
    """
    if array.dtype.kind not in "fc":
        return True
    if array.dtype in _BLAS and array.flags.c_contiguous:
        flat = array.reshape(-1)
        total = np.dot(flat, flat)
    else:
        total = np.add.reduce(array, axis=None)
    if math.isfinite(float(total.real)):
        return True
    return bool(np.isfinite(array).all())


class GuardedUpdate:
    """Applies a rule's updates only when they leave the parameters and the rule's state
    finite: :meth:`apply` undoes an update that made any of them NaN or inf.

    One huge but finite gradient can overflow an update-rule's state (Adagrad's sum of squares
    of N(0, 1e20) values is inf, and those coordinates never move again) or the parameters
    themselves; a NaN gradient is easy to spot, these are not, so the result is checked.  The
    price is a copy of the slice and of its state per update (kept in preallocated buffers)
    and one sum over each.

    Parameters
    ----------
    rule : UpdateRule
    params : ndarray
        The slice the updates go to (its shape and dtype size the undo buffers).
    state : dict
        The rule's state for that slice (same).
    """

    def __init__(self, rule: UpdateRule, params: np.ndarray, state: dict[str, np.ndarray]):
        self.rule = rule
        self._undo = {"": np.empty_like(params)}
        self._undo.update({name: np.empty_like(array) for name, array in state.items()})

    def apply(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
    ) -> str | None:
        """Apply ``grad`` in place; return None, or -- with ``params`` and ``state`` left as
        they were -- the name of what would have become non-finite (``"parameters"`` or the
        state array's name)."""
        arrays = {"": params, **state}
        for name, array in arrays.items():
            np.copyto(self._undo[name], array)
        self.rule.update(params, grad, state, staleness=staleness)
        bad = next((name for name, array in arrays.items() if not all_finite(array)), None)
        if bad is None:
            return None
        for name, array in arrays.items():
            np.copyto(array, self._undo[name])
        return bad or "parameters"


def clip_norm(grad: np.ndarray, max_norm: float) -> float:
    """Scale ``grad`` in place so that its L2 norm is at most ``max_norm``; return the norm it
    had (computed in float64, so a float32 gradient's norm does not overflow)."""
    norm = float(np.sqrt(np.dot(grad.astype(np.float64, copy=False), grad)))
    if math.isfinite(norm) and norm > max_norm > 0:
        grad *= np.float32(max_norm / norm) if grad.dtype == np.float32 else max_norm / norm
    return norm
