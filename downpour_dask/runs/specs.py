"""Datasets and models from their names: ``--dataset mnist5k`` (or a path), ``--model mlp:128``.

Models are built by :func:`downpour_dask.core.specs.make_model` (re-exported here), which the
estimators share for their ``model="softmax"``-style specs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..core.specs import make_model
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


def describe_labels(train: Any) -> tuple[int, int | None]:
    """Number of features and of classes (``None`` if the labels are not class indices)."""
    n_classes = getattr(train, "n_classes", None)
    if n_classes is None and hasattr(train, "y"):
        y = np.asarray(train.y)
        integral = y.ndim == 1 and len(y) and np.all(np.equal(np.mod(y, 1), 0)) and y.min() >= 0
        n_classes = int(y.max()) + 1 if integral else None
    return int(train.n_features), n_classes
