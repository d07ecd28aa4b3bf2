"""Guarded updates: a pushed gradient that would make a shard's parameters or its update
rule's state non-finite is refused, and a gradient's norm can be capped.

Used by the parameter-server shards (:mod:`downpour_dask.ps.shard`) on every push.  Numpy only.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import blas

from .averaging import AVERAGE_STATE, Averaged, innermost
from .optim import SGD, Adagrad, Adam, UpdateRule
from .params import BLAS_DTYPES

#: BLAS's dot product for each dtype it has one for (see :func:`sum_of_squares`).
_DOT = {np.dtype(np.float32): blas.sdot, np.dtype(np.float64): blas.ddot}

#: Elements up to which :func:`sum_of_squares` holds the GIL through the product.
HOLD_GIL_UP_TO = 1 << 20


def sum_of_squares(array: np.ndarray) -> float:
    """The sum of the squares of ``array``'s elements, fast: NaN if any element is NaN, inf if
    any is inf -- or if the sum overflows (elements above ~1e19 in float32).

    For a contiguous float32/float64 array it is BLAS's dot product of the array with itself,
    which runs at memory speed, 2-4x faster than numpy's pairwise ``add.reduce``; it is on the
    path of every push a shard applies.  Up to :data:`HOLD_GIL_UP_TO` elements through scipy's
    BLAS wrapper, which holds the GIL: ``np.dot`` lets it go around the product, and in a worker
    where other threads run Python (the wire's, the event loop, other replicas) taking it back
    can wait out the whole GIL switch interval (5 ms) for a product of microseconds.  A longer
    product (a model-parallel partition's shard) is worth letting the GIL go for: the worker's
    other threads run meanwhile.  A sum of non-negative terms is never rounded below its
    largest term, so no element's square exceeds it (what :class:`GuardedUpdate` relies on).
    """
    if array.dtype in BLAS_DTYPES and array.flags.c_contiguous and array.size:
        flat = array.reshape(-1)
        if flat.size <= HOLD_GIL_UP_TO:
            return float(_DOT[flat.dtype](flat, flat))  # BLAS warns of no overflow
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an answer here
            return float(np.dot(flat, flat))
    return float(np.add.reduce(np.square(array, dtype=np.float64), axis=None))


def all_finite(array: np.ndarray) -> bool:
    """Whether every element of ``array`` is finite: one fast reduction
    (:func:`sum_of_squares`), NaN or inf if any element is; only when it overflows (huge finite
    values) is every element checked."""
    if array.dtype.kind not in "fc":
        return True
    if array.dtype.kind == "f" and math.isfinite(sum_of_squares(array)):
        return True
    return bool(np.isfinite(array).all())


class GuardedUpdate:
    """Applies a rule's updates only when they leave the parameters and the rule's state
    finite: :meth:`apply` undoes an update that made any of them NaN or inf.

    One huge but finite gradient can overflow an update-rule's state (Adagrad's sum of squares
    of N(0, 1e20) values is inf, and those coordinates never move again) or the parameters
    themselves; a NaN gradient is easy to spot, these are not, so the result is checked: a copy
    of the slice and of its state before the update (kept in preallocated buffers) and a
    finiteness check of each after it.

    For plain SGD, Adagrad and Adam that price is mostly avoided: how far one update can move
    any element is known from the gradient's norm (:func:`sum_of_squares`, which the caller's
    finiteness check of the gradient computes anyway): ``lr * |g|`` for SGD, ``lr`` for
    Adagrad's parameters (its step is ``lr * g / sqrt(sum of squares including g**2)``) and
    ``|g|**2`` for its sum of squares; for Adam see :func:`_largest_moves`.  The guard keeps an
    upper bound of every float array's largest magnitude (measured once, then grown by each
    update's largest move); while the bounds stay far below the dtype's largest value no
    update can overflow, and it is applied without copy and check.  Otherwise -- another
    rule, a bound too high -- the update is checked as above.  The arrays must change only
    through :meth:`apply` (a shard's do).

    Parameters
    ----------
    rule : UpdateRule
    params : ndarray
        The slice the updates go to (its shape and dtype size the undo buffers).
    state : dict
        The rule's state for that slice (same).
    """

    #: Updates checked in full before the bounds are measured again, after they were too high.
    REMEASURE_AFTER = 64

    def __init__(
        self,
        rule: UpdateRule,
        params: np.ndarray,
        state: dict[str, np.ndarray],
        bounds: np.ndarray | None = None,
    ):
        self.rule = rule
        # An averaged rule's update is guarded without its average, folded in once accepted:
        # the average of finite values is finite (core/averaging.py)
        self._averaged = rule if isinstance(rule, Averaged) else None
        self._updating = innermost(rule)
        arrays = self._checked(params, state)
        self._undo = {name: np.empty_like(array) for name, array in arrays.items()}
        # how large each float array's bound may grow (an integer array -- Adam's step count --
        # cannot overflow): worked out once, not on every push
        self._limits = {
            n: _LIMIT.get(a.dtype, 0.0) for n, a in arrays.items() if a.dtype.kind not in "iub"
        }
        self._names = sorted(self._limits)
        self.store = bounds  # where the bounds live: an array another process may share
        self._own: dict[str, float] | None = None  # of each array's largest magnitude
        self._skip_measuring = 0
        self.unchecked = 0  # updates applied on the bounds alone (diagnostics, tests)

    def apply(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
        grad_sq: float | None = None,
    ) -> str | None:
        """Apply ``grad`` in place; return None, or -- with ``params`` and ``state`` left as
        they were -- the name of what would have become non-finite (``"parameters"`` or the
        state array's name).  ``grad_sq``: :func:`sum_of_squares` of ``grad`` if the caller
        has it (or of a gradient no element of ``grad`` exceeds in magnitude)."""
        arrays = self._checked(params, state)
        if self._cannot_overflow(arrays, grad, grad_sq):
            self._updating.update(params, grad, state, staleness=staleness)
            self.unchecked += 1
            self._accepted(params, state)
            return None
        self._bounds = None  # measured again when next needed
        for name, array in arrays.items():
            np.copyto(self._undo[name], array)
        self._updating.update(params, grad, state, staleness=staleness)
        bad = next((name for name, array in arrays.items() if not all_finite(array)), None)
        if bad is None:
            self._accepted(params, state)
            return None
        for name, array in arrays.items():
            np.copyto(array, self._undo[name])
        return bad or "parameters"

    @property
    def _bounds(self) -> dict[str, float] | None:
        """Each float array's bound, or None while not measured: kept in :attr:`store` when
        given (float64, NaN: not measured), so that every process updating the same shared
        arrays grows the same bounds (:mod:`downpour_dask.ps.shard_body`)."""
        if self.store is None:
            return self._own
        if math.isnan(self.store[0]):
            return None
        return dict(zip(self._names, self.store[: len(self._names)].tolist()))

    @_bounds.setter
    def _bounds(self, bounds: dict[str, float] | None) -> None:
        if self.store is None:
            self._own = bounds
        elif bounds is None:
            self.store[0] = math.nan
        else:
            self.store[: len(self._names)] = [bounds[name] for name in self._names]

    def _checked(self, params: np.ndarray, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The arrays an update may make non-finite, by name (``""``: the parameters): all of
        them, but an averaged rule's average."""
        arrays = {"": params, **state}
        if self._averaged is not None:
            for name in AVERAGE_STATE:
                del arrays[name]
        return arrays

    def _accepted(self, params: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """What follows an update that was applied: an averaged rule's average."""
        if self._averaged is not None:
            self._averaged.accumulate(params, state)

    def _cannot_overflow(
        self, arrays: dict[str, np.ndarray], grad: np.ndarray, grad_sq: float | None
    ) -> bool:
        """Whether the bounds prove that this update leaves every array finite (if so, they
        are grown by it)."""
        if type(self._updating) not in _BOUNDED:
            return False
        if self._bounds is None:
            if self._skip_measuring:
                self._skip_measuring -= 1
                return False
            self._bounds = {name: _largest_magnitude(arrays[name]) for name in self._limits}
        moves = _largest_moves(self._updating, grad, grad_sq, self._bounds)
        if moves is None or not moves.keys() <= self._limits.keys():
            return False
        grown = {name: bound + moves.get(name, 0.0) for name, bound in self._bounds.items()}
        if all(grown[name] < limit for name, limit in self._limits.items()):
            self._bounds = grown  # (a NaN bound fails the comparison)
            return True
        self._bounds, self._skip_measuring = None, self.REMEASURE_AFTER
        return False


#: Rounding slack on the bounds (float32 rounds by 6e-8 per operation).
_SLACK = 1.001
#: Above the largest element whose square underflows in a float32 sum of squares (~1.1e-19).
_UNDERFLOW = 1e-18
#: The bounds must stay below these: far from overflowing, whatever rounding does.
_LIMIT: dict[np.dtype, float] = {d: float(np.finfo(d).max) / 16 for d in BLAS_DTYPES}


def _largest_magnitude(array: np.ndarray) -> float:
    if array.dtype not in BLAS_DTYPES:
        return math.inf  # no bound
    return float(max(array.max(), -array.min())) if array.size else 0.0


#: The rules whose largest moves :func:`_largest_moves` knows (a subclass or a wrapper may do
#: anything, so the type must be one of these exactly).
_BOUNDED = (SGD, Adagrad, Adam)


def _largest_moves(
    rule: UpdateRule, grad: np.ndarray, grad_sq: float | None, bounds: dict[str, float]
) -> dict | None:
    """How far one update by ``rule`` can move any element of each array it changes, given
    ``bounds`` of the arrays' largest magnitudes, or None when a non-finite or huge gradient
    leaves it unknown."""
    norm_sq = sum_of_squares(grad) if grad_sq is None else float(grad_sq)
    if not math.isfinite(norm_sq):
        return None
    # An element whose square underflowed in the sum is missing from it: no element exceeds
    # the norm or _UNDERFLOW, whichever is larger.
    g_max = max(math.sqrt(norm_sq), _UNDERFLOW)
    if type(rule) is SGD:
        return {"": rule.learning_rate * g_max * _SLACK}
    if type(rule) is Adagrad:
        # |g| / (sqrt(sum_sq + g**2) + eps) <= 1, unless g**2 underflowed: then it is at most
        # _UNDERFLOW / eps.
        step = rule.learning_rate * max(1.0, _UNDERFLOW / rule.eps) * _SLACK
        return {"": step, "sum_sq": g_max**2 * _SLACK}
    # Adam: |m'| <= |m| + (1 - beta1) |g| and |v'| <= |v| + (1 - beta2) g**2; the step
    # lr / (1 - beta1**t) * m' / (sqrt(v' / (1 - beta2**t)) + eps) is at most
    # lr * |m'| / ((1 - beta1) eps) for any t >= 1 and any v' >= 0.  Loose (eps is small),
    # but it needs nothing of the state's history, and it stays far below overflow.
    m_move = (1.0 - rule.beta1) * g_max
    m_largest = bounds.get("m", math.inf) + m_move
    step = rule.learning_rate * m_largest / ((1.0 - rule.beta1) * rule.eps)
    return {"": step * _SLACK, "m": m_move * _SLACK, "v": (1.0 - rule.beta2) * g_max**2 * _SLACK}


def clip_norm(grad: np.ndarray, max_norm: float) -> float:
    """Scale ``grad`` in place so that its L2 norm is at most ``max_norm``; return the norm it
    had (computed in float64, so a float32 gradient's norm does not overflow)."""
    norm = float(np.sqrt(np.dot(grad.astype(np.float64, copy=False), grad)))
    if math.isfinite(norm) and norm > max_norm > 0:
        grad *= np.float32(max_norm / norm) if grad.dtype == np.float32 else max_norm / norm
    return norm
