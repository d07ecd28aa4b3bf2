"""Dask collections as datasets, described from their metadata without importing Dask.

:func:`dask_dataset` checks a Dask DataFrame (or an ``(X, y)`` pair of Dask Arrays) from its
metadata alone -- columns, dtypes, chunk sizes -- and wraps it as a :class:`DaskDataset`.  The
collection is recognised by duck typing (the ``__dask_graph__`` of Dask's collection protocol,
``columns``/``dtypes`` of a DataFrame, ``chunks`` of an Array), so the data layer needs no Dask.

Which rows each partition holds is known only once the collection is persisted on a cluster;
that is done at fit (:mod:`downpour_dask.runtime.placement`), which describes the result with
:meth:`DaskDataset.with_partitions`: a *new* dataset.  The caller's dataset and collection are
never changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .arrays import Dataset
from .scan import check_columns
from .schema import Schema, Shard
from .shards import ShardedDataset
from .targets import encode


class DaskDataset(ShardedDataset):
    """A Dask DataFrame or ``(X, y)`` Dask Arrays; its shards (partitions) are known once placed.

    ``collection`` is the DataFrame or the ``(X, y)`` pair.  As built by
    :func:`~downpour_dask.datasets.from_dask`, ``shards`` is empty and :attr:`n_rows` is None
    unless the chunk sizes are known; :meth:`with_partitions` gives the placed copy that has them.
    """

    def __init__(
        self,
        schema: Schema,
        collection: Any,
        name: str | None,
        shuffle_buffer: int | None,
        shards: Sequence[Shard] = (),
    ):
        super().__init__(schema, list(shards), name=name, shuffle_buffer=shuffle_buffer)
        self.collection = collection

    @property
    def n_rows(self) -> int | None:  # type: ignore[override]
        """Total rows: known once placed (:meth:`with_partitions`), or from the chunk sizes."""
        if self.shards:
            return sum(s.rows for s in self.shards)
        if self.kind == "array":
            rows = self.collection[0].shape[0]
            return None if np.isnan(rows) else int(rows)
        return None

    @property
    def n_partitions(self) -> int:
        """Partitions of the DataFrame, or row blocks of the arrays."""
        if self.kind == "frame":
            return int(self.collection.npartitions)
        return len(self.collection[0].chunks[0])

    def with_partitions(
        self, collection: Any, rows: Sequence[int], names: Sequence[str]
    ) -> DaskDataset:
        """A new dataset for ``collection`` (this one's, persisted) with its partitions as shards.

        ``rows[i]`` is the number of rows in partition ``i`` and ``names[i]`` how error messages
        name it.  Empty partitions get no shard; each shard's ``part`` is its partition's index.
        This dataset is left as it is.
        """
        if len(rows) != len(names):
            raise ValueError(f"got row counts of {len(rows)} partitions but {len(names)} names")
        shards = [
            Shard(self.kind, names[i], 0, int(n), part=i) for i, n in enumerate(rows) if n > 0
        ]
        return DaskDataset(self.schema, collection, self.name, self.shuffle_buffer, shards)

    @property
    def labels(self) -> Any:
        """The label collection: the DataFrame's label column, or the ``y`` array."""
        if self.kind == "frame":
            return self.collection[self.schema.label]
        return self.collection[1]

    def with_labels(self, labels: Any) -> DaskDataset:
        """A new dataset whose labels are ``labels`` (a lazy collection with the same rows, e.g.
        from :func:`encode_labels`); this one is left as it is."""
        if self.kind == "frame":
            frame = self.collection.assign(**{self.schema.label: labels})
            return _frame_dataset(frame, self.schema.label, list(self.schema.features),
                                  self.name, self.shuffle_buffer)  # fmt: skip
        return _array_dataset(self.collection[0], labels, self.name, self.shuffle_buffer)

    def to_dataset(self) -> Dataset:
        """Compute the collection into an in-memory Dataset, here (for data that fits in memory).

        Runs the collection's graph with its default scheduler, or the active
        ``distributed.Client``, and gathers the result into this process.
        """
        if self.kind == "frame":
            frame = self.collection.compute()
            X = frame[list(self.schema.features)].to_numpy(dtype=np.float32, na_value=np.nan)
            y = frame[self.schema.label].to_numpy()
        else:
            X, y = (part.compute() for part in self.collection)
        return Dataset(X, y, name=self.name)


def _np_dtype(dtype: Any) -> np.dtype | None:
    """The numpy dtype behind a pandas/numpy dtype (nullable Int64 -> int64), or None."""
    try:
        return np.dtype(getattr(dtype, "numpy_dtype", dtype))
    except TypeError:
        return None


def _numeric(dtype: Any) -> bool:
    np_dtype = _np_dtype(dtype)
    return np_dtype is not None and np_dtype.kind in "biuf"


def _is_collection(obj: Any) -> bool:
    """Whether ``obj`` follows Dask's collection protocol (has a task graph)."""
    return callable(getattr(obj, "__dask_graph__", None))


def is_dask_frame(obj: Any) -> bool:
    """A Dask DataFrame (2-D, with columns), not a Series or an Array."""
    return (
        _is_collection(obj)
        and getattr(obj, "ndim", None) == 2
        and hasattr(obj, "columns")
        and hasattr(obj, "dtypes")
        and hasattr(obj, "npartitions")
    )


def is_dask_array(obj: Any) -> bool:
    """A Dask Array (has chunks and a dtype)."""
    return _is_collection(obj) and hasattr(obj, "chunks") and hasattr(obj, "dtype")


def _frame_dataset(
    data: Any, label: str | None, features: Any, name: str | None, shuffle_buffer: int | None
) -> DaskDataset:
    where = "data (Dask DataFrame)"
    label, feats = check_columns([str(c) for c in data.columns], label, features, where)
    dtypes = data.dtypes
    bad = [f"{c} ({dtypes[c]})" for c in (*feats, label) if not _numeric(dtypes[c])]
    if bad:
        raise TypeError(
            f"{where}: columns must be numeric (int, float or bool); non-numeric column(s): "
            f"{', '.join(bad[:10])}"
        )
    x_dtype = "+".join(sorted({_np_dtype(dtypes[c]).name for c in feats}))
    schema = Schema("frame", len(feats), x_dtype, str(dtypes[label]), feats, label)
    return DaskDataset(schema, data, name, shuffle_buffer)


def _array_dataset(X: Any, y: Any, name: str | None, shuffle_buffer: int | None) -> DaskDataset:
    if X.ndim != 2 or y.ndim not in (1, 2):
        raise ValueError(
            f"from_dask((X, y)): X must be 2-D and y 1-D or 2-D, got {X.ndim}-D and {y.ndim}-D"
        )
    for what, arr in (("X", X), ("y", y)):
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"from_dask((X, y)): {what} must be numeric, got {arr.dtype}")
    if not (np.isnan(X.shape[0]) or np.isnan(y.shape[0])) and X.shape[0] != y.shape[0]:
        raise ValueError(
            f"from_dask((X, y)): X and y must have the same number of rows, got "
            f"{X.shape[0]} and {y.shape[0]}"
        )
    X = X.rechunk({1: -1})  # one block per row range (a new collection: the caller's is kept)
    if y.ndim == 2:
        y = y.rechunk({1: -1})
    if not np.isnan(sum(X.chunks[0])) and y.chunks[0] != X.chunks[0]:
        y = y.rechunk({0: X.chunks[0]})
    y_width = y.shape[1] if y.ndim == 2 else 0
    schema = Schema("array", X.shape[1], X.dtype.name, y.dtype.name, y_width=y_width)
    return DaskDataset(schema, (X, y), name, shuffle_buffer)


