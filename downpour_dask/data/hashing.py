"""Categorical columns hashed to table row ids: the hashing trick, seeded and stable.

A click log's categorical columns (site, advertiser, device...) take millions of values, most of
them rare, and new ones keep arriving; the hashing trick (Weinberger et al., 2009) maps each
``(field, value)`` straight to a row of one table of ``n_rows`` rows, with no vocabulary to
build or ship.  The hash must be the same in every worker process and every run, so it is never
Python's ``hash()`` (salted per process): strings go through pandas' keyed SipHash
(:func:`pandas.util.hash_array`, key derived from ``(seed, field)``), integers through its
splitmix64 finaliser after an xor with the same per-field key.  Missing values get a bucket of
their own per field.

:class:`HashSpec` names the columns of a file -- numeric, categorical, label -- and the table;
:func:`hash_frame` turns a pandas/pyarrow table into a
:class:`~downpour_dask.core.sparse.SparseBatch`; :func:`read_hashed` streams parquet or CSV
files as hashed minibatches (chunks read in a random order, rows shuffled within a chunk), and
:func:`load_hashed` reads them whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from pandas.util import hash_array

from ..core.params import DTYPE
from ..core.sparse import SparseBatch

#: How numeric columns may be transformed before training.
TRANSFORMS = ("none", "log1p")
_MISSING = "\x00missing"
_INT_MISSING = -(2**63)


def field_key(seed: int, field: str) -> bytes:
    """The 16-byte key of ``field``'s hash for ``seed`` (stable: derived with BLAKE2b)."""
    return hashlib.blake2b(f"{int(seed)}/{field}".encode(), digest_size=8).hexdigest().encode()


