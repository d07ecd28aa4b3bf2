"""Which rows (or files) each replica reads, re-split when a replica joins a running fit.

Every replica of a fit starts with its own subset: in-memory ``(X, y)`` arrays, or the files
(shards) of a streamed dataset it reads -- for a sparse fit (:mod:`.sparse_growth`), a
:class:`~downpour_dask.core.sparse.SparseBatch` or ``(paths, HashSpec)``.  When :mod:`.elastic`
adds a replica on a worker that joined, :class:`DataShares` takes ``1/k`` of what each of the
``k - 1`` training replicas reads now (a reproducible random pick) and gives it to the new
replica: the union of the replicas' shares stays every row (every file) exactly once.  The
replicas that gave some away hear of their smaller share through
:func:`~.registry.assign_share` on their worker:

- in memory, at their next epoch boundary (their epoch so far may have read rows the new replica
  reads too; from the boundary on, each row is read once per epoch across the replicas);
- streamed, before they open their next file: files not yet read in the current epoch are read by
  the new replica only.

A share is positions into the arrays (or the file list) the replica's task was started with, so
a replica that moves to another worker keeps its share: :meth:`DataShares.positions` is sent to
its new worker before its task starts there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..core.sparse import SparseBatch
from ..data.hashing import count_rows, is_hashed_files
from ..data.stream import ArraySource, ShardStream, StreamSpec
from .registry import assigned_share


def split_off(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of the ``n // k`` of ``n`` items (at random) a replica gives away when
    ``k`` replicas share what it had."""
    return np.sort(rng.choice(n, size=n // max(1, k), replace=False))


def shareable(data: Any, placed: list[Any]) -> list[Any]:
    """What :class:`DataShares` splits of a fit's ``data``: each replica's ``(X, y)`` arrays
    (``data`` itself) or its :class:`StreamSpec` (``placed[r].data``); nothing for Dask
    collections, whose partitions a replica cannot hand over (no replica is added then)."""
    if isinstance(data, list):
        return data
    return [] if any(p.parts for p in placed) else [p.data for p in placed]


class DataShares:
    """The driver's record of each replica's data and of the part of it the replica reads.

    Parameters
    ----------
    data : list
        Each original replica's data: ``(X, y)`` arrays or a :class:`StreamSpec`.
    seed : int
        Seeds the picks (a fit with the same seed and joins splits the same way).
    """

    def __init__(self, data: list[Any], seed: int):
        self.data = dict(enumerate(data))
        self.keep = {r: np.arange(self._size(d)) for r, d in self.data.items()}
        self.seed = seed

    @staticmethod
    def _size(data: Any) -> int:
        if isinstance(data, StreamSpec):
            return len(data.shards)
        return len(data.y) if isinstance(data, SparseBatch) else len(data[0])

    def positions(self, replica: int) -> np.ndarray | None:
        """What ``replica`` reads of its data (positions), None if all of it -- as a replica
        whose data is not shared does (a Dask collection's partitions: not in the record)."""
        keep = self.keep.get(replica)
        if keep is None:
            return None
        return None if len(keep) == self._size(self.data[replica]) else keep

    def add(self, replica: int, sharing: list[int]) -> tuple[Any, dict[int, np.ndarray]] | None:
        """Give ``replica`` (new) ``1/k`` of what each replica of ``sharing`` reads (``k`` is
        ``len(sharing) + 1``); return its data and the new positions of each replica that gave
        some away, or None when there is nothing to give (every share is a single file)."""
        k = len(sharing) + 1
        rng = np.random.default_rng([self.seed, replica])
        given: dict[int, np.ndarray] = {}
        for r in sharing:
            keep = self.keep[r]
            taken = split_off(len(keep), k, rng)
            if len(taken) and len(taken) < len(keep):
                given[r] = taken
        if not given:
            return None
        changed = {}
        pieces = []
        for r, taken in given.items():
            pieces.append((r, self.keep[r][taken]))
            self.keep[r] = np.delete(self.keep[r], taken)
            changed[r] = self.keep[r]
        new = self._gather(pieces)
        self.data[replica] = new
        self.keep[replica] = np.arange(self._size(new))
        return new, changed

    def _gather(self, pieces: list[tuple[int, np.ndarray]]) -> Any:
        first = self.data[pieces[0][0]]
        if isinstance(first, StreamSpec):
            shards = tuple(self.data[r].shards[i] for r, taken in pieces for i in taken)
            return dataclasses.replace(first, shards=shards)
        if isinstance(first, SparseBatch):
            return SparseBatch.concat([self.data[r].take(taken) for r, taken in pieces])
        if is_hashed_files(first):
            return [self.data[r][0][i] for r, taken in pieces for i in taken], first[1]
        X = np.concatenate([self.data[r][0][taken] for r, taken in pieces])
        y = np.concatenate([self.data[r][1][taken] for r, taken in pieces])
        return X, y

    def rows(self, replica: int) -> int:
        """Rows ``replica`` reads per epoch."""
        data, keep = self.data[replica], self.keep[replica]
        if isinstance(data, StreamSpec):
            return sum(data.shards[i].rows for i in keep)
        if is_hashed_files(data):
            return count_rows([data[0][i] for i in keep], data[1])
        return len(keep)

    def rows_read(self) -> dict[str, int]:
        """Rows per epoch of each replica, by replica (for the experiment's config): they add
        up to the dataset's rows while no added replica left."""
        return {str(r): self.rows(r) for r in self.data}


class SharedSource:
    """A replica's batch source that follows the share the driver assigns it (module docstring).

    ``share()`` returns the latest assigned positions, or None while the replica reads all of
    its data; it is asked at each epoch start (and, streamed, before each file).
    """

    def __init__(self, source: ArraySource | ShardStream, share: Callable[[], np.ndarray | None]):
        self.source, self.share = source, share
        self.full = source
        self.current: np.ndarray | None = None
        if isinstance(source, ShardStream):
            source.keeps = self._keeps

    def _keeps(self, i: int) -> bool:
        share = self.share()
        return share is None or bool(np.isin(i, share))

    def epoch(self, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One epoch over the replica's current share."""
        share = self.share()
        full = self.full
        if isinstance(full, ArraySource) and share is not None and share is not self.current:
            self.current = share
            self.source = ArraySource(full.X[share], full.y[share], full.batch_size)
        return self.source.epoch(rng)


def shared_source(source: ArraySource | ShardStream, run: str, replica: int) -> SharedSource:
    """``source`` following the shares the driver of fit ``run`` assigns ``replica``."""
    return SharedSource(source, lambda: assigned_share(run, replica))
