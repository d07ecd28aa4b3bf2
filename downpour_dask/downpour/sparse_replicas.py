"""The replica tasks of a sparse fit, in the shape the dense path's supervisor moves them.

:func:`~.sparse_fit.fit_sparse` hands :class:`SparseTasks` to the dense path's
:class:`~.supervisor.Supervisor` (which decides: a replica whose worker died -- its task
cancelled, lost, ``KilledWorker`` or its worker gone -- is restarted on the least-loaded
surviving worker, continuing after the steps it pushed, as counted by the shard that counted
most of them; an error of the replica's own ends the fit).  This module only does what is
particular to sparse replicas:

- :meth:`SparseTasks.resume_replica` scatters the replica's in-memory share of the data to its
  new worker again (the old copy died with the old worker) and submits the replica task from
  the step the supervisor names; it skips the batches before it, which come in the same order
  (the replica's batches are drawn from ``(seed, replica)``), so it continues with its share;
- the push records of a replica outlive its worker: the task registers its record list on its
  worker (:func:`keep_records`) and the driver takes the new records of every worker every
  :data:`COLLECT_EVERY` seconds (:meth:`SparseTasks.collect`), saying how many of each list it
  holds: an answer that comes too late is given again, as in :mod:`.outbox`.  The records a
  killed replica made after the last collection died with it, but its pushes reached the
  shards, and each shard remembers the last pushes of every replica
  (:meth:`~downpour_dask.ps.table.SparseShard.recent_pushes`: session, push number, what the
  push said and got): :func:`fill_gap` rebuilds the missing records from them, numbering their
  steps on from the last collected record of the same session (a session's pushes are
  ``n_push`` steps apart), or, in the task's first session, from the step its id says the
  session started at (:func:`~downpour_dask.ps.rows.session_start`: a replica killed before
  the driver's first collection).  A rebuilt record has the shard's clock for ``time`` and
  counts only the push's bytes (the pulls in between are not known).  A push to a shard that
  was lost too, or of a later session (after a shard was replaced) none of whose records was
  collected, stays unknown.  The log of a fit
  is then every dead incarnation's records, followed by each replica's last incarnation's own
  result (:meth:`SparseTasks.records`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..ps.rows import session_start
from .wind_down import wind_down

#: Push records of this worker process's sparse replicas, per (run, task key): the list the
#: replica appends to (the task returns it whole at its end: nothing is dropped before).
_KEPT: dict[tuple[str, str], list[dict[str, Any]]] = {}
_LOCK = threading.Lock()

#: Seconds between the driver's collections of the replicas' records.
COLLECT_EVERY = 0.5


def keep_records(run: str, key: str, records: list[dict[str, Any]]) -> None:
    """In a replica task: let the driver read ``records`` (appended to as the task runs)."""
    with _LOCK:
        _KEPT[(run, key)] = records


def records_after(run: str, taken: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """On a worker (``client.run``): per task key of ``run``, the records after the first
    ``taken[key]`` (those the driver holds)."""
    with _LOCK:
        return {key: records[taken.get(key, 0):]  # (a slice of a list is taken atomically)
                for (r, key), records in _KEPT.items() if r == run}


def fill_gap(records: list[dict[str, Any]], recent: list[list[dict[str, Any]]], n_push: int,
             started: float, replica: int | None = None,
             first_step: int | None = None) -> list[dict[str, Any]]:
    """``records`` (collected of an incarnation of ``replica`` that died) followed by the
    records rebuilt from ``recent`` (per shard, its
    :meth:`~downpour_dask.ps.table.SparseShard.recent_pushes` of that replica) of the pushes
    they lack; ``started``: the fit's wall-clock start.

    A push is numbered on from the last collected record of its session.  The incarnation's
    first session (its id says it starts at ``first_step``, the step the incarnation started
    from: :func:`~downpour_dask.ps.rows.session_start`) needs none: its k-th push is at step
    ``first_step + (k + 1) * n_push - 1``; a record rebuilt so does not know its
    ``transport``.  Other sessions none of whose records was collected stay unknown (earlier
    incarnations' among them: their records are kept already)."""
    last: dict[tuple[int, str], dict[str, Any]] = {}
    seen = set()
    for r in records:
        key = (r["shard"], r.get("session", ""))
        seen.add((*key, r.get("seq")))
        if key not in last or r["seq"] > last[key]["seq"]:
            last[key] = r
    rebuilt = []
    for shard, entries in enumerate(recent):
        for entry in entries:
            if (shard, entry["session"], entry["seq"]) in seen:
                continue
            known = last.get((shard, entry["session"]))
            if known is not None and entry["seq"] > known["seq"]:
                base, step = known, known["step"] + (entry["seq"] - known["seq"]) * n_push
            elif (known is None and first_step is not None
                  and session_start(entry["session"]) == first_step):
                base, step = {"replica": replica}, first_step + (entry["seq"] + 1) * n_push - 1
            else:
                continue
            seen.add((shard, entry["session"], entry["seq"]))
            rebuilt.append({**base, **entry, "time": entry["time"] - started, "shard": shard,
                            "step": step})
    rebuilt.sort(key=lambda r: (r["step"], r["shard"]))
    return [*records, *rebuilt]


def forget_records(run: str) -> None:
    """On a worker (``client.run``): drop what :func:`keep_records` kept for ``run``."""
    with _LOCK:
        for k in [k for k in _KEPT if k[0] == run]:
            del _KEPT[k]


class SparseTasks:
    """One task per replica of a sparse fit, as :class:`~.supervisor.Supervisor` sees them
    (``tasks``, ``workers``, ``slots``, ``results``, ``stop_replica``, ``resume_replica``...).

    Parameters
    ----------
    cluster : DaskCluster
        Scatters data, runs :func:`records_after` on the workers.
    start : callable
        ``start(replica, data, start_step, worker, key)`` submits a replica task; its future.
    data : list
        Per replica what its task reads: a future of its scattered share, or the file list.
    shares : list, optional
        Per replica its in-memory share (a SparseBatch) on the driver, scattered again when
        the replica moves; None for files, which a replica reads wherever it runs.
    workers : list of str
        Where each replica starts.
    n_shards : int
    recent : callable, optional
        ``recent(replica)``: per shard, the pushes of ``replica`` it remembers; with it the
        records of a replica that died are completed from them (:func:`fill_gap`).
    n_push : int
    started : float
        The fit's wall-clock start.
    """

    plan = None  # no model parallelism: one slot per replica

    def __init__(self, cluster: Any, start: Callable[..., Any], data: list[Any],
                 shares: list[Any] | None, workers: list[str], n_shards: int,
                 recent: Callable[[int], list[list[dict[str, Any]]]] | None = None,
                 n_push: int = 1, started: float = 0.0):
        self.cluster, self.start, self.data, self.shares = cluster, start, data, shares
        self.recent, self.n_push, self.started = recent, n_push, started
        self.workers = list(workers)
        self.slots = [(r, 0) for r in range(len(workers))]
        # The supervisor restarts a replica after the pushes of its partition furthest ahead,
        # counted on each partition's first shard: here every shard is one, so the count comes
        # from the shard furthest ahead (a shard restored from a checkpoint counts fewer).
        self.shard_bounds = list(range(n_shards + 1))
        self.results: dict[int, list[dict[str, Any]]] = {}
        self.leaving: dict[int, str] = {}
        self.generation = 0
        self.dead: dict[int, list[str]] = {r: [] for r in range(len(workers))}
        self.kept: dict[str, list[dict[str, Any]]] = {}
        self.taken: dict[str, int] = {}  # per task key: how many records its worker handed over
        self.starts: dict[str, int] = {}  # per task key: the step its replica started from
        self.collected_at = time.monotonic()
        #: Set by the driver: the positions of its data a replica reads since one joined.
        self.share_of: Callable[[int], Any] | None = None
        self.tasks = [self._submit(r, 0) for r in range(len(workers))]

    def _submit(self, replica: int, step: int) -> Any:
        key = f"sparse-replica-{replica}-{self.cluster.run}-{self.generation}"
        self.starts[key] = step
        return self.start(replica, self.data[replica], step, self.workers[replica], key)

    def slots_of(self, replica: int) -> list[int]:
        return [replica]

    def all_gathered(self) -> bool:
        return len(self.results) == len(self.tasks)

    def stop_replica(self, replica: int, reason: str) -> None:
        """Let the replica's task go, and keep its records: those collected, completed from
        the shards' memory of its pushes (:func:`fill_gap`)."""
        key = self.tasks[replica].key
        self.dead[replica].append(key)
        self.tasks[replica].cancel()
        self.results.pop(replica, None)
        self.collect(force=True)
        if self.recent is not None:
            self.kept[key] = fill_gap(self.kept.get(key, []), self.recent(replica), self.n_push,
                                      self.started, replica, self.starts[key])

    def resume_replica(self, replica: int, workers: list[str], start_step: int) -> None:
        """Start ``replica`` again on ``workers[0]`` after ``start_step`` steps, with the part
        of its data it reads since a replica joined (``share_of``)."""
        self.generation += 1
        self.workers[replica] = workers[0]
        share = None if self.share_of is None else self.share_of(replica)
        if share is not None:
            self.cluster.assign_share(workers[0], replica, share)
        if self.shares is not None:
            self.data[replica] = self.cluster.scatter([self.shares[replica]], workers[0])[0]
        self.tasks[replica] = self._submit(replica, start_step)

    def add_replica(self, data: Any, worker: str) -> int:
        """Start a new replica on ``worker`` (which joined) reading ``data`` (a SparseBatch,
        scattered to it here, or ``(paths, spec)``); its number."""
        replica = len(self.tasks)
        if self.shares is not None:
            self.shares.append(data)
            data = self.cluster.scatter([data], worker)[0]
        self.data.append(data)
        self.workers.append(worker)
        self.slots.append((replica, 0))
        self.dead[replica] = []
        self.tasks.append(self._submit(replica, 0))
        return replica

    def collect(self, force: bool = False) -> None:
        """Take the records the replicas' workers hold, every :data:`COLLECT_EVERY` s."""
        if not force and time.monotonic() - self.collected_at < COLLECT_EVERY:
            return
        self.collected_at = time.monotonic()
        for found in self.cluster.collect(records_after, self.cluster.run, self.taken).values():
            if isinstance(found, dict):
                for key, records in found.items():
                    self.kept.setdefault(key, []).extend(records)
                    self.taken[key] = self.taken.get(key, 0) + len(records)

    def records(self) -> list[dict[str, Any]]:
        """Every replica's records: those collected from its incarnations that died, then its
        last incarnation's result (all gathered)."""
        out = []
        for r in range(len(self.tasks)):
            for key in self.dead[r]:
                out.extend(self.kept.get(key, []))
            out.extend(self.results[r])
        return out

    def stop(self, request_stop: Callable[[], Any]) -> None:
        """A failed fit: stop the replicas (``request_stop``) and wait for them to end, before
        :meth:`release` and the shards go (:func:`~.wind_down.wind_down`)."""
        wind_down(self.tasks, request_stop)

    def release(self) -> None:
        """At the end (or on failure): let every task go, and what the workers kept."""
        for task in self.tasks:
            task.cancel()
        self.cluster.everywhere(forget_records, self.cluster.run)
