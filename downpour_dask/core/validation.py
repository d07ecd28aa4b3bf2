"""Checks of user input: the models' constructor arguments, features, labels and targets, and
the estimators' numeric arguments (:func:`check_int`, :func:`check_positive`: here, not with the
estimators, so that the modules a worker loads can use them without scikit-learn).

Every model validates user data once, through :meth:`~downpour_dask.core.model.Model.check_data`,
and its hot path (``loss_and_grad``) then trusts it.  The checks here turn bad input into a
``TypeError`` or ``ValueError`` that names the argument, what is allowed and what was given, and
convert good input to what the hot path expects: C-contiguous float32 features, int64 class
labels, float32 regression targets.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .params import BLAS_DTYPES, DTYPE

_FINITE_BLOCK = 8192  # rows checked for NaN/inf at a time: no bool temporary the size of X


def require_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, or a TypeError/ValueError unless it is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_int(
    name: str, value: Any, low: int, high: int | None = None, allow_none: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is an int in ``[low, high]`` (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_positive(
    name: str, value: Any, allow_none: bool = False, allow_zero: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is a finite number > 0 (>= 0 if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    bad = not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


def require_l2(l2: Any) -> float:
    """The L2 penalty strength as a float, or a TypeError/ValueError unless finite and >= 0."""
    if isinstance(l2, bool) or not isinstance(l2, (int, float, np.integer, np.floating)):
        raise TypeError(f"l2 must be a real number, got {type(l2).__name__} {l2!r}")
    if not (math.isfinite(l2) and l2 >= 0):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    return float(l2)


def as_numeric(name: str, value: Any) -> np.ndarray:
    """``value`` as an array of real numbers, or a TypeError/ValueError naming ``name``."""
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular array of numbers; {exc}") from None
    if arr.dtype.kind == "O":
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must contain real numbers, got Python objects that are not numbers"
            ) from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must contain real numbers (bool, int or float), got dtype {arr.dtype}"
        )
    return arr


def all_finite(arr: np.ndarray) -> bool:
    """Whether every element of the float array ``arr`` is finite.

    One pass and no large temporary: a NaN or an infinity always makes the sum non-finite.  A
    matrix of float32 or float64 rows is summed by BLAS (its product with a vector of ones),
    which streams through memory faster than numpy's pairwise sum; other arrays are summed by
    numpy.  A sum can also overflow on large finite values, so only a non-finite sum looks at
    every element, ``_FINITE_BLOCK`` rows at a time.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(_sum(arr)):
            return True
    rows = arr.reshape(len(arr), -1) if arr.ndim else arr.reshape(1, 1)
    return all(
        np.isfinite(rows[lo : lo + _FINITE_BLOCK]).all()
        for lo in range(0, len(rows), _FINITE_BLOCK)
    )


def _sum(arr: np.ndarray) -> float:
    """The sum of ``arr``'s elements: row sums by BLAS, then their sum, for a C-contiguous
    float32 or float64 matrix of at least two columns; numpy's sum otherwise."""
    if arr.ndim == 2 and arr.shape[1] > 1 and arr.dtype in BLAS_DTYPES and arr.flags.c_contiguous:
        return np.dot(arr, np.ones(arr.shape[1], arr.dtype)).sum()
    return arr.sum()


def as_float32(name: str, arr: np.ndarray) -> np.ndarray:
    """C-contiguous float32 version of ``arr``; NaN/inf (also from overflow) rejected."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.ascontiguousarray(arr, dtype=DTYPE)
    rows = out.reshape(out.shape[0], -1)
    if not all_finite(rows):
        bad = ~np.isfinite(rows)
        raise ValueError(
            f"{name} contains {int(bad.sum())} NaN or infinite value(s), first in row "
            f"{int(np.argmax(bad.any(axis=1)))} (values beyond float32's ~3.4e38 count "
            "too); remove or impute them"
        )
    return out


def check_features(X: Any, n_inputs: int, model: str) -> np.ndarray:
    """Features as C-contiguous float32 of shape (n_samples >= 1, n_inputs).

    ``model`` names the model in the message when the width is wrong.
    """
    X = as_numeric("X", X)
    if X.ndim != 2:
        raise ValueError(
            f"X must be a 2-D array of shape (n_samples, n_features), got a "
            f"{X.ndim}-D array of shape {X.shape}; use X.reshape(1, -1) for "
            "a single sample"
        )
    if X.shape[0] == 0:
        raise ValueError(f"X is empty: got 0 samples (shape {X.shape}); at least 1 is needed")
    if X.shape[1] != n_inputs:
        raise ValueError(
            f"X has {X.shape[1]} features, but {model} expects {n_inputs} features (n_inputs)"
        )
    return as_float32("X", X)


def check_same_rows(X: np.ndarray, y: np.ndarray) -> None:
    """Raise a ValueError unless ``y`` has one row per row of ``X``."""
    if y.ndim == 0 or y.shape[0] != X.shape[0]:
        got = "a scalar" if y.ndim == 0 else f"{y.shape[0]} rows"
        raise ValueError(
            f"X and y must have the same number of samples: X has {X.shape[0]} rows, y has {got}"
        )


def check_class_labels(y: np.ndarray, n_classes: int) -> np.ndarray:
    """1-D integer labels in ``0..n_classes-1`` as int64 (integral floats are accepted)."""
    k = n_classes
    if y.ndim != 1:
        raise ValueError(
            f"y must be a 1-D array of class labels of shape (n_samples,), "
            f"got shape {y.shape} (one-hot labels? pass y.argmax(axis=1))"
        )
    if y.dtype.kind == "f":
        odd = ~np.isfinite(y) | (y != np.round(y))
        if odd.any():
            raise ValueError(
                f"y must contain integer class labels 0..{k - 1}, got "
                f"non-integer values {np.unique(y[odd])[:10].tolist()}"
            )
    bad = (y < 0) | (y >= k)
    if bad.any():
        vals = [int(v) for v in np.unique(y[bad])[:10]]
        raise ValueError(
            f"y contains labels {vals} outside the model's classes 0..{k - 1} (n_classes={k})"
        )
    return y.astype(np.int64)


def check_regression_targets(y: np.ndarray, n_outputs: int, model: str) -> np.ndarray:
    """Targets as float32 of shape (n,) for one output, else (n, n_outputs)."""
    if y.shape[1:] != ((n_outputs,) if n_outputs > 1 else ()):
        want = "(n_samples,)" if n_outputs == 1 else f"(n_samples, {n_outputs})"
        raise ValueError(
            f"y has shape {y.shape}, but {model} expects {n_outputs} "
            f"target column(s) (n_outputs): shape {want}"
        )
    return as_float32("y", y)
