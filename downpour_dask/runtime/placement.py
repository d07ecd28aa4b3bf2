"""Where each replica runs and what it reads: the Dask side of placing data on the workers.

At fit, :func:`place_replicas` decides each replica's worker and the data its task receives:

- in-memory data: each replica's contiguous subset is scattered to its worker;
- files: :func:`~downpour_dask.data.assignment.assign_shards` gives each replica its
  row-balanced shards, and the replicas go round-robin over the workers (files are assumed
  readable from every worker);
- Dask collections: a persisted copy of the collection is made, ``who_has`` tells which worker
  holds each partition, and :func:`~downpour_dask.data.assignment.assign_partitions` pins
  replicas next to their partitions (:func:`persist_partitions`, which Sandblaster uses too).
  The partition futures are task arguments, so Dask hands each replica its partitions from the
  worker's own memory.

Replicas receive shard descriptors (and partition futures), never data through the client.  The
caller's dataset and collection are left as they are: what was placed is described by the
returned :class:`PlacedData`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distributed import Client, Future, futures_of, wait

from ..data.assignment import assign_partitions, assign_shards
from ..data.dask_collections import DaskDataset
from ..data.shards import ShardedDataset
from ..data.stream import replica_spec
from .cluster import send_to_workers
from .deadlines import waiting_for


@dataclass
class Placement:
    """Where replica ``r`` runs and what its task receives.

    Attributes
    ----------
    worker : str
        The worker's address.
    data : tuple of Future or StreamSpec
        The scattered ``(X, y)`` subset, or the replica's shards to stream.
    parts : list
        Dask data: the partitions (futures, or ``(X, y)`` future pairs) the StreamSpec's
        shards index; empty otherwise.
    rows : int
        Rows the replica trains on per epoch.
    """

    worker: str
    data: Any
    parts: list
    rows: int = 0


@dataclass
class PlacedData:
    """The outcome of :func:`place_replicas`.

    Attributes
    ----------
    replicas : list of Placement
        One per replica, in replica order.
    n_rows : int
        Rows of one epoch over all replicas.
    info : dict
        JSON-serialisable description for the experiment's config: ``kind``, ``n_shards``,
        ``rows`` (and ``name`` for files and Dask data).
    """

    replicas: list[Placement]
    n_rows: int
    info: dict[str, Any]


def place_replicas(
    client: Client,
    data: Any,
    n_replicas: int,
    workers: list[str],
    batch_size: int,
    model: Any,
    timeout: float,
) -> PlacedData:
    """Decide each replica's worker and data (see the module docstring); no data via the client.

    ``data`` is a list of in-memory ``(X, y)`` subsets (one per replica) or a ShardedDataset;
    it is not modified.

    Raises
    ------
    ValueError
        If the data has fewer rows than ``n_replicas`` (known for Dask data once persisted).
    """
    n_classes = model.n_classes if model.is_classifier else None
    if isinstance(data, DaskDataset):
        return _place_dask(client, data, n_replicas, batch_size, n_classes, timeout)
    if isinstance(data, ShardedDataset):
        replicas = [
            Placement(
                workers[r % len(workers)],
                replica_spec(data, shards, batch_size, n_classes),
                [],
                sum(s.rows for s in shards),
            )
            for r, shards in enumerate(assign_shards(data.shards, n_replicas))
        ]
        return PlacedData(replicas, data.n_rows, data.describe())
    replicas = []
    for r, (X_part, y_part) in enumerate(data):
        address = workers[r % len(workers)]
        with waiting_for(f"sending replica {r}'s {len(y_part)} rows to worker {address}", timeout):
            X_r, y_r = send_to_workers(client, [X_part, y_part], [address], timeout=timeout)
        replicas.append(Placement(address, (X_r, y_r), [], len(y_part)))
    n_rows = sum(p.rows for p in replicas)
    return PlacedData(
        replicas, n_rows, {"kind": "arrays", "n_shards": len(replicas), "rows": n_rows}
    )


def _persist(client: Client, ds: DaskDataset, timeout: float) -> tuple[Any, list, list[str]]:
    """Persist a copy of the collection: (the copy, its partitions, their names in messages).

    Partitions are futures for a DataFrame, ``(X, y)`` future pairs for arrays.
    """
    if ds.kind == "frame":
        frame = client.persist(ds.collection)
        # dask-expr renames the persisted graph: match futures by partition index, not by key
        by_index = {f.key[1]: f for f in futures_of(frame)}
        parts = [by_index[i] for i in range(frame.npartitions)]
        with waiting_for(f"persisting the Dask DataFrame's {len(parts)} partitions", timeout):
            wait(parts, timeout=timeout)
        label = f"Dask DataFrame {parts[0].key[0]}"
        return frame, parts, [f"partition {i} of {label}" for i in range(len(parts))]
    X, y = client.persist(list(ds.collection))
    xs = {f.key[1]: f for f in futures_of(X)}  # block (i, 0) holds rows of chunk i
    ys = {f.key[1]: f for f in futures_of(y)}
    parts = [(xs[i], ys[i]) for i in range(len(X.chunks[0]))]
    with waiting_for(f"persisting the Dask Arrays' {len(parts)} row blocks", timeout):
        wait([f for pair in parts for f in pair], timeout=timeout)
    return (X, y), parts, [f"block {i} of Dask Array {X.name}" for i in range(len(parts))]


def _holder(holders: dict, future: Future) -> str:
    """The worker holding ``future``'s data (the first by address if several do)."""
    found = holders.get(future.key)
    if not found:
        raise RuntimeError(
            f"no worker holds {future.key!r} after persisting it; was a worker lost meanwhile?"
        )
    return sorted(found)[0]


