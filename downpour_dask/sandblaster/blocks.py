"""Where a Sandblaster fit's training rows live: portions of rows, each a block on one worker.

A fit cuts its rows into *portions* (the rows one task computes a gradient on), and each
portion's rows are a *block*, a Dask future held by one worker for the whole fit: every later
pass over the portion runs where its block is and moves no data.

:class:`ArrayBlocks` is in-memory training data: its blocks are scattered from the driver, whose
copy is also the backup from which a block lost with its worker is scattered again.
:class:`ShardBlocks` is training data that is not in the driver: files (a
:class:`~downpour_dask.data.shards.ShardedDataset` of parquet, ``.npy`` or CSV files), or a
Dask DataFrame or Arrays persisted on the cluster
(:func:`~downpour_dask.runtime.placement.persist_partitions`).  A task on each worker reads
that worker's portions (:func:`read_block`): the rows go from disk, or from the partition in the
same worker's memory, to the worker that computes on them, never through the driver; a block
lost with its worker is simply read again elsewhere (Dask recomputes a lost partition).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from distributed import Client, Future

from ..core.params import split_range
from ..data.readers import IN_ORDER, read_array_rows, read_chunks
from ..data.schema import Schema, Shard
from ..data.shards import ShardedDataset
from ..runtime.cluster import cluster_workers, send_to_workers
from ..runtime.placement import PersistedPartitions

#: Dataset kinds whose shards a worker reads itself from files.
FILE_KINDS = ("parquet", "npy", "csv")
_CHUNK_ROWS = 65536  # rows decoded at a time while a block is read


#: Portions per worker thread by default.  Every portion costs a Dask task and a round trip to
#: each shard on top of its gradient, more than the gradient of a 250,000 x 100 logistic
#: portion, so a pass is quickest with the fewest, largest portions: one per thread.  Backup
#: tasks still copy a straggler's portion to an idle worker near the end of the batch (its
#: block moves, which the backup rule allows for), and ``portions_per_batch`` asks for more
#: where load balancing matters more.  Files get one portion per file (or Dask partition)
#: unless that makes fewer.  See ``bench_sandblaster.py`` and ``bench_backup_tasks.py`` in
#: benchmarks/README.md.
PORTIONS_PER_THREAD = 1

#: Largest block of features the default portions cut: scattering a multi-GB block from the
#: driver and aligning it on its worker took longer than the same rows in 1 GB blocks
#: (``bench_sandblaster_files.py``'s driver-fed row), so larger batches get more portions.
MAX_BLOCK_BYTES = 2**30


def default_portions(threads: int, batch_bytes: int = 0) -> int:
    """Portions per batch when ``portions_per_batch`` is None: ``PORTIONS_PER_THREAD`` per
    worker thread, or more if a batch of ``batch_bytes`` would make blocks larger than
    ``MAX_BLOCK_BYTES``."""
    return max(PORTIONS_PER_THREAD * max(1, threads), -(-batch_bytes // MAX_BLOCK_BYTES))


class ArrayBlocks:
    """In-memory training rows ``(X, y)``, scattered from the driver as one block per portion.

    Parameters
    ----------
    X, y : ndarray
        The checked training data (the model's ``check_data``).
    """

    def __init__(self, X: np.ndarray, y: np.ndarray):
        self.X, self.y = X, y
        self.homes: dict[int, str] = {}  # the worker each block was scattered to

    @property
    def n_rows(self) -> int:
        """Number of training rows."""
        return len(self.X)

    def portions(self, size: int, per_batch: int, order: np.ndarray | None) -> list[list]:
        """Rows of every portion of every batch of ``size`` rows, ``per_batch`` portions each:
        slices in full-batch mode (views, no copy), else index arrays of the permutation
        ``order`` cut into disjoint batches."""
        batches = []
        for lo, hi in split_range(self.n_rows, -(-self.n_rows // size)):
            parts = split_range(hi - lo, min(per_batch, hi - lo))
            batches.append(
                [
                    slice(lo + a, lo + b) if order is None else order[lo + a : lo + b]
                    for a, b in parts
                ]
            )
        return batches

    def place(
        self, client: Client, rows: list, workers: list[str] | None, timeout: float
    ) -> list[Future]:
        """Scatter every portion's rows, spread over ``workers`` (default: any), and align
        them where they landed (:func:`aligned_block`)."""
        X, y = self.X, self.y
        sent = send_to_workers(
            client, [(X[idx], y[idx]) for idx in rows], workers, timeout=timeout
        )  # views when the rows are contiguous
        return self._align(client, sent, range(len(rows)))

    def replace(self, client: Client, rows: slice | np.ndarray, timeout: float) -> Future:
        """Send the rows of one portion again, to one worker (Dask picks it, spreading blocks)."""
        X, y = self.X, self.y
        sent = send_to_workers(client, [(X[rows], y[rows])], timeout=timeout)
        return self._align(client, sent, [None])[0]

    def release(self) -> None:
        """Nothing to let go of at the end of a fit: the blocks are the passes' (cancelled
        then), the rows the driver's."""

    def _align(
        self, client: Client, sent: list[Future], pids: Sequence[int | None]
    ) -> list[Future]:
        """A task per scattered block, on its worker, giving its rows aligned; the scattered
        copy is released once that is done (nothing else holds it)."""
        who = client.who_has(sent)
        blocks = []
        for pid, future in zip(pids, sent):
            home = sorted(who.get(future.key, ()))[:1]
            if pid is not None and home:
                self.homes[pid] = home[0]
            blocks.append(
                client.submit(
                    aligned_block, future, workers=home or None,
                    allow_other_workers=bool(home), pure=False,
                    key=f"sandblaster-block-{uuid.uuid4().hex[:8]}",
                )  # fmt: skip
            )
        return blocks


