"""A replica's line to one parameter-server shard, whatever carries it.

:class:`~downpour_dask.ps.protocol.ShardChannel` is the interface the replica loop is written
against: start a pull, a push or both in one round trip (``exchange``), poll the warmstart gate,
wait for a call's reply, and, when the shard is lost, ``switch`` to the replacement the driver
starts.  Calls return at once with a ``Call`` (``done()``, ``result(timeout)``), so a replica keeps
computing while its fetches and pushes travel; the loop never sees the transport (tests: fakes).

:class:`DaskShardChannel` implements it for a shard actor, over whichever of three transports
is cheapest:

- ``"local"``: the shard lives in the replica's own worker process; its methods are called
  directly (no message at all) and every call is complete when it returns;
- ``"wire"``: a direct connection (:mod:`~downpour_dask.ps.wire`) where the comm is plain TCP,
  its arrays through shared memory when the shard is on the replica's host (:attr:`shared`);
- ``"one-sided"`` (when asked for): a shard on the replica's host whose body the replica maps
  and updates itself (:mod:`~downpour_dask.ps.one_sided`), over the wire for what it cannot;
- ``"actor"``: Dask actor messages, whose finished replies are read without a round trip
  through the event loop (:func:`~downpour_dask.runtime.dask_internals.actor_result`).

A lost shard is replaced by the driver, which publishes the new actor's future in a
``distributed.Variable`` (and its generation in a second one, :func:`generation_variable`,
set first); the channel then talks to the new actor under a new *session*, in which push
numbers start again from 0 (the channel translates them, see :meth:`~ShardChannel.includes`).

**Fencing.**  The channel never accepts a reply from an incarnation older than the newest it
knows of (:class:`~downpour_dask.ps.protocol.FencedError`, handled like a lost shard).  It
learns of a replacement when a call is stuck for :attr:`~DaskShardChannel.STUCK` seconds, from
any reply at most every :attr:`~DaskShardChannel.CHECK_EVERY` seconds (a shard in the replica's
own process, back from a stopped worker, would answer at once), and from a retired shard.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import numpy as np

from ..core.params import DTYPE
from ..runtime.dask_internals import actor_result, local_actor, release_hold, task_cancelled
from .calls import Done, Half
from .one_sided import OneSidedShard
from .protocol import (
    FencedError,
    PullReply,
    ShardLostError,
    TaskCancelled,
    is_fenced,
    is_shard_lost,
)
from .replacement_lookups import ReplacementLookups
from .shard import ParameterServerShard
from .wire import WireClient, WireError


class DaskShardChannel(ReplacementLookups):
    """A :class:`~downpour_dask.ps.protocol.ShardChannel` to a shard actor (module docstring).

    Parameters
    ----------
    actor : distributed.Actor
        A handle to the shard's actor.
    shard : int
        The shard's number in the whole server (names it in errors and in the registry).
    size : int
        How many parameters the shard owns.
    replica : int
        The replica this channel belongs to (sent with its calls).
    timeout : float
        Seconds a call may go unanswered, and to wait for a lost shard's replacement.
    replacements : str, optional
        Name of the ``distributed.Variable`` where the driver publishes the future of the
        shard's current actor; without it a lost shard is final.
    direct : bool
        Whether to reach a shard on another worker over :mod:`~downpour_dask.ps.wire` when it
        offers an endpoint (else always actor messages).
    secret : bytes
        The run's wire secret, sent in a direct connection's hello (:mod:`~.service`).
    generation : int
        The generation of ``actor`` (replies from an older incarnation are refused).
    one_sided : bool
        Whether to push one-sided to a shard on another worker of this host that can take it.
    """

    #: Seconds a call may be outstanding before the channel asks whether its shard was replaced,
    #: and between two looks at the replacements variables; a gap longer than ``FROZEN``
    #: seconds between two looks at a call means this process was stopped.
    STUCK = CHECK_EVERY = 1.0
    FROZEN = 2.0

    def __init__(
        self,
        actor: Any,
        shard: int,
        size: int,
        replica: int,
        timeout: float,
        replacements: str | None = None,
        direct: bool = True,
        secret: bytes = b"",
        generation: int = 0,
        one_sided: bool = False,
    ):
        self.secret, self.one_sided_wanted = secret, one_sided
        self.one_sided: OneSidedShard | None = None
        self.shard, self.size, self.replica, self.timeout = shard, size, replica, timeout
        self.replacements, self.direct = replacements, direct
        self.wire: WireClient | None = None
        self._next_seq = 0  # one past the highest push number sent
        self._checked = time.monotonic()
        self.generation = int(generation)  # the newest known: older replies are refused
        self._attach(actor)

    def _attach(self, actor: Any) -> None:
        """Talk to ``actor`` from now on, under a new session numbering pushes from 0."""
        self.actor, self.key = actor, actor.key
        found = local_actor(actor.key)
        self.local = found if isinstance(found, ParameterServerShard) else None
        self.in_process = self.local is not None
        self.session = uuid.uuid4().hex
        self._looking = None  # a look-up started for the actor left behind may name that one
        self._base = self._next_seq  # the replica's number of this session's push 0
        self._buffers: list[np.ndarray] = []

    @property
    def transport(self) -> str:
        if self.one_sided is not None and self.one_sided.usable:
            return "one-sided"
        return "local" if self.local is not None else "wire" if self.wire is not None else "actor"

    @property
    def shared(self) -> bool:
        return self.wire is not None and self.wire.shared

    # -- opening the direct connection -----------------------------------------------------------
    def ask_endpoint(self) -> Any | None:
        """Start asking a shard on another worker for its direct endpoint (None: not wanted)."""
        if not self.direct or self.local is not None:
            return None
        try:
            return self.actor.open_wire()
        except Exception as err:  # a lost actor's handle raises at once
            if is_shard_lost(err):
                return None
            raise

    def connect(self, asked: Any | None, sent: float) -> None:
        """Open the direct connection offered in reply to :meth:`ask_endpoint`.  A shard that
        offers none (its worker's comm is not plain TCP) or cannot be reached so is called
        through actor messages; one that does not answer is left to the first fetch."""
        if asked is None:
            return
        try:
            endpoint = self.wait(asked, self.key, sent)
            if endpoint is not None:
                self.wire = WireClient(endpoint, min(10.0, self.timeout), self.secret)
            if self.one_sided_wanted and self.shared:  # the shard is on this host
                asked_offer = self.actor.open_one_sided(self.replica, self.session, os.getpid())
                offer = self.wait(asked_offer, self.key, sent)
                self.one_sided = OneSidedShard.open(offer, self.wire)
        except (ShardLostError, WireError, OSError):
            self.wire = None

    # -- the calls -------------------------------------------------------------------------------
    def _buffer(self, avoid: np.ndarray | None) -> np.ndarray:
        """A buffer for pulled values, reused from pull to pull: a fresh array above glibc's
        32 MiB mmap limit is page-faulted afresh every time.  A direct connection keeps two,
        so a pull never writes into ``avoid`` (the values a caller still holds)."""
        buffers = self._buffers
        if not buffers:
            count = 1 if self.local is not None else 2
            buffers.extend(np.empty(self.size, dtype=DTYPE) for _ in range(count))
        return buffers[1] if avoid is buffers[0] and len(buffers) > 1 else buffers[0]

    def _here(self, method: Any, *args: Any, **kw: Any) -> Done:
        """A call of the shard in this process: complete, failed if the shard was retired."""
        try:
            return Done(method(*args, **kw))
        except FencedError as err:
            return Done(error=err)

    def _failed(self, error: Exception) -> Done:
        """A call its handle refused: lost (fails at :meth:`wait`), or a bug (raised now)."""
        if is_shard_lost(error):
            return Done(error=error)
        raise error

    def pull(self, avoid: np.ndarray | None = None, into: np.ndarray | None = None) -> Any:
        if self.local is not None:  # straight into the caller's array if it offers one
            out = self._buffer(None) if into is None else into
            return self._here(self.local.snapshot_into, out, self.replica, self.session)
        try:
            if self.one_sided is not None:
                return self.one_sided.pull(self.replica, self.session, self._buffer(avoid))
            if self.wire is not None:
                return self.wire.pull(self.replica, self.session, out=self._buffer(avoid))
            return self.actor.pull(self.replica, self.session)
        except Exception as err:
            return self._failed(err)

    def push(
        self, grad: np.ndarray, fetched_version: int, seq: int, examples: int, loss: float
    ) -> Any:
        self._next_seq = seq + 1
        kw = {"seq": seq - self._base, "session": self.session, "examples": examples, "loss": loss}
        if self.local is not None:  # same process: no message at all
            return self._here(self.local.apply_push, grad, fetched_version, self.replica, **kw)
        try:
            line = self.one_sided or self.wire or self.actor
            return line.push(grad, fetched_version, self.replica, **kw)
        except Exception as err:
            return self._failed(err)

    def exchange(
        self,
        grad: np.ndarray,
        fetched_version: int,
        seq: int,
        examples: int,
        loss: float,
        avoid: np.ndarray | None = None,
        into: np.ndarray | None = None,
    ) -> tuple[Any, Any]:
        self._next_seq = seq + 1
        kw = {"seq": seq - self._base, "session": self.session, "examples": examples, "loss": loss}
        if self.local is not None:  # both under one hold of the shard's lock
            out = self._buffer(None) if into is None else into
            exchange = self.local.exchange_into
            both = self._here(exchange, grad, fetched_version, self.replica, out, **kw)
            if both.error is not None:
                return both, both
            return Done(both.value[0]), Done(both.value[1])
        try:
            if self.one_sided is not None or self.wire is not None:
                call = (self.one_sided or self.wire).exchange(
                    grad, fetched_version, self.replica, out=self._buffer(avoid), **kw
                )
            else:
                call = self.actor.exchange(grad, fetched_version, self.replica, **kw)
        except Exception as err:
            failed = self._failed(err)
            return failed, failed
        return Half(call, 0), Half(call, 1)

    def poll_warmstart(self) -> Any:
        if self.local is not None:
            return self._here(self.local.warmstart_state)
        try:
            return (self.one_sided or self.wire or self.actor).poll_warmstart()
        except Exception as err:
            return self._failed(err)

    def includes(self, reply: PullReply, seq: int) -> bool:
        seq -= self._base
        return seq <= reply.applied_through or seq in reply.applied_ahead

    # -- a lost shard ----------------------------------------------------------------------------
    def wait(self, call: Any, key: str, sent: float) -> Any:
        last = time.monotonic()
        deadline = last + self.timeout
        try:
            while not call.done():
                now = time.monotonic()  # time this process was stopped (SIGSTOP) is not the shard's
                deadline += max(0.0, now - last - self.FROZEN)
                if now >= deadline:
                    message = f"shard {self.shard} did not answer within {self.timeout} s"
                    raise TimeoutError(message)
                if task_cancelled():  # the driver let this replica go: the shard may be gone too
                    raise TaskCancelled(f"replica {self.replica}: its task was cancelled")
                if self.replaced(key, sent):
                    raise ShardLostError(f"shard {self.shard} was replaced", self.shard)
                last = time.monotonic()  # a slow look at the replacements is not a freeze
                with contextlib.suppress(TimeoutError):
                    reply = actor_result(call, min(0.5, max(0.01, deadline - time.monotonic())))
                    return self._fenced(reply, key)
            return self._fenced(actor_result(call, self.timeout), key)
        except ShardLostError:
            raise
        except Exception as err:
            if is_fenced(err):
                raise FencedError(f"{err}", self.shard) from err
            if is_shard_lost(err):
                message = f"parameter-server shard {self.shard} was lost: {err}"
                raise ShardLostError(message, self.shard) from err
            raise

    def _fenced(self, reply: Any, key: str) -> Any:
        """``reply``, unless it comes from an incarnation older than the newest this channel
        knows of, or the shard it was sent to has been replaced meanwhile (looked up at most
        every :attr:`CHECK_EVERY` seconds): then :class:`FencedError`."""
        generation = getattr(reply, "generation", None)
        if generation is None:  # a warmstart poll or an endpoint: no fencing needed
            return reply
        if generation < self.generation or (key == self.key and self._superseded(key)):
            raise FencedError(
                f"replica {self.replica}: a reply of parameter-server shard {self.shard} "
                f"generation {generation} was refused: generation {self.generation} replaced it",
                self.shard,
            )
        self.generation = generation
        return reply

    def switch(self, lost_key: str, error: BaseException) -> bool:
        """Wait for the driver to publish the lost shard's replacement, then talk to it.

        Raises
        ------
        ShardLostError
            If no replacement appears within ``2 * timeout`` seconds (at once without
            ``replacements``: nobody would publish one).
        """
        if self.key != lost_key:
            return False  # already switched
        actor = self._replacement(lost_key)
        if actor is None:
            raise ShardLostError(
                f"replica {self.replica}: parameter-server shard {self.shard} was lost and no "
                f"replacement appeared within 2 * timeout={self.timeout} s: {error}",
                self.shard,
            ) from error
        self.close()  # its receiver may still be writing into a buffer: new ones
        self.generation = max(self.generation, self._published_generation())
        self._attach(actor)
        self.connect(self.ask_endpoint(), time.monotonic())
        return True

    def close(self) -> None:
        """Close the direct connection and let go of the handle's hold on the actor (a called
        handle sits in reference cycles: it would keep the actor alive after the fit, until
        this worker's cycle collector happened to run)."""
        if self.one_sided is not None:
            self.one_sided.close()
            self.one_sided = None
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        release_hold(self.actor)
