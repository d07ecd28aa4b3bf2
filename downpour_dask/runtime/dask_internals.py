"""Every use of Dask's private API in the package but its bounded client calls, which are in
:mod:`.dask_client_calls`, the making of clients through Dask's handshake race, in
:mod:`.dask_connect`, and a scheduler plugin's changes to the scheduler's state, in
:mod:`.dask_scheduler_state`.

Each function below relies on something ``distributed`` does not promise to keep: an attribute
of an object, the signature of a constructor not meant to be called directly, a private
method.  Each says what it relies on, the ``distributed`` versions it was checked against, and
what it falls back to -- or that it fails loudly -- when Dask changes.  ``tests/
test_dask_internals.py`` runs every one of them on the installed ``distributed``: when that test
fails after an upgrade (or ``tests/test_driver_loss.py``), this module and its three siblings
are the only ones to fix.

Outside this module the package also relies on the *wording* of one Dask error, "Worker holding
Actor was lost" (see :data:`downpour_dask.ps.protocol.LOST_ACTOR`, which stays free of Dask
imports); the same test pins it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from distributed import Actor, Client, Future, get_worker, wait
from distributed import worker as _dask_worker
from distributed.client import FuturesCancelledError

from .dask_connect import worker_client

#: What waiting on futures raises when one of them was cancelled -- e.g. scattered data that a
#: dead worker took with it.  ``distributed`` raises it from ``wait``/``gather`` but exports it
#: only from its ``client`` module, not from the package (checked: distributed 2024.x to
#: 2026.8); a move fails at import, loudly.
FUTURES_CANCELLED = FuturesCancelledError


def wait_quietly(futures: list[Future], timeout: float) -> None:
    """``distributed.wait(futures, timeout=timeout)`` that returns, instead of raising, when the
    time is up or a future was cancelled (the caller looks at their states).

    ``Client.sync`` keeps the error it raises in a reference cycle with its own frame, and the
    error's traceback reaches the caller's frames: a driver that waits in a loop, as a fit does
    every tick, would keep its frames, and the futures of the data they hold (so the cluster
    keeps the data), until the cycle collector ran.  Dropping the traceback breaks the cycle.
    Relies on ``sync`` keeping no other reference to the frames (checked: distributed 2026.8).
    """
    try:
        wait(futures, timeout=timeout)
    except (TimeoutError, concurrent.futures.CancelledError, FUTURES_CANCELLED) as err:
        err.__traceback__ = None


def actor_result(call: Any, timeout: float | None) -> Any:
    """The result of an actor call, read straight from the future once it has arrived.

    ``ActorFuture.result()`` always hands a coroutine to the event loop of the worker (or
    client) and blocks until the loop runs it, even for a finished call: inside a busy worker,
    a few such hand-offs per step cost more than the gradient itself.

    Relies on ``distributed.actor.ActorFuture`` keeping a finished call's outcome in ``_out``,
    an object whose ``unwrap()`` returns the value or raises the call's exception (checked:
    distributed 2024.x to 2026.8).  Falls back to the public ``call.result(timeout)`` for a call
    not finished yet, and for any future without such an attribute (a changed Dask, or a call
    that is not an ``ActorFuture``).

    A ``TimeoutError`` from the fallback is raised afresh from here, without the frames of
    Dask's ``sync``: when the call's own wait times out before ``sync``'s, ``sync`` raises the
    error it stored, in a cycle with its frame (see :func:`wait_quietly`), and callers that
    wait in slices and swallow each slice's error would keep their frames, and the reply they
    wait for, until the cycle collector ran.
    """
    out = getattr(call, "_out", None) if call.done() else None
    if out is not None and hasattr(out, "unwrap"):
        return out.unwrap()  # raises the call's exception, as result() would
    try:
        return call.result(timeout=timeout)
    except TimeoutError as err:
        raise err.with_traceback(None) from None


def local_actor(key: str) -> Any | None:
    """The object of actor ``key`` if it lives in this worker process, else None.

    A task on the actor's own worker can then call it directly, without the serialisation and
    the loopback round trip of an actor message.

    Relies on ``Worker.state.actors``, a dict of actor key -> object (checked: distributed
    2024.x to 2026.8).  Falls back to None -- the caller then uses ordinary actor calls -- when
    not running on a worker or when the worker no longer exposes that dict.
    """
    try:
        actors = get_worker().state.actors
    except (ValueError, AttributeError):
        return None
    return actors.get(key) if isinstance(actors, dict) else None


def worker_actor(worker: Any, key: str) -> Any | None:
    """The object of actor ``key`` if it lives in ``worker`` (a ``distributed.Worker``, e.g.
    the ``dask_worker`` a function run on it with ``Client.run`` gets), else None; on
    :func:`local_actor`'s reliance on ``Worker.state.actors`` (run on real workers by
    ``tests/test_driver_loss.py``)."""
    actors = getattr(getattr(worker, "state", None), "actors", None)
    return actors.get(key) if isinstance(actors, dict) else None


def on_worker_loop(coroutine: Any) -> concurrent.futures.Future:
    """Run ``coroutine`` on this worker's event loop, from one of its task threads; return a
    future of its result.

    A coroutine method of an actor in this process then runs where Dask would run an actor
    message -- on the loop, one call at a time with the others -- without the message itself
    (its framing, the loopback round trip and the dispatch on the way back).

    Relies on ``Worker.loop`` being a tornado ``IOLoop`` over asyncio whose ``asyncio_loop`` is
    the running asyncio loop (checked: distributed 2024.x to 2026.8, tornado 6.x).  Raises
    ``RuntimeError`` when that is not so; the caller then sends an ordinary actor message.
    """
    try:
        loop = getattr(getattr(get_worker(), "loop", None), "asyncio_loop", None)
    except ValueError:  # not on a worker
        loop = None
    if not isinstance(loop, asyncio.AbstractEventLoop) or not loop.is_running():
        coroutine.close()
        raise RuntimeError("this worker's event loop is not a running asyncio loop")
    return asyncio.run_coroutine_threadsafe(coroutine, loop)


def serve_on_worker(worker: Any, op: str, handler: Callable[..., Any]) -> None:
    """Have ``worker`` answer messages ``{"op": op, ...}`` with ``handler`` (called with the
    message's other fields as keyword arguments; a coroutine is awaited), as its own handlers
    (``gather``, ``actor_execute``...) answer theirs.

    Relies on ``Worker.handlers``, the dict of op -> handler that ``distributed.core.Server``
    dispatches by, which Dask's own extensions fill from their worker plugins (checked:
    distributed 2024.x to 2026.8).  No fallback: a changed dispatch fails here, loudly.
    """
    worker.handlers[op] = handler


def call_worker(client: Client, address: str, op: str, **msg: Any) -> concurrent.futures.Future:
    """Send the worker at ``address`` the message ``{"op": op, **msg}`` from the driver, over
    the client's own connections (straight to the worker, never through the scheduler); a
    ``concurrent.futures.Future`` of its answer (an ``OSError`` if the worker is gone).

    Relies on ``Client.rpc`` (the client's connection pool, as ``client.rpc(address).op(...)``
    reaches a worker) and ``Client.loop`` being a tornado ``IOLoop`` over asyncio whose
    ``asyncio_loop`` runs (checked: distributed 2024.x to 2026.8, tornado 6.x).  Raises
    ``RuntimeError``, before sending anything, when the loop is not so.
    """
    loop = getattr(getattr(client, "loop", None), "asyncio_loop", None)
    if not isinstance(loop, asyncio.AbstractEventLoop) or not loop.is_running():
        raise RuntimeError("this client's event loop is not a running asyncio loop")

    async def send() -> Any:
        return await getattr(client.rpc(address), op)(**msg)

    return asyncio.run_coroutine_threadsafe(send(), loop)


@contextlib.contextmanager
def as_worker(worker: Any) -> Iterator[None]:
    """Make ``distributed.get_worker()`` return ``worker`` in this thread while the block runs,
    as Dask arranges for a task's thread.

    Work a worker handler started in a thread of its own has no worker otherwise.  Relies on
    ``distributed.worker._worker_cvar``, the context variable ``get_worker`` reads (checked:
    distributed 2024.x to 2026.8).  No fallback: a changed ``get_worker`` fails here, loudly.
    """
    token = _dask_worker._worker_cvar.set(worker)
    try:
        yield
    finally:
        _dask_worker._worker_cvar.reset(token)


@contextlib.contextmanager
def running_as(key: str) -> Iterator[None]:
    """Show the current thread, for as long as the block runs, as running ``key`` on this
    worker: where Dask lists the threads running tasks (its profiler, its dashboard, anything
    that asks a worker what it is busy with).

    Work a worker handler started in a thread of its own is invisible there otherwise.  Relies
    on ``Worker.active_threads`` (thread id -> key) and ``Worker.active_threads_lock``, which
    Dask fills for tasks and actor calls itself (checked: distributed 2024.x to 2026.8).  Does
    nothing when not on a worker or when the worker no longer has them.
    """
    try:
        worker = get_worker()
        threads, lock = worker.active_threads, worker.active_threads_lock
    except (ValueError, AttributeError):
        yield
        return
    ident = threading.get_ident()
    with lock:
        before = threads.get(ident)  # a task's thread: its own key comes back after
        threads[ident] = key
    try:
        yield
    finally:
        with lock:
            if before is None:
                threads.pop(ident, None)
            else:
                threads[ident] = before


def task_cancelled() -> bool:
    """Whether the Dask task running on this thread has been cancelled (its client let it go:
    e.g. the driver of a fit failed or ended).

    Dask cannot interrupt a running task; a long task that should end with its client asks.

    Relies on ``Worker.get_current_task()`` (public) and on ``Worker.state.tasks``, a dict of
    key -> task state whose ``state`` is ``"cancelled"`` once the scheduler released a task
    that is still running (checked: distributed 2024.x to 2026.8).  Falls back to False -- no
    cancellation is ever claimed -- outside a task or when Dask no longer exposes these.
    """
    try:
        worker = get_worker()
        return worker.state.tasks[worker.get_current_task()].state == "cancelled"
    except (ValueError, KeyError, AttributeError):
        return False


class CancelWatch:
    """:func:`task_cancelled` for a long task that asks once a step: looked up at most every
    ``every`` seconds (the first call looks), and once cancelled it stays so."""

    def __init__(self, every: float = 0.25):
        self.every = every
        self._cancelled, self._checked = False, -math.inf

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._cancelled and now - self._checked >= self.every:
            self._checked = now
            self._cancelled = task_cancelled()
        return self._cancelled


def actor_handle(cls: type, address: str, key: str) -> Actor:
    """A handle to the actor ``key`` of class ``cls`` living on the worker at ``address``.

    Lets a task reach an actor from a plain (class, address, key) triple instead of receiving
    a handle in its arguments (see :class:`downpour_dask.ps.refs.ActorRef` for why).  Inside
    a worker, its client is made first, by :func:`worker_client`.

    Relies on the constructor ``distributed.Actor(cls, address, key)``, which Dask itself uses
    to unpickle handles (``Actor.__reduce__``) but does not document for users (checked:
    distributed 2024.x to 2026.8).  No fallback: a changed signature fails here, loudly.
    """
    try:
        get_worker()
    except ValueError:  # outside a worker: the handle binds the default client
        pass
    else:
        worker_client()  # at once when the worker's client is connected already
    return Actor(cls, address, key)


class _DirectActor(Actor):
    """An actor handle whose calls from outside the cluster go straight to the actor's worker.

    Overrides ``Actor._worker_rpc``: Dask relays a handle's calls through the scheduler when it
    lives in a client made without ``direct_to_workers=True``; here they take the client's own
    connection to the worker instead (inside a worker, Dask's path is direct already).
    """

    @property
    def _worker_rpc(self) -> Any:
        if self._worker is None and self._client is not None:
            return self._client.rpc(self._address)
        return super()._worker_rpc


def direct_actor(actor: Any, client: Client) -> Any:
    """A handle to ``actor`` whose calls from the driver go straight to the worker holding it.

    A client made without ``direct_to_workers=True`` (Dask's default) relays every actor call
    through the scheduler: two hops each way, and the scheduler's CPU on every call
    (``benchmarks/README.md`` compares the two paths).  The driver already sends data
    straight to the workers (:func:`~downpour_dask.runtime.cluster.send_to_workers`), so going
    direct adds no reachability requirement; a client made with ``direct_to_workers=False``
    keeps the relay, and so does a handle used inside a worker (already direct there).

    Relies on ``Actor``'s private ``_worker_rpc`` property, ``_worker``, ``_client``,
    ``_address`` and ``_cls`` attributes and ``client.rpc(address)`` (checked: distributed
    2024.x to 2026.8).  Falls back to ``actor`` itself when it has none of them.  The handle
    pickles as a plain ``Actor`` (``Actor.__reduce__``).
    """
    if client.direct_to_workers is False or not isinstance(actor, Actor):
        return actor
    if getattr(actor, "_worker", None) is not None or not hasattr(actor, "_address"):
        return actor
    handle = _DirectActor(actor._cls, actor._address, actor.key)
    if handle._client is not client:  # bind to the fit's client, not just the default one
        handle._client, handle._future = client, Future(actor.key, client)
    return handle


def release_hold(held: Any) -> None:
    """Let go of the driver's hold on a key through ``held``: a future, or an actor handle made
    in the driver (through the handle's own future of the actor's key).

    A handle's future is released when the handle is deleted.  But a handle whose methods were
    called sits in reference cycles: the closure Dask makes for each call
    (``run_actor_function_on_worker`` in ``Actor.__getattr__``) refers to itself, and through
    its cell to the handle.  The handle then outlives its last use until Python's cycle
    collector happens to run, and so does the actor, with its memory on the worker, after the
    fit that made it has returned.

    Relies on ``Actor._future``, the handle's future of the key (None in a handle made inside
    a worker), and on ``Future.release()`` letting go of the key once only, however often it
    is called (checked: distributed 2026.8).  Does nothing for a handle without such a future.
    """
    future = held if isinstance(held, Future) else getattr(held, "_future", None)
    if isinstance(future, Future):
        future.release()
