"""Datasets and models from their names: ``--dataset mnist5k`` (or a path), ``--model mlp:128``
(or ``cnn``, or a user's factory ``package.module:function``).

Built-in models are built by :func:`downpour_dask.core.specs.make_model`, which the estimators
share for their ``model="softmax"``-style specs; a factory spec is the command line's own.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np

from ..core import specs
from ..core.protocol import TrainableModel, check_model
from ..data import datasets

__all__ = ["describe_labels", "load_dataset", "make_model"]


def load_dataset(
    spec: str, eval_spec: str | None = None, label: str = "label"
) -> tuple[Any, Any]:
    """Resolve ``--dataset`` (and ``--eval-dataset``) to ``(train, test)``.

    Parameters
    ----------
    spec : str
        The name of a shipped dataset (see :func:`downpour_dask.datasets.available`; its test
        split becomes the evaluation data) or a path: a parquet file, a directory or glob of
        parquet files, or a ``.csv`` file, with the label in column ``label``.  Files are
        streamed by the replicas, never loaded here.
    eval_spec : str, optional
        Evaluation data as a path of the same kinds (read into memory), or a shipped name (its
        test split).  For a path ``spec`` without it, the run is not evaluated.
    label : str, default "label"
        The label column of the files (shipped datasets have their own).
    """
    if spec in datasets.available():
        train, test = datasets.load(spec)
    else:
        train, test = _from_path(spec, "dataset", label), None
    if eval_spec is not None:
        if eval_spec in datasets.available():
            test = datasets.load(eval_spec)[1]
        else:
            test = _from_path(eval_spec, "eval_dataset", label).to_dataset()
    return train, test


def _from_path(spec: str, what: str, label: str) -> Any:
    looks_like_glob = any(c in spec for c in "*?[")
    if not looks_like_glob and not Path(spec).exists():
        raise ValueError(
            f"{what} {spec!r} is neither a shipped dataset ({', '.join(datasets.available())}) "
            f"nor an existing file or directory"
        )
    if spec.endswith(".csv"):
        return datasets.from_csv(spec, label=label)
    return datasets.from_parquet(spec, label=label)  # a file, a directory or a glob


def make_model(spec: str, n_features: int, n_classes: int | None) -> TrainableModel:
    """Build a model from a built-in spec (``mlp:128,64``, ``mlp``, ``softmax``, ``logistic``,
    ``linear``, ``cnn``: :func:`downpour_dask.core.specs.make_model`) or a factory,
    ``package.module:factory``.

    ``n_classes`` is the number of class labels in the training data (``None`` for a regression
    target).  A factory is imported and called as ``factory(n_features=..., n_classes=...)`` and
    must return a model of the protocol (:mod:`downpour_dask.core.protocol`); its module must be
    importable here and on the workers (installed, or on ``PYTHONPATH``).
    """
    kind, _, arg = spec.partition(":")
    if kind not in specs.CLASSIFIER_KINDS + ("linear",) and arg:
        return _from_factory(spec, kind, arg, n_features, n_classes)
    return specs.make_model(spec, n_features, n_classes)


def _from_factory(
    spec: str, module_name: str, attr: str, n_features: int, n_classes: int | None
) -> TrainableModel:
    """``module_name:attr`` imported and called with the dataset's shape."""
    try:
        factory: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model {spec!r}: cannot import module {module_name!r} ({err}); a factory must be "
            f"importable (installed, or its directory on PYTHONPATH)"
        ) from None
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {module_name} has no function {attr!r}")
    model = factory(n_features=n_features, n_classes=n_classes)
    check_model(model, what=f"the model from {spec!r}")
    return model


def describe_labels(train: Any) -> tuple[int, int | None]:
    """Number of features and of classes (``None`` if the labels are not class indices)."""
    n_classes = getattr(train, "n_classes", None)
    if n_classes is None and hasattr(train, "y"):
        y = np.asarray(train.y)
        integral = y.ndim == 1 and len(y) and np.all(np.equal(np.mod(y, 1), 0)) and y.min() >= 0
        n_classes = int(y.max()) + 1 if integral else None
    return int(train.n_features), n_classes
