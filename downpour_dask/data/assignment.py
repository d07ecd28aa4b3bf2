"""The one place that splits data among model replicas: in-memory rows, files, Dask partitions.

Each replica trains on its own contiguous, row-balanced subset, as in the paper, and together the
subsets hold every row exactly once:

* :func:`split_rows` cuts ``n_rows`` in-memory rows into ``n_replicas`` contiguous ranges whose
  sizes differ by at most one (:meth:`~downpour_dask.data.arrays.Dataset.partition` uses it);
* :func:`assign_shards` lays file shards end to end and cuts the combined rows the same way,
  splitting a shard into two row ranges where a cut falls inside it;
* :func:`assign_partitions` does it for a Dask collection whose partitions are already held by
  workers: each worker gets replicas in proportion to the rows it holds (largest remainder), its
  partitions are split among them with :func:`assign_shards`, and each replica is pinned to it,
  so replicas read their partitions from their own worker's memory.

Everything here is plain arithmetic on row counts (no data, no Dask), so it is tested in-process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..core.params import split_range
from .schema import Shard


def _check_replicas(n_replicas: int, n_rows: int, what: str) -> None:
    """Raise ValueError unless every one of ``n_replicas`` replicas can have rows of its own."""
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, (int, np.integer)):
        raise TypeError(f"n_replicas must be an int, got {n_replicas!r}")
    if n_replicas < 1:
        raise ValueError(f"n_replicas must be >= 1, got {n_replicas}")
    if n_replicas > n_rows:
        raise ValueError(
            f"cannot give each of {n_replicas} replicas its own data: {what} has only "
            f"{n_rows} rows; use n_replicas <= {n_rows}"
        )


def split_rows(n_rows: int, n_replicas: int, what: str = "the dataset") -> list[tuple[int, int]]:
    """``n_replicas`` contiguous ``(start, stop)`` row ranges covering ``range(n_rows)``.

    Sizes differ by at most one row; earlier ranges are the longer ones.  ``what`` names the
    data in the error message.

    Raises
    ------
    ValueError
        If there are fewer rows than replicas (a replica would have no data), or
        ``n_replicas < 1``.
    """
    _check_replicas(n_replicas, n_rows, what)
    return split_range(n_rows, n_replicas)


def assign_shards(
    shards: Sequence[Shard], n_replicas: int, what: str = "the dataset"
) -> list[list[Shard]]:
    """Give each of ``n_replicas`` replicas a row-balanced list of shards.

    The shards are laid end to end and the combined row sequence is cut by :func:`split_rows`.
    A cut inside a shard splits it into two row ranges, so at most ``n_replicas - 1`` shards are
    split, every row belongs to exactly one replica, and a replica reads at most a few files
    partially.  With fewer files than replicas, files are split into row ranges; with uneven file
    sizes, big files are shared and small ones grouped.

    Raises
    ------
    ValueError
        If there are fewer rows than replicas (a replica would have no data).
    """
    offsets = np.cumsum([0] + [s.rows for s in shards])
    plan: list[list[Shard]] = []
    for lo, hi in split_rows(int(offsets[-1]), n_replicas, what):
        mine = []
        for i, shard in enumerate(shards):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                base = shard.start - int(offsets[i])
                mine.append(replace(shard, start=base + int(a), stop=base + int(b)))
        plan.append(mine)
    return plan


@dataclass(frozen=True)
class ReplicaShare:
    """One replica's share of a Dask collection held by the workers.

    Attributes
    ----------
    worker : str
        The worker the replica runs on: the one holding (most of) its partitions.
    shards : tuple of Shard
        Row ranges to read; each shard's ``part`` indexes ``parts``.
    parts : tuple of int
        The collection's partition indices the replica's task receives, in order.
    """

    worker: str
    shards: tuple[Shard, ...]
    parts: tuple[int, ...]


def replica_quotas(rows: Mapping[str, int], n_replicas: int) -> dict[str, int]:
    """Replicas per worker in proportion to the rows it holds (largest remainder).

    A worker never gets more replicas than it holds rows (``ceil(n * r / total) <= r`` while
    ``n <= total``); a worker holding few rows may get none.
    """
    total = sum(rows.values())
    exact = {w: n_replicas * r / total for w, r in rows.items()}
    quotas = {w: int(x) for w, x in exact.items()}
    short = n_replicas - sum(quotas.values())
    for w in sorted(exact, key=lambda v: quotas[v] - exact[v])[:short]:
        quotas[w] += 1
    return quotas


def assign_partitions(
    shards: Sequence[Shard], holders: Mapping[int, str], n_replicas: int
) -> list[ReplicaShare]:
    """Split partitions held by workers among ``n_replicas`` replicas pinned next to them.

    Parameters
    ----------
    shards : sequence of Shard
        One per partition to train on (empty partitions left out); ``part`` is the partition's
        index in the collection.
    holders : mapping of int to str
        The worker holding each partition (by index).
    n_replicas : int
        How many replicas share the data.

    Returns
    -------
    list of ReplicaShare
        Workers in the order their first partition appears; on each, replicas with row counts
        differing by at most one.  Partitions of a worker given no replica (it holds too few
        rows) go to the worker whose replicas have the fewest rows each.

    Raises
    ------
    ValueError
        If the partitions hold fewer rows than ``n_replicas``.
    """
    _check_replicas(n_replicas, sum(s.rows for s in shards), "the Dask collection")
    by_worker: dict[str, list[Shard]] = {}
    for shard in shards:
        by_worker.setdefault(holders[shard.part], []).append(shard)
    quotas = replica_quotas({w: sum(s.rows for s in sh) for w, sh in by_worker.items()}, n_replicas)

    def rows_per_replica(w: str) -> float:
        return sum(s.rows for s in by_worker[w]) / quotas[w]

    for w, quota in list(quotas.items()):
        if quota == 0:  # its data moves to a worker that runs replicas
            target = min((v for v in quotas if quotas[v]), key=rows_per_replica)
            by_worker[target] += by_worker.pop(w)
    shares = []
    for w, held in by_worker.items():
        for mine in assign_shards(held, quotas[w], "the Dask collection"):
            used = sorted({s.part for s in mine})
            local = {p: i for i, p in enumerate(used)}
            local_shards = tuple(replace(s, part=local[s.part]) for s in mine)
            shares.append(ReplicaShare(w, local_shards, tuple(used)))
    return shares