class ShardBlocks:
    """Training rows in files or Dask partitions, read by the workers themselves: one block per
    portion.

    Every pass is over all the rows (full batch).  A portion is one file or partition (or its
    part of one): with ``per_batch`` portions wanted and fewer shards, each is cut into equal
    row ranges.  A partition's portions are read on the worker holding the partition, so no row
    moves; file portions are spread over the workers so that each holds about as many rows.
    The blocks stay where they are read for the whole fit.

    Parameters
    ----------
    dataset : ShardedDataset
        Files (``dataset.kind`` in :data:`FILE_KINDS`), already checked against the model, or a
        persisted Dask collection's dataset (``PersistedPartitions.dataset``).
    n_classes : int or None
        The classifier's number of classes (labels are checked to be in ``0..n_classes-1``
        while reading); None for regression targets.
    persisted : PersistedPartitions, optional
        Dask data: the persisted copy whose ``dataset`` this is; its ``parts`` (indexed by
        ``shard.part``) are read where its ``holders`` keep them.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        n_classes: int | None,
        persisted: PersistedPartitions | None = None,
    ):
        if dataset.kind not in FILE_KINDS and persisted is None:
            raise TypeError(
                f"SandblasterLBFGS reads files on the workers ({', '.join(FILE_KINDS)}) or "
                f"persisted Dask partitions, not a {dataset.kind!r} dataset without them"
            )
        self.dataset, self.n_classes, self.persisted = dataset, n_classes, persisted
        self.parts = [] if persisted is None else list(persisted.parts)
        self.holders = {} if persisted is None else dict(persisted.holders)
        self.shards: list[Shard] = []
        self.homes: dict[int, str] = {}  # the worker each portion's rows are first read on

    @property
    def n_rows(self) -> int:
        """Number of training rows."""
        return self.dataset.n_rows

    def portions(self, size: int, per_batch: int, order: np.ndarray | None) -> list[list]:
        """One batch of every row: a portion per shard, or per equal row range of a shard when
        ``per_batch`` is more than the number of shards.  The rows of portion ``i`` are ``i``."""
        if size != self.n_rows or order is not None:
            raise ValueError(
                "data read on the workers is read in full batches: batch_size must be None"
            )
        whole = self.dataset.shards
        cuts = max(1, -(-per_batch // len(whole)))
        self.shards = [
            dataclasses.replace(shard, start=shard.start + a, stop=shard.start + b)
            for shard in whole
            for a, b in split_range(shard.rows, min(cuts, shard.rows))
        ]
        return [list(range(len(self.shards)))]

    def place(
        self, client: Client, rows: list, workers: list[str] | None, timeout: float
    ) -> list[Future]:
        """Start a task reading each portion's rows on a worker: a partition's on the worker
        holding it (if among ``workers``), files spread so that the rows are even (the largest
        portions first, each to the worker with the fewest rows so far)."""
        pool = sorted(workers or cluster_workers(client))
        held = dict.fromkeys(pool, 0)
        local = [p for p in rows if self.holders.get(self.shards[p].part) in held]
        for pid in local:
            self.homes[pid] = self.holders[self.shards[pid].part]
            held[self.homes[pid]] += self.shards[pid].rows
        for pid in sorted(set(rows) - set(local), key=lambda p: -self.shards[p].rows):
            worker = min(pool, key=lambda w: held[w])
            self.homes[pid] = worker
            held[worker] += self.shards[pid].rows
        return [self._read(client, pid, [self.homes[pid]]) for pid in rows]

    def replace(self, client: Client, rows: int, timeout: float) -> Future:
        """Read the rows of portion ``rows`` again, on any worker (its block was lost).

        Raises
        ------
        RuntimeError
            If its Dask partition is gone for good: Dask recomputes a lost partition from the
            collection's graph, but one made of scattered data has no graph to recompute.
        """
        shard = self.shards[rows]
        if shard.part is not None:
            part = self.parts[shard.part]  # a future, or an (X, y) pair of them
            futures = part if isinstance(part, tuple) else (part,)
            if any(f.status in ("cancelled", "error") for f in futures):
                raise RuntimeError(
                    f"the rows of {shard.where()} were lost with their worker, and Dask cannot "
                    f"recompute them (a collection made of scattered data has no graph to "
                    f"recompute): build the collection from a graph (files, dask.array "
                    f"functions, from_array) or pass the data in memory"
                )
        return self._read(client, rows, None)

    def release(self) -> None:
        """Let go of the fit's hold on the persisted Dask partitions, at the end of the fit.

        Only the fit's own hold goes: a collection the user persisted keeps the user's, and the
        data with it.  Done explicitly rather than left to the futures' deletion: a finished
        fit's coordinator and its passes refer to each other, and Dask leaves futures in
        reference cycles, so the copy would stay in the workers' memory until Python's cycle
        collector happened to run.
        """
        if self.persisted is not None:
            self.persisted.release()

    def _read(self, client: Client, pid: int, workers: list[str] | None) -> Future:
        shard = self.shards[pid]
        part = None if shard.part is None else self.parts[shard.part]
        return client.submit(
            read_block, shard, self.dataset.schema, self.n_classes, part,
            workers=workers, allow_other_workers=workers is not None, pure=False,
            key=f"sandblaster-block-{pid}-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip


def aligned_block(block: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Dask task: ``block``'s arrays themselves when every element is aligned (no copy), else
    aligned copies.  Dask receives a scattered array into one buffer with the message's other
    frames, so its rows can start at any byte: a gradient over rows that are not even
    float32-aligned runs several times slower."""
    X, y = block
    return np.require(X, requirements=["C", "A"]), np.require(y, requirements=["A"])


