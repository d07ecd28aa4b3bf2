"""What ``fit(X, y)`` accepts, checked and made ready for a model: :func:`prepare_fit`.

Both estimators take data as scikit-learn does (arrays, DataFrames, any labels) and as this
library does (a :class:`~downpour_dask.datasets.Dataset`, files, Dask collections).  Here each
form is checked once, the fitted facts scikit-learn defines are set on the estimator
(``n_features_in_``, ``feature_names_in_``, ``classes_``), labels become the codes 0..K-1 the
model trains on (:mod:`downpour_dask.data.targets`), and the model is built from its spec for
the data's shape.  Dask collections stay distributed: their classes come from one pass over the
labels on the cluster, and their labels are encoded lazily, block by block, where the replicas
compute them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import assert_all_finite, column_or_1d, validate_data

from .core import protocol
from .core.protocol import TrainableModel
from .core.specs import make_model
from .data import targets
from .data.dask_collections import (
    DaskDataset,
    distinct_labels,
    encode_labels,
    fit_arguments_dataset,
    is_dask_collection,
)
from .data.datasets import Dataset, as_dataset
from .data.shards import ShardedDataset
from .runtime.deadlines import waiting_for


def is_distributed(data: Any) -> bool:
    """Whether ``data`` stays where it is (files or Dask collections): :func:`prepare_fit`
    then needs the cluster's client."""
    return isinstance(data, ShardedDataset) or is_dask_collection(data)


def prepare_fit(est: Any, data: Any, y: Any, client: Any = None) -> tuple[TrainableModel, Any]:
    """Check ``data``/``y`` for ``est.fit``; set ``n_features_in_`` (``feature_names_in_``) and
    ``classes_`` on ``est`` and build the model.  Returns ``(model, training data)``.

    In-memory data gives checked ``(X, codes)`` arrays.  Files or Dask collections give a
    :class:`~downpour_dask.datasets.ShardedDataset`; for Dask labels, ``client`` computes their
    distinct values on its cluster (a small result) and the codes are computed lazily there.
    With ``est.warm_start`` and a previous fit, the model, features and classes are that fit's.
    """
    if is_distributed(data):
        return _prepare_distributed(est, data, y, client)
    if isinstance(data, Dataset):
        if y is not None:
            raise TypeError("data is a Dataset, so y must not be given separately")
        data, y = data.X, data.y
    elif isinstance(data, tuple) and len(data) == 2 and y is None:
        data, y = data
    warm, classifier = est._warm(), est._is_classifier()
    X, y = validate_data(
        est, data, y, reset=not warm, dtype=np.float32, multi_output=True,
        y_numeric=not classifier, ensure_all_finite=False,  # the model's check looks: below
    )  # fmt: skip
    n_classes = n_outputs = None
    if classifier:
        if not (y.ndim == 1 and y.dtype.kind in "iub"):  # integers are classes: no sort to see
            check_classification_targets(y)
        y = column_or_1d(y, warn=True)
        if warm:
            y = targets.encode(y, est.classes_)
        else:
            est.classes_, y = targets.fit_classes(y, _fixed_classes(est))
        n_classes = len(est.classes_)
    else:
        n_outputs = 1 if y.ndim == 1 else y.shape[1]
    model = build_model(est, X.shape[1], n_classes, n_outputs)
    if not protocol.checks_finite_features(model):
        assert_all_finite(X, input_name="X")
    try:
        return model, protocol.check_data(model, X, y)
    except (ValueError, TypeError) as err:
        raise type(err)(f"data: {err}") from None


def prepare_before_cluster(
    est: Any, data: Any, y: Any, eval_data: Any
) -> tuple[TrainableModel | None, Any, tuple | None]:
    """What ``est.fit`` can check before any cluster work: in-memory data and ``eval_data``
    checked, and the model built (:func:`prepare_fit`, :func:`evaluation_data`): ``(model,
    training data, evaluation data)``; files too, from their metadata.  Dask collections need
    the cluster for their labels: only the kinds of ``data`` and ``y`` are checked
    (:func:`check_distributed`), and ``(None, None, None)`` returned."""
    if isinstance(data, DaskDataset) or is_dask_collection(data):
        check_distributed(est, data, y)
        return None, None, None
    model, train = prepare_fit(est, data, y)
    return model, train, evaluation_data(est, model, eval_data)


