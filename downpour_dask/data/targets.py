"""Class labels as users give them, and as models need them: ``classes_`` and the codes 0..K-1.

scikit-learn classifiers take labels of any kind (strings, ``[-1, 1]``, ``[3, 7, 9]``) and give
them back from ``predict``; a model here has K output units for the classes ``0..K-1``.  The
estimators keep the sorted distinct labels as ``classes_`` and train on each label's index in it:
:func:`fit_classes` finds them (for a model of fixed width, labels that already are its class
indices are kept as they are, so every output unit stays a class), :func:`encode` maps labels
to codes and :func:`decode` codes back to labels.
"""

from __future__ import annotations

import numpy as np


def fit_classes(
    y: np.ndarray, n_model_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The classes of labels ``y`` (1-D) and ``y`` as codes 0..K-1 (int64).

    Parameters
    ----------
    y : ndarray
        Class labels of any sortable kind.
    n_model_classes : int, optional
        The class count of a model already built.  Integer labels within ``0..n-1`` are then
        its class indices: ``classes_`` is ``0..n-1`` even if some class is absent from ``y``.
        Other labels must be exactly ``n`` distinct values.

    Raises
    ------
    ValueError
        Fewer than two classes (nothing to tell apart), or a label count that does not match a
        model of fixed width.
    """
    classes, codes = _counted_classes(y) or np.unique(y, return_inverse=True)
    codes = codes.reshape(-1).astype(np.int64, copy=False)
    if n_model_classes is not None:
        integral = classes.dtype.kind in "iub" or (
            classes.dtype.kind == "f" and np.all(np.mod(classes, 1) == 0)
        )
        if integral and len(classes) and classes[0] >= 0 and classes[-1] < n_model_classes:
            return np.arange(n_model_classes, dtype=classes.dtype), y.astype(np.int64)
        if len(classes) != n_model_classes:
            outside = "labels outside its classes, " if integral else ""
            raise ValueError(
                f"the model has {n_model_classes} classes (output units), but y has "
                f"{outside}{len(classes)} distinct labels {_show(classes)}; give labels "
                f"0..{n_model_classes - 1}, or a model with as many classes as labels (or a "
                f"model spec such as model='softmax', sized from the data)"
            )
    if len(classes) < 2:
        raise ValueError(
            f"a classifier needs at least 2 classes in y, got 1 class {_show(classes)}"
        )
    return classes, codes


#: Widest range of integer labels :func:`fit_classes` counts rather than sorts (a count per value).
COUNT_SPAN = 2**16


def _counted_classes(y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.unique(y, return_inverse=True)`` for integer (or bool) labels whose range is at most
    ``COUNT_SPAN`` (or ``len(y)``) values, found by counting each value: a few passes over the
    labels instead of a sort (1M labels: a few ms against ~25 ms).  None for other labels."""
    if y.dtype.kind not in "iub" or y.size == 0 or y.ndim != 1:
        return None
    lo, hi = int(y.min()), int(y.max())
    if hi - lo > max(COUNT_SPAN, len(y)) or hi > np.iinfo(np.int64).max:
        return None
    shifted = y.astype(np.int64) - lo if lo else y.astype(np.int64, copy=False)
    present = np.bincount(shifted, minlength=hi - lo + 1) > 0
    code_of = np.cumsum(present) - 1  # each value's index among the values present
    return (np.flatnonzero(present) + lo).astype(y.dtype), code_of[shifted]


def encode(y: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Codes (int64 indices into ``classes``) of labels ``y``; raises for an unknown label."""
    y = np.asarray(y).reshape(-1)
    codes = np.searchsorted(classes, y)
    np.minimum(codes, len(classes) - 1, out=codes)
    unknown = classes[codes] != y
    if np.any(unknown):
        raise ValueError(
            f"y has labels the estimator was not fitted with: {_show(np.unique(y[unknown]))}; "
            f"its classes_ are {_show(classes)}"
        )
    return codes.astype(np.int64)


def decode(codes: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Labels of codes 0..K-1: ``classes[codes]``."""
    return classes[codes]


def _show(values: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(repr(v.item() if hasattr(v, "item") else v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