def read_block(
    shard: Shard, schema: Schema, n_classes: int | None, part: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Dask task: the rows of ``shard`` as a C-contiguous float32 ``X`` and the targets (int64
    labels for a classifier, float32 otherwise), checked as a replica's stream checks them.

    ``part`` is the Dask partition a ``frame`` or ``array`` shard is in (a pandas DataFrame or
    an ``(X, y)`` pair of arrays); None for files.  An ``array`` shard's ``X`` is a view of its
    partition when that is aligned, C-contiguous float32 already.

    Raises
    ------
    ShardReadError, ShardDataError
        An unreadable file, or bad values, naming the file and the row group or rows.
    """
    if shard.kind == "array":  # rows in memory already: a view of them when they can be
        return read_array_rows(shard, part, n_classes)
    X = np.empty((shard.rows, schema.n_features), np.float32)
    y = np.empty(
        (shard.rows, *((schema.y_width,) if schema.y_width else ())),
        np.float32 if n_classes is None else np.int64,
    )
    xbuf = np.empty((min(_CHUNK_ROWS, shard.rows), schema.n_features), np.float32)
    row = 0
    for Xc, yc in read_chunks(shard, schema, IN_ORDER, xbuf, n_classes, part):
        X[row : row + len(Xc)] = Xc
        y[row : row + len(Xc)] = yc
        row += len(Xc)
    if row != shard.rows:
        raise ValueError(f"{shard.where()}: read {row} rows, expected {shard.rows}")
    return X, y