def distinct_labels(labels: Any) -> Any:
    """A lazy collection of the distinct values of ``labels`` (a Dask Series or 1-D Array), each
    block's own: compute it on the cluster and ``np.unique`` the small result.

    A block's values are found by hashing (``pandas.unique``), not by sorting the whole block
    as ``np.unique`` does: the scan is on the critical path of every fit on a Dask collection.
    """
    if hasattr(labels, "map_partitions"):
        return labels.map_partitions(_unique_values, meta=(labels.name, labels.dtype))
    blocks = ((np.nan,) * len(labels.chunks[0]),)
    return labels.map_blocks(pd.unique, chunks=blocks, dtype=labels.dtype)


def encode_labels(labels: Any, classes: np.ndarray) -> Any:
    """``labels`` (a Dask Series or 1-D Array) as int64 codes into ``classes``, lazily: each block
    is encoded where it is computed (an unknown label fails that block with a clear error)."""
    if hasattr(labels, "map_partitions"):
        return labels.map_partitions(_encode_series, classes, meta=(labels.name, "int64"))
    return labels.map_blocks(encode, classes, dtype=np.int64)


def _unique_values(part: pd.Series) -> pd.Series:
    return pd.Series(pd.unique(part.to_numpy()), name=part.name)


def _encode_series(part: pd.Series, classes: np.ndarray) -> pd.Series:
    return pd.Series(encode(part.to_numpy(), classes), index=part.index, name=part.name)


