"""Reading a dataset's metadata up front: which files, which columns, how many rows.

:func:`scan_parquet`, :func:`scan_npy` and :func:`scan_csv` check everything a run can check
without reading the data, once, before training starts: the files exist and open, the label
column is present, features are numeric with the same names, width and dtype in every file, and
no file is empty.  They return the dataset's :class:`~downpour_dask.data.schema.Schema` and one
:class:`~downpour_dask.data.schema.Shard` per file.  What only the data itself can show (NaN/inf,
labels out of range, a file that vanished or got corrupted since) is checked batch by batch while
streaming (:mod:`downpour_dask.data.readers`).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from .schema import Schema, Shard, open_npy, read_error


def expand_paths(paths: Any, suffix: str, what: str = "paths") -> list[str]:
    """Files named by a path, a glob pattern, a directory (its ``*suffix`` files) or a list,
    as absolute paths: workers read them from folders of their own (a cluster started
    elsewhere), where a path relative to the driver's folder names nothing.

    Raises
    ------
    FileNotFoundError
        If a path or pattern names no file.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError(f"{what} must name at least one file, got an empty list")
    files: list[str] = []
    for item in items:
        text = os.fspath(item)
        if os.path.isdir(text):
            found = sorted(str(p) for p in Path(text).glob(f"*{suffix}"))
            if not found:
                raise FileNotFoundError(f"{what}: directory {text!r} holds no *{suffix} files")
        elif glob.has_magic(text):
            found = sorted(glob.glob(text))
            if not found:
                raise FileNotFoundError(f"{what}: pattern {text!r} matches no file")
        elif os.path.isfile(text):
            found = [text]
        else:
            raise FileNotFoundError(f"{what}: no such file {text!r}")
        files.extend(os.path.abspath(f) for f in found)
    return files


def _numeric_kind(type_: Any) -> bool:
    return (
        pa.types.is_integer(type_)
        or pa.types.is_floating(type_)
        or pa.types.is_boolean(type_)
        or pa.types.is_null(type_)  # no values in the first block: checked while streaming
    )


def check_columns(
    names: list[str], label: str, features: Any, path: str
) -> tuple[str, tuple[str, ...]]:
    """Check that ``label`` and the requested features exist among ``names``; return them.

    ``path`` names the file (or collection) in error messages.  Without ``features``, every
    column but the label is a feature, in order.
    """
    if label not in names:
        raise ValueError(
            f"{path}: label column {label!r} not found; its columns are "
            f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''} (pass label=)"
        )
    if features is None:
        feats = tuple(n for n in names if n != label)
    else:
        feats = tuple([features] if isinstance(features, str) else features)
        missing = [f for f in feats if f not in names]
        if missing:
            raise ValueError(f"{path}: feature column(s) {missing} not found (features=)")
        if label in feats:
            raise ValueError(f"features must not include the label column {label!r}")
    if not feats:
        raise ValueError(f"{path}: no feature columns besides the label {label!r}")
    return label, feats


def _check_types(types: dict[str, Any], cols: list[str], path: str) -> None:
    bad = [f"{c} ({types[c]})" for c in cols if not _numeric_kind(types[c])]
    if bad:
        raise TypeError(
            f"{path}: columns must be numeric (int, float or bool); non-numeric column(s): "
            f"{', '.join(bad[:10])}"
        )


def _same_as_first(
    first: tuple[str, dict], current: tuple[str, dict], path: str, cols: list[str]
) -> None:
    """Every file must have the columns, width and dtypes of the first one."""
    first_path, first_types = first
    _, types = current
    for c in cols:
        if c not in types:
            raise ValueError(
                f"{path}: column {c!r} is missing, but {first_path} has it; every file must "
                "have the same columns"
            )
        if types[c] != first_types[c]:
            raise ValueError(
                f"{path}: column {c!r} has dtype {types[c]}, but {first_path} has "
                f"{first_types[c]}; every file must have the same dtypes"
            )


def scan_parquet(
    paths: Any, label: str = "label", features: Any = None
) -> tuple[Schema, list[Shard]]:
    """Validate parquet files from their metadata only (no data read); one shard per file."""
    files = expand_paths(paths, ".parquet")
    shards, first, cols, ranges = [], None, None, []
    for path in files:
        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except Exception as err:  # OSError, or pyarrow's ArrowInvalid for a corrupt footer
            raise read_error(err, path) from err
        types = {f.name: f.type for f in schema}
        if first is None:
            label, feats = check_columns(list(types), label, features, path)
            cols = [*feats, label]
            _check_types(types, cols, path)
            first = (path, types)
        else:
            _same_as_first(first, (path, types), path, cols)
        if meta.num_rows == 0:
            raise ValueError(f"{path}: the file has 0 rows; remove it or write data into it")
        shards.append(Shard("parquet", path, 0, meta.num_rows))
        ranges.append(_parquet_range(meta, schema.get_field_index(label)))
    types = first[1]
    return (
        Schema(
            "parquet",
            len(feats),
            _common_dtype([types[f] for f in feats]),
            np.dtype(types[label].to_pandas_dtype()).name,
            features=feats,
            label=label,
            label_range=_union(ranges),
        ),
        shards,
    )


def _parquet_range(meta: Any, column: int) -> tuple[float, float] | None:
    """(min, max) of a column from row-group statistics, or None if any group lacks them."""
    lo, hi = np.inf, -np.inf
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        lo, hi = min(lo, float(stats.min)), max(hi, float(stats.max))
    return lo, hi


