"""Which worker slot runs which portion of a Sandblaster pass, and when a straggler gets a backup.

:class:`PortionScheduling` holds the rules :class:`~downpour_dask.sandblaster.portions.Portions`
dispatches by: a free slot takes a portion whose data block it holds (a portion whose block is on
another live worker waits for it, unless that worker is late by more than moving the block would
take), and near the end of a batch a portion running unusually long is copied to an idle worker,
later still if its block would have to move.  It is a mixin: the
state it reads is the pass's own (see the class), kept in one object so that the tests drive the
bookkeeping with fakes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import NamedTuple

import dask.config
from dask.utils import parse_bytes

from ..runtime.cluster import cluster_workers
from ..runtime.dask_internals import FUTURES_CANCELLED
from .runners import RunnerCall


class PortionCopy(NamedTuple):
    """One submitted copy of a portion (the original or a backup)."""

    version: int
    portion: int
    worker: str
    submitted: float


class PortionScheduling:
    """Dispatch and backup rules over the state of a pass (mixed into ``Portions``).

    Reads ``inflight`` (future -> :class:`PortionCopy`), ``load`` and ``capacity`` (copies
    queued and allowed per worker), ``freed`` (when each worker's last copy was collected),
    ``where`` (portion -> workers holding its block), ``blocks`` and ``nbytes`` (the blocks'
    futures and sizes), ``metrics`` (the workers' Dask metrics), ``client`` and ``observer``;
    submits through ``_submit(version, pid, worker, backup)``.  :meth:`_refresh` re-reads the
    workers and where the blocks are (a lost shard's worker raises, through ``_check_shards``).
    """

    DEPTH = 4  # portions queued per worker thread, so a worker never waits for the driver
    LOCAL_ONLY = True  # a portion runs where its block is while that worker lives

    def _running_since(self, copy: PortionCopy) -> float:
        """Since when ``copy``'s worker has been at it, as far as the driver can tell.

        A worker runs its queued copies (``DEPTH`` per thread) in submission order.  Its oldest
        copy began when it was submitted or when the worker's previous copy was collected,
        whichever is later; a copy queued behind it is as late as that one (it waits for it),
        and no later: timed from its own submission it would look like a straggler as soon as
        the copies ahead of it took their normal time.
        """
        return self._busy_since(copy.worker, copy.submitted)

    def _busy_since(self, worker: str, default: float) -> float:
        """Since when ``worker`` has been at its oldest copy in flight (``default`` if it has
        none); see :meth:`_running_since`."""
        oldest = min(
            (c.submitted for c in self.inflight.values() if c.worker == worker), default=default
        )
        return max(oldest, self.freed.get(worker, oldest))

    @staticmethod
    def _straggler_limit(durations: Sequence[float]) -> float:
        """How long a worker may be at one copy before it counts as late: 1.5x the median time
        of this batch's finished portions (plus 2 ms, so that tiny portions' jitter is not
        lateness)."""
        return 1.5 * statistics.median(durations) + 0.002

    def _moving_seconds(self, pid: int, worker: str) -> float:
        """Dask's estimate of the time to move portion ``pid``'s block to ``worker`` (0 if it
        is there): bytes over the worker's measured bandwidth, or before Dask has measured one,
        ``distributed.scheduler.bandwidth``."""
        if worker in self.where.get(pid, ()):
            return 0.0
        rate = self.metrics.get(worker, {}).get("bandwidth", {}).get("total")
        rate = rate or parse_bytes(dask.config.get("distributed.scheduler.bandwidth"))
        block = self.blocks[pid]
        if block.key not in self.nbytes and block.status == "finished":  # read since _refresh
            self.nbytes.update(self.client.nbytes([block.key], summary=False))
        return self.nbytes.get(block.key, 0) / rate

    def _free(self) -> list[str]:
        return [w for w in sorted(self.capacity) if self.load.get(w, 0) < self.capacity[w]]

    def _dispatch(
        self, version: int, todo: list[int], copies: dict, durations: Sequence[float] = ()
    ) -> None:
        """Give each free worker slot a portion whose data it holds; with ``LOCAL_ONLY``, a
        portion whose data is on another live worker waits for that worker (moving a block
        costs more than the wait), else any portion.  The wait ends when that worker is late
        (:meth:`_overdue`): then the free slot takes the portion, so that a straggler's
        portions not yet started go to faster workers, and once none is left waiting, backup
        tasks copy the ones it started (``durations``: this batch's finished portions)."""
        while todo:
            assigned = False
            for worker in self._free():
                if not todo:
                    return
                pid = next((p for p in todo if worker in self.where.get(p, ())), None)
                if pid is None:
                    held = [p for p in todo if not self.where.get(p, set()) & set(self.capacity)]
                    pid = (held or todo)[0] if held or not self.LOCAL_ONLY else None
                if pid is None:
                    pid = self._overdue(version, todo, worker, durations)
                if pid is None:
                    continue
                todo.remove(pid)
                copies[pid] = [self._submit(version, pid, worker, backup=False)]
                assigned = True
            if not assigned:
                return

    def _overdue(
        self, version: int, todo: list[int], worker: str, durations: Sequence[float]
    ) -> int | None:
        """A portion of ``todo`` whose block is held only by busy workers that are late, to run
        on ``worker`` instead; None if there is none.

        Late is as for a backup (:meth:`_backups`): each holder has been at its current copy
        longer than the straggler limit plus the time to move the block to ``worker``.  Until
        a portion of this batch has finished there is no limit, and no portion is taken.  A
        holder with a free slot takes the portion itself.
        """
        if not durations:
            return None
        limit, now = self._straggler_limit(durations), time.time()
        for pid in todo:
            holders = self.where.get(pid, set()) & set(self.capacity)
            if not holders or any(self.load.get(h, 0) < self.capacity[h] for h in holders):
                continue
            waited = min(now - self._busy_since(h, now) for h in holders)
            if waited >= limit + self._moving_seconds(pid, worker):
                self.observer.event(
                    "portion_reassigned",
                    f"portion {pid} (its block on {', '.join(sorted(holders))}, busy for "
                    f"{waited:.3f}s) given to {worker}",
                    portion=pid, version=version, worker=worker, holders=sorted(holders),
                    waited=waited,
                )  # fmt: skip
                return pid
        return None

    def _backups(self, version: int, copies: dict, done: dict, durations: list) -> None:
        """Near the end of a batch, re-submit portions running unusually long on idle workers.

        A portion is a straggler once its worker has been at it (:meth:`_running_since`) 1.5x
        the median time of this batch's finished portions; its copy goes to a free slot on
        another worker, one holding its block if there is one.  A copy whose block would have
        to move waits that much longer: the block's bytes over Dask's bandwidth estimate (as
        the scheduler weighs a transfer), so ordinary jitter does not copy a large block.
        Whichever copy finishes first counts; the shards discard the other's gradient and the
        driver its loss.
        """
        free = self._free()
        if not free or not durations:
            return
        limit, now = self._straggler_limit(durations), time.time()
        for pid, runs in copies.items():
            if pid in done or len(runs) > 1 or not free:
                continue
            began = self._running_since(runs[0])  # a pass over the copies in flight: last
            if now - began < limit:
                continue
            others = [w for w in free if w != runs[0].worker]
            if not others:
                continue
            worker = next((w for w in others if w in self.where.get(pid, ())), others[0])
            if now - began < limit + self._moving_seconds(pid, worker):
                continue
            runs.append(self._submit(version, pid, worker, backup=True))
            self.observer.event(
                "backup_launched",
                f"portion {pid} (on {runs[0].worker} for {now - began:.3f}s) "
                f"copied to {worker}",
                portion=pid, version=version, worker=worker, straggler=runs[0].worker,
                running=now - began,
            )  # fmt: skip
            free = self._free()

    def _refresh(self, first: bool = False) -> None:
        """Re-read the live workers (a killed one disappears, its restarted successor appears);
        raise :class:`ShardLostError` if one of them held a shard."""
        workers = cluster_workers(self.client)
        if not first:
            for gone in set(self.capacity) - set(workers):
                self.observer.event(
                    "worker_lost", f"{gone}: its portions are re-run elsewhere", worker=gone
                )
                for future, copy in self.inflight.items():  # Dask re-runs its own tasks
                    if copy.worker == gone and isinstance(future, RunnerCall):
                        future.abandon()  # lost now, not at Dask's connect timeout
            self._check_shards(workers)
        self.capacity = {w: self.DEPTH * info.get("nthreads", 1) for w, info in workers.items()}
        self.metrics = {w: info.get("metrics", {}) for w, info in workers.items()}
        placed = [b for b in self.blocks if b.status == "finished"]
        try:  # where each block is: only a hint for data-local dispatch
            who = self.client.who_has(placed)
            unknown = [b.key for b in placed if b.key not in self.nbytes]
            if unknown:  # once per block: sizes do not change
                self.nbytes.update(self.client.nbytes(unknown, summary=False))
        except FUTURES_CANCELLED:  # a block died meanwhile; _restore_blocks resends it
            return
        homes = self.data.homes  # where a block still being read will be
        self.where = {
            pid: set(who.get(block.key, ())) or ({homes[pid]} if pid in homes else set())
            for pid, block in enumerate(self.blocks)
        }
