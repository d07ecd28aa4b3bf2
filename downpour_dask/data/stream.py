"""A replica's minibatches, streamed from its shards in bounded memory.

Reading goes in three stages, top to bottom in this module:

1. **Chunk readers** (:func:`read_chunks`) turn one shard into chunks of at most ``chunk_rows``
   rows of float32 features and checked targets: parquet by row group (``iter_batches`` inside
   each group, restricted to the shard's row range), ``.npy`` through a memory map (pages are
   released after each chunk), CSV with pyarrow's streaming reader, Dask partitions by row slices.
   Row groups / chunks are visited in a fresh random order every epoch.  Every chunk is checked
   for NaN/inf and bad labels, and every read failure becomes a :class:`ShardReadError`; both
   name the file and the row group or rows.
2. A **shuffle buffer** (:func:`shuffle_batches`) of ``capacity`` rows: once full, each batch
   takes ``batch_size`` random rows out and the next rows read take their slots (a vectorised
   version of tf.data's buffer); at the end the rest is drained in random order.  Every row is
   emitted exactly once per epoch.
3. A **prefetch thread** (:func:`prefetched`) runs stages 1-2 ahead of the training loop through a
   bounded queue, so reading overlaps the gradient computation.  Every get/put polls a stop flag,
   the consumer re-raises the reader's exception, and leaving the loop early stops the thread.

:class:`ArraySource` is the in-memory path (exactly :func:`~downpour_dask.data.minibatches`);
:class:`ShardStream` the streaming one.  Both offer ``epoch(rng)``, all a replica needs.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .datasets import minibatches
from .shards import Schema, Shard, ShardDataError, ShardReadError, _open_npy, _wrap_read

CHUNK_BYTES = 4 << 20  # rows read at a time: ~4 MiB of float32 features
BUFFER_BYTES = 32 << 20  # default shuffle buffer: ~32 MiB of float32 features
MAX_BUFFER_ROWS = 65536


def default_buffer(n_features: int, batch_size: int) -> int:
    """Default shuffle-buffer rows: ~32 MiB of features, at most 65,536, at least 4 batches."""
    return max(4 * batch_size, min(MAX_BUFFER_ROWS, BUFFER_BYTES // (4 * n_features)))


@dataclass(frozen=True)
class StreamSpec:
    """Everything a replica needs to stream its shards (small and picklable; no data).

    ``n_classes`` is set for classifiers (labels must be integers in ``0..n_classes-1``) and
    None for regression (float32 targets).
    """

    schema: Schema
    shards: tuple[Shard, ...]
    batch_size: int
    shuffle_buffer: int
    n_classes: int | None
    prefetch: int = 2

    @property
    def chunk_rows(self) -> int:
        return max(1, min(self.shuffle_buffer, CHUNK_BYTES // (4 * self.schema.n_features)))


# -- 1. chunk readers ----------------------------------------------------------------------------


def _guarded(items: Any, where: str) -> Iterator[Any]:
    """Iterate ``items``, turning any failure to produce the next one into a ShardReadError."""
    try:
        it = iter(items)
    except Exception as err:
        raise _wrap_read(err, where) from err
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as err:
            raise _wrap_read(err, where) from err
        yield item


def _check_chunk(
    X: np.ndarray, y: np.ndarray, where: str, row0: int, n_classes: int | None
) -> np.ndarray:
    """Raise ShardDataError on NaN/inf features or bad targets; return the training targets."""
    if not np.isfinite(X.sum(dtype=np.float64)):  # one pass, no temporary; finite iff all are
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


def _arrow_chunks(
    batches: Any, lo: int, hi: int, pos: int, xbuf: np.ndarray, where: str
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Rows ``[lo, hi)`` of a stream of record batches starting at row ``pos``, as chunks.

    Columns are the features in order, then the label.
    """
    n_feat, size = xbuf.shape[1], xbuf.shape[0]
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
            with np.errstate(over="ignore", invalid="ignore"):
                for j in range(n_feat):
                    X[:, j] = columns[j][r0 : r0 + m]
            yield X, columns[n_feat][r0 : r0 + m], c0


