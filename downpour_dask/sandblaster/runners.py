"""Portions sent straight to the worker that holds their data, not through the scheduler.

A portion sent as a Dask task goes driver -> scheduler -> worker, and its result worker ->
scheduler -> driver; the client sends the scheduler at most one batch of messages per 10 ms.
That is several milliseconds of each pass, paid even when the portion's data block is already in
the memory of the worker that runs it, where the scheduler has nothing to decide.  So every
worker gets a *runner*: a handler (installed by the :class:`PortionRunner` worker plugin) that
takes a portion whose block it holds in one message from the driver, computes it in the worker's
thread pool exactly as the task would (:func:`~downpour_dask.sandblaster.tasks.run_portion`) and
answers straight back, as the driver's calls to the shards go.  A fit's scores of ``eval_data``
go the same way to the worker holding the evaluation data (see
:mod:`~downpour_dask.sandblaster.scoring`).  A handler, not an actor: Dask does not retire a
worker that holds an actor, and a fit must not keep its cluster from shrinking.

Everything that needs the scheduler stays a Dask task: a portion whose block must move, a backup
on a worker without the block, a portion a runner could not take.  :class:`RunnerCall` gives a
runner's answer the few parts of a Dask future a pass reads, and :class:`Arrivals` waits for the
first of both kinds to finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from distributed import Client, Future, WorkerPlugin
from distributed.protocol import to_serialize

from ..runtime.dask_client_calls import register_worker_plugin
from ..runtime.dask_internals import (
    as_worker,
    call_worker,
    running_as,
    serve_on_worker,
    wait_quietly,
)
from ..runtime.deadlines import TIMEOUTS
from .tasks import PortionResult, evaluate_task, run_portion

#: The message a runner answers (the op of a Dask worker handler).
OP = "downpour_dask_sandblaster_portion"


class PortionRunner(WorkerPlugin):
    """Dask worker plugin: installs the runner on every worker, present and to come."""

    name = "downpour-dask-sandblaster-runner"

    def setup(self, worker: Any) -> None:
        async def run_portion_here(payload: tuple) -> Any:  # (Dask logs handlers by name)
            return await _serve(worker, payload)

        serve_on_worker(worker, OP, run_portion_here)


async def _serve(worker: Any, payload: tuple) -> Any:
    """The runner: ``payload`` is (what, data key, arguments): ``"portion"`` with the block's
    key and :func:`run_portion`'s other arguments in order, or ``"score"`` with the evaluation
    data's key and :func:`evaluate_task`'s.  The work runs in the worker's thread pool, as a
    task would, so that a worker with several threads runs as many at a time; the event loop
    stays free meanwhile.  The answer is ``("ok", result or None)`` (None: the data is not in
    this worker's memory, or the work failed while the worker was closing) or ``("error",
    exception)``: the driver raises it, and the worker logs no traceback of its own for an
    error that is the caller's to report."""
    what, key, args = payload
    try:
        result = await asyncio.get_running_loop().run_in_executor(
            worker.executors["default"], _run, worker, what, key, args
        )
    except Exception as err:
        if getattr(worker.status, "name", "running") != "running":  # retired, or closing:
            return to_serialize(("ok", None))  # lost, as Dask re-runs such a worker's tasks
        return to_serialize(("error", err))
    return to_serialize(("ok", result))


def _run(worker: Any, what: str, key: Any, args: tuple) -> Any:
    """The runner's work, in a thread of the worker's pool: the data (read from memory, or
    from disk if Dask spilled it), then the portion or the score, shown as running where Dask
    lists its threads' work."""
    try:
        data = worker.data[key]
    except KeyError:
        return None
    if what == "score":
        server, model, timeout, token = args
        with as_worker(worker), running_as(f"evaluate-{token}-runner"):
            return evaluate_task(server, model, data, timeout, token)
    server, token, version, portion, *rest = args
    with as_worker(worker), running_as(f"portion-{portion}-v{version}-runner"):
        return run_portion(server, token, version, portion, data, *rest)


