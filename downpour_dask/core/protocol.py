"""The model protocol: what any model must provide to be trained by downpour-dask.

The estimators never look inside a model.  They ask it for a parameter count, a first flat
``float32`` parameter vector, the loss and gradient of a batch, predictions and a score; the
parameter server only ever holds the flat vector, sharded by element ranges.  So any object with
the members below trains with Downpour SGD and Sandblaster L-BFGS -- the four built-in models,
a JAX function wrapped by :func:`downpour_dask.models.from_jax`, or a numpy class of your own.

Required members (:class:`TrainableModel`):

``n_params`` : int
    Length of the flat parameter vector.
``n_inputs`` : int
    Features per row of ``X`` (the data is checked against it before any work).
``is_classifier`` : bool
    True: ``y`` holds integer labels ``0..n_classes-1`` and ``score`` is the accuracy.  False:
    ``y`` holds float targets, ``n_outputs`` of them per row, and ``score`` is R^2.
``n_classes`` (classifiers) / ``n_outputs`` (regressors) : int
``init(rng) -> ndarray``
    A new float32 vector of ``n_params`` elements; depends only on ``rng`` (a
    ``numpy.random.Generator``), so every process seeded alike starts alike.
``loss_and_grad(params, X, y, out=None) -> (float, ndarray)``
    The objective on the batch -- the **mean** loss over its rows plus any penalty -- and its
    gradient with respect to ``params``, written into ``out`` when given (a contiguous vector of
    ``params``' dtype and length, which must then be returned) or into a new vector.  ``params``
    must not be modified.
``predict(params, X) -> ndarray`` and ``score(params, X, y) -> float``
    :func:`score_predictions` computes accuracy or R^2 from predictions as the built-in models do.

Optional members, with what is done without them:

``get_config() -> dict``
    JSON-able constructor arguments with ``"type"``; run directories and checkpoints store it,
    and :func:`downpour_dask.models.from_config` rebuilds built-in models from it.  Without it
    the config is a description (:func:`config`) and a run directory is read back with
    ``load_run(path, model=...)``.
``check_data(X, y=None) -> (X, y)``
    Validates user data once; default :func:`default_check_data` (float32 features of width
    ``n_inputs``, finite, labels in range or targets of the right width).
``loss(params, X, y) -> float``
    The objective without the gradient (evaluations); default: ``loss_and_grad`` in blocks.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from .validation import (
    as_numeric,
    check_class_labels,
    check_features,
    check_regression_targets,
    check_same_rows,
)

#: Members every model needs, and what each one is (for error messages).
REQUIRED = {
    "n_params": "int, length of the flat parameter vector",
    "n_inputs": "int, features per row of X",
    "is_classifier": "bool, whether y holds class labels",
    "init": "method init(rng) -> float32 vector of n_params",
    "loss_and_grad": "method loss_and_grad(params, X, y, out=None) -> (mean loss, gradient)",
    "predict": "method predict(params, X) -> predictions",
    "score": "method score(params, X, y) -> accuracy or R^2",
}
_METHODS = ("init", "loss_and_grad", "predict", "score")
_BLOCK = 2048  # rows per loss_and_grad call when a model has no loss()
_PACKAGE = __name__.partition(".")[0]  # "downpour_dask"

#: The ``"type"`` of :func:`config` for a model that has no ``get_config``.
CUSTOM = "custom"


@runtime_checkable
class TrainableModel(Protocol):
    """What the estimators need of a model (see the module docstring for the contract)."""

    n_params: int
    n_inputs: int
    is_classifier: bool

    def init(self, rng: np.random.Generator) -> np.ndarray: ...

    def loss_and_grad(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[float, np.ndarray]: ...

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray: ...

    def score(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float: ...


def check_model(model: Any, what: str = "model") -> None:
    """Raise TypeError unless ``model`` satisfies the protocol, naming every missing member.

    Raises
    ------
    TypeError
        Members missing or of the wrong kind; the message lists what each required member is.
    """
    problems = [name for name in REQUIRED if not hasattr(model, name)]
    for method in _METHODS:
        if method not in problems and not callable(getattr(model, method)):
            problems.append(f"{method} (not callable)")
    if not problems:
        size, inputs = model.n_params, model.n_inputs
        for name, value in (("n_params", size), ("n_inputs", inputs)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                problems.append(f"{name} (must be an int >= 1, got {value!r})")
        extra = "n_classes" if model.is_classifier else "n_outputs"
        value = getattr(model, extra, None)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            kind = "a classifier" if extra == "n_classes" else "a regressor"
            problems.append(f"{extra} (an int >= 1 that {kind} must have, got {value!r})")
    if problems:
        required = "; ".join(f"{k}: {v}" for k, v in REQUIRED.items())
        raise TypeError(
            f"{what} of type {type(model).__name__} does not satisfy the model protocol: "
            f"missing or invalid {', '.join(problems)}.  A model needs {required}; and "
            f"n_classes (classifiers) or n_outputs (regressors).  See "
            f"downpour_dask.core.protocol, or wrap a JAX function with models.from_jax"
        )


def default_check_data(model: Any, X: Any, y: Any = None) -> tuple[np.ndarray, Any]:
    """Validate user data for a protocol model; see :meth:`Model.check_data` for the result.

    Features become C-contiguous float32 of shape (n, ``n_inputs``), finite; labels int64 in
    ``0..n_classes-1``; regression targets float32 of shape (n,) or (n, n_outputs).
    """
    name = type(model).__name__
    X = check_features(X, model.n_inputs, name)
    if y is None:
        return X, None
    y = as_numeric("y", y)
    check_same_rows(X, y)
    n_outputs = getattr(model, "n_outputs", 1)
    if y.ndim == 2 and y.shape[1] == 1 and (model.is_classifier or n_outputs == 1):
        y = y[:, 0]
    if model.is_classifier:
        return X, check_class_labels(y, model.n_classes)
    return X, check_regression_targets(y, n_outputs, name)


def checks_finite_features(model: Any) -> bool:
    """Whether :func:`check_data` rejects NaN and infinite features for ``model``: it does
    with :func:`default_check_data` and this library's models (which call it); a model's own
    ``check_data`` is not known to, so ``fit`` checks the features itself before calling it."""
    own = getattr(type(model), "check_data", None)
    return own is None or getattr(own, "__module__", "").startswith(f"{_PACKAGE}.")


def check_data(model: Any, X: Any, y: Any = None) -> tuple[np.ndarray, Any]:
    """``model.check_data(X, y)`` if the model has one, else :func:`default_check_data`."""
    own = getattr(model, "check_data", None)
    return own(X, y) if callable(own) else default_check_data(model, X, y)


def loss(model: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    """The model's objective on ``(X, y)``: ``model.loss`` if it has one, else the row-weighted
    mean of ``loss_and_grad`` over blocks (the penalty, the same in every block, counts once)."""
    own = getattr(model, "loss", None)
    if callable(own):
        return float(own(params, X, y))
    total, out = 0.0, np.empty(len(params), params.dtype)
    for lo in range(0, len(X), _BLOCK):
        value, _ = model.loss_and_grad(params, X[lo : lo + _BLOCK], y[lo : lo + _BLOCK], out=out)
        total += float(value) * len(X[lo : lo + _BLOCK])
    return total / len(X)


def loss_and_score(
    model: Any, params: np.ndarray, X: np.ndarray, y: np.ndarray
) -> tuple[float, float]:
    """``(loss, score)`` of ``params`` on ``(X, y)``: ``model.loss_and_score`` if the model has
    one (the library's models: one forward pass for both), else :func:`loss` and ``score``."""
    own = getattr(model, "loss_and_score", None)
    if callable(own):
        value, score = own(params, X, y)
        return float(value), float(score)
    return loss(model, params, X, y), float(model.score(params, X, y))


def config(model: Any) -> dict[str, Any]:
    """``model.get_config()``, or a description that says it cannot rebuild the model:
    ``{"type": "custom", "class": "module.Name", "n_params": ...}``."""
    own = getattr(model, "get_config", None)
    if callable(own):
        return own()
    cls = type(model)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return {"type": CUSTOM, "class": name, "n_params": int(model.n_params)}


def score_predictions(pred: np.ndarray, y: np.ndarray, is_classifier: bool) -> float:
    """Accuracy of predicted labels, or R^2 averaged over outputs (as scikit-learn's
    ``r2_score``, with its ``force_finite``: constant targets score 1 if fitted exactly, else 0)."""
    pred = np.asarray(pred)
    if is_classifier:
        return float(np.mean(pred == np.asarray(y).reshape(pred.shape)))
    truth = np.asarray(y, np.float64).reshape(len(pred), -1)
    pred = pred.astype(np.float64).reshape(truth.shape)
    sse = ((truth - pred) ** 2).sum(axis=0)
    sst = ((truth - truth.mean(axis=0)) ** 2).sum(axis=0)
    r2 = np.where(sst > 0, 1 - sse / np.where(sst > 0, sst, 1), np.where(sse == 0, 1.0, 0.0))
    return float(r2.mean())
