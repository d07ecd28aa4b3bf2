"""Sandblaster's distributed passes: portions handed to workers as they free up, backup tasks.

:class:`Portions` is the coordinator's side of one distributed pass over a batch (the ``Space`` that
:class:`~downpour_dask.core.lbfgs.LBFGS` evaluates through).  It hands portions to worker slots as
they free up (faster workers take more, data-local portions first), launches backup copies of
stragglers near the end of a batch on idle workers (the rules are in
:mod:`~downpour_dask.sandblaster.scheduling`), re-sends data blocks lost with a worker, and counts
every portion once (the work itself is in :mod:`~downpour_dask.sandblaster.tasks`).  A portion
whose data block is in its worker's memory goes straight to that worker's runner, any other
as a Dask task (:mod:`~downpour_dask.sandblaster.runners`).  A pass ends on the shards: each runs
the coordinator's *finish* program as soon as it holds every portion's gradient, and the portion
whose gradient completed it brings the program's dot products back with its result, so
the coordinator learns the objective, the slope and the next step's inner products without a round
trip of its own.  What it reports goes to a :class:`PassObserver` (the coordinator, or a fake in the
tests): events with structured data, and each counted portion.

A lost *shard* is not a lost portion: when a shard's worker leaves, a portion fails, or a batch
runs out of time while a shard does not answer, the pass raises
:class:`~downpour_dask.ps.protocol.ShardLostError` naming the shard (the coordinator restores it)
instead of waiting on portions that cannot finish.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any, Protocol

import numpy as np
from distributed import Client, Future

from ..core.models import Model
from ..core.params import DTYPE
from ..core.vectors import Command, Program, sum_replies, written
from ..ps.protocol import ShardLostError
from ..ps.server import ParameterServer
from .blocks import ArrayBlocks, ShardBlocks
from .runners import Arrivals, RunnerCall, Runners
from .scheduling import PortionCopy, PortionScheduling
from .shard import Finish, Finished, SandblasterShard
from .tasks import PortionResult, run_portion


class PassObserver(Protocol):
    """What a distributed pass reports to the coordinator driving it."""

    def event(self, kind: str, detail: str = "", **data: Any) -> object:
        """Record an event: ``detail`` for people, ``data`` (plain values) for code."""
        ...

    def portion_counted(self, result: PortionResult) -> None:
        """Record a portion whose gradient the shards counted (one push row)."""
        ...


class Portions(PortionScheduling):
    """Runs distributed passes for :class:`~downpour_dask.core.lbfgs.LBFGS` (its ``Space``).

    Parameters
    ----------
    client : distributed.Client
    server : ParameterServer
        The :class:`~downpour_dask.sandblaster.shard.SandblasterShard` actors.
    data : ArrayBlocks or ShardBlocks
        The training rows: each portion's a block on one worker, placed again if it dies.
    batches : list of list of int
        The portion ids of every batch.
    rows : list
        Rows of every portion (a slice or an index array into ``X``), by portion id.
    model : Model
        The model with ``l2 = 0`` (small: it goes with every portion task).
    observer : PassObserver
        Receives the events and the counted portions.
    token : str
        The fit's id, under which workers cache the published parameters.
    timeout : float
        Seconds a scatter, a result or a whole batch may take before the run fails.
    backup_tasks : bool
        Whether to copy stragglers near the end of a batch.
    delay : mapping of worker address to seconds, optional
        Fault injection: portions on that worker sleep this long first.
    workers : list of str, optional
        The workers the data blocks are first scattered to (default: any); the coordinator
        leaves out a worker whose shard was lost, which the scheduler may still list.
    keep : sequence of str
        Vectors whose latest values the driver keeps: a program (or a pass's finish program)
        that writes one of them brings it back with its dot products, into :attr:`kept` (the
        coordinator keeps ``x``, the point a lost shard is restored at, without a call of its
        own after each iteration).
    """

    #: A model whose parameters take at most this many bytes has each batch's point sent with
    #: the portions (it comes back with ``begin``): a portion then makes no fetch, a round
    #: trip to every shard.  Larger points stay off the driver, as the paper has it.
    INLINE_POINT_BYTES = 256 * 2**10

    #: A portion whose data block is in its worker's memory (and a score) is sent straight to
    #: that worker's runner (see runners.py), not as a Dask task through the scheduler.
    RUNNERS = True

    def __init__(
        self,
        client: Client,
        server: ParameterServer,
        data: ArrayBlocks | ShardBlocks,
        batches: list[list[int]],
        rows: list,
        model: Model,
        observer: PassObserver,
        *,
        token: str,
        timeout: float,
        backup_tasks: bool = True,
        delay: Mapping[str, float] | None = None,
        workers: list[str] | None = None,
        keep: Sequence[str] = (),
    ):
        self.client, self.server, self.data = client, server, data
        self.keep = tuple(keep)
        self.kept: dict[str, np.ndarray] = {}  # name -> the whole vector, as last written
        self.batches, self.rows, self.model, self.observer = batches, rows, model, observer
        self.token, self.timeout, self.backup_tasks = token, timeout, backup_tasks
        self.delay = dict(delay or {})
        self.task_only: set[int] = set()  # portions a runner lost: tasks from now on
        self.blocks = data.place(client, rows, workers, timeout)  # spread over the workers
        self.runners = Runners(client, timeout, enabled=self.RUNNERS)  # see runners.py
        self.started = False  # whether a pass has waited for the blocks to be in memory
        # copies in flight, Dask tasks and runner calls; survives batches: stragglers hold slots
        self.inflight: dict[Future | RunnerCall, PortionCopy] = {}
        self.arrivals = Arrivals()  # wakes the pass when any of them finishes
        # Collected copies, held until the next batch's portions are submitted.  Dropping a
        # future makes the client send the scheduler a release message, and a Dask client sends
        # at most one batch of messages per 10 ms: the next batch's submissions, a few ms later,
        # would wait out the rest of that interval.  Released after them, it travels with them.
        self.retired: list[Future] = []
        self._lead: list[Command] = []  # commands the shards run first in the next program
        self._before_submit: list[Callable[[], None]] = []  # calls before the next submissions
        self.freed: dict[str, float] = {}  # when each worker's last copy was collected
        self.load: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.where: dict[int, set[str]] = {}
        self.nbytes: dict[str, int] = {}  # block key -> bytes, as the scheduler counts them
        self.examples_seen = 0
        self.point: np.ndarray | None = None  # the batch's point, if sent with its portions
        self.finished: dict[int, Finished] = {}  # the batch's finish results, by shard index
        self._refresh(first=True)

    # -- what the coordinator adds to the next pass -------------------------------------------
    def lead(self, program: Program) -> None:
        """Have the shards run ``program`` first in the next program they run (a pass's prelude,
        or :meth:`run`'s): a snapshot, say, without a round trip of its own."""
        self._lead.extend(program)

    def before_next_submit(self, call: Callable[[], None]) -> None:
        """Call ``call`` just before the next batch's portions are submitted: a task it submits
        goes to the scheduler with them, in one batch of messages (see :attr:`retired`)."""
        self._before_submit.append(call)

    def _led(self, program: Program) -> list[Command]:
        lead, self._lead = self._lead, []
        return [*lead, *program]

    # -- Space protocol -----------------------------------------------------------------------
    def run(self, program: Program) -> np.ndarray:
        """Run ``program`` on all shards concurrently (one round trip); sum the dot products.
        The vectors of :attr:`keep` it writes come back with them, into :attr:`kept`."""
        program = self._led(program)
        if not program:
            return np.zeros(0)
        names = [name for name in self.keep if name in written(program)]
        if not names:
            replies = self.server.call_all(SandblasterShard.run, program, timeout=self.timeout)
            return sum_replies(replies)
        replies = self.server.call_all(
            SandblasterShard.run_and_copy, program, names, timeout=self.timeout
        )
        for i, name in enumerate(names):
            self.kept[name] = np.concatenate([vectors[i] for _, vectors in replies])
        return sum_replies([dots for dots, _ in replies])

    def evaluate(
        self, batch: int, prelude: Program, finish: Program = ()
    ) -> tuple[float, int, np.ndarray]:
        """One distributed pass over ``batch`` at the point ``xt`` (after ``prelude``); the
        shards then make ``acc`` the mean gradient and run ``finish`` themselves, and the task
        whose gradient completed a shard's batch brings its dot products back (no call of the
        coordinator's own after the pass).  Returns the summed loss, the examples and the
        summed dot products; the vectors of :attr:`keep` that ``finish`` writes go to
        :attr:`kept`."""
        send = self.server.size * np.dtype(DTYPE).itemsize <= self.INLINE_POINT_BYTES
        names = tuple(name for name in self.keep if name in written(finish))
        ending = Finish(frozenset(self.batches[batch]), list(finish), names)
        self.finished = {}
        begun = self.server.call_all(
            SandblasterShard.begin, self._led(prelude), "xt", send, ending, timeout=self.timeout
        )
        version = begun[0][0]
        self.point = np.concatenate([values for _, values in begun]) if send else None
        if not self.started:  # a portion goes to a runner once its block is in memory: the
            self.runners.wait(self.blocks, self.timeout)  # first pass waits for the blocks
            self.started = True
        self._refresh()
        t_start = last_progress = time.time()
        self.observer.event(
            "batch_start", f"batch {batch}, version {version}", batch=batch, version=version
        )
        todo = list(self.batches[batch])
        retired, self.retired = self.retired, []
        calls, self._before_submit = self._before_submit, []
        for call in calls:
            call()
        done: dict[int, PortionResult] = {}
        copies: dict[int, list[PortionCopy]] = {}  # every copy submitted in this batch
        durations: list[float] = []  # submit-to-result seconds of the counted copies
        while len(done) < len(self.batches[batch]):
            self._dispatch(version, todo, copies, durations)
            retired.clear()  # released now: their message goes with the submissions
            if not todo and self.backup_tasks:
                self._backups(version, copies, done, durations)
            if not self.inflight:  # no live worker slot at the moment: wait for one
                time.sleep(0.05)
                self._refresh()
                continue
            # near a batch's end, or while a free slot waits, look at stragglers often
            finished = self.arrivals.first(
                self.inflight, timeout=0.5 if todo and not self._free() else 0.02
            )
            for future in finished:
                if self._collect(future, version, todo, done, durations):
                    last_progress = time.time()
            if time.time() - last_progress > 1.0:  # no progress: did a worker die?
                self._refresh()
                last_progress = time.time()
            if time.time() - t_start > self.timeout:
                self._check_shards(seconds=min(5.0, self.timeout))  # the usual reason
                raise RuntimeError(
                    f"batch {batch} did not finish within timeout={self.timeout} s: "
                    f"{len(done)} of {len(self.batches[batch])} portions done; "
                    f"{self._outstanding(version)}"
                )
        self.examples_seen += sum(r.examples for r in done.values())
        self.observer.event(
            "batch_done",
            f"batch {batch}, version {version}, {len(done)} portions",
            batch=batch, version=version, portions=len(done),
        )  # fmt: skip
        dots = self._finish_results(version, names)
        return sum(r.loss_sum for r in done.values()), sum(r.examples for r in done.values()), dots

    def _finish_results(self, version: int, names: tuple[str, ...]) -> np.ndarray:
        """The finish programs' summed dot products (and kept vectors) of batch ``version``.

        Every shard has run its finish program once the pass counted every portion; the copy
        that completed a shard's batch is usually a counted one, whose result brought it.  The
        shards are asked when a copy not collected yet (a backup discarded on the other shards,
        say) brought it, or when the vectors to keep were too large to travel with a task.
        """
        brought = {i: done for i, done in self.finished.items() if len(done.copies) == len(names)}
        if len(brought) < self.server.n_shards:
            replies = self.server.call_all(
                SandblasterShard.finished, version, timeout=self.timeout
            )
            for i, reply in enumerate(replies):
                if reply is None:
                    raise RuntimeError(f"shard {i} did not finish batch version {version}")
                brought.setdefault(i, reply)
        ordered = [brought[i] for i in range(self.server.n_shards)]
        for k, name in enumerate(names):
            self.kept[name] = np.concatenate([done.copies[k] for done in ordered])
        return sum_replies([done.dots for done in ordered])

    def _collect(
        self, future: Future, version: int, todo: list, done: dict, durations: list
    ) -> bool:
        """Take in one finished copy; True if it counted (the first copy of its portion)."""
        copy = self.inflight[future]
        began = self._running_since(copy)
        del self.inflight[future]
        self.retired.append(future)  # released after the next submissions
        self.load[copy.worker] -= 1
        self.freed[copy.worker] = time.time()
        if future.status == "error":
            self._check_shards(seconds=min(5.0, self.timeout))  # a lost shard fails portions
            raise RuntimeError(f"portion {copy.portion} failed: {future.exception(timeout=5)!r}")
        result: PortionResult | None = None
        if future.status == "finished":
            try:
                result = future.result(timeout=self.timeout)
            except CancelledError:  # finished, but its worker died before we got the result
                pass
        if result is not None and result.version == version:  # counted or not
            self.finished.update(result.finished)
        if result is None:  # cancelled or lost with its data block: run it again
            if isinstance(future, RunnerCall):
                self.task_only.add(copy.portion)  # by a task, wherever its block now is
            self._restore_blocks()
            running = any(
                c.portion == copy.portion and c.version == version for c in self.inflight.values()
            )  # a straggling copy of an earlier batch does not count
            if copy.version == version and copy.portion not in done and not running:
                todo.append(copy.portion)
            return False
        if result.version != version or result.status != "done" or copy.portion in done:
            self.observer.event(
                "duplicate_discarded",
                f"portion {copy.portion} of version {result.version} ({result.status}) from "
                f"{result.worker}",
                portion=copy.portion, version=result.version, status=result.status,
                worker=result.worker,
            )  # fmt: skip
            return False
        done[copy.portion] = result
        durations.append(time.time() - began)
        self.where.setdefault(copy.portion, set()).add(result.worker)
        self.observer.portion_counted(result)
        return True

    def _outstanding(self, version: int) -> str:
        """The copies of batch ``version`` still running, for an error message: which portion,
        on which worker, for how long, and in which state Dask has the task."""
        now, copies = time.time(), self.inflight.items()
        running = [
            f"portion {c.portion} on {c.worker} for {now - c.submitted:.1f} s ({f.status})"
            for f, c in copies if c.version == version
        ]  # fmt: skip
        return "still running: " + ("; ".join(running) if running else "nothing")

    def _check_shards(self, workers: Mapping[str, Any] | None = None, seconds: float = 0.0) -> None:
        """Raise :class:`ShardLostError` naming the first shard whose worker has left the
        cluster (``workers``: the live ones), or, with ``seconds``, that does not answer within
        that long."""
        lost = []
        if workers is not None:
            lost = [i for i, w in enumerate(self.server.workers) if w not in workers]
        if not lost and seconds:
            lost = self.server.lost_shards(timeout=seconds)
        if lost:
            i = lost[0]
            raise ShardLostError(
                f"Sandblaster shard {i} (on worker {self.server.workers[i]}) was lost: "
                + ("its worker left the cluster" if workers is not None else
                   f"it did not answer within {seconds} s"),
                i,
            )  # fmt: skip

    # -- scheduling ---------------------------------------------------------------------------
    def _scatter(self, pid: int) -> Future:
        """Send the rows of portion ``pid`` to one worker (Dask picks it, spreading blocks)."""
        return self.data.replace(self.client, self.rows[pid], self.timeout)

    def _restore_blocks(self) -> None:
        """Place again every data block that died with its worker (see ``data.replace``).

        Scattered data cannot be recomputed by Dask, and its Active Memory Manager removes extra
        replicas, so the driver (which holds the training data anyway) is the backup copy.  A
        block read from a file or Dask partition is read again, unless Dask is reading it.
        """
        for pid, block in enumerate(self.blocks):
            reading = block.status == "pending" and pid in self.data.homes
            if block.status != "finished" and not reading:
                self.blocks[pid] = self._scatter(pid)
                self.observer.event(
                    "data_restored", f"portion {pid}'s rows placed again", portion=pid
                )
        self._refresh()

    def _submit(self, version: int, pid: int, worker: str, backup: bool) -> PortionCopy:
        """Send a copy of portion ``pid`` to ``worker``: to its runner if the block is there
        (see runners.py), else as a Dask task (which brings the block if it must)."""
        block, future = self.blocks[pid], None
        args = (self.server.portable(), self.token, version, pid)
        rest = (self.model, backup, self.timeout, self.delay, self.point)
        local = worker in self.where.get(pid, ()) and block.status == "finished"
        if local and pid not in self.task_only:
            future = self.runners.call(worker, block.key, *args, *rest)
        if future is None:
            future = self.client.submit(
                run_portion, *args, block, *rest,
                workers=[worker], allow_other_workers=True, pure=False,
                key=f"portion-{pid}-v{version}-{'b' if backup else 'o'}-{uuid.uuid4().hex[:6]}",
            )  # fmt: skip
        self.arrivals.watch(future)
        copy = PortionCopy(version, pid, worker, time.time())
        self.inflight[future] = copy
        self.load[worker] = self.load.get(worker, 0) + 1
        return copy