def hash_column(
    values: np.ndarray | pd.Series, field: str, n_rows: int, seed: int = 0
) -> np.ndarray:
    """Row ids in ``[0, n_rows)`` of ``values`` of the categorical column ``field`` (int64).

    Integers, booleans and integral floats (an integer column with missing values reads as
    floats) hash by value, anything else by its text; missing values (None, NaN) share one
    bucket per field.
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, (int, np.integer)) or n_rows < 1:
        raise ValueError(f"n_rows must be an int >= 1, got {n_rows!r}")
    key = field_key(seed, field)
    series = pd.Series(values)
    if pd.api.types.is_bool_dtype(series.dtype):
        series = series.astype(np.int64)
    as_float = None
    if pd.api.types.is_numeric_dtype(series.dtype):
        as_float = series.to_numpy(np.float64, na_value=np.nan)
        present = as_float[~np.isnan(as_float)]
        if not (np.all(present == np.round(present)) and np.all(np.abs(present) < 2**62)):
            as_float = None
    if as_float is not None:
        raw = np.where(np.isnan(as_float), _INT_MISSING, np.nan_to_num(as_float)).astype(np.int64)
        if pd.api.types.is_integer_dtype(series.dtype) and not series.isna().any():
            raw = series.to_numpy(np.int64)  # exact beyond 2**53
        salt = np.uint64(int.from_bytes(key[:8], "little"))
        hashed = hash_array(raw.view(np.uint64) ^ salt)
    else:
        text = series.astype(object).where(series.notna(), _MISSING).astype(str).to_numpy(object)
        hashed = hash_array(text, hash_key=key.decode(), categorize=True)
    return (hashed % np.uint64(n_rows)).astype(np.int64)


@dataclass(frozen=True)
class HashSpec:
    """Which columns of a file feed a sparse model, and into how many table rows.

    Parameters
    ----------
    numeric : tuple of str
        Numeric columns (missing values become 0 after ``transform``).
    categorical : tuple of str
        Categorical columns, each hashed to one row id per row.
    label : str
        The 0/1 label column.
    n_rows : int
        Rows of the table the ids index.
    seed : int
        The hash's seed: another seed gives other collisions.
    transform : str
        ``"log1p"`` (``log(1 + max(x, 0))``, for heavy-tailed counts) or ``"none"``.
    """

    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    label: str
    n_rows: int
    seed: int = 0
    transform: str = "none"

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if not self.categorical:
            raise ValueError("categorical must name at least one column")
        if isinstance(self.n_rows, bool) or not isinstance(self.n_rows, int) or self.n_rows < 1:
            raise ValueError(f"n_rows must be an int >= 1, got {self.n_rows!r}")

    @property
    def columns(self) -> list[str]:
        return [*self.numeric, *self.categorical, self.label]


def _require(names: Sequence[str], spec: HashSpec, where: str = "the data") -> None:
    missing = [c for c in spec.columns if c not in names]
    if missing:
        raise ValueError(f"columns {missing} are missing; {where} has {list(names)}")


def hash_frame(frame: pd.DataFrame | pa.Table, spec: HashSpec) -> SparseBatch:
    """The rows of ``frame`` as a hashed :class:`SparseBatch`; ValueError naming a missing
    column or a label that is not 0/1."""
    _require(list(frame.column_names if isinstance(frame, pa.Table) else frame.columns), spec)
    df = frame.to_pandas() if isinstance(frame, pa.Table) else frame
    n = len(df)
    numeric = np.zeros((n, len(spec.numeric)), DTYPE)
    for j, column in enumerate(spec.numeric):
        x = pd.to_numeric(df[column], errors="raise").to_numpy(np.float64, na_value=np.nan)
        if spec.transform == "log1p":
            x = np.log1p(np.maximum(x, 0))
        numeric[:, j] = np.nan_to_num(x, nan=0.0)
    ids = np.empty((n, len(spec.categorical)), np.int64)
    for j, column in enumerate(spec.categorical):
        ids[:, j] = hash_column(df[column], column, spec.n_rows, spec.seed)
    y = df[spec.label].to_numpy()
    if n and not np.isin(y, (0, 1)).all():
        raise ValueError(f"label column {spec.label!r} must hold 0 and 1 only")
    return SparseBatch(numeric, ids, y.astype(np.int64))


def _tables(path: Path, spec: HashSpec, chunk_rows: int) -> Iterator[pa.Table]:
    if path.suffix == ".parquet":
        pf = pq.ParquetFile(path)
        _require(pf.schema_arrow.names, spec, str(path))
        for group in range(pf.metadata.num_row_groups):
            for record in pf.iter_batches(chunk_rows, row_groups=[group], columns=spec.columns):
                yield pa.Table.from_batches([record])
    elif path.suffix == ".csv":
        with pacsv.open_csv(path) as head:
            _require(head.schema.names, spec, str(path))
        reader = pacsv.open_csv(
            path,
            convert_options=pacsv.ConvertOptions(
                include_columns=spec.columns,
                column_types={c: pa.string() for c in spec.categorical},
                strings_can_be_null=True,  # an empty field is missing, as in parquet
            ),
        )
        for record in reader:
            yield pa.Table.from_batches([record])
    else:
        raise ValueError(f"{path}: only .parquet and .csv files can be read, got {path.suffix!r}")


def _paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = sorted(Path().glob(str(paths))) if any(c in str(paths) for c in "*?[") else [paths]
    found = [Path(p).absolute() for p in paths]  # workers may read from another folder
    absent = [str(p) for p in found if not p.exists()]
    if not found or absent:
        raise FileNotFoundError(f"no such data file(s): {absent or paths}")
    return found


def read_hashed(
    paths: str | Path | Sequence[str | Path],
    spec: HashSpec,
    batch_size: int,
    rng: np.random.Generator,
    chunk_rows: int = 65536,
    keeps: Callable[[int], bool] | None = None,
) -> Iterator[SparseBatch]:
    """One epoch of hashed minibatches of ``batch_size`` rows from parquet/CSV files: files in a
    random order, each read in chunks of ``chunk_rows`` rows shuffled within the chunk (the
    last batch of a chunk may be smaller).  ``keeps(i)``, asked just before file ``i`` (its
    position in ``paths``) is opened, may skip it: a replica whose share of the files shrank
    while the epoch ran."""
    for index in rng.permutation(len(files := _paths(paths))):
        if keeps is not None and not keeps(int(index)):
            continue
        for table in _tables(files[index], spec, chunk_rows):
            batch = hash_frame(table, spec)
            order = rng.permutation(len(batch.y))
            for lo in range(0, len(order), batch_size):
                yield batch.take(order[lo : lo + batch_size])


def is_hashed_files(data: Any) -> bool:
    """Whether ``data`` is ``(paths, HashSpec)``: files to read hashed (not a batch in memory)."""
    return isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], HashSpec)


def count_rows(paths: str | Path | Sequence[str | Path], spec: HashSpec) -> int:
    """The rows of the files: parquet's from its footer, CSV's by reading its label column."""
    rows = 0
    for path in _paths(paths):
        if path.suffix == ".parquet":
            rows += pq.ParquetFile(path).metadata.num_rows
        else:
            label = pacsv.ConvertOptions(include_columns=[spec.label])
            with pacsv.open_csv(path, convert_options=label) as reader:
                rows += sum(record.num_rows for record in reader)
    return rows


def load_hashed(paths: str | Path | Sequence[str | Path], spec: HashSpec) -> SparseBatch:
    """Every row of the files, hashed, in file order."""
    parts = [hash_frame(t, spec) for p in _paths(paths) for t in _tables(p, spec, 1 << 20)]
    return SparseBatch.concat(parts)


def minibatches(
    data: SparseBatch, batch_size: int, rng: np.random.Generator
) -> Iterator[SparseBatch]:
    """One shuffled epoch of ``data`` in batches of ``batch_size`` rows."""
    order = rng.permutation(len(data.y))
    for lo in range(0, len(order), batch_size):
        yield data.take(order[lo : lo + batch_size])
