"""The public datasets module, imported as ``downpour_dask.datasets``: every way to get data.

* Shipped real data: :func:`load` (``digits``, ``mnist5k``) and :func:`available`.
* In memory: :func:`from_arrays` (a :class:`Dataset`); :func:`as_dataset` accepts the forms
  estimators take (a Dataset, an ``(X, y)`` pair, or ``X`` with ``y``).
* Data that stays where it is: :func:`from_parquet`, :func:`from_npy`, :func:`from_csv` and
  :func:`from_dask` return a :class:`ShardedDataset`, a validated list of shards that each
  replica streams on its own worker; :func:`synthetic` writes a large learnable one.

The work is done in the data layer's modules (:mod:`downpour_dask.data`); this one gathers the
names users need in one place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import Dataset, minibatches
from .dask_collections import DaskDataset, dask_dataset
from .scan import scan_csv, scan_npy, scan_parquet
from .schema import Shard, ShardDataError, ShardReadError
from .shards import ShardedDataset
from .shipped import available, load
from .synthetic import write_synthetic

__all__ = [
    "DaskDataset",
    "Dataset",
    "Shard",
    "ShardDataError",
    "ShardReadError",
    "ShardedDataset",
    "as_dataset",
    "available",
    "from_arrays",
    "from_csv",
    "from_dask",
    "from_npy",
    "from_parquet",
    "load",
    "minibatches",
    "synthetic",
]


def from_arrays(X: np.ndarray, y: np.ndarray, name: str | None = None) -> Dataset:
    """Wrap in-memory arrays as a :class:`Dataset` (see :class:`Dataset` for the checks made)."""
    return Dataset(X, y, name=name)


# -- data that stays where it is: files and Dask collections, streamed by the replicas --------


def from_parquet(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    label: str = "label",
    features: Sequence[str] | None = None,
    name: str | None = None,
    shuffle_buffer: int | None = None,
) -> ShardedDataset:
    """Parquet files as a dataset that replicas stream by row group (nothing is loaded here).

    Parameters
    ----------
    paths : path, glob pattern, directory, or a list of them
        The files; a directory means its ``*.parquet`` files.  Each file is a shard; files are
        split into row ranges when there are fewer than replicas.
    label : str, default "label"
        The target column.
    features : list of str, optional
        Feature columns, in order; by default every column but ``label``.
    name : str, optional
        A label for logs and reports.
    shuffle_buffer : int, optional
        Rows in each replica's shuffle buffer (default: ~32 MiB of rows, at most 65,536).

    Raises
    ------
    FileNotFoundError, ShardReadError
        A path names no file, or a file's metadata cannot be read (the message names it).
    ValueError, TypeError
        Missing label/feature columns, non-numeric columns, files whose columns or dtypes differ
        from the first file's, or an empty file -- all found from the metadata, before training.
    """
    schema, shards = scan_parquet(paths, label, features)
    return ShardedDataset(schema, shards, name=name, shuffle_buffer=shuffle_buffer)


def from_npy(
    X_path: str | os.PathLike | Sequence[str | os.PathLike],
    y_path: str | os.PathLike | Sequence[str | os.PathLike],
    name: str | None = None,
    shuffle_buffer: int | None = None,
) -> ShardedDataset:
    """``.npy`` features and targets, memory-mapped where the replicas read them.

    ``X_path``/``y_path`` are one file each or equally long lists of files (pairs).  Only the
    headers are read here: X must be 2-D, y 1-D or 2-D with as many rows, numeric, non-empty, and
    every pair must have the same width and dtypes.  Raises as :func:`from_parquet`.
    """
    schema, shards = scan_npy(X_path, y_path)
    return ShardedDataset(schema, shards, name=name, shuffle_buffer=shuffle_buffer)


def from_csv(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    label: str = "label",
    features: Sequence[str] | None = None,
    delimiter: str = ",",
    name: str | None = None,
    shuffle_buffer: int | None = None,
) -> ShardedDataset:
    """CSV files with a header row, streamed with pyarrow's CSV reader.

    Column types are inferred from each file's first block and must be numeric; features are
    read as floats, so an integer column in one file may be a float column in another (the
    column names must match).  Rows are counted here with one pass over each file.  Other
    arguments and errors as :func:`from_parquet`.
    """
    schema, shards = scan_csv(paths, label, features, delimiter)
    return ShardedDataset(schema, shards, name=name, shuffle_buffer=shuffle_buffer)


def from_dask(
    data: Any,
    label: str | None = "label",
    features: Sequence[str] | None = None,
    name: str | None = None,
    shuffle_buffer: int | None = None,
) -> DaskDataset:
    """A Dask DataFrame (with ``label``) or an ``(X, y)`` pair of Dask Arrays.

    At ``fit`` a persisted copy of the collection is placed on the cluster and each replica runs
    on the worker that holds its partitions, reading them there: nothing goes through the client,
    and ``data`` itself is left as it is.  The columns and dtypes are checked here from the
    collection's metadata (no computation).
    """
    return dask_dataset(data, label, features, name, shuffle_buffer)


def synthetic(
    path: str | os.PathLike,
    rows: int,
    features: int,
    classes: int,
    seed: int = 0,
    n_files: int | None = None,
    hidden: int = 32,
    row_group_rows: int = 65536,
) -> ShardedDataset:
    """Write a large, learnable classification dataset as parquet files; return it.

    Features are standard normal float32 columns ``f0..f{features-1}``; the integer ``label`` is
    the argmax of a fixed random teacher network (``features -> hidden (tanh) -> classes``, class
    biases centred so classes are roughly balanced), so an MLP can learn it well and a linear
    model partly.  Files are written one row group at a time (memory stays bounded whatever
    ``rows``); by default there is one file per ~256 MiB.  The same ``seed`` gives the same data.
    """
    files = write_synthetic(path, rows, features, classes, seed, n_files, hidden, row_group_rows)
    return from_parquet(files, label="label", name=f"synthetic:{rows}x{features}")


def as_dataset(data: Dataset | tuple | np.ndarray, y: Any = None, what: str = "data") -> Dataset:
    """Accept a :class:`Dataset`, an ``(X, y)`` pair, or ``X`` plus ``y``; return a Dataset.

    ``what`` names the argument in error messages.  A :class:`ShardedDataset` (files or a Dask
    collection) is refused, never read into memory on the quiet: its owner decides with
    :meth:`ShardedDataset.to_dataset`.

    Raises
    ------
    TypeError
        ``data`` is a ShardedDataset, or none of the accepted forms.
    """
    if isinstance(data, ShardedDataset):
        raise TypeError(
            f"{what} is a ShardedDataset ({data!r}): it is streamed where it lives and never "
            f"read into memory implicitly; for data that fits in memory, pass "
            f"{what}.to_dataset(), which reads every row into this process"
        )
    if isinstance(data, Dataset):
        if y is not None:
            raise TypeError(f"{what} is a Dataset, so y must not be given separately")
        return data
    if y is not None:
        return Dataset(data, y)
    if isinstance(data, tuple) and len(data) == 2:
        return Dataset(*data)
    raise TypeError(
        f"{what} must be a downpour_dask Dataset, an (X, y) tuple, or X together with y; "
        f"got {type(data).__name__}"
    )
