"""A large, learnable classification dataset written as parquet files in bounded memory.

Labels come from a fixed random *teacher* network, so the task is learnable (an MLP can reach
high accuracy, a linear model part of the way) and any number of rows can be generated: each
row group is drawn from its own seeded stream, written, and dropped before the next one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .part_files import all_or_nothing

FILE_BYTES = 256 << 20  # default: one file per ~256 MiB of features


def _check(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def teacher(
    features: int, classes: int, hidden: int, seed: int
) -> Callable[[np.ndarray], np.ndarray]:
    """The labelling function: ``argmax(tanh(X @ W1) @ W2 + b)`` with class-balancing biases."""
    rng = np.random.default_rng([seed, 0])
    W1 = (rng.standard_normal((features, hidden)) / math.sqrt(features)).astype(np.float32)
    W2 = rng.standard_normal((hidden, classes)).astype(np.float32)
    calib = rng.standard_normal((4096, features), dtype=np.float32)
    bias = -np.median(np.tanh(calib @ W1) @ W2, axis=0)  # centre logits: balanced-ish classes

    def label(X: np.ndarray) -> np.ndarray:
        return np.argmax(np.tanh(X @ W1) @ W2 + bias, axis=1).astype(np.int64)

    return label


def write_synthetic(
    path: str | os.PathLike,
    rows: int,
    features: int,
    classes: int,
    seed: int = 0,
    n_files: int | None = None,
    hidden: int = 32,
    row_group_rows: int = 65536,
) -> list[str]:
    """Write ``rows`` rows as ``path/part-00000.parquet``...; return the file names.

    See :func:`downpour_dask.datasets.synthetic` for the data.  Memory use is one row group.

    Raises
    ------
    ValueError, TypeError
        Non-integer or out-of-range sizes.
    FileExistsError
        If ``path`` already holds parquet files (they would be mixed with the new ones).

    Stopped half way (an error, Ctrl-C), it removes the files it wrote, and ``path`` if it
    created it (:mod:`.part_files`): no shorter dataset is left to load.
    """
    rows = _check("rows", rows, 1)
    features = _check("features", features, 1)
    classes = _check("classes", classes, 2)
    seed = _check("seed", seed, 0)
    hidden = _check("hidden", hidden, 1)
    row_group_rows = _check("row_group_rows", row_group_rows, 1)
    if n_files is None:
        n_files = max(1, min(rows, -(-rows * features * 4 // FILE_BYTES)))
    n_files = _check("n_files", n_files, 1)
    if n_files > rows:
        raise ValueError(f"n_files must be <= rows ({rows}), got {n_files}")
    out = Path(path)
    if out.is_dir() and any(out.glob("*.parquet")):
        raise FileExistsError(f"path {str(out)!r} already holds parquet files; use an empty folder")
    label = teacher(features, classes, hidden, seed)
    names = [f"f{j}" for j in range(features)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])
    files, block = [], (-1, None)
    bounds = np.linspace(0, rows, n_files + 1).astype(np.int64)
    with all_or_nothing(out) as written:
        for i in range(n_files):
            name = str(out / f"part-{i:05d}.parquet")
            written.append(Path(name))  # removed again if the writing stops half way
            rows_of_file = (int(bounds[i]), int(bounds[i + 1]))
            block = _write_rows(name + ".tmp", schema, label, rows_of_file, seed, row_group_rows,
                                (rows, features), block)  # fmt: skip
            os.replace(name + ".tmp", name)  # a reader never sees a half-written file
            files.append(name)
    return files


def _write_rows(tmp, schema, label, rows_of_file, seed, row_group_rows, shape, block):
    """Write rows ``a..b`` (``rows_of_file``) of the ``shape`` = (rows, features) dataset to
    the file ``tmp``, a row group at a time; return the last global block of rows drawn (the
    next file may begin inside it)."""
    (a, b), (rows, features) = rows_of_file, shape
    cuts = sorted({a, b, *range(-(-a // row_group_rows) * row_group_rows, b, row_group_rows)})
    # Random floats do not compress: compressing the features saves almost no bytes but makes
    # reading them several times slower, and dictionary encoding only adds bytes.
    with pq.ParquetWriter(
        tmp, schema, compression={"label": "snappy"}, use_dictionary=["label"]
    ) as writer:
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            # rows come in global blocks of row_group_rows, each from its own seeded stream, so
            # the data depends on (seed, rows, features, classes) and not on n_files
            k = lo // row_group_rows
            if block[0] != k:
                n = min(row_group_rows, rows - k * row_group_rows)
                rng = np.random.default_rng([seed, 1, k])
                block = (k, rng.standard_normal((n, features), dtype=np.float32))
            X = block[1][lo - k * row_group_rows : hi - k * row_group_rows]
            XT = np.ascontiguousarray(X.T)  # one contiguous buffer per column
            columns = [pa.array(XT[j]) for j in range(features)]
            columns.append(pa.array(label(X)))
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
    return block