class RunnerCall:
    """A portion sent to a runner: what a pass reads of a Dask future.

    ``status`` is ``"pending"`` until the answer arrives, then ``"finished"`` or ``"error"``
    (the portion raised); ``"lost"`` when the worker could not be reached, did not hold the
    block or left the cluster (:meth:`abandon`) -- the pass then runs the portion again, as for
    a Dask task whose worker died.
    """

    def __init__(self, reply: concurrent.futures.Future):
        self.reply = reply

    def done(self) -> bool:
        return self.reply.done()

    def abandon(self) -> None:
        """Give the call up (its worker left the cluster): it is lost at once, where a call
        to a worker that is gone would wait out Dask's connect timeout first."""
        self.reply.cancel()

    def _answer(self) -> tuple[str, Any]:
        if self.reply.cancelled():
            return "lost", None
        error = self.reply.exception()
        if isinstance(error, OSError):  # the worker died, or its connection did
            return "lost", None
        if error is not None:
            return "error", error
        kind, value = self.reply.result()
        if kind == "ok":
            return ("finished", value) if value is not None else ("lost", None)
        return "error", value

    @property
    def status(self) -> str:
        return self._answer()[0] if self.reply.done() else "pending"

    def _settled(self, timeout: float | None) -> tuple[str, Any]:
        """The answer, waited for up to ``timeout`` seconds (``TimeoutError`` after that)."""
        concurrent.futures.wait([self.reply], timeout=timeout)
        if not self.reply.done():  # (a call given up is done, though wait() does not say so)
            raise TimeoutError(f"no answer from the runner within {timeout} s")
        return self._answer()

    def result(self, timeout: float | None = None) -> PortionResult | None:
        """The portion's result; None if the call was lost (see :attr:`status`); raises the
        portion's error, or ``TimeoutError`` if no answer came within ``timeout`` seconds."""
        kind, value = self._settled(timeout)
        if kind == "error":
            raise value
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        kind, value = self._settled(timeout)
        return value if kind == "error" else None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.reply.add_done_callback(lambda _: callback(self))

    def release(self) -> None:
        """Nothing to let go of on the cluster (as a Dask future's ``release``)."""


class Runners:
    """The driver's side of the workers' runners for one fit (see the module's docstring)."""

    def __init__(self, client: Client, timeout: float, enabled: bool = True):
        self.client = client
        # The client's own connections go to the workers; one made with
        # ``direct_to_workers=False`` may not reach them: it keeps Dask tasks only.
        self.usable = enabled and client.direct_to_workers is not False
        if self.usable:  # (again on every fit: cheap, and a new worker gets it from Dask)
            try:  # a worker that is stopped or hung would hold the registration for ever
                register_worker_plugin(client, PortionRunner(), PortionRunner.name, timeout)
            except TIMEOUTS:  # some worker may lack its runner: this fit sends Dask tasks
                self.usable = False

    def wait(self, blocks: list[Future], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for ``blocks`` to be in their workers' memory, so that
        the first pass sends its portions to the runners.  The wait ends early if a block fails
        or is lost (its worker died, say): the pass deals with that as ever, and sends what is
        not ready as Dask tasks."""
        pending = list(blocks) if self.usable else []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            wait_quietly(pending, min(1.0, max(0.0, deadline - time.monotonic())))
            if any(f.status not in ("pending", "finished") for f in pending):
                return
            pending = [f for f in pending if f.status == "pending"]

    def call(self, worker: str, block_key: Any, *args: Any) -> RunnerCall | None:
        """Send a portion to ``worker``'s runner (``args``: :func:`run_portion`'s arguments
        after the block, in order); None if runners cannot be used: send a task instead."""
        return self._send(worker, ("portion", block_key, args))

    def score(self, worker: str, data_key: Any, *args: Any) -> RunnerCall | None:
        """Have ``worker``'s runner score the iterate on the evaluation data it holds
        (``args``: :func:`evaluate_task`'s arguments after the data); None as for :meth:`call`."""
        return self._send(worker, ("score", data_key, args))

    def _send(self, worker: str, payload: tuple) -> RunnerCall | None:
        if not self.usable:
            return None
        try:
            reply = call_worker(self.client, worker, OP, payload=to_serialize(payload))
        except RuntimeError:
            self.usable = False
            return None
        return RunnerCall(reply)


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
