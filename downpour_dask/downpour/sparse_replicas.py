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
- the push records of a replica outlive its worker as far as they can: the task registers its
  record list on its worker (:func:`keep_records`) and the driver takes the new records of
  every worker every :data:`COLLECT_EVERY` seconds (:meth:`SparseTasks.collect`); the log of
  a fit is then the collected records of every incarnation that died, followed by each
  replica's last incarnation's own (complete) result (:meth:`SparseTasks.records`).  Records a
  killed replica made after the last collection die with it, as the dense path's push-log rows
  do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Push records of this worker process's sparse replicas, per (run, task key): the list the
#: replica appends to, and how many of its records the driver has taken.
_KEPT: dict[tuple[str, str], list[Any]] = {}
_LOCK = threading.Lock()

#: Seconds between the driver's collections of the replicas' records.
COLLECT_EVERY = 0.5


def keep_records(run: str, key: str, records: list[dict[str, Any]]) -> None:
    """In a replica task: let the driver read ``records`` (appended to as the task runs)."""
    with _LOCK:
        _KEPT[(run, key)] = [records, 0]


def drain_records(run: str) -> dict[str, list[dict[str, Any]]]:
    """On a worker (``client.run``): per task key of ``run``, the records not taken yet."""
    out = {}
    with _LOCK:
        for (r, key), entry in _KEPT.items():
            if r == run:
                new = entry[0][entry[1]:]  # (a slice of a list is taken atomically)
                entry[1] += len(new)
                out[key] = list(new)
    return out


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
        Scatters data, runs :func:`drain_records` on the workers.
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
    """

    plan = None  # no model parallelism: one slot per replica

    def __init__(self, cluster: Any, start: Callable[..., Any], data: list[Any],
                 shares: list[Any] | None, workers: list[str], n_shards: int):
        self.cluster, self.start, self.data, self.shares = cluster, start, data, shares
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
        self.collected_at = time.monotonic()
        self.tasks = [self._submit(r, 0) for r in range(len(workers))]

    def _submit(self, replica: int, step: int) -> Any:
        key = f"sparse-replica-{replica}-{self.cluster.run}-{self.generation}"
        return self.start(replica, self.data[replica], step, self.workers[replica], key)

    def slots_of(self, replica: int) -> list[int]:
        return [replica]

    def all_gathered(self) -> bool:
        return len(self.results) == len(self.tasks)

    def stop_replica(self, replica: int, reason: str) -> None:
        """Let the replica's task go (its records collected so far are kept)."""
        self.dead[replica].append(self.tasks[replica].key)
        self.tasks[replica].cancel()
        self.results.pop(replica, None)

    def resume_replica(self, replica: int, workers: list[str], start_step: int) -> None:
        """Start ``replica`` again on ``workers[0]`` after ``start_step`` steps."""
        self.generation += 1
        self.workers[replica] = workers[0]
        if self.shares is not None:
            self.data[replica] = self.cluster.scatter([self.shares[replica]], workers[0])[0]
        self.tasks[replica] = self._submit(replica, start_step)

    def collect(self, force: bool = False) -> None:
        """Take the records the replicas' workers hold, every :data:`COLLECT_EVERY` s."""
        if not force and time.monotonic() - self.collected_at < COLLECT_EVERY:
            return
        self.collected_at = time.monotonic()
        for found in self.cluster.collect(drain_records, self.cluster.run).values():
            if isinstance(found, dict):
                for key, records in found.items():
                    self.kept.setdefault(key, []).extend(records)

    def records(self) -> list[dict[str, Any]]:
        """Every replica's records: those collected from its incarnations that died, then its
        last incarnation's result (all gathered)."""
        out = []
        for r in range(len(self.tasks)):
            for key in self.dead[r]:
                out.extend(self.kept.get(key, []))
            out.extend(self.results[r])
        return out

    def release(self) -> None:
        """At the end (or on failure): let every task go, and what the workers kept."""
        for task in self.tasks:
            task.cancel()
        self.cluster.collect(forget_records, self.cluster.run)
