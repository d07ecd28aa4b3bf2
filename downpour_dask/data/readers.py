"""Chunk readers: one shard turned into checked chunks of float32 features and targets.

:func:`read_chunks` reads at most ``len(xbuf)`` rows at a time: parquet by row group
(``iter_batches`` inside each group, restricted to the shard's row range), ``.npy`` through a
memory map (pages are released after each chunk), CSV with pyarrow's streaming reader, Dask
partitions by row slices.  Row groups / chunks are visited in a fresh random order every epoch
(:data:`IN_ORDER` reads them in file order instead).  Every chunk is checked for NaN/inf and bad
labels, and every read failure becomes a :class:`~downpour_dask.data.schema.ShardReadError`;
both name the file and the row group or rows.  This is the first stage of a replica's stream
(:mod:`downpour_dask.data.stream`).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..core.validation import all_finite
from .schema import Schema, Shard, ShardDataError, ShardReadError, open_npy, read_error


def _guarded(items: Any, where: str) -> Iterator[Any]:
    """Iterate ``items``, turning any failure to produce the next one into a ShardReadError."""
    try:
        it = iter(items)
    except Exception as err:
        raise read_error(err, where) from err
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as err:
            raise read_error(err, where) from err
        yield item


def _check_chunk(
    X: np.ndarray, y: np.ndarray, where: str, row0: int, n_classes: int | None
) -> np.ndarray:
    """Raise ShardDataError on NaN/inf features or bad targets; return the training targets."""
    if not all_finite(X):  # summed in float32: 2-3x faster than in float64
        bad = ~np.isfinite(X)
        row = row0 + int(np.argmax(bad.any(axis=1)))
        raise ShardDataError(
            f"{where}: features contain {int(bad.sum())} NaN, infinite or missing value(s), "
            f"first in row {row} (values beyond float32's ~3.4e38 count too); remove or impute "
            "them"
        )
    if n_classes is None:
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.asarray(y, dtype=np.float32)
        if not np.isfinite(out).all():
            row = row0 + int(np.argmax(~np.isfinite(out.reshape(len(out), -1)).all(axis=1)))
            raise ShardDataError(
                f"{where}: targets contain NaN, infinite or missing values, first in row {row}"
            )
        return out
    if y.dtype.kind == "f":
        odd = ~np.isfinite(y) | (y != np.round(y))
        if odd.any():
            raise ShardDataError(
                f"{where}: labels must be integers 0..{n_classes - 1}, got "
                f"{np.unique(y[odd])[:5].tolist()} (first in row {row0 + int(np.argmax(odd))})"
            )
    bad = (y < 0) | (y >= n_classes)
    if bad.any():
        raise ShardDataError(
            f"{where}: labels {np.unique(y[bad])[:5].tolist()} are outside the model's classes "
            f"0..{n_classes - 1} (first in row {row0 + int(np.argmax(bad))})"
        )
    return y.astype(np.int64)


#: Bytes of the column-major buffer that feature columns are transposed through (_rows_of).
STAGING_BYTES = 4 << 20


def _rows_of(columns: list[np.ndarray], r0: int, X: np.ndarray, staging: np.ndarray) -> None:
    """Write rows ``r0 : r0 + len(X)`` of the feature ``columns`` into the row-major ``X``.

    Each part of at most ``staging.shape[1]`` rows is first copied column by column into the
    rows of the column-major ``staging`` (contiguous copies), then transposed into ``X`` in one
    pass.  Written straight into ``X``, each column would be a strided pass over all of it,
    which is larger than the cache.
    """
    step = staging.shape[1]
    for s0 in range(0, len(X), step):
        k = min(step, len(X) - s0)
        part, lo = staging[:, :k], r0 + s0
        with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32's range
            for j, column in enumerate(columns):
                part[j] = column[lo : lo + k]
        np.copyto(X[s0 : s0 + k], part.T)


def _arrow_chunks(
    batches: Any, lo: int, hi: int, pos: int, xbuf: np.ndarray, where: str
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Rows ``[lo, hi)`` of a stream of record batches starting at row ``pos``, as chunks.

    Columns are the features in order, then the label.
    """
    n_feat, size = xbuf.shape[1], xbuf.shape[0]
    staging_rows = max(1, min(size, STAGING_BYTES // (xbuf.itemsize * n_feat)))
    staging = np.empty((n_feat, staging_rows), xbuf.dtype)
    for batch in _guarded(batches, where):
        b0, pos = pos, pos + batch.num_rows
        a, b = max(lo, b0), min(hi, pos)
        if a >= b:
            if b0 >= hi:
                return
            continue
        # numpy views of the batch's columns (zero-copy for null-free numbers), made once
        columns = [batch.column(j).to_numpy(zero_copy_only=False) for j in range(n_feat + 1)]
        for c0 in range(a, b, size):
            r0, m = c0 - b0, min(size, b - c0)
            X = xbuf[:m]
            _rows_of(columns[:n_feat], r0, X, staging)
            yield X, columns[n_feat][r0 : r0 + m], c0


def _parquet_chunks(shard: Shard, schema: Schema, rng, xbuf: np.ndarray) -> Iterator:
    try:
        pf = pq.ParquetFile(shard.path)
        meta = pf.metadata
    except Exception as err:
        raise read_error(err, shard.where()) from err
    with contextlib.closing(pf):
        if meta.num_rows < shard.stop:
            raise ShardReadError(
                f"cannot read {shard.where()}: the file now has {meta.num_rows} rows, it changed "
                "since the dataset was validated"
            )
        offsets = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        groups = [
            g
            for g in range(meta.num_row_groups)
            if offsets[g] < shard.stop and offsets[g + 1] > shard.start
        ]
        columns = [*schema.features, schema.label]
        for g in rng.permutation(groups):
            where = f"{shard.path} (row group {g})"
            batches = pf.iter_batches(  # decoding several chunks at once is cheaper per row
                batch_size=4 * xbuf.shape[0],
                row_groups=[int(g)],
                columns=columns,
                use_threads=False,
            )
            for X, y, row0 in _arrow_chunks(
                batches, shard.start, shard.stop, int(offsets[g]), xbuf, where
            ):
                yield X, y, where, row0


def _csv_chunks(shard: Shard, schema: Schema, rng, xbuf: np.ndarray) -> Iterator:
    columns = [*schema.features, schema.label]
    where = shard.where()
    try:
        reader = pacsv.open_csv(
            shard.path,
            read_options=pacsv.ReadOptions(block_size=max(1 << 16, xbuf.nbytes)),
            parse_options=pacsv.ParseOptions(delimiter=schema.delimiter),
            convert_options=pacsv.ConvertOptions(
                include_columns=columns, column_types={c: pa.float64() for c in columns}
            ),
        )
    except Exception as err:
        raise read_error(err, where) from err
    with contextlib.closing(reader):
        rows = 0
        for X, y, row0 in _arrow_chunks(reader, shard.start, shard.stop, 0, xbuf, where):
            rows += len(X)
            yield X, y, where, row0
    if rows < shard.rows:
        raise ShardReadError(
            f"cannot read {where}: only {rows} of its rows are left; the file changed since the "
            "dataset was validated"
        )


def _slices(shard: Shard, size: int, rng) -> list[tuple[int, int]]:
    """The shard's rows as ``size``-row ranges, in random order."""
    ranges = [(lo, min(lo + size, shard.stop)) for lo in range(shard.start, shard.stop, size)]
    return [ranges[i] for i in rng.permutation(len(ranges))]


def _npy_chunks(shard: Shard, schema: Schema, rng, xbuf: np.ndarray) -> Iterator:
    X, y = open_npy(shard.path), open_npy(shard.y_path)
    if len(X) < shard.stop or len(y) < shard.stop:
        raise ShardReadError(
            f"cannot read {shard.where()}: the file now has fewer rows; it changed since the "
            "dataset was validated"
        )
    for lo, hi in _slices(shard, xbuf.shape[0], rng):
        where = shard.where(lo, hi)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(xbuf[: hi - lo], X[lo:hi], casting="unsafe")
            yb = np.array(y[lo:hi])
        except Exception as err:
            raise read_error(err, where) from err
        _release_pages(X, lo, hi)
        yield xbuf[: hi - lo], yb, where, lo


def _release_pages(arr: np.ndarray, lo: int, hi: int) -> None:
    """Drop rows ``[lo, hi)`` of a memory map from this process's resident set (best effort)."""
    mm = getattr(arr, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    row = arr.strides[0]
    start = arr.offset + lo * row
    aligned = start - start % mmap.PAGESIZE
    with contextlib.suppress(Exception):
        mm.madvise(mmap.MADV_DONTNEED, aligned, start + (hi - lo) * row - aligned)


def _partition_chunks(shard: Shard, schema: Schema, rng, xbuf: np.ndarray, part: Any) -> Iterator:
    size = len(part[0]) if shard.kind == "array" else len(part)
    if size < shard.stop:
        raise ShardReadError(f"cannot read {shard.where()}: the partition has only {size} rows")
    for lo, hi in _slices(shard, xbuf.shape[0], rng):
        where = shard.where(lo, hi)
        X = xbuf[: hi - lo]
        try:
            if shard.kind == "array":
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(X, part[0][lo:hi], casting="unsafe")
                yb = np.asarray(part[1][lo:hi])
            else:
                rows = part.iloc[lo:hi]
                block = rows[list(schema.features)].to_numpy(dtype=np.float64, na_value=np.nan)
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(X, block, casting="unsafe")
                yb = rows[schema.label].to_numpy(dtype=np.float64, na_value=np.nan)
        except Exception as err:
            raise read_error(err, where) from err
        yield X, yb, where, lo


def read_array_rows(
    shard: Shard, part: Any, n_classes: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of an ``array`` shard of the Dask partition ``part = (X, y)``, whole and checked
    as :func:`read_chunks` checks them: float32 ``X`` and the training targets.

    ``X`` is a view of the partition's rows when they are aligned, C-contiguous float32
    already (no second copy in memory), else one converted copy: rows unpickled at an odd
    offset (Dask's scatter can leave them so) would make every gradient over them slower.
    """
    where = shard.where()
    try:
        features, labels = part
        if len(features) < shard.stop:
            raise ValueError(f"the partition has only {len(features)} rows")
        with np.errstate(over="ignore", invalid="ignore"):
            X = np.require(features[shard.start : shard.stop], np.float32, ["C", "A"])
        y = np.asarray(labels[shard.start : shard.stop])
    except Exception as err:
        raise read_error(err, where) from err
    return X, _check_chunk(X, y, where, shard.start, n_classes)


_READERS = {"parquet": _parquet_chunks, "csv": _csv_chunks, "npy": _npy_chunks}


def read_chunks(
    shard: Shard,
    schema: Schema,
    rng: np.random.Generator,
    xbuf: np.ndarray,
    n_classes: int | None,
    part: Any = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield checked ``(X, y)`` chunks of ``shard``: float32 X in ``xbuf`` (reused), targets.

    Each chunk is valid until the next one is requested.

    Raises
    ------
    ShardReadError
        The file is missing, unreadable, corrupt or changed (message names file/row group).
    ShardDataError
        NaN/inf features or targets, or labels outside ``0..n_classes-1``.
    """
    if shard.kind in _READERS:
        chunks = _READERS[shard.kind](shard, schema, rng, xbuf)
    else:
        chunks = _partition_chunks(shard, schema, rng, xbuf, part)
    for X, y, where, row0 in chunks:
        yield X, _check_chunk(X, y, where, row0, n_classes)


class _InOrder:
    """Stands in for a random generator where data must be read in file order."""

    @staticmethod
    def permutation(x: Any) -> np.ndarray:
        return np.arange(x) if isinstance(x, (int, np.integer)) else np.asarray(x)


#: Pass as ``rng`` to :func:`read_chunks` to read row groups and chunks in file order.
IN_ORDER: Any = _InOrder()
