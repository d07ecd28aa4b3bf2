"""A replica's one-sided line to a shard on its own host: pushes applied without waking the shard.

Over the wire, even through shared slots (:mod:`~downpour_dask.ps.shared_slots`), every push
wakes a thread in the shard's process, which then competes for that process's GIL with the
replica training there.  :class:`OneSidedShard` instead maps the shard's body
(:mod:`~downpour_dask.ps.shard_body`) and does the shard's work itself, in the replica's own
thread: under the shard's file lock it applies the gradient with the shard's rule and guard,
raises the version and records the push in its ledger, which the shard folds into its counters
the next time it takes the lock (:mod:`~downpour_dask.ps.one_sided_host`).  A pull copies the
values out under the same lock.  Every call is complete when it returns (a
:class:`~downpour_dask.ps.calls.Done`), as a shard in the replica's own process is.

What a replica cannot do alone goes over the wire it keeps open, which the shard serves as
before: a push the shard must refuse (non-finite, or one whose update would overflow: the
shard records the event), every call while such a push is on its way (so pushes stay in
order), every call while the shard's process is stopped (SIGSTOP), for good every call once
the shard took its state back (``REVOKED``) or its process is gone (both looked at every
:attr:`OneSidedShard.LOOK_EVERY` seconds; the wire's timeouts and the channel's replacement
logic then apply), and a call for which another process holds the lock longer than
:attr:`OneSidedShard.WAIT` seconds.  A retired shard's head says so:
the call fails with :class:`~downpour_dask.ps.protocol.FencedError`, as it would over the wire.
Closing the line closes the session's ledger, which the shard then frees for a new session.

Linux only.  This module does not import Dask.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from ..core.compression import SparseGradient
from ..core.guard import GuardedUpdate, clip_norm, sum_of_squares
from .calls import Done
from .protocol import FencedError, PullReply, PushReply
from .shard_body import (
    ACCEPTED,
    CLIPPED,
    DIRTY,
    EXAMPLES,
    GONE,
    IN_PROGRESS,
    LEDGERED,
    RELEASED,
    REPLICA,
    RETIRED_BY,
    REVOKED,
    STALENESS_MAX,
    STALENESS_SUM,
    STOPPED,
    THROUGH,
    VERSION,
    ShardBody,
    closed_mark,
    drop_file_lock,
    process_state,
    take_file_lock,
)


class OneSidedShard:
    """One replica session's one-sided line to a shard (see the module docstring).

    Use :meth:`open`; ``wire`` is the :class:`~downpour_dask.ps.wire.WireClient` to the same
    shard, for what cannot be done one-sided.
    """

    #: Seconds a call waits for the shard's lock before it goes over the wire instead.
    WAIT = 0.25
    #: Seconds between two looks at whether the shard's process still runs.
    LOOK_EVERY = 0.1

    def __init__(self, body: ShardBody, offer: dict[str, Any], wire: Any):
        self.body, self.wire = body, wire
        self.ledger = int(offer["ledger"])
        self.row = body.ledgers[self.ledger]
        self.shard, self.generation = int(offer["shard"]), int(offer["generation"])
        self.max_grad_norm = offer["max_grad_norm"]
        self.pid = int(offer["pid"])
        self.guard = GuardedUpdate(offer["rule"], body.values, body.state, body.bounds)
        self.usable = True  # False for good: revoked, or the shard's process not running
        self._pending: Any = None  # a call on the wire that later calls must not overtake
        self._pending_seq = -1
        self._through = -1  # this session's pushes all processed up to here
        self._looked = time.monotonic()
        self._paused = False  # the shard's process was stopped when last looked at
        self._lock = threading.Lock()

    @classmethod
    def open(cls, offer: dict[str, Any] | None, wire: Any) -> OneSidedShard | None:
        """A one-sided line from a shard's offer (``open_one_sided``), or None if there is none
        or its body cannot be mapped from this process."""
        body = ShardBody.attach(offer) if offer else None
        return None if body is None else cls(body, offer, wire)  # type: ignore[arg-type]

    # -- the calls -------------------------------------------------------------------------------
    def push(self, grad: Any, fetched_version: int, replica: int, **kw: Any) -> Any:
        """Apply a push (the wire's arguments); over the wire when it cannot be done here."""
        return self._push(grad, fetched_version, replica, None, kw)

    def exchange(self, grad: Any, fetched_version: int, replica: int, **kw: Any) -> Any:
        """A push, then a pull into ``kw["out"]`` under the same hold of the lock: one call
        whose result is both replies."""
        out = kw.pop("out")
        return self._push(grad, fetched_version, replica, out, kw)

    def _push(self, grad: Any, fetched: int, replica: int, out: Any, kw: dict[str, Any]) -> Any:
        if isinstance(grad, SparseGradient):
            grad = grad.dense()
        if grad.shape != self.body.values.shape:
            raise ValueError(
                f"shard {self.shard} owns {self.body.values.shape[0]} parameters, got a gradient "
                f"of shape {grad.shape}"
            )
        seq = kw.get("seq")
        if seq is None or not self._here():
            return self._by_wire(grad, fetched, replica, out, kw)
        grad_sq = sum_of_squares(grad)
        if not math.isfinite(grad_sq) and not np.isfinite(grad).all():
            return self._by_wire(grad, fetched, replica, out, kw)  # refused there
        clipped = False
        if self.max_grad_norm is not None:
            grad = np.array(grad, copy=True)
            clipped = clip_norm(grad, self.max_grad_norm) > self.max_grad_norm
        if not self._enter():
            return self._by_wire(grad, fetched, replica, out, kw)
        try:
            reply = self._apply(grad, grad_sq, int(fetched), int(seq), clipped, kw)
            pulled = None if out is None or reply is None else self._pull(out)
        finally:
            self._leave()
        if reply is None:  # it would overflow (the shard refuses it, recording the event), or the
            return self._by_wire(grad, fetched, replica, out, kw)  # body was revoked
        return reply if pulled is None else _Both(reply, pulled)

    def pull(self, replica: int, session: str, out: np.ndarray) -> Any:
        """Copy the values into ``out`` (over the wire when it cannot be done here)."""
        if not self._here() or not self._enter():
            return self.wire.pull(replica, session, out=out)
        try:
            return self._pull(out)
        finally:
            self._leave()

    def poll_warmstart(self) -> Any:
        head = self.body.head
        if not self._here():
            return self.wire.poll_warmstart()
        if head[RETIRED_BY] >= 0:
            return Done(error=self._fenced())
        return Done((int(head[VERSION]), bool(head[STOPPED]), bool(head[RELEASED])))

    def close(self) -> None:
        """Let go of the shard: this session's ledger is marked closed, which the shard folds
        in and frees for a new session, if the lock can be had (a ledger left marked open stays
        taken)."""
        if self.usable and self._enter():
            try:
                self.row[REPLICA] = closed_mark(int(self.row[REPLICA]))
                self.body.head[LEDGERED] += 1
            finally:
                self._leave()
        self.usable = False
        self.row = None  # type: ignore[assignment]
        self.guard = None  # type: ignore[assignment]
        self.body.close()

    # -- the work --------------------------------------------------------------------------------
    def _apply(
        self, grad: np.ndarray, grad_sq: float | None, fetched: int, seq: int, clipped: bool,
        kw: dict[str, Any],
    ) -> Done | None:  # fmt: skip
        """The shard's push, under the lock: a complete call, or None if it must go over the
        wire (it would overflow, or the body is no longer the shard's)."""
        head, row = self.body.head, self.row
        if head[RETIRED_BY] >= 0:
            return Done(error=self._fenced())
        staleness = max(0, int(head[VERSION]) - fetched)
        head[DIRTY] = self.ledger  # a torn push is found by these two (in this order)
        row[IN_PROGRESS] = seq
        if head[REVOKED]:  # taken back while this process was stopped after _enter: not applied
            row[IN_PROGRESS] = -1  # (the shard counts it as torn if it saw the mark: then the
            head[DIRTY] = -1  # wire's push of the same number is a duplicate, counted once)
            self.usable = False
            return None
        overflow = self.guard.apply(
            self.body.values, grad, self.body.state, staleness=staleness, grad_sq=grad_sq
        )
        if overflow is not None:
            row[IN_PROGRESS] = -1
            head[DIRTY] = -1
            return None
        row[THROUGH] = seq  # the commit: from here the push counts as applied
        row[ACCEPTED] += 1
        row[EXAMPLES] += int(kw.get("examples", 0))
        row[STALENESS_SUM] += staleness
        row[STALENESS_MAX] = max(int(row[STALENESS_MAX]), staleness)
        row[CLIPPED] += int(clipped)
        head[VERSION] += 1
        self.body.average_loss(kw.get("loss", math.nan))
        head[LEDGERED] += 1
        row[IN_PROGRESS] = -1
        head[DIRTY] = -1
        self._through = seq
        reply = PushReply(int(head[VERSION]), staleness, True, bool(head[STOPPED]), self.generation)
        return Done(reply)

    def _pull(self, out: np.ndarray) -> Done:
        head = self.body.head
        if head[RETIRED_BY] >= 0:
            return Done(error=self._fenced())
        np.copyto(out, self.body.values)
        version, stop = int(head[VERSION]), bool(head[STOPPED])
        return Done(PullReply(out, version, stop, self._through, (), self.generation))

    def _fenced(self) -> FencedError:
        return FencedError(
            f"parameter-server shard {self.shard} generation {self.generation} was retired: "
            f"generation {int(self.body.head[RETIRED_BY])} replaced it",
            self.shard,
        )

    # -- when to go over the wire ----------------------------------------------------------------
    def _here(self) -> bool:
        """Whether this call can be one-sided: usable, and no call on the wire in the way."""
        if not self.usable:
            return False
        if self._pending is not None:
            if not self._pending.done():
                return False
            self._through = max(self._through, self._pending_seq)
            self._pending = None
        now = time.monotonic()
        if now - self._looked >= self.LOOK_EVERY:
            self._looked = now
            state = process_state(self.pid)
            if self.body.head[REVOKED] or state in GONE or self.wire._broken:
                self.usable = False
            self._paused = state == "T"  # SIGSTOP: over the wire until it runs again
        return self.usable and not self._paused

    def _enter(self) -> bool:
        """Take the shard's lock, unless it cannot be had within :attr:`WAIT` seconds or the
        body is no longer the shard's (revoked) or holds a torn push the shard must settle."""
        self._lock.acquire()
        if not take_file_lock(self.body.fd, self.WAIT):  # type: ignore[arg-type]
            self._lock.release()
            return False
        head = self.body.head
        if head[REVOKED] or head[DIRTY] >= 0:
            self.usable = not head[REVOKED]
            self._leave()
            return False
        return True

    def _leave(self) -> None:
        drop_file_lock(self.body.fd)  # type: ignore[arg-type]
        self._lock.release()

    def _by_wire(self, grad: Any, fetched: int, replica: int, out: Any, kw: dict[str, Any]) -> Any:
        """The push (with ``out``: the exchange) over the wire; later calls wait for it."""
        if out is None:
            call = self.wire.push(grad, fetched, replica, **kw)
        else:
            call = self.wire.exchange(grad, fetched, replica, out=out, **kw)
        seq = kw.get("seq")
        if seq is not None:
            self._pending, self._pending_seq = call, int(seq)
        return call


class _Both:
    """An exchange's two calls as one whose result is ``(push reply, pull reply)``."""

    __slots__ = ("pushed", "pulled")

    def __init__(self, pushed: Any, pulled: Any):
        self.pushed, self.pulled = pushed, pulled

    def done(self) -> bool:
        return self.pushed.done() and self.pulled.done()

    def result(self, timeout: float | None = None) -> tuple[Any, Any]:
        return self.pushed.result(timeout), self.pulled.result(timeout)
