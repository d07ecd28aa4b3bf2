"""Datasets that stay where they are: shard descriptors, up-front validation, replica assignment.

A :class:`ShardedDataset` is a list of :class:`Shard` descriptors (a parquet/CSV file, an ``.npy``
pair, or a Dask partition, each with a row range) plus the :class:`Schema` all of them share.
Descriptors are small picklable records: a replica task receives only its own descriptors and
reads the rows itself, on its worker (see :mod:`downpour_dask.stream`), so the data is never
gathered to the client.

Everything a run can check without reading the data is checked here, once, before training
starts: files exist and open, the label column is present, features are numeric with the same
names, width and dtype in every file, and no file is empty.  What only the data itself can show
(NaN/inf, labels out of range, a file that vanished or got corrupted since) is checked batch by
batch while streaming, and stops the run with an error naming the file.

:func:`assign` gives each replica a row-balanced share of the shards (sizes differ by at most one
row), splitting files into row ranges where needed -- always when there are fewer files than
replicas.  No Dask import here: the Dask adapter lives in :mod:`downpour_dask.dask_data`.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.params import split_range

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

    def to_dataset(self) -> Any:
        """Read every row, in order, into an in-memory Dataset (e.g. evaluation data).

        This gathers the data where it is called: meant for data that fits in memory.
        """
        from .datasets import Dataset
        from .stream import read_chunks

        xbuf = np.empty((65536, self.n_features), np.float32)
        Xs, ys = [], []
        for shard in self.shards:
            for X, y in read_chunks(shard, self.schema, _IN_ORDER, xbuf, None):
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


class _InOrder:
    """Stands in for a random generator where data must be read in file order."""

    @staticmethod
    def permutation(x: Any) -> np.ndarray:
        return np.arange(x) if isinstance(x, (int, np.integer)) else np.asarray(x)


_IN_ORDER = _InOrder()


# -- assignment ----------------------------------------------------------------------------------


def assign(shards: list[Shard], n_replicas: int) -> list[list[Shard]]:
    """Give each of ``n_replicas`` replicas a row-balanced list of shards.

    The shards are laid end to end and the combined row sequence is cut into ``n_replicas``
    contiguous ranges whose sizes differ by at most one row (:func:`~downpour_dask.params.
    split_range`).  A cut inside a shard splits it into two row ranges, so at most
    ``n_replicas - 1`` shards are split, every row belongs to exactly one replica, and a replica
    reads at most a few files partially.  With fewer files than replicas, files are split into
    row ranges; with uneven file sizes, big files are shared and small ones grouped.

    Raises
    ------
    ValueError
        If there are fewer rows than replicas (a replica would have no data).
    """
    total = sum(s.rows for s in shards)
    if n_replicas > total:
        raise ValueError(
            f"cannot give each of {n_replicas} replicas its own data: the dataset has only "
            f"{total} rows; use n_replicas <= {total}"
        )
    plan: list[list[Shard]] = []
    offsets = np.cumsum([0] + [s.rows for s in shards])
    for lo, hi in split_range(total, n_replicas):
        mine = []
        for i, shard in enumerate(shards):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                base = shard.start - int(offsets[i])
                mine.append(replace(shard, start=base + int(a), stop=base + int(b)))
        plan.append(mine)
    return plan


# -- finding and validating files ----------------------------------------------------------------


def expand_paths(paths: Any, suffix: str, what: str = "paths") -> list[str]:
    """Files named by a path, a glob pattern, a directory (its ``*suffix`` files) or a list.

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
        files.extend(found)
    return files


def _numeric_kind(type_: Any) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_integer(type_)
        or pa.types.is_floating(type_)
        or pa.types.is_boolean(type_)
        or pa.types.is_null(type_)  # no values in the first block: checked while streaming
    )


def _columns(names: list[str], label: str, features: Any, path: str) -> tuple[str, tuple[str, ...]]:
    """Check that ``label`` and the requested features exist in a file's ``names``."""
    if label not in names:
        raise ValueError(
            f"{path}: label column {label!r} not found; the file has columns "
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


def _wrap_read(err: Exception, where: str) -> ShardReadError:
    return ShardReadError(f"cannot read {where}: {type(err).__name__}: {err}")


def scan_parquet(
    paths: Any, label: str = "label", features: Any = None
) -> tuple[Schema, list[Shard]]:
    """Validate parquet files from their metadata only (no data read); one shard per file."""
    import pyarrow.parquet as pq

    files = expand_paths(paths, ".parquet")
    shards, first, cols, ranges = [], None, None, []
    for path in files:
        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except Exception as err:  # OSError, or pyarrow's ArrowInvalid for a corrupt footer
            raise _wrap_read(err, path) from err
        types = {f.name: f.type for f in schema}
        if first is None:
            label, feats = _columns(list(types), label, features, path)
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
        X, y = _open_npy(xp), _open_npy(yp)
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
        raise _wrap_read(err, path) from err
    return lo, hi


def _open_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise _wrap_read(err, path) from err


def scan_csv(
    paths: Any, label: str = "label", features: Any = None, delimiter: str = ","
) -> tuple[Schema, list[Shard]]:
    """Validate CSV files: header, numeric columns (inferred from the first block), row counts.

    Counting rows needs one pass over each file (parsing only the label column).  Features are
    read as float64 whatever the inferred integer/float type, so dtypes need not match exactly
    across files; the column names must.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    files = expand_paths(paths, ".csv")
    shards, first, cols, lo, hi = [], None, None, np.inf, -np.inf
    for path in files:
        try:
            reader = pacsv.open_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter))
            types = {f.name: f.type for f in reader.schema}
            if first is None:
                label, feats = _columns(list(types), label, features, path)
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
            raise _wrap_read(err, path) from err
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
