"""The Dask side of the data: Dask collections as datasets, and replicas placed next to data.

:func:`dask_dataset` checks a Dask DataFrame (or an ``(X, y)`` pair of Dask Arrays) from its
metadata alone.  At fit, :func:`place_replicas` decides where each replica runs and what it
reads:

- in-memory data: each replica's contiguous subset is scattered to its worker (as before);
- files: :func:`~downpour_dask.shards.assign` gives each replica its row-balanced shards, and the
  replicas go round-robin over the workers (files are assumed readable from every worker);
- Dask collections: the collection is persisted, ``who_has`` tells which worker holds each
  partition, each worker gets replicas in proportion to the rows it holds, its partitions are
  split among them, and every replica is pinned to that worker.  The partition futures are task
  arguments, so Dask hands each replica its partitions from the worker's own memory.

Replicas receive shard descriptors (and partition futures), never data through the client.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from distributed import Client, futures_of, wait

from .shards import Schema, Shard, ShardedDataset, assign
from .stream import StreamSpec, default_buffer


class DaskDataset(ShardedDataset):
    """A Dask DataFrame or ``(X, y)`` Dask Arrays; shards (partitions) are known once placed.

    ``collection`` is the DataFrame or the ``(X, y)`` pair.  Before :meth:`DownpourSGD.fit`
    has persisted it, ``shards`` is empty and :attr:`n_rows` is None unless the chunk sizes
    are known.
    """

    def __init__(self, schema: Schema, collection: Any, name: str | None, shuffle_buffer):
        super().__init__(schema, [], name=name, shuffle_buffer=shuffle_buffer)
        self.collection = collection

    @property
    def n_rows(self) -> int | None:  # type: ignore[override]
        """Total rows: known once ``fit`` has persisted the collection, or from chunk sizes."""
        if self.shards:
            return sum(s.rows for s in self.shards)
        if self.kind == "array":
            rows = self.collection[0].shape[0]
            return None if np.isnan(rows) else int(rows)
        return None

    def to_dataset(self) -> Any:
        """Compute the collection into an in-memory Dataset on the client (evaluation data)."""
        import dask

        from .datasets import Dataset

        if self.kind == "frame":
            frame = self.collection.compute()
            X = frame[list(self.schema.features)].to_numpy(dtype=np.float32, na_value=np.nan)
            y = frame[self.schema.label].to_numpy()
        else:
            X, y = dask.compute(*self.collection)
        return Dataset(X, y, name=self.name)


def _np_dtype(dtype: Any) -> np.dtype | None:
    """The numpy dtype behind a pandas/numpy dtype (nullable Int64 -> int64), or None."""
    try:
        return np.dtype(getattr(dtype, "numpy_dtype", dtype))
    except TypeError:
        return None


def _numeric(dtype: Any) -> bool:
    np_dtype = _np_dtype(dtype)
    return np_dtype is not None and np_dtype.kind in "biuf"


def dask_dataset(
    data: Any, label: str | None, features: Any, name: str | None, shuffle_buffer: int | None
) -> DaskDataset:
    """Check a Dask DataFrame or (X, y) Dask Arrays from metadata; see ``datasets.from_dask``."""
    import dask.array as da
    import dask.dataframe as dd

    from .shards import _columns

    if isinstance(data, dd.DataFrame):
        where = "data (Dask DataFrame)"
        label, feats = _columns([str(c) for c in data.columns], label, features, where)
        dtypes = data.dtypes
        bad = [f"{c} ({dtypes[c]})" for c in (*feats, label) if not _numeric(dtypes[c])]
        if bad:
            raise TypeError(
                f"{where}: columns must be numeric (int, float or bool); non-numeric column(s): "
                f"{', '.join(bad[:10])}"
            )
        x_dtype = "+".join(sorted({_np_dtype(dtypes[c]).name for c in feats}))
        schema = Schema("frame", len(feats), x_dtype, str(dtypes[label]), feats, label)
        return DaskDataset(schema, data, name, shuffle_buffer)
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(a, da.Array) for a in data):
        X, y = data
        if X.ndim != 2 or y.ndim not in (1, 2):
            raise ValueError(
                f"from_dask((X, y)): X must be 2-D and y 1-D or 2-D, got {X.ndim}-D and {y.ndim}-D"
            )
        for what, arr in (("X", X), ("y", y)):
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"from_dask((X, y)): {what} must be numeric, got {arr.dtype}")
        if not (np.isnan(X.shape[0]) or np.isnan(y.shape[0])) and X.shape[0] != y.shape[0]:
            raise ValueError(
                f"from_dask((X, y)): X and y must have the same number of rows, got "
                f"{X.shape[0]} and {y.shape[0]}"
            )
        X = X.rechunk({1: -1})  # one block per row range
        if y.ndim == 2:
            y = y.rechunk({1: -1})
        if not np.isnan(sum(X.chunks[0])) and y.chunks[0] != X.chunks[0]:
            y = y.rechunk({0: X.chunks[0]})
        y_width = y.shape[1] if y.ndim == 2 else 0
        schema = Schema("array", X.shape[1], X.dtype.name, y.dtype.name, y_width=y_width)
        return DaskDataset(schema, (X, y), name, shuffle_buffer)
    raise TypeError(
        "from_dask expects a dask.dataframe.DataFrame or an (X, y) tuple of dask.array.Arrays, "
        f"got {type(data).__name__}"
    )


@dataclass
class Placement:
    """Where replica ``r`` runs and what its task receives: ``(X, y)``/StreamSpec, partitions."""

    worker: str
    data: Any
    parts: list


def _spec(ds: ShardedDataset, shards: list[Shard], batch_size: int, model: Any) -> StreamSpec:
    rows = sum(s.rows for s in shards)
    buffer = ds.shuffle_buffer or default_buffer(ds.n_features, batch_size)
    return StreamSpec(
        ds.schema,
        tuple(shards),
        batch_size,
        shuffle_buffer=max(batch_size, min(buffer, rows)),
        n_classes=model.n_classes if model.is_classifier else None,
    )


def place_replicas(
    client: Client,
    data: Any,
    n_replicas: int,
    workers: list[str],
    batch_size: int,
    model: Any,
    timeout: float,
) -> list[Placement]:
    """Decide each replica's worker and data (see the module docstring); no data via the client.

    ``data`` is a list of in-memory ``(X, y)`` subsets (one per replica) or a ShardedDataset.

    Raises
    ------
    ValueError
        If a Dask collection has fewer rows than ``n_replicas``.
    """
    if isinstance(data, DaskDataset):
        return _place_dask(client, data, n_replicas, batch_size, model, timeout)
    if isinstance(data, ShardedDataset):
        return [
            Placement(workers[r % len(workers)], _spec(data, shards, batch_size, model), [])
            for r, shards in enumerate(assign(data.shards, n_replicas))
        ]
    placements = []
    for r, (X_part, y_part) in enumerate(data):
        address = workers[r % len(workers)]
        # hash=False: unique keys, so a previous fit releasing the same data cannot race this one
        X_r, y_r = client.scatter([X_part, y_part], workers=[address], hash=False)
        placements.append(Placement(address, (X_r, y_r), []))
    return placements


def _persist(client: Client, ds: DaskDataset, timeout: float) -> tuple[list, list[str]]:
    """Persist the collection; return its partitions (futures, or (X, y) future pairs), names."""
    if ds.kind == "frame":
        frame = client.persist(ds.collection)
        # dask-expr renames the persisted graph: match futures by partition index, not by key
        by_index = {f.key[1]: f for f in futures_of(frame)}
        parts = [by_index[i] for i in range(frame.npartitions)]
        label = f"Dask DataFrame {frame._name}"
        wait(parts, timeout=timeout)
        return parts, [f"partition {i} of {label}" for i in range(len(parts))]
    X, y = client.persist(list(ds.collection))
    xs = {f.key[1]: f for f in futures_of(X)}  # block (i, 0) holds rows of chunk i
    ys = {f.key[1]: f for f in futures_of(y)}
    parts = [(xs[i], ys[i]) for i in range(len(X.chunks[0]))]
    wait([f for pair in parts for f in pair], timeout=timeout)
    return parts, [f"block {i} of Dask Array {X.name}" for i in range(len(parts))]


def _place_dask(
    client: Client, ds: DaskDataset, n_replicas: int, batch_size: int, model: Any, timeout: float
) -> list[Placement]:
    parts, names = _persist(client, ds, timeout)
    heavy = parts if ds.kind == "frame" else [x for x, _ in parts]  # where the rows are
    lengths = client.gather(client.map(len, heavy, pure=False))
    holders = client.who_has(heavy)
    ds.shards = [
        Shard(ds.kind, names[i], 0, int(n), part=i) for i, n in enumerate(lengths) if n > 0
    ]
    total = sum(int(n) for n in lengths)
    if total < n_replicas:
        raise ValueError(
            f"cannot give each of {n_replicas} replicas its own data: the Dask collection has "
            f"only {total} rows; use n_replicas <= {total}"
        )
    key = (lambda p: p.key) if ds.kind == "frame" else (lambda p: p[0].key)
    by_worker: dict[str, list[Shard]] = {}
    for shard in ds.shards:
        owner = sorted(holders.get(key(parts[shard.part])) or ["?"])[0]
        by_worker.setdefault(owner, []).append(shard)
    quotas = _quotas({w: sum(s.rows for s in sh) for w, sh in by_worker.items()}, n_replicas)
    for w, q in list(quotas.items()):  # data on a worker without a replica moves to one that has
        if q == 0:
            hosts = [v for v in quotas if quotas[v]]
            target = min(hosts, key=lambda v: _load(by_worker, quotas, v))
            by_worker[target] += by_worker.pop(w)
    placements = []
    for w, shards in by_worker.items():
        for mine in assign(shards, quotas[w]):
            used = sorted({s.part for s in mine})
            local = {p: i for i, p in enumerate(used)}
            mine = [replace(s, part=local[s.part]) for s in mine]
            placements.append(
                Placement(w, _spec(ds, mine, batch_size, model), [parts[p] for p in used])
            )
    return placements


def _load(by_worker: dict, quotas: dict, w: str) -> float:
    return sum(s.rows for s in by_worker[w]) / quotas[w]


def _quotas(rows: dict[str, int], n_replicas: int) -> dict[str, int]:
    """Replicas per worker in proportion to its rows (largest remainder), each at most its rows."""
    total = sum(rows.values())
    exact = {w: n_replicas * r / total for w, r in rows.items()}
    quotas = {w: int(x) for w, x in exact.items()}
    for w in sorted(exact, key=lambda v: quotas[v] - exact[v])[: n_replicas - sum(quotas.values())]:
        quotas[w] += 1
    return quotas