@dataclass
class PersistedPartitions:
    """A Dask collection persisted on the cluster by :func:`persist_partitions`.

    Attributes
    ----------
    dataset : DaskDataset
        The persisted copy, its non-empty partitions as shards (``shard.part`` indexes
        ``parts``).
    parts : list
        Every partition: a future (DataFrame) or an ``(X, y)`` future pair (arrays).  Holding
        them keeps the persisted copy alive.
    holders : dict of int to str
        The worker holding each non-empty partition's rows, by partition index.
    own : list of Future
        The copy's futures that are the fit's own (not the caller's objects): :meth:`release`
        lets go of them.
    """

    dataset: DaskDataset
    parts: list
    holders: dict[int, str]
    own: list[Future]

    def release(self) -> None:
        """Let go of the fit's hold on the copy; a collection the caller persisted keeps the
        caller's hold, and its data with it."""
        for future in self.own:
            future.release()


def persist_partitions(client: Client, ds: DaskDataset, timeout: float) -> PersistedPartitions:
    """Persist a copy of ``ds``'s collection and learn each partition's rows and worker.

    The collection is computed on the workers (a no-op for one the caller persisted already);
    only the partitions' lengths and locations come back to the driver.  ``ds`` and its
    collection are left as they are.
    """
    collection, parts, names = _persist(client, ds, timeout)
    heavy = parts if ds.kind == "frame" else [x for x, _ in parts]  # where the rows are
    known = () if ds.kind == "frame" else collection[0].chunks[0]  # NaN where not known
    if known and not any(math.isnan(n) for n in known):
        lengths = list(known)  # a Dask Array's row chunks: no task to count them
    else:
        counts = client.map(len, heavy, pure=False)  # on the workers holding the partitions
        with waiting_for(f"counting the rows of the {len(heavy)} partitions", timeout):
            wait(counts, timeout=timeout)
        lengths = client.gather(counts)
    placed = ds.with_partitions(collection, [int(n) for n in lengths], names)
    who_has = client.who_has(heavy)
    holders = {s.part: _holder(who_has, heavy[s.part]) for s in placed.shards}
    theirs = {id(f) for f in futures_of(ds.collection)}  # a persisted collection's, if any
    own = [f for f in futures_of(collection) if id(f) not in theirs]
    return PersistedPartitions(placed, parts, holders, own)


def _place_dask(
    client: Client,
    ds: DaskDataset,
    n_replicas: int,
    batch_size: int,
    n_classes: int | None,
    timeout: float,
) -> PlacedData:
    persisted = persist_partitions(client, ds, timeout)
    placed, parts = persisted.dataset, persisted.parts
    replicas = []
    for share in assign_partitions(placed.shards, persisted.holders, n_replicas):
        spec = replica_spec(placed, share.shards, batch_size, n_classes)
        rows = sum(s.rows for s in share.shards)
        replicas.append(Placement(share.worker, spec, [parts[p] for p in share.parts], rows))
    return PlacedData(replicas, placed.n_rows, placed.describe())