def check_distributed(est: Any, data: Any, y: Any) -> None:
    """Raise if files or a Dask ``data`` come with a ``y`` they cannot take: a ShardedDataset
    holds its targets; a Dask X needs a Dask y, whose blocks line up with its partitions."""
    if isinstance(data, ShardedDataset):
        if y is not None:
            raise TypeError("data is a ShardedDataset (it holds the targets), so y must be None")
    elif y is None:
        raise ValueError(
            f"{type(est).__name__}.fit(X, y) with a Dask X needs y (a Dask Series or Array); or "
            f"pass datasets.from_dask(frame, label=...)"
        )
    elif not is_dask_collection(y):
        raise TypeError(
            f"{type(est).__name__}.fit(X, y) with a Dask X needs y as a Dask Series or Array "
            f"too, split as X is, got {type(y).__module__}.{type(y).__name__}; e.g. "
            f"dask.array.from_array(y, chunks=X.chunks[0]), or datasets.from_dask(frame, "
            f"label=...)"
        )


def _prepare_distributed(est: Any, data: Any, y: Any, client: Any) -> tuple[TrainableModel, Any]:
    check_distributed(est, data, y)
    classifier, warm = est._is_classifier(), est._warm()
    labels = data.labels if isinstance(data, DaskDataset) else y  # None: files
    encoded = False
    if classifier:
        if warm:
            classes = est.classes_
        elif labels is None:  # files: the model's classes, or 0..max label from metadata
            n_classes = _fixed_classes(est) or data.n_classes
            if n_classes is None:
                raise ValueError(
                    "data: the files' label range is unknown (written without statistics); "
                    "give a model with its number of classes, e.g. models.SoftmaxRegression(n, k)"
                )
            classes = np.arange(n_classes)
        else:
            scan = "the label scan of the Dask collection (its distinct labels, for classes_)"
            with waiting_for(scan, est.timeout):
                distinct = client.compute(distinct_labels(labels)).result(timeout=est.timeout)
            classes = targets.fit_classes(np.unique(np.asarray(distinct)), _fixed_classes(est))[0]
        if labels is not None and not np.array_equal(classes, np.arange(len(classes))):
            labels, encoded = encode_labels(labels, classes), True
        est.classes_ = classes
    if not isinstance(data, ShardedDataset):
        data = fit_arguments_dataset(data, labels)
    elif encoded:
        data = data.with_labels(labels)
    if not warm:
        est.n_features_in_ = data.n_features
        if data.kind == "frame":
            est.feature_names_in_ = np.asarray(data.schema.features, dtype=object)
    elif data.n_features != est.n_features_in_:
        raise ValueError(
            f"X has {data.n_features} features, but {type(est).__name__} is expecting "
            f"{est.n_features_in_} features as input"
        )
    n_classes = len(est.classes_) if classifier else None
    model = build_model(est, data.n_features, n_classes, max(data.schema.y_width, 1))
    data.check_model(model, "data")
    return model, data


def _fixed_classes(est: Any) -> int | None:
    """The class count of a model given ready-built, or None for a spec."""
    spec = est._model_spec()
    return spec.n_classes if not isinstance(spec, str) and spec.is_classifier else None


def build_model(
    est: Any, n_features: int, n_classes: int | None, n_outputs: int | None
) -> TrainableModel:
    """The model ``est`` trains: the previous fit's (``warm_start``), the one given, or one
    built from its spec for this data's features and classes (or target columns)."""
    if est._warm():
        return est.model_
    model = est._model_spec()
    if isinstance(model, str):
        model = make_model(model, n_features, n_classes, n_outputs or 1)
    est._check_model(model)  # e.g. more shards than parameters
    return model


def evaluation_data(est: Any, model: TrainableModel, eval_data: Any) -> tuple | None:
    """``eval_data`` (a Dataset or ``(X, y)``, in memory) checked against the fitted features
    and ``model``, its labels encoded as the training's; None if not given."""
    if eval_data is None:
        return None
    parts = eval_data if isinstance(eval_data, tuple) else (eval_data,)
    if any(is_dask_collection(part) for part in parts):  # never gathered behind the user's back
        raise TypeError(
            "eval_data is scored in memory, so it must be a Dataset or (X, y) arrays, not Dask "
            "collections, which are never gathered implicitly; compute them first (e.g. "
            "dask.compute(X, y)) if they fit in memory"
        )
    dataset = as_dataset(eval_data, None, what="eval_data")
    y = dataset.y
    try:
        if est._is_classifier():
            y = targets.encode(column_or_1d(y), est.classes_)
        return protocol.check_data(model, dataset.X, y)  # a Dataset's arrays have no column names
    except (ValueError, TypeError) as err:
        raise type(err)(f"eval_data: {err}") from None
