"""A dataset that stays where it is: :class:`ShardedDataset`, a validated list of shards.

Built by :func:`downpour_dask.datasets.from_parquet`, ``from_npy``, ``from_csv``, ``from_dask``
or ``synthetic`` after checking the files' metadata (:mod:`downpour_dask.data.scan`), it is a
:class:`~downpour_dask.data.schema.Schema` plus :class:`~downpour_dask.data.schema.Shard`
descriptors.  :meth:`DownpourSGD.fit <downpour_dask.DownpourSGD.fit>` splits the shards among the
replicas (:mod:`downpour_dask.data.assignment`) and each replica streams its own, on its worker
(:mod:`downpour_dask.data.stream`): the data is never gathered to the client unless asked for
with :meth:`ShardedDataset.to_dataset`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import Dataset
from .readers import IN_ORDER, read_chunks
from .schema import Schema, Shard


class ShardedDataset:
    """A dataset made of shards that replicas stream where the data lives.

    Build one with :func:`downpour_dask.datasets.from_parquet`, ``from_npy``, ``from_csv``,
    ``from_dask`` or ``synthetic`` and pass it to :meth:`DownpourSGD.fit` like in-memory data.

    Parameters
    ----------
    schema : Schema
        Columns and dtypes shared by every shard.
    shards : list of Shard
        Whole files or partitions, in a fixed order.
    name : str, optional
        A label for logs and reports.
    shuffle_buffer : int, optional
        Rows each replica keeps in its shuffle buffer; by default about 32 MiB worth of rows
        (at least 4 batches, at most 65,536 rows).
    """

    def __init__(
        self,
        schema: Schema,
        shards: list[Shard],
        name: str | None = None,
        shuffle_buffer: int | None = None,
    ):
        if shuffle_buffer is not None and (
            isinstance(shuffle_buffer, bool)
            or not isinstance(shuffle_buffer, (int, np.integer))
            or shuffle_buffer < 1
        ):
            raise ValueError(f"shuffle_buffer must be an int >= 1 or None, got {shuffle_buffer!r}")
        self.schema, self.shards, self.name = schema, list(shards), name
        self.shuffle_buffer = shuffle_buffer

    @property
    def kind(self) -> str:
        """What the shards are: ``parquet``, ``npy``, ``csv``, ``frame`` or ``array``."""
        return self.schema.kind

    @property
    def n_rows(self) -> int:
        """Total number of rows over all shards."""
        return sum(s.rows for s in self.shards)

    @property
    def n_features(self) -> int:
        """Number of feature columns."""
        return self.schema.n_features

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return (
            f"ShardedDataset({label}kind={self.kind!r}, shards={len(self.shards)}, "
            f"rows={self.n_rows}, features={self.n_features})"
        )

    @property
    def n_classes(self) -> int | None:
        """``max label + 1`` if the labels are known (from metadata) to be integers >= 0.

        None for regression targets, or when the range is unknown (parquet files written
        without statistics, Dask collections).
        """
        schema = self.schema
        if schema.label_range is None or schema.y_width or schema.y_dtype[:1] not in "iub":
            return None
        lo, hi = schema.label_range
        return int(hi) + 1 if lo >= 0 else None

    def to_dataset(self) -> Dataset:
        """Read every row, in order, into an in-memory :class:`~downpour_dask.data.arrays.Dataset`.

        The only way a ShardedDataset is gathered: explicitly, where it is called, for data that
        fits in memory (evaluation data, a model's ``score``).  Nothing else reads it whole.
        """
        xbuf = np.empty((65536, self.n_features), np.float32)
        Xs, ys = [], []
        for shard in self.shards:
            for X, y in read_chunks(shard, self.schema, IN_ORDER, xbuf, None):
                Xs.append(X.copy())
                ys.append(y)
        X, y = np.concatenate(Xs), np.concatenate(ys)
        if self.schema.y_dtype[:1] in "iub":
            y = y.astype(np.int64)
        return Dataset(X, y, name=self.name)

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable summary for experiment configs: kind, shards, rows, features."""
        return {
            "kind": self.kind,
            "name": self.name,
            "n_shards": len(self.shards),
            "rows": self.n_rows,
            "features": self.n_features,
        }

    def check_model(self, model: Any, what: str = "data") -> None:
        """Raise ValueError/TypeError if ``model`` cannot train on this data (before any work).

        Checks the feature width against ``model.n_inputs`` and the target against the model's
        outputs: classifiers need a 1-D numeric label, regressors as many target columns as
        outputs.  Label values (range, integrality) are checked while streaming.
        """
        schema = self.schema
        if schema.n_features != model.n_inputs:
            raise ValueError(
                f"{what}: X has {schema.n_features} features, but {type(model).__name__} "
                f"expects {model.n_inputs} features (n_inputs)"
            )
        width = max(schema.y_width, 1)
        if model.is_classifier and schema.y_width > 1:
            raise ValueError(
                f"{what}: y must be 1-D class labels for a classifier, got {schema.y_width} "
                "target columns"
            )
        if not model.is_classifier and width != model.n_outputs:
            raise ValueError(
                f"{what}: y has {width} target column(s), but {type(model).__name__} expects "
                f"{model.n_outputs} (n_outputs)"
            )
