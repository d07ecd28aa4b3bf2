"""What a dataset's shards are and share: :class:`Shard` descriptors, the :class:`Schema`, and the
errors that name a shard.

A shard is a row range of one parquet/CSV file, one ``.npy`` pair, or one Dask partition.
Descriptors are small frozen, picklable records: a replica task receives only its own descriptors
and reads the rows itself, on its worker, so the data never goes through the client.  Every
other module of the data layer speaks in these terms, so this one imports nothing from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: How a shard is read: files (``parquet``, ``npy``, ``csv``) or Dask partitions.
KINDS = ("parquet", "npy", "csv", "frame", "array")


class ShardReadError(OSError):
    """A shard's file could not be read (missing, unreadable or corrupt); names the file."""


class ShardDataError(ValueError):
    """A shard holds data training cannot use (NaN/inf, bad labels); names the file and rows."""


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of one file or partition.

    Attributes
    ----------
    kind : {"parquet", "npy", "csv", "frame", "array"}
        How to read it; ``frame``/``array`` are Dask DataFrame/Array partitions.
    path : str
        The file (the features file for ``npy``), or a partition's name for Dask kinds.
    start, stop : int
        Row range inside the file or partition.
    y_path : str, optional
        The labels file of an ``npy`` pair.
    part : int, optional
        Dask kinds: index of the partition among those passed to the replica task.
    """

    kind: str
    path: str
    start: int
    stop: int
    y_path: str | None = None
    part: int | None = None

    @property
    def rows(self) -> int:
        """Number of rows in the shard."""
        return self.stop - self.start

    def where(self, lo: int | None = None, hi: int | None = None) -> str:
        """Human-readable location for error messages, e.g. ``'a.parquet (rows 0-100)'``."""
        lo = self.start if lo is None else lo
        hi = self.stop if hi is None else hi
        return f"{self.path} (rows {lo}-{hi})"


@dataclass(frozen=True)
class Schema:
    """What every shard of a dataset shares: columns, dtypes and widths.

    ``features`` and ``label`` are column names (``None`` for npy/array data, which have no
    names); ``x_dtype``/``y_dtype`` are numpy dtype strings of the stored data; ``y_width`` is 0
    for 1-D targets, else the number of target columns.
    """

    kind: str
    n_features: int
    x_dtype: str
    y_dtype: str
    features: tuple[str, ...] | None = None
    label: str | None = None
    y_width: int = 0
    delimiter: str = ","
    label_range: tuple[float, float] | None = None  # (min, max) when known from metadata


def read_error(err: Exception, where: str) -> ShardReadError:
    """``err`` (raised while reading ``where``) as a ShardReadError naming the place."""
    return ShardReadError(f"cannot read {where}: {type(err).__name__}: {err}")


def open_npy(path: str) -> np.ndarray:
    """Memory-map an ``.npy`` file (only its header is read); ShardReadError if it cannot."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise read_error(err, path) from err
