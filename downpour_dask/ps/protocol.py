"""What replicas, the driver and shards say to each other, whatever carries it.

The replies of the calls replicas make (:class:`PullReply`, :class:`PushReply`, each naming
the shard incarnation -- its *generation* -- that answered), what a lost or retired shard looks
like to its callers (:class:`ShardLostError`, :class:`FencedError`, :data:`SHARD_ERRORS`,
:func:`is_shard_lost`) and the interface a replica talks to a shard through
(:class:`ShardChannel`, whose calls are :class:`Call` objects).  The transports -- in-process
calls, :mod:`~downpour_dask.ps.wire`'s direct connections, Dask actor messages -- all deliver
these same values (:mod:`~downpour_dask.ps.channel` hides which one is used).  This module
imports no Dask, so code written against it runs in-process against fakes.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import NamedTuple, Protocol, TypeVar

import numpy as np


class PullReply(NamedTuple):
    """What a shard returns to a pull.

    ``applied_through`` / ``applied_ahead`` tell the calling replica which of its own pushes these
    values already contain: every push numbered ``<= applied_through`` and those in
    ``applied_ahead`` (pushes that overtook an earlier one on the network).
    """

    values: np.ndarray
    version: int
    stop: bool
    applied_through: int
    applied_ahead: tuple[int, ...]
    generation: int = 0  # the incarnation of the shard that answered (see FencedError)


class PushReply(NamedTuple):
    """What a shard returns to a push."""

    version: int  # the shard's version after this push
    staleness: int  # updates the shard applied between the pusher's fetch and this push
    accepted: bool  # False: refused (non-finite gradient, or a duplicate)
    stop: bool  # the run is over: the replica should finish
    generation: int = 0  # the incarnation of the shard that answered (see FencedError)


class TaskCancelled(RuntimeError):
    """A replica's call was abandoned because its Dask task was cancelled: the driver that
    started it failed or ended, and what the call waits for may never come (a call into a
    released actor is never answered)."""


class ShardLostError(RuntimeError):
    """A parameter-server shard was lost or did not answer in time; ``shard`` is its index."""

    def __init__(self, message: str, shard: int):
        super().__init__(message)
        self.shard = shard

    def __reduce__(self) -> tuple:  # the shard travels too when Dask sends the error back
        return type(self), (str(self), self.shard)


class FencedError(ShardLostError):
    """A shard incarnation that was retired answered, or a reply came from an older
    incarnation than the caller expects: the shard was replaced, and this copy must not serve.

    Every shard incarnation has a *generation*: 0 for the shard the fit started, one more for
    each replacement.  The driver retires the old incarnation (``retire``) wherever it can still
    reach it before the replacement serves, and every reply carries its incarnation's generation,
    so a caller that learnt of a newer generation refuses replies from an older one even when
    the old copy could not be reached (a stopped worker that came back) -- the fencing of
    ZooKeeper's epochs or Kafka's leader epochs.  A :class:`ShardLostError`: callers switch to
    the replacement as they do for a lost shard.
    """

    #: The first words of the message: a direct connection carries errors as text.
    PREFIX = "fenced:"

    def __init__(self, message: str, shard: int):
        if not message.startswith(self.PREFIX):
            message = f"{self.PREFIX} {message}"
        super().__init__(message, shard)


#: The words Dask's error starts with when the worker holding an actor died: raised by a call on
#: the actor's handle once its task is gone (``distributed/actor.py``) and set as the actor
#: task's exception by the scheduler (``distributed/scheduler.py``).  Checked in distributed
#: 2024.x to 2026.8; ``tests/test_dask_internals.py`` pins it on the installed version.
LOST_ACTOR = "Worker holding Actor was lost"

#: What callers of the parameter-server layer catch for "a shard was lost": the layer's own
#: :class:`ShardLostError` (raised by :class:`~downpour_dask.ps.server.ParameterServer` and
#: the replicas' channels for every error :func:`is_shard_lost` recognises), and the errors a
#: lost worker raises through Dask's own calls: a closed connection (``OSError``, e.g.
#: ``CommClosedError``, or the direct wire's ``ConnectionError``), no answer in time
#: (``TimeoutError``) or the actor's task cancelled as its worker is removed (``CancelledError``,
#: e.g. ``FutureCancelledError``).  Not every ``RuntimeError``: a bug in a shard method is a bug.
SHARD_ERRORS = (ShardLostError, OSError, TimeoutError, CancelledError)


def generation_variable(replacements: str) -> str:
    """Name of the variable holding the generation of the actor announced in the variable
    ``replacements`` (set before it: a channel that sees the new actor finds its generation)."""
    return f"{replacements}-generation"


def is_fenced(error: BaseException) -> bool:
    """Whether ``error`` says the shard answering was retired: a :class:`FencedError`, or the
    text of one carried over a direct connection (``WireError("FencedError: fenced: ...")``, or
    the service's ``"this parameter-server shard was retired"``)."""
    if isinstance(error, FencedError):
        return True
    text = str(error) if isinstance(error, RuntimeError) else ""
    # the direct-connection service's refusal once its shard left it (``ps/service.py``)
    return f"FencedError: {FencedError.PREFIX}" in text or "shard was retired" in text


def is_shard_lost(error: BaseException) -> bool:
    """Whether ``error``, raised by a call into a parameter-server shard, means the shard (its
    worker) was lost or stopped answering -- rather than a bug or bad input, which must surface.

    True for :data:`SHARD_ERRORS`, for a retired incarnation's refusal (:func:`is_fenced`) and
    for Dask's ``RuntimeError`` about a lost actor (:data:`LOST_ACTOR`); False for any other
    error, a ``RuntimeError`` included.
    """
    if isinstance(error, SHARD_ERRORS) or is_fenced(error):
        return True
    return isinstance(error, RuntimeError) and str(error).startswith(LOST_ACTOR)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: What a warmstart poll returns: the shard's ``(version, stopped, released)``.
WarmstartState = tuple[int, bool, bool]


class Call(Protocol[T_co]):
    """A call on its way: ``done()`` without blocking, ``result(timeout)`` to wait for it."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> T_co: ...


class ShardChannel(Protocol):
    """What a replica needs from one parameter-server shard, whatever carries the calls.

    ``key`` names the shard the channel talks to now and changes when it switches to a
    replacement: a caller keeps the ``key`` a call was sent under, with the ``time.monotonic()``
    it was sent at, and hands both back to :meth:`wait` and :meth:`replaced`.
    """

    shard: int  # the shard's number in the whole server
    key: str  # which shard actor the channel talks to now
    session: str  # the replica's session on that actor
    transport: str  # "local", "wire" or "actor"
    shared: bool  # a "wire" whose arrays go through memory shared with the shard (one host)
    in_process: bool  # calls complete as they are made; the shard's values die with this process

    def pull(
        self, avoid: np.ndarray | None = None, into: np.ndarray | None = None
    ) -> Call[PullReply]:
        """Start fetching the shard's values (never into ``avoid``, a buffer still in use).

        A shard in this process copies them straight into ``into`` if given (the reply's
        ``values`` is then ``into``), saving a copy; other transports ignore it.  The caller
        must not use ``into`` until it takes the reply.
        """
        ...

    def push(
        self, grad: np.ndarray, fetched_version: int, seq: int, examples: int, loss: float
    ) -> Call[PushReply]:
        """Start pushing the replica's push number ``seq`` (its own numbering)."""
        ...

    def exchange(
        self,
        grad: np.ndarray,
        fetched_version: int,
        seq: int,
        examples: int,
        loss: float,
        avoid: np.ndarray | None = None,
        into: np.ndarray | None = None,
    ) -> tuple[Call[PushReply], Call[PullReply]]:
        """A push and a pull of its result in one round trip (``avoid``, ``into``: :meth:`pull`)."""
        ...

    def poll_warmstart(self) -> Call[WarmstartState]:
        """Start reading the shard's ``(version, stopped, released)``."""
        ...

    def includes(self, reply: PullReply, seq: int) -> bool:
        """Whether the values of ``reply`` contain the replica's push number ``seq``."""
        ...

    def replaced(self, key: str, sent: float) -> bool:
        """Whether the shard a call was sent to (under ``key`` at ``sent``) was replaced."""
        ...

    def wait(self, call: Call[T], key: str, sent: float) -> T:
        """The outcome of ``call``; :class:`ShardLostError` if its shard was lost or replaced."""
        ...

    def switch(self, lost_key: str, error: BaseException) -> bool:
        """Move to the replacement of the lost shard ``lost_key``; False if already moved."""
        ...

    def close(self) -> None: ...
