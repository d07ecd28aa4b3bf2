"""A replica's pushes from the moment they are sent until no fetch can miss them any more.

Every push carries a sequence number, and every pulled slice says which of the replica's pushes
its values contain (:class:`~downpour_dask.ps.protocol.PullReply`).  So that an asynchronous
fetch never *undoes* the replica's own work, a fetched slice is installed as ``fetched - alpha *
(own pushes it does not contain yet)``: :class:`PushLedger` keeps each push's gradient until
every shard's values are known to contain it, re-applies exactly the missing ones
(:meth:`PushLedger.replay`), counts the pushes a lost shard took with it
(:meth:`PushLedger.shard_switched`), and recycles the gradient buffers of settled pushes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.optim import axpy
from ..core.params import DTYPE
from ..ps.protocol import PullReply, ShardChannel


@dataclass
class Push:
    """A push in flight, or acknowledged but kept for replay."""

    seq: int  # the replica's push number
    step: int  # the replica's step when it pushed
    grad: np.ndarray  # the full-length gradient pushed
    calls: list  # one call per shard, until acknowledged
    loss: float  # mean training loss over the accrued steps
    examples: int  # examples accrued
    acked: bool = False
    needed_by: set[int] = field(default_factory=set)  # shards whose fetches may still lack it
    keys: tuple = ()  # the shard each call went to (their channels' keys then)
    sent: float = 0.0  # time.monotonic() when it was sent


class PushLedger:
    """The pushes of one replica not settled yet, and the gradient buffers they free.

    Parameters
    ----------
    size : int
        Length of the parameter vector (of a gradient buffer).
    """

    def __init__(self, size: int):
        self.size = size
        self.pending: list[Push] = []
        self.next_seq = 0
        self.lost = 0  # pushes a lost shard took with it before acknowledging them
        self._free: list[np.ndarray] = []

    def take_seq(self) -> int:
        """The next push number."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def add(self, push: Push) -> None:
        self.pending.append(push)

    def in_flight(self) -> int:
        """How many pushes are not acknowledged yet."""
        return sum(not p.acked for p in self.pending)

    def oldest_in_flight(self) -> Push:
        return next(p for p in self.pending if not p.acked)

    def unacknowledged(self) -> list[Push]:
        return [p for p in self.pending if not p.acked]

    def replay(
        self,
        s: int,
        channel: ShardChannel,
        reply: PullReply,
        local: np.ndarray,
        bounds: tuple[int, int],
        alpha: float,
    ) -> int:
        """Re-apply to ``local`` (slice ``bounds`` of the replica's copy, just overwritten with
        shard ``s``'s fetched values) ``alpha`` times each own push these values lack; return
        how many that was.

        Shard ``s`` stops needing a push its values contain, and one already acknowledged
        (fetches issued after the acknowledgement contain it).
        """
        lo, hi = bounds
        replayed = 0
        for p in self.pending:
            if s not in p.needed_by:
                continue
            included = channel.includes(reply, p.seq)
            if not included:
                axpy(-alpha, p.grad[lo:hi], local)
                replayed += 1
            if included or p.acked:
                p.needed_by.discard(s)
        return replayed

    def acknowledged(self, push: Push, settled: Any) -> None:
        """Mark ``push`` acknowledged; shards in ``settled`` (those with no fetch in flight:
        their next fetch is issued after this and contains it) stop needing it."""
        push.acked, push.calls = True, []
        push.needed_by.difference_update(settled)
        self.release()

    def shard_switched(self, s: int) -> None:
        """Shard ``s`` was replaced: its new actor never saw any push in flight (they are lost)
        and its fetches restart from the replacement's state, so no push needs replaying there."""
        for p in self.pending:
            p.needed_by.discard(s)
            if not p.acked:
                self.lost += 1
        self.release()

    # -- gradient buffers ------------------------------------------------------------------------
    def buffer(self) -> np.ndarray:
        """A gradient buffer, recycled if one is free; its contents are undefined (the first
        step of an accrual overwrites it, and nothing reads it before)."""
        if self._free:
            return self._free.pop()
        return np.empty(self.size, dtype=DTYPE)

    def release(self) -> None:
        """Recycle the buffers of pushes that are acknowledged and needed for no replay."""
        keep = []
        for p in self.pending:
            if p.acked and not p.needed_by:
                self._free.append(p.grad)
            else:
                keep.append(p)
        self.pending = keep
