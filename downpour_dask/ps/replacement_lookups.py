"""How a replica's channel learns that its shard was replaced: the driver's published future.

:class:`ReplacementLookups` -- part of :class:`~downpour_dask.ps.channel.DaskShardChannel` --
reads the ``distributed.Variable`` where the driver publishes the future of a shard's current
actor (and, in a second variable, its generation, set first).  A call outstanding for more than
``STUCK`` seconds looks there (:meth:`~ReplacementLookups.replaced`, waiting for the answer: the
replica is waiting anyway); every reply is checked against it at most every ``CHECK_EVERY``
seconds (:meth:`~ReplacementLookups._superseded`), in the background: a look-up goes through the
worker's event loop to the scheduler, tens of milliseconds on a busy machine, which the
replica's thread computes through instead.  A look-up started before the channel switched to a
new actor is dropped: its answer may name the actor the channel has just left.

A sparse replica, whose links cannot switch on their own, waits for the replacement between
two runs of its loop instead (:func:`await_replacement`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from distributed import Variable

from ..runtime.dask_connect import worker_client
from ..runtime.dask_internals import task_cancelled
from .protocol import ShardLostError, generation_variable

#: What :meth:`ReplacementLookups._look_up` returns while its look-up runs.
_PENDING = object()


class ReplacementLookups:
    """The look-ups of a shard's replacement (module docstring); the channel provides the
    attributes below and resets :attr:`_looking` whenever it talks to a new actor."""

    STUCK: float
    CHECK_EVERY: float
    FROZEN: float
    replacements: str | None
    key: str
    timeout: float
    generation: int
    _checked: float
    _looking: Any

    def _published(self, timeout: float) -> Any | None:
        """The future the driver last published for this shard, if it can be read in time."""
        if self.replacements is None:
            return None
        with contextlib.suppress(TimeoutError, OSError):
            return Variable(self.replacements, client=worker_client()).get(timeout=timeout)
        return None

    def replaced(self, key: str, sent: float) -> bool:
        """A call into a lost actor may never complete, so a call outstanding for more than
        :attr:`STUCK` seconds makes the channel look (at most every :attr:`CHECK_EVERY`
        seconds) at the variable where the driver publishes replacements."""
        if self.key != key:
            return True
        now = time.monotonic()
        early = now - sent < self.STUCK or now - self._checked < self.CHECK_EVERY
        if self.replacements is None or early:
            return False
        self._checked = now
        future = self._published(min(self.timeout, self.FROZEN))  # a deleted variable blocks
        return future is not None and future.key != key

    def _superseded(self, key: str) -> bool:
        """Whether the driver announced a newer incarnation than actor ``key`` (looked up at
        most every :attr:`CHECK_EVERY` seconds, in the background: a look-up goes through the
        worker's event loop to the scheduler, tens of milliseconds on a busy machine, which
        the replica's thread computes through; raises the known generation if so)."""
        now = time.monotonic()
        if self.replacements is None or now - self._checked < self.CHECK_EVERY:
            return False
        if task_cancelled():  # let go: the fit may have deleted the variable, which would block
            return False
        found = self._look_up()
        if found is _PENDING:
            return False
        self._checked = now
        if found is None or found.key == key:
            return False
        self.generation = max(self.generation, self._published_generation())
        return True

    def _look_up(self) -> Any:
        """The future the driver published for this shard, once a look-up started by an
        earlier call has finished (None if it could not be read), else :data:`_PENDING`."""
        looking = self._looking
        if looking is None:
            client = worker_client()
            variable = Variable(self.replacements, client=client)
            asked = variable.get(timeout=self.timeout, asynchronous=True)  # a coroutine
            self._looking = asyncio.run_coroutine_threadsafe(asked, client.loop.asyncio_loop)
            return _PENDING
        if not looking.done():
            return _PENDING
        self._looking = None
        with contextlib.suppress(Exception):  # (a timeout, a closing client: not known)
            return looking.result()
        return None

    def _published_generation(self) -> int:
        """The generation the driver announced last for this shard (0 if it cannot be read
        within a second: it is set before the actor, so it is there once the actor is)."""
        if self.replacements is None:
            return 0
        with contextlib.suppress(TimeoutError, OSError, TypeError, ValueError, RuntimeError):
            name = generation_variable(self.replacements)
            return int(Variable(name, client=worker_client()).get(timeout=1.0))
        return 0

    def _replacement(self, lost_key: str) -> Any | None:
        """The actor replacing ``lost_key`` once the driver publishes it, or None if none
        appears within ``2 * timeout`` seconds (the driver may take ``timeout`` to notice the
        loss, and fences the old incarnation first)."""
        if self.replacements is None:
            return None
        deadline = time.monotonic() + 2 * self.timeout
        while True:
            future = self._published(max(0.1, min(5.0, deadline - time.monotonic())))
            if future is not None and future.key != lost_key:
                return future.result(timeout=self.timeout)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def await_replacement(client: Any, replacements: str, shard: int, generation: int,
                      timeout: float) -> Any:
    """In a replica task: wait up to ``timeout`` seconds for the driver to announce, in the
    variable ``replacements``, a generation of ``shard`` newer than ``generation``; the new
    actor's handle.  Raises ShardLostError if none comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            announced = int(
                Variable(generation_variable(replacements), client=client).get(timeout=1.0))
            if announced > generation:
                future = Variable(replacements, client=client).get(timeout=1.0)
                return future.result(timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            pass
        time.sleep(0.1)
    raise ShardLostError(f"parameter-server shard {shard} was lost and no replacement was "
                         f"announced within {timeout} s", shard)
