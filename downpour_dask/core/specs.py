"""Models by name: ``"mlp:128,64"``, ``"mlp"``, ``"softmax"``, ``"logistic"``, ``"linear"``,
``"cnn"``.

A *model spec* names a model without its sizes, which come from the data: the CLI's ``--model``
and the estimators' ``model="softmax"`` (or ``model=None``, a default per estimator) are built
here once the number of features and of classes (or target columns) is known.  A spec names a
classifier (``mlp``, ``softmax``, ``logistic``) or a regressor (``linear``) before any data is
seen, which is what lets an unfitted estimator say which kind it is (:func:`is_classifier_spec`).
"""

from __future__ import annotations

import math

from .models import MLP, LinearRegression, LogisticRegression, SoftmaxRegression, cnn
from .protocol import TrainableModel

#: What a model spec may be, for error messages.
ALLOWED = "mlp:H1,H2,... (hidden layer widths), mlp, softmax, logistic, linear or cnn (needs jax)"
#: Spec kinds that build classifiers; ``linear`` builds a regressor.
CLASSIFIER_KINDS = ("mlp", "softmax", "logistic", "cnn")


def parse_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """``"mlp:128,64"`` -> ``("mlp", (128, 64))``; raises ValueError naming what is allowed."""
    if not isinstance(spec, str):
        raise TypeError(f"a model spec must be a str ({ALLOWED}), got {type(spec).__name__}")
    kind, _, arg = spec.partition(":")
    if kind == "mlp":
        try:
            hidden = tuple(int(h) for h in arg.split(",")) if arg else (128,)
        except ValueError:
            raise ValueError(f"model {spec!r}: hidden widths must be integers; {ALLOWED}") from None
        if any(h < 1 for h in hidden):
            raise ValueError(f"model {spec!r}: hidden widths must be >= 1")
        return kind, hidden
    if kind not in ("softmax", "logistic", "linear", "cnn"):
        raise ValueError(f"unknown model {spec!r}; allowed: {ALLOWED}")
    if arg:
        raise ValueError(f"model {spec!r}: only mlp takes arguments; {ALLOWED}")
    return kind, ()


def is_classifier_spec(spec: str) -> bool:
    """Whether ``spec`` builds a classifier (checked: raises ValueError for a bad spec)."""
    return parse_spec(spec)[0] in CLASSIFIER_KINDS


def make_model(
    spec: str, n_features: int, n_classes: int | None, n_outputs: int = 1
) -> TrainableModel:
    """Build a model from ``mlp:128,64``, ``mlp``, ``softmax``, ``logistic``, ``linear`` or
    ``cnn`` (a JAX convolutional network for square images such as mnist5k's 28x28; needs the
    ``jax`` extra).

    ``n_classes`` is the number of class labels in the training data (``None`` for a regression
    target); it sets the output width of ``mlp``, ``softmax`` and ``cnn``.  ``n_outputs`` is the
    number of target columns of ``linear``.
    """
    kind, hidden = parse_spec(spec)
    if kind == "mlp":
        return MLP(n_features, hidden, _classes(spec, n_classes))
    if kind == "softmax":
        return SoftmaxRegression(n_features, _classes(spec, n_classes))
    if kind == "logistic":
        if n_classes != 2:
            raise ValueError(f"model 'logistic' needs labels 0/1, the data has {n_classes} classes")
        return LogisticRegression(n_features)
    if kind == "cnn":
        side = math.isqrt(n_features)
        if side * side != n_features:
            raise ValueError(
                f"model 'cnn' needs square images (n_features a square), got {n_features} features"
            )
        return cnn(image_shape=(side, side), n_classes=_classes(spec, n_classes))
    return LinearRegression(n_features, n_outputs)


def _classes(spec: str, n_classes: int | None) -> int:
    if n_classes is None or n_classes < 2:
        raise ValueError(
            f"model {spec!r} is a classifier, which needs at least 2 classes, but the labels "
            f"are not classes 0..K-1 with K >= 2 (got n_classes={n_classes})"
        )
    return n_classes
