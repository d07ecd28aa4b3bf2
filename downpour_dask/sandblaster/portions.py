"""Sandblaster's distributed passes: the shard accumulator, portion tasks and backup tasks.

The pieces, top to bottom:

* :class:`SandblasterShard` -- a parameter-server shard (a Dask actor) that also runs the vector
  programs of :mod:`downpour_dask.lbfgs` on its range of every vector, publishes the point the
  workers evaluate (as float32 ``values`` with a new ``version``) and accumulates portion
  gradients exactly once per ``(version, portion)``.
* :func:`run_portion` -- the Dask task computing one portion's gradient.  It fetches the published
  parameters once per batch per worker (a cache keyed by run and version) and adds its gradient to
  the shards' accumulator directly, worker to worker, never through the driver.
* :class:`Portions` -- the coordinator's side of one distributed pass: it hands portions to
  workers as they free up (faster workers take more, data-local portions first), launches backup
  copies of stragglers near the end of a batch on idle workers, and counts every portion once.

The estimator that drives them is :class:`downpour_dask.sandblaster.SandblasterLBFGS`.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from distributed import Future, get_worker, wait
from distributed.client import FuturesCancelledError

from ..core import optim
from ..core.lbfgs import Program, VectorStore, sum_replies
from ..core.models import Model
from ..core.params import DTYPE
from ..ps.server import ParameterServer
from ..ps.shard import ParameterServerShard
from ..runtime.cluster import cluster_workers
from ..runtime.malloc import tune_malloc

if TYPE_CHECKING:
    from .estimator import _Run


class SandblasterShard(ParameterServerShard):
    """A shard holding its range of every L-BFGS vector, plus the published float32 point.

    ``values``/``version`` (inherited) are the point workers evaluate; ``store`` holds the float64
    vectors the coordinator's programs work on (``x``, ``g``, ``d``, ``acc``, the history ...).
    The inherited update rule is unused: L-BFGS moves the parameters by vector programs.
    """

    def __init__(
        self,
        shard_id: int,
        start: int,
        stop: int,
        values: np.ndarray,
        rule: optim.UpdateRule,
        *,
        l2mask: np.ndarray,
    ):
        super().__init__(shard_id, start, stop, values, rule)  # the rule is never applied
        self.store = VectorStore(stop - start)
        self.store.set("x", values)
        self.store.set("l2mask", l2mask)
        self.store.run([("zero", "acc")])
        self._accepted: set[int] = set()
        self._scratch = np.empty(stop - start, np.float64)

    def run(self, program: Program) -> list[float]:
        """Run a vector program (see :meth:`VectorStore.run`); return its partial dot products."""
        return self.store.run(program)

    def begin(self, prelude: Program, publish: str = "xt") -> int:
        """Run ``prelude``, zero the accumulator and publish vector ``publish`` as a new version."""
        self.store.run([*prelude, ("zero", "acc")])
        np.copyto(self.values, self.store[publish], casting="same_kind")
        self.version += 1
        self._accepted = set()
        return self.version

    def fetch(self, version: int) -> np.ndarray | None:
        """The published values if ``version`` is still current, else None (a stale portion)."""
        return self.values.copy() if version == self.version else None

    def wanted(self, version: int, portion: int) -> bool:
        """Whether ``portion`` of batch ``version`` still has to be computed."""
        return version == self.version and portion not in self._accepted

    def accumulate(self, version: int, portion: int, grad: np.ndarray, examples: int) -> bool:
        """Add ``examples * grad`` (a portion's summed gradient) to ``acc``, once per portion.

        A copy of a portion already counted, or of an earlier batch, is discarded and counted in
        ``duplicates``; both copies of a portion compute the same gradient from the same
        parameters, so deduplicating on every shard independently is still exactly-once.
        """
        if not self.wanted(version, portion):
            self.duplicates += 1
            return False
        np.multiply(grad, float(examples), out=self._scratch)
        acc = self.store["acc"]
        acc += self._scratch
        self._accepted.add(portion)
        self.examples += int(examples)
        return True

    def vector(self, name: str) -> np.ndarray:
        """A copy of this shard's range of vector ``name`` (for ``params_`` at the end)."""
        return self.store[name].copy()


# -- the worker side --------------------------------------------------------------------------

_CACHE: dict[str, tuple[int, np.ndarray]] = {}  # run token -> (version, parameters)
_CACHE_LOCK = threading.Lock()
_ENDED: set[str] = set()  # runs whose fit ended: their straggling portions stop waiting


class _RunEnded(Exception):
    """The fit of this portion ended; its shards are gone."""


def _reply(call, token: str, timeout: float):
    """The result of an actor call, waited for in short slices so that a straggler of a fit
    that ended stops at once: a call into a released actor may never be answered."""
    deadline = time.monotonic() + timeout
    while True:
        if token in _ENDED:
            raise _RunEnded(token)
        try:
            return call.result(timeout=max(0.01, min(0.1, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


class PortionResult(NamedTuple):
    """What a portion task returns to the driver: scalars only."""

    portion: int
    version: int
    status: str  # "done", "stale" (batch over before it ran) or "skipped" (backup not needed)
    loss_sum: float  # sum of per-example data losses
    examples: int
    worker: str


def _params_for(server: ParameterServer, token: str, version: int, timeout: float):
    """The published parameters of ``version``, fetched from the shards once per worker."""
    with _CACHE_LOCK:  # portions on one worker's threads share a single fetch
        hit = _CACHE.get(token)
        if hit is not None and hit[0] == version:
            return hit[1]
        if hit is not None and hit[0] > version:
            return None
        calls = [shard.fetch(version) for shard in server.shards]
        pieces = [_reply(call, token, timeout) for call in calls]
        if any(p is None for p in pieces):
            return None
        params = np.concatenate(pieces).astype(DTYPE, copy=False)
        _CACHE[token] = (version, params)  # replaces the older version
        return params


def forget_run(token: str) -> None:
    """Drop a finished run's cached parameters from this worker; its portions still running
    stop waiting for its shards."""
    _ENDED.add(token)
    with _CACHE_LOCK:
        _CACHE.pop(token, None)


def run_portion(
    server: ParameterServer,
    token: str,
    version: int,
    portion: int,
    block: tuple[np.ndarray, np.ndarray],
    model: Model,
    backup: bool,
    timeout: float,
    delay: Mapping[str, float] | None = None,
) -> PortionResult:
    """Dask task: add one portion's gradient at parameters ``version`` to the shards' ``acc``.

    ``model`` has ``l2 = 0``: the penalty is added once, on the shards.  ``delay`` maps worker
    addresses to seconds slept first: a fault-injection knob that makes a worker a straggler.
    """
    tune_malloc()  # see _malloc.py: this worker may hold no shard
    server = server.opened()  # actor handles from the references the task was given
    address = get_worker().address
    if delay and delay.get(address):
        time.sleep(delay[address])
    try:
        if backup and not _reply(server.shards[0].wanted(version, portion), token, timeout):
            return PortionResult(portion, version, "skipped", 0.0, 0, address)
        params = _params_for(server, token, version, timeout)
    except _RunEnded:
        params = None
    if params is None:
        return PortionResult(portion, version, "stale", 0.0, 0, address)
    # Received blocks are often unaligned, which halves matmul speed: align (one copy) first.
    X, y = (np.require(a, requirements=["C", "A"]) for a in block)
    loss, grad = model.loss_and_grad(params, X, y)
    n = len(X)
    calls = [
        shard.accumulate(version, portion, grad[lo:hi], n)
        for shard, (lo, hi) in zip(server.shards, server.ranges)
    ]
    try:
        for call in calls:  # the driver may count this portion only once every shard has it
            _reply(call, token, timeout)
    except _RunEnded:
        return PortionResult(portion, version, "stale", 0.0, 0, address)
    return PortionResult(portion, version, "done", float(loss) * n, n, address)


def evaluate_task(server: ParameterServer, model: Model, data: tuple, timeout: float) -> tuple:
    """Dask task: loss and score of the snapshot ``xe`` of an iterate on ``data`` (vectors stay
    off the driver: the worker pulls ``xe`` from the shards)."""
    server = server.opened()  # actor handles from the references the task was given
    calls = [shard.vector("xe") for shard in server.shards]
    params = np.concatenate([c.result(timeout=timeout) for c in calls]).astype(DTYPE)
    X, y = data
    return model.loss(params, X, y), model.score(params, X, y)


# -- the coordinator's side of a distributed pass ----------------------------------------------


class _Copy(NamedTuple):
    """One submitted copy of a portion (the original or a backup)."""

    version: int
    portion: int
    worker: str
    submitted: float


class Portions:
    """Runs distributed passes for :class:`~downpour_dask.lbfgs.LBFGS` (its ``Space``)."""

    DEPTH = 2  # portions queued per worker thread, so a worker never waits for the driver

    def __init__(self, run: _Run, batches: list[list[int]], rows: list, model: Future):
        self.run_, self.client, self.server, self.rows = run, run.client, run.server, rows
        self.blocks = run.client.scatter(
            [(run.X[idx], run.y[idx]) for idx in rows], hash=False, timeout=run.est.timeout
        )  # spread over the workers; views when the rows are contiguous
        self.est, self.batches, self.model = run.est, batches, model
        self.inflight: dict[Future, _Copy] = {}  # survives batches: stragglers still occupy slots
        self.load: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.where: dict[int, set[str]] = {}
        self.examples_seen = 0
        self._refresh(first=True)

    # -- Space protocol -----------------------------------------------------------------------
    def run(self, program: Program) -> np.ndarray:
        """Run ``program`` on all shards concurrently (one round trip); sum the dot products."""
        return sum_replies(self.server.call_all("run", program, timeout=self.est.timeout))

    def evaluate(self, batch: int, prelude: Program) -> tuple[float, int]:
        """One distributed pass over ``batch`` at the point ``xt`` (after ``prelude``)."""
        version = self.server.call_all("begin", prelude, timeout=self.est.timeout)[0]
        self._refresh()
        t_start = last_progress = time.time()
        self.run_.event("batch_start", f"batch {batch}, version {version}")
        todo = list(self.batches[batch])
        done: dict[int, PortionResult] = {}
        copies: dict[int, list[_Copy]] = {}  # every copy of each portion submitted in this batch
        durations: list[float] = []  # submit-to-result seconds of the counted copies
        while len(done) < len(self.batches[batch]):
            self._dispatch(version, todo, copies)
            if not todo and self.est.backup_tasks:
                self._backups(version, copies, done, durations)
            if not self.inflight:  # no live worker slot at the moment: wait for one
                time.sleep(0.05)
                self._refresh()
                continue
            try:  # near the end of a batch, wake up often enough to launch backups
                finished = wait(
                    list(self.inflight),
                    timeout=0.5 if todo else 0.02,
                    return_when="FIRST_COMPLETED",
                ).done
            except TimeoutError:
                finished = set()
            except FuturesCancelledError:  # a dead worker took scattered data with it
                finished = {f for f in self.inflight if f.done()}
            for future in finished:
                if self._collect(future, version, todo, done, durations):
                    last_progress = time.time()
            if time.time() - last_progress > 1.0:  # no progress: did a worker die?
                self._refresh()
                last_progress = time.time()
            if time.time() - t_start > self.est.timeout:
                raise RuntimeError(
                    f"batch {batch} did not finish within timeout={self.est.timeout} s: "
                    f"{len(done)} of {len(self.batches[batch])} portions done; "
                    f"{self._outstanding(version)}"
                )
        self.examples_seen += sum(r.examples for r in done.values())
        self.run_.event("batch_done", f"batch {batch}, version {version}, {len(done)} portions")
        return sum(r.loss_sum for r in done.values()), sum(r.examples for r in done.values())

    def _collect(
        self, future: Future, version: int, todo: list, done: dict, durations: list
    ) -> bool:
        """Take in one finished copy; True if it counted (the first copy of its portion)."""
        copy = self.inflight.pop(future)
        self.load[copy.worker] -= 1
        if future.status == "error":
            raise RuntimeError(f"portion {copy.portion} failed: {future.exception(timeout=5)!r}")
        result: PortionResult | None = None
        if future.status == "finished":
            try:
                result = future.result(timeout=self.est.timeout)
            except CancelledError:  # finished, but its worker died before we got the result
                pass
        if result is None:  # cancelled or lost with its data block: run it again
            self._restore_blocks()
            running = any(
                c.portion == copy.portion and c.version == version for c in self.inflight.values()
            )  # a straggling copy of an earlier batch does not count
            if copy.version == version and copy.portion not in done and not running:
                todo.append(copy.portion)
            return False
        if result.version != version or result.status != "done" or copy.portion in done:
            self.run_.event(
                "duplicate_discarded",
                f"portion {copy.portion} of version {result.version} ({result.status}) from "
                f"{result.worker}",
            )
            return False
        done[copy.portion] = result
        durations.append(time.time() - copy.submitted)
        self.where.setdefault(copy.portion, set()).add(result.worker)
        self.run_.push(result, time.time())
        return True

    def _outstanding(self, version: int) -> str:
        """The copies of batch ``version`` still running, for an error message: which portion,
        on which worker, for how long, and in which state Dask has the task."""
        now = time.time()
        running = [
            f"portion {c.portion} on {c.worker} for {now - c.submitted:.1f} s ({f.status})"
            for f, c in self.inflight.items()
            if c.version == version
        ]
        return "still running: " + ("; ".join(running) if running else "nothing")

    # -- scheduling ---------------------------------------------------------------------------
    def _refresh(self, first: bool = False) -> None:
        """Re-read the live workers (a killed one disappears, its restarted successor appears)."""
        workers = cluster_workers(self.client)
        if not first:
            for gone in set(self.capacity) - set(workers):
                self.run_.event("worker_lost", f"{gone}: its portions are re-run elsewhere")
        self.capacity = {w: self.DEPTH * info.get("nthreads", 1) for w, info in workers.items()}
        try:  # where each block is: only a hint for data-local dispatch
            who = self.client.who_has([b for b in self.blocks if b.status == "finished"])
        except FuturesCancelledError:  # a block died meanwhile; _restore_blocks resends it
            return
        self.where = {pid: set(who.get(block.key, ())) for pid, block in enumerate(self.blocks)}

    def _scatter(self, pid: int) -> Future:
        """Send the rows of portion ``pid`` to one worker (Dask picks it, spreading blocks)."""
        idx, X, y = self.rows[pid], self.run_.X, self.run_.y
        return self.client.scatter([(X[idx], y[idx])], hash=False, timeout=self.est.timeout)[0]

    def _restore_blocks(self) -> None:
        """Re-scatter, from the driver's copy, every data block that died with its worker.

        Scattered data cannot be recomputed by Dask, and its Active Memory Manager removes extra
        replicas, so the driver (which holds the training data anyway) is the backup copy.
        """
        for pid, block in enumerate(self.blocks):
            if block.status != "finished":
                self.blocks[pid] = self._scatter(pid)
                self.run_.event("data_restored", f"portion {pid}'s rows scattered again")
        self._refresh()

    def _submit(self, version: int, pid: int, worker: str, backup: bool) -> _Copy:
        est, server = self.est, self.server.portable()
        future = self.client.submit(
            run_portion, server, self.run_.token, version, pid, self.blocks[pid], self.model,
            backup, est.timeout, self.run_.delay,
            workers=[worker], allow_other_workers=True, pure=False,
            key=f"portion-{pid}-v{version}-{'b' if backup else 'o'}-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip
        copy = _Copy(version, pid, worker, time.time())
        self.inflight[future] = copy
        self.load[worker] = self.load.get(worker, 0) + 1
        return copy

    def _free(self) -> list[str]:
        return [w for w in sorted(self.capacity) if self.load.get(w, 0) < self.capacity[w]]

    def _dispatch(self, version: int, todo: list[int], copies: dict) -> None:
        """Give each free worker slot a portion, preferring portions whose data it holds."""
        while todo:
            free = self._free()
            if not free:
                return
            for worker in free:
                if not todo:
                    return
                pid = next((p for p in todo if worker in self.where.get(p, ())), todo[0])
                todo.remove(pid)
                copies[pid] = [self._submit(version, pid, worker, backup=False)]

    def _backups(self, version: int, copies: dict, done: dict, durations: list) -> None:
        """Near the end of a batch, re-submit portions running unusually long on idle workers.

        A portion is a straggler once it has run 1.5x the median time of this batch's finished
        portions; its copy goes to a free slot on another worker.  Whichever copy finishes first
        counts; the shards discard the other's gradient and the driver its loss.
        """
        free = self._free()
        if not free or not durations:
            return
        limit, now = 1.5 * statistics.median(durations) + 0.002, time.time()
        for pid, runs in copies.items():
            if pid in done or len(runs) > 1 or now - runs[0].submitted < limit or not free:
                continue
            others = [w for w in free if w != runs[0].worker]
            if not others:
                continue
            worker = next((w for w in others if w in self.where.get(pid, ())), others[0])
            runs.append(self._submit(version, pid, worker, backup=True))
            self.run_.event(
                "backup_launched",
                f"portion {pid} (on {runs[0].worker} for {now - runs[0].submitted:.3f}s) "
                f"copied to {worker}",
            )
            free = self._free()