def fit_arguments_dataset(X: Any, y: Any, name: str | None = None) -> DaskDataset:
    """``fit(X, y)`` with Dask collections: a DataFrame X with a Series y, or Array X with Array y.

    The label joins the frame as column ``label`` (``__label__`` if X has a ``label`` column);
    nothing is computed.  Raises TypeError for any other combination.
    """
    if is_dask_frame(X) and hasattr(y, "map_partitions") and getattr(y, "ndim", 0) == 1:
        label = "__label__" if "label" in X.columns else "label"
        features = [str(c) for c in X.columns]
        return _frame_dataset(X.assign(**{label: y}), label, features, name, None)
    if is_dask_array(X) and is_dask_array(y):
        return _array_dataset(X, y, name, None)
    raise TypeError(
        "fit(X, y) with Dask collections takes a Dask DataFrame X with a Dask Series y, or a "
        f"Dask Array X with a Dask Array y; got {type(X).__name__} and {type(y).__name__}"
    )


def map_rows(collection: Any, func: Any, dtype: Any, columns: Sequence | None = None) -> Any:
    """Apply ``func`` (a 2-D float block -> (n,) or (n, len(columns)) values) lazily to each
    row block of a Dask Array or partition of a Dask DataFrame, where they are.

    Returns a Dask Array (1-D, or 2-D with ``columns``) for an Array, a Dask Series (or
    DataFrame with ``columns``, keeping the index) for a DataFrame; nothing is computed.
    """
    dtype = np.dtype(dtype)
    if is_dask_frame(collection):
        if columns is None:
            meta: Any = pd.Series([], dtype=dtype if dtype.kind != "U" else object)
            return collection.map_partitions(_series_of, func, meta=meta)
        meta = pd.DataFrame({c: pd.Series([], dtype=dtype) for c in columns})
        return collection.map_partitions(_frame_of, func, list(columns), meta=meta)
    X = collection.rechunk({1: -1})
    if columns is None:
        return X.map_blocks(func, dtype=dtype, drop_axis=1, meta=np.empty((0,), dtype))
    chunks = (X.chunks[0], (len(columns),))
    return X.map_blocks(func, dtype=dtype, chunks=chunks, meta=np.empty((0, 0), dtype))


def _series_of(part: pd.DataFrame, func: Any) -> pd.Series:
    return pd.Series(func(part.to_numpy(np.float32)), index=part.index)


def _frame_of(part: pd.DataFrame, func: Any, columns: list) -> pd.DataFrame:
    return pd.DataFrame(func(part.to_numpy(np.float32)), index=part.index, columns=columns)


def is_dask_collection(obj: Any) -> bool:
    """Whether ``obj`` is any Dask collection (Array, DataFrame, Series, ...)."""
    return _is_collection(obj)


def dask_dataset(
    data: Any,
    label: str | None,
    features: Any,
    name: str | None,
    shuffle_buffer: int | None,
) -> DaskDataset:
    """Check a Dask DataFrame or (X, y) Dask Arrays from metadata; see ``datasets.from_dask``.

    Raises
    ------
    TypeError
        ``data`` is neither, or has non-numeric columns/arrays.
    ValueError
        Missing label/feature columns, arrays of the wrong dimensions or lengths.
    """
    if is_dask_frame(data):
        return _frame_dataset(data, label, features, name, shuffle_buffer)
    if isinstance(data, tuple) and len(data) == 2 and all(is_dask_array(a) for a in data):
        return _array_dataset(data[0], data[1], name, shuffle_buffer)
    raise TypeError(
        "from_dask expects a dask.dataframe.DataFrame or an (X, y) tuple of dask.array.Arrays, "
        f"got {type(data).__name__}"
    )