def _parquet_chunks(shard: Shard, schema: Schema, rng, xbuf: np.ndarray) -> Iterator:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(shard.path)
        meta = pf.metadata
    except Exception as err:
        raise _wrap_read(err, shard.where()) from err
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
            batches = pf.iter_batches(  # decoding 4 chunks at once is ~25% cheaper per row
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
    import pyarrow as pa
    import pyarrow.csv as pacsv

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
        raise _wrap_read(err, where) from err
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
    X, y = _open_npy(shard.path), _open_npy(shard.y_path)
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
            raise _wrap_read(err, where) from err
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
            raise _wrap_read(err, where) from err
        yield X, yb, where, lo


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


# -- 2. the shuffle buffer -----------------------------------------------------------------------


class _Feed:
    """Copies the next rows of a chunk stream into given slots of the shuffle buffer."""

    def __init__(self, chunks: Iterator[tuple[np.ndarray, np.ndarray]]):
        self.chunks, self.X, self.y, self.pos = chunks, None, None, 0

    def fill(self, Xbuf: np.ndarray, ybuf: np.ndarray, slots: np.ndarray) -> int:
        """Write rows into ``slots`` (in order); return how many (fewer only at the end)."""
        written = 0
        while written < len(slots):
            if self.X is None or self.pos == len(self.X):
                nxt = next(self.chunks, None)
                if nxt is None:
                    break
                self.X, self.y = nxt
                self.pos = 0
            m = min(len(slots) - written, len(self.X) - self.pos)
            dest = slots[written : written + m]
            Xbuf[dest] = self.X[self.pos : self.pos + m]
            ybuf[dest] = self.y[self.pos : self.pos + m]
            written, self.pos = written + m, self.pos + m
        return written


def shuffle_batches(
    chunks: Iterator[tuple[np.ndarray, np.ndarray]],
    capacity: int,
    ring: Sequence[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of shuffled minibatches from ``chunks`` through a ``capacity``-row buffer.

    Batches are written into the ``ring`` of preallocated ``(X, y)`` batch buffers in turn, so a
    yielded batch stays valid while ``len(ring) - 1`` more are produced.  Every row of
    ``chunks`` is emitted exactly once; the last batch may be smaller.
    """
    Xo, yo = ring[0]
    size = len(Xo)
    capacity = max(capacity, size)
    Xbuf = np.empty((capacity,) + Xo.shape[1:], Xo.dtype)
    ybuf = np.empty((capacity,) + yo.shape[1:], yo.dtype)
    feed, turn = _Feed(chunks), 0

    def emit(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nonlocal turn
        Xo, yo = ring[turn % len(ring)]
        turn += 1
        k = len(slots)
        np.take(Xbuf, slots, axis=0, out=Xo[:k], mode="clip")  # indices are valid
        np.take(ybuf, slots, axis=0, out=yo[:k], mode="clip")
        return Xo[:k], yo[:k]

    n = feed.fill(Xbuf, ybuf, np.arange(capacity))
    live = np.arange(n)
    while n == capacity:  # steady state: random rows out, the next rows read into their slots
        slots = rng.choice(n, size=size, replace=False)
        batch = emit(slots)
        got = feed.fill(Xbuf, ybuf, slots)
        yield batch
        if got < size:  # the stream ended: the unfilled slots are holes
            keep = np.ones(n, bool)
            keep[slots[got:]] = False
            live = np.flatnonzero(keep)
            break
    order = live[rng.permutation(len(live))]
    for lo in range(0, len(order), size):
        yield emit(order[lo : lo + size])


# -- 3. prefetching ------------------------------------------------------------------------------

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def prefetched(
    produce: Callable[[], Iterator[Any]], depth: int = 2, poll: float = 0.1
) -> Iterator[Any]:
    """Run the iterator ``produce()`` in a background thread, ``depth`` items ahead.

    The thread's exception is re-raised here; closing this generator (or leaving a ``for`` loop
    over it) stops the thread.  Every queue operation waits at most ``poll`` seconds before
    checking the stop flag or whether the thread is still alive, so nothing can block forever.
    """
    items: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=poll)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        source = None
        try:
            source = produce()
            for item in source:
                if not put(item):
                    return
            put(_END)
        except BaseException as err:  # handed to the consumer, which re-raises it
            put(_Failure(err))
        finally:
            if source is not None and hasattr(source, "close"):
                with contextlib.suppress(Exception):
                    source.close()

    thread = threading.Thread(target=work, name="downpour-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = items.get(timeout=poll)
            except queue.Empty:
                if not thread.is_alive() and items.empty():
                    raise RuntimeError("the prefetch thread ended without a result") from None
                continue
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join(timeout=10 * poll)


# -- sources: what a replica iterates over -------------------------------------------------------


class ArraySource:
    """In-memory ``(X, y)``: each epoch is :func:`~downpour_dask.data.minibatches`, unchanged.

    Arrays that arrive in a Dask message are often *unaligned* (their data starts at an odd
    offset in the received frame), and numpy gathers rows from unaligned arrays through a slow
    element-wise path: measured in a worker, 10k instead of 5M rows/s for 256 float32 features.
    So unaligned arrays are copied once, here, into aligned memory.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, batch_size: int):
        self.X = np.require(X, requirements=["C", "A"])
        self.y = np.require(y, requirements=["C", "A"])
        self.batch_size = batch_size

    def epoch(self, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One shuffled pass (order drawn from ``rng``); batches valid until the next one."""
        return minibatches(self.X, self.y, self.batch_size, rng)


class ShardStream:
    """A replica's shards streamed as minibatches (see the module docstring for the stages).

    Parameters
    ----------
    spec : StreamSpec
        The replica's shards and reading settings.
    parts : sequence, optional
        For Dask data: the partitions named by the shards' ``part`` indices.
    """

    def __init__(self, spec: StreamSpec, parts: Sequence[Any] = ()):
        self.spec, self.parts = spec, list(parts)

    def epoch(self, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One pass over every row of the shards, shuffled; batches are read ahead in a thread.

        A yielded batch is valid until the next one is requested.
        """
        seed = int(rng.integers(2**63))  # the reader thread owns its own generator
        return prefetched(
            lambda: self.batches(np.random.default_rng(seed)), depth=self.spec.prefetch
        )

    def batches(self, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The same pass without the prefetch thread (shard order, chunks, shuffle buffer)."""
        spec, schema = self.spec, self.spec.schema
        size = spec.batch_size
        xbuf = np.empty((spec.chunk_rows, schema.n_features), np.float32)
        y_shape = (schema.y_width,) if schema.y_width else ()
        y_dtype = np.float32 if spec.n_classes is None else np.int64
        ring = [
            (np.empty((size, schema.n_features), np.float32), np.empty((size, *y_shape), y_dtype))
            for _ in range(spec.prefetch + 3)  # consumer 1 + queue + producer 1, and a spare
        ]
        order = rng.permutation(len(spec.shards))
        chunks = (
            chunk
            for i in order
            for chunk in read_chunks(
                spec.shards[i],
                schema,
                rng,
                xbuf,
                spec.n_classes,
                None if spec.shards[i].part is None else self.parts[spec.shards[i].part],
            )
        )
        yield from shuffle_batches(chunks, spec.shuffle_buffer, ring, rng)


def make_source(data: Any, batch_size: int, parts: Sequence[Any] = ()) -> ArraySource | ShardStream:
    """The batch source of a replica task: ``(X, y)`` arrays or a :class:`StreamSpec`."""
    if isinstance(data, StreamSpec):
        return ShardStream(data, parts)
    X, y = data
    return ArraySource(X, y, batch_size)
