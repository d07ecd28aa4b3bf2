"""The fencing look-ups of a process's channels, made on one background thread.

A :class:`~downpour_dask.ps.channel.DaskShardChannel` refuses a reply from a shard the driver
has replaced; to know, it reads the ``distributed.Variable`` where the driver publishes each
shard's current actor (and its generation).  Such a read is a round trip to the scheduler,
which on the replica's own thread holds up the gradients (tens of ms on a busy machine).  Here
one daemon thread per process makes those reads for every open channel, each every
``every`` seconds with a timeout, and keeps the latest answer as a :class:`Look`: the channel
reads it without blocking.

A look is only as good as its age: :meth:`ReplacementWatch.fresh` gives the channel the
latest look if it *started* no more than ``within`` seconds ago, else None, and the channel
then reads the variable itself, as it did before this thread existed.  So a channel never
accepts a reply on older knowledge than it would have without the thread -- in particular not
after its own process was stopped (SIGSTOP), when the thread's last look is old too.

The thread ends once no channel is watched (:func:`unwatch`, from the channel's ``close``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from distributed import Variable

from .protocol import generation_variable


def published(name: str, timeout: float) -> Any | None:
    """The future the driver last published in variable ``name`` (None: not read in time)."""
    with contextlib.suppress(TimeoutError, OSError):
        return Variable(name).get(timeout=timeout)
    return None


def published_generation(name: str, timeout: float = 1.0) -> int:
    """The generation published with it (0 if it cannot be read within ``timeout``: it is set
    before the actor, so it is there once the actor is)."""
    with contextlib.suppress(TimeoutError, OSError, TypeError, ValueError, RuntimeError):
        return int(Variable(generation_variable(name)).get(timeout=timeout))
    return 0


class Look(NamedTuple):
    """One read of a shard's replacement variables."""

    started: float  #: ``time.monotonic()`` when the read began (the answer is at least this new)
    key: str | None  #: the key of the published actor's future (None: nothing published)
    generation: int  #: the generation published with it (read after the key)


class ReplacementWatch:
    """The looks at one channel's replacement variables (made by the process's watch thread).

    Parameters
    ----------
    name : str
        The variable where the driver publishes the shard's current actor.
    every : float
        Seconds between two looks.
    timeout : float
        Seconds one read may take.
    read_key, read_generation : callable
        How to read the variables: ``read_key(name, timeout)`` returns the published future or
        None, ``read_generation(name)`` its generation (default: :func:`published`,
        :func:`published_generation`).
    """

    def __init__(
        self,
        name: str,
        every: float,
        timeout: float,
        read_key: Callable[[str, float], Any | None] | None = None,
        read_generation: Callable[[str], int] | None = None,
    ):
        self.name, self.every, self.timeout = name, every, timeout
        self.read_key, self.read_generation = read_key, read_generation
        self.latest: Look | None = None
        self.due = 0.0  # monotonic time of the next look

    def fresh(self, within: float, since: float = 0.0) -> Look | None:
        """The latest look if it started at most ``within`` seconds ago and not before the
        monotonic time ``since`` (when the channel moved to a new actor), else None."""
        look = self.latest
        if look is None or look.started < since or time.monotonic() - look.started > within:
            return None
        return look

    def look(self) -> None:
        """Read the variables once (on the watch thread); a failed read keeps the old look."""
        started = time.monotonic()
        self.due = started + self.every
        try:
            future = (self.read_key or published)(self.name, self.timeout)
        except Exception:  # a closing client, a cancelled future: try again next time
            return
        if future is None:
            return
        key = future.key
        previous = self.latest
        if previous is not None and previous.key == key:
            generation = previous.generation  # the generation is set before the actor
        else:
            generation = int((self.read_generation or published_generation)(self.name))
        self.latest = Look(started, key, generation)


_lock = threading.Lock()
_changed = threading.Condition(_lock)
_watched: list[ReplacementWatch] = []
_thread: threading.Thread | None = None


def watch(target: ReplacementWatch | None) -> None:
    """Have the process's watch thread look at ``target`` (starting the thread if needed, in a
    copy of the caller's context, so the reads find the caller's Dask client; None: nothing)."""
    global _thread
    if target is None:
        return
    with _changed:
        if target not in _watched:
            _watched.append(target)
        if _thread is None:
            context = contextvars.copy_context()
            _thread = threading.Thread(
                target=context.run, args=(_run,), name="downpour-replacement-watch", daemon=True
            )
            _thread.start()
        _changed.notify_all()


def unwatch(target: ReplacementWatch | None) -> None:
    """Stop looking at ``target`` (None: nothing); the thread ends when nothing is left."""
    if target is None:
        return
    with _changed:
        if target in _watched:
            _watched.remove(target)
        _changed.notify_all()


def watch_thread() -> threading.Thread | None:
    """The running watch thread, if any (for tests and diagnostics)."""
    return _thread


def _run() -> None:
    """The watch thread: each watched channel's look when it is due, until none is left."""
    global _thread
    try:
        while True:
            with _changed:
                if not _watched:
                    _thread = None  # under the lock: a new watch() starts a new thread
                    return
                now = time.monotonic()
                due = [target for target in _watched if target.due <= now]
                if not due:
                    _changed.wait(max(0.0, min(target.due for target in _watched) - now))
                    continue
            for target in due:  # outside the lock: a read may take its whole timeout
                target.look()
    finally:  # ended by an error: the next watch() starts a new thread
        with _changed:
            if _thread is threading.current_thread():
                _thread = None
