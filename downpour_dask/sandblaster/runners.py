"""Portions sent straight to a standing actor on the worker that holds their data.

A portion sent as a Dask task goes driver -> scheduler -> worker, and its result worker ->
scheduler -> driver; the client sends the scheduler at most one batch of messages per 10 ms.
That is several milliseconds of each pass, paid even when the portion's data block is already in
the memory of the worker that runs it, where the scheduler has nothing to decide.  So each
worker gets a :class:`PortionRunner` actor for the fit, and a portion whose block that worker
holds is sent to it: one message straight to the worker and the reply straight back, as the
driver's calls to the shards go.  The runner computes the portion exactly as the task would
(:func:`~downpour_dask.sandblaster.tasks.run_portion`), in its worker's thread pool.

Everything that needs the scheduler stays a Dask task: a portion whose block must move, a
backup on a worker without the block, a portion sent before its worker's runner started.
:class:`RunnerCall` gives a runner's reply the few parts of a Dask future a pass reads, and
:class:`Arrivals` waits for the first of both kinds to finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from distributed import Client, Future, get_worker, wait

from ..runtime.dask_internals import (
    FUTURES_CANCELLED,
    actor_call_future,
    direct_actor,
    release_hold,
    running_as,
)
from .tasks import PortionResult, run_portion


class PortionRunner:
    """Dask actor: runs the portions of one fit whose data block is in its worker's memory.

    A call returns to the worker's event loop at once; the portion runs in the worker's own
    thread pool, as a task would, so that a worker with several threads runs as many portions
    at a time (an actor's plain method would run in the single thread Dask keeps for actors).
    """

    async def run(self, block_key: Any, *args: Any) -> PortionResult | None:
        """:func:`~downpour_dask.sandblaster.tasks.run_portion` on the block of key
        ``block_key`` (``args`` are that function's other arguments, in order); None when
        the block is not in this worker's memory (it moved, or its worker was replaced)."""
        worker = get_worker()
        context = contextvars.copy_context()  # get_worker() works in the pool's thread too
        return await asyncio.get_running_loop().run_in_executor(
            worker.executors["default"], context.run, _run, worker, block_key, args
        )


def _run(worker: Any, block_key: Any, args: tuple) -> PortionResult | None:
    """The runner's work, in a thread of the worker's pool: the block (read from memory, or
    from disk if Dask spilled it), then the portion, shown as running where Dask lists its
    threads' work."""
    try:
        block = worker.data[block_key]
    except KeyError:
        return None
    server, token, version, portion, *rest = args
    with running_as(f"portion-{portion}-v{version}-runner"):
        return run_portion(server, token, version, portion, block, *rest)


class RunnerCall:
    """A portion sent to a :class:`PortionRunner`: what a pass reads of a Dask future.

    ``status`` is ``"pending"`` until the reply arrives, then ``"finished"`` or ``"error"`` (the
    portion raised); ``"lost"`` when the runner's worker could not be reached or the reply
    says the block was not there -- the pass then runs the portion again, as for a Dask task
    whose worker died.
    """

    def __init__(self, reply: concurrent.futures.Future):
        self.reply = reply

    def done(self) -> bool:
        return self.reply.done()

    @property
    def status(self) -> str:
        if not self.reply.done():
            return "pending"
        error = self.reply.exception()
        if isinstance(error, OSError):  # the worker died, or its connection did
            return "lost"
        if error is not None:
            return "error"
        return "finished" if self.reply.result() is not None else "lost"

    def result(self, timeout: float | None = None) -> PortionResult | None:
        """The portion's result; None if the call was lost (see :attr:`status`)."""
        return None if self.status == "lost" else self.reply.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.reply.exception(timeout)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.reply.add_done_callback(lambda _: callback(self))


class RunnerPool:
    """One :class:`PortionRunner` per worker for the fit ``token``: started without waiting,
    used once started, released by :meth:`close`."""

    def __init__(self, client: Client, workers: Iterable[str], token: str):
        self.client = client
        self.futures: dict[str, Future] = {
            worker: client.submit(
                PortionRunner, actor=True, workers=[worker], allow_other_workers=False,
                pure=False, key=f"sandblaster-portion-runner-{token}-{uuid.uuid4().hex[:6]}",
            )  # fmt: skip
            for worker in workers
        }
        self.handles: dict[str, Any] = {}
        self.usable = True  # False once the client's loop cannot take actor calls

    def wait(self, blocks: list[Future], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the runners to start and for ``blocks`` to be in
        their workers' memory, so that the first pass sends its portions to the runners.  The
        wait ends early if a block or runner fails or is lost (its worker died, say): the pass
        deals with that as ever, and sends what is not ready as Dask tasks."""
        pending = [*blocks, *self.futures.values()]
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, FUTURES_CANCELLED):
                wait(pending, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if any(f.status not in ("pending", "finished") for f in pending):
                return
            pending = [f for f in pending if f.status == "pending"]

    def call(self, worker: str, block_key: Any, *args: Any) -> RunnerCall | None:
        """Send a portion to ``worker``'s runner (``args`` as for :meth:`PortionRunner.run`);
        None if that runner has not started (or cannot be called): send a task instead."""
        handle = self._handle(worker)
        if handle is None:
            return None
        try:
            reply = actor_call_future(lambda: handle.run(block_key, *args), self.client)
        except RuntimeError:
            self.usable = False
            return None
        return RunnerCall(reply)

    def _handle(self, worker: str) -> Any:
        handle = self.handles.get(worker)
        if handle is not None or not self.usable:
            return handle
        future = self.futures.get(worker)
        if future is None or future.status != "finished":
            return None
        handle = self.handles[worker] = direct_actor(future.result(timeout=5), self.client)
        return handle

    def close(self) -> None:
        """Let go of the runners (Dask deletes an actor once nothing refers to it)."""
        for held in [*self.handles.values(), *self.futures.values()]:
            release_hold(held)
        self.handles, self.futures = {}, {}


class Arrivals:
    """Waits for the first of a set of futures -- Dask futures and :class:`RunnerCall` s
    alike -- to finish: each future sets one event when it finishes (:meth:`watch`)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def watch(self, future: Future | RunnerCall) -> None:
        """Have ``future`` wake :meth:`first` when it finishes."""
        future.add_done_callback(lambda _: self._event.set())

    def first(self, futures: Iterable[Future | RunnerCall], timeout: float) -> set:
        """The futures of ``futures`` that have finished, waiting up to ``timeout`` seconds for
        one if none has; an empty set if none finished in that time."""
        futures = list(futures)
        self._event.clear()  # a finish from now on sets it again
        done = {f for f in futures if f.done()}
        if not done and self._event.wait(timeout):
            done = {f for f in futures if f.done()}
        return done
