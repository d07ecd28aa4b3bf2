"""A replica's minibatches, streamed from its shards in bounded memory.

Reading goes in three stages:

1. **Chunk readers** (:func:`~downpour_dask.data.readers.read_chunks`) turn one shard into
   checked chunks of at most :attr:`StreamSpec.chunk_rows` rows, visited in a fresh random order
   every epoch.
2. A **shuffle buffer** (:func:`shuffle_batches`) of ``capacity`` rows: once full, each batch
   takes ``batch_size`` random rows out and the next rows read take their slots (a vectorised
   version of tf.data's buffer); at the end the rest is drained in random order.  Every row is
   emitted exactly once per epoch.
3. A **prefetch thread** (:func:`prefetched`) runs stages 1-2 ahead of the training loop through a
   bounded queue, so reading overlaps the gradient computation.  Once the queue is full the thread
   sleeps until the loop has taken half of it, then refills it in one burst (:class:`Handoff`).
   Every get/put polls a stop flag, the consumer re-raises the reader's exception, and leaving
   the loop early stops the thread.

:class:`ArraySource` is the in-memory path (exactly :func:`~downpour_dask.data.arrays.minibatches`);
:class:`ShardStream` the streaming one.  Both offer ``epoch(rng)``, all a replica needs, and
:func:`make_source` picks one from what a replica task receives.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import minibatches
from .readers import read_chunks
from .schema import Schema, Shard
from .shards import ShardedDataset

CHUNK_BYTES = 4 << 20  # rows read at a time: ~4 MiB of float32 features
BUFFER_BYTES = 32 << 20  # default shuffle buffer: ~32 MiB of float32 features
MAX_BUFFER_ROWS = 65536
PREFETCH_BYTES = 8 << 20  # batches read ahead: ~8 MiB of float32 features, 2 to MAX_PREFETCH
MAX_PREFETCH = 32


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

    @property
    def chunk_rows(self) -> int:
        """Rows read at a time: ~4 MiB of float32 features, at most the shuffle buffer."""
        return max(1, min(self.shuffle_buffer, CHUNK_BYTES // (4 * self.schema.n_features)))

    @property
    def prefetch(self) -> int:
        """Batches the prefetch thread may hold ready: ~8 MiB of features, 2 to 32."""
        batch_bytes = 4 * self.schema.n_features * self.batch_size
        return max(2, min(MAX_PREFETCH, PREFETCH_BYTES // batch_bytes))


def replica_spec(
    data: ShardedDataset, shards: Sequence[Shard], batch_size: int, n_classes: int | None
) -> StreamSpec:
    """The StreamSpec of a replica that streams ``shards`` of ``data``.

    The shuffle buffer is the dataset's ``shuffle_buffer`` (else :func:`default_buffer`), at
    most the replica's rows and at least one batch.  ``n_classes`` is the model's number of
    classes for a classifier, None for regression.
    """
    rows = sum(s.rows for s in shards)
    buffer = data.shuffle_buffer or default_buffer(data.n_features, batch_size)
    return StreamSpec(
        data.schema,
        tuple(shards),
        batch_size,
        shuffle_buffer=max(batch_size, min(buffer, rows)),
        n_classes=n_classes,
    )


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


class Handoff:
    """A bounded FIFO from one producer thread to one consumer, with a low-water mark.

    A producer that finds ``depth`` items waiting sleeps until at most ``resume_at`` are left,
    then refills in a burst; each side wakes the other only when that one sleeps.  So a
    producer that keeps ahead costs a thread switch per ``depth - resume_at`` items, where
    :class:`queue.Queue` wakes a waiting producer on every ``get``: one switch per item, which
    on a busy process costs the consumer more than the handing over itself.  Never more than
    ``depth`` items wait.  Every wait lasts at most ``poll`` seconds.
    """

    def __init__(self, depth: int, resume_at: int, stop: threading.Event, poll: float = 0.1):
        if not 0 <= resume_at < depth:
            raise ValueError(f"resume_at must be in [0, depth), got {resume_at} for depth {depth}")
        self.depth, self.resume_at, self.stop, self.poll = depth, resume_at, stop, poll
        self._items: deque = deque()
        self._changed = threading.Condition()
        self._producer_sleeps = self._consumer_sleeps = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> bool:
        """Append ``item`` (waiting while the FIFO is full); False if ``stop`` was set first."""
        with self._changed:
            if len(self._items) >= self.depth:
                self._producer_sleeps = True
                while len(self._items) > self.resume_at and not self.stop.is_set():
                    self._changed.wait(self.poll)
                self._producer_sleeps = False
            if self.stop.is_set():
                return False
            self._items.append(item)
            if self._consumer_sleeps:
                self._changed.notify()
            return True

    def get(self) -> Any:
        """The oldest item; :class:`queue.Empty` if none came within ``poll`` seconds."""
        with self._changed:
            if not self._items:
                self._consumer_sleeps = True
                self._changed.wait(self.poll)
                self._consumer_sleeps = False
                if not self._items:
                    raise queue.Empty
            item = self._items.popleft()
            if self._producer_sleeps and len(self._items) <= self.resume_at:
                self._changed.notify()
            return item


def prefetched(
    produce: Callable[[], Iterator[Any]], depth: int = 2, poll: float = 0.1
) -> Iterator[Any]:
    """Run the iterator ``produce()`` in a background thread, up to ``depth`` items ahead.

    The items go through a :class:`Handoff` that lets the thread resume once half of them were
    taken.  The thread's exception is re-raised here; closing this generator (or leaving a
    ``for`` loop over it) stops the thread.  Every wait lasts at most ``poll`` seconds before
    checking the stop flag or whether the thread is still alive, so nothing can block forever.
    """
    stop = threading.Event()
    depth = max(1, depth)
    items = Handoff(depth, depth // 2, stop, poll)

    def work() -> None:
        source = None
        try:
            source = produce()
            for item in source:
                if not items.put(item):
                    return
            items.put(_END)
        except BaseException as err:  # handed to the consumer, which re-raises it
            items.put(_Failure(err))
        finally:
            if source is not None and hasattr(source, "close"):
                with contextlib.suppress(Exception):
                    source.close()

    thread = threading.Thread(target=work, name="downpour-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = items.get()
            except queue.Empty:
                if not thread.is_alive() and not items:
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
    """In-memory ``(X, y)``: each epoch is :func:`~downpour_dask.data.arrays.minibatches`.

    Arrays that arrive in a Dask message are often *unaligned* (their data starts at an odd
    offset in the received frame), and numpy gathers rows from unaligned arrays through a slow
    element-wise path, orders of magnitude slower than from aligned memory.  So unaligned arrays
    are copied once, here, into aligned memory.
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
        #: Whether shard ``i`` is still this replica's to read (asked before opening it): a
        #: running fit may hand shards not yet read to a replica that joined.
        self.keeps: Callable[[int], bool] = lambda i: True

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
            if self.keeps(int(i))
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