def _union(ranges: list) -> tuple[float, float] | None:
    if not ranges or any(r is None for r in ranges):
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _common_dtype(types: list[Any]) -> str:
    """numpy name of the feature dtypes (a list of them if they differ, e.g. 'int64+float32')."""
    names = sorted({np.dtype(t.to_pandas_dtype()).name for t in types})
    return "+".join(names)


def scan_npy(X_paths: Any, y_paths: Any) -> tuple[Schema, list[Shard]]:
    """Validate ``.npy`` pairs from their headers (memory-mapped, nothing read)."""
    xs = [X_paths] if isinstance(X_paths, (str, os.PathLike)) else list(X_paths)
    ys = [y_paths] if isinstance(y_paths, (str, os.PathLike)) else list(y_paths)
    if len(xs) != len(ys) or not xs:
        raise ValueError(
            f"X_path and y_path must name as many files each (at least one), got {len(xs)} "
            f"and {len(ys)}"
        )
    shards, first, ranges = [], None, []
    for xp, yp in zip(map(os.fspath, xs), map(os.fspath, ys)):
        X, y = open_npy(xp), open_npy(yp)
        if X.ndim != 2:
            raise ValueError(f"{xp}: X must be 2-D (rows x features), got shape {X.shape}")
        if y.ndim not in (1, 2):
            raise ValueError(f"{yp}: y must be 1-D or 2-D, got shape {y.shape}")
        for path, arr in ((xp, X), (yp, y)):
            if arr.dtype.kind not in "biuf":
                raise TypeError(
                    f"{path}: data must be numeric (bool, int or float), got {arr.dtype}"
                )
        if len(X) != len(y):
            raise ValueError(f"{xp} has {len(X)} rows but {yp} has {len(y)}; they must match")
        if len(X) == 0:
            raise ValueError(f"{xp}: the file has 0 rows; remove it or write data into it")
        sig = (X.shape[1], X.dtype.name, y.shape[1:], y.dtype.name)
        if first is None:
            first = (xp, sig)
        elif sig != first[1]:
            raise ValueError(
                f"{xp}: (features, X dtype, y shape, y dtype) is {sig}, but {first[0]} has "
                f"{first[1]}; every file must have the same width and dtypes"
            )
        shards.append(Shard("npy", xp, 0, len(X), y_path=yp))
        ranges.append(_npy_range(y, yp) if y.ndim == 1 and y.dtype.kind in "iub" else None)
    width, x_dtype, y_shape, y_dtype = first[1]
    y_width = y_shape[0] if y_shape else 0
    schema = Schema("npy", width, x_dtype, y_dtype, y_width=y_width, label_range=_union(ranges))
    return schema, shards


def _npy_range(y: np.ndarray, path: str) -> tuple[float, float]:
    """(min, max) of integer labels, read through the memory map in blocks."""
    lo, hi = np.inf, -np.inf
    try:
        for a in range(0, len(y), 1 << 20):
            block = np.asarray(y[a : a + (1 << 20)])
            lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
    except OSError as err:
        raise read_error(err, path) from err
    return lo, hi


def scan_csv(
    paths: Any, label: str = "label", features: Any = None, delimiter: str = ","
) -> tuple[Schema, list[Shard]]:
    """Validate CSV files: header, numeric columns (inferred from the first block), row counts.

    Counting rows needs one pass over each file (parsing only the label column).  Features are
    read as float64 whatever the inferred integer/float type, so dtypes need not match exactly
    across files; the column names must.
    """
    files = expand_paths(paths, ".csv")
    shards, first, cols, lo, hi = [], None, None, np.inf, -np.inf
    for path in files:
        try:
            reader = pacsv.open_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter))
            types = {f.name: f.type for f in reader.schema}
            if first is None:
                label, feats = check_columns(list(types), label, features, path)
                cols = [*feats, label]
                first = (path, types)
            missing = [c for c in cols if c not in types]
            if missing:
                raise ValueError(
                    f"{path}: column(s) {missing} missing, but {first[0]} has them; every file "
                    "must have the same columns"
                )
            _check_types(types, cols, path)
            reader.close()
            rows = 0
            counter = pacsv.open_csv(
                path,
                parse_options=pacsv.ParseOptions(delimiter=delimiter),
                convert_options=pacsv.ConvertOptions(include_columns=[label]),
            )
            for batch in counter:
                rows += batch.num_rows
                if batch.num_rows and batch.column(0).null_count < batch.num_rows:
                    extremes = pc.min_max(batch.column(0))
                    lo = min(lo, float(extremes["min"].as_py()))
                    hi = max(hi, float(extremes["max"].as_py()))
        except (OSError, pa.ArrowException) as err:  # pyarrow's own errors, not our checks
            if "Empty CSV file" in str(err):
                raise ValueError(f"{path}: the file is empty (no header, 0 rows)") from None
            raise read_error(err, path) from err
        if rows == 0:
            raise ValueError(f"{path}: the file has 0 rows; remove it or write data into it")
        shards.append(Shard("csv", path, 0, rows))
    y_type = first[1][label]
    y_dtype = "float64" if pa.types.is_floating(y_type) else "int64"
    return (
        Schema(
            "csv",
            len(feats),
            "float64",
            y_dtype,
            features=feats,
            label=label,
            delimiter=delimiter,
            label_range=(lo, hi),
        ),
        shards,
    )
