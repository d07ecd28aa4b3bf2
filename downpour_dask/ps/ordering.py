"""Keeping each replica's pushes in the order it made them, on a shard.

Pushes of one replica session may overtake each other on the network (actor messages travel
independently).  :class:`InOrder` -- part of
:class:`~downpour_dask.ps.shard.ParameterServerShard` -- tracks which push numbers each session
delivered (:class:`SeqTracker`) and makes a push wait briefly for its predecessors.
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class SeqTracker:
    """Which push numbers of one replica session a shard has processed.

    ``through`` is the largest n such that pushes 0..n were all processed; ``ahead`` holds the few
    processed pushes above it (pushes may overtake each other on the network).
    """

    __slots__ = ("through", "ahead")

    def __init__(self) -> None:
        self.through = -1
        self.ahead: set[int] = set()

    def seen(self, seq: int) -> bool:
        return seq <= self.through or seq in self.ahead

    def add(self, seq: int) -> None:
        self.ahead.add(seq)
        while self.through + 1 in self.ahead:
            self.through += 1
            self.ahead.discard(self.through)


class InOrder:
    """The waiting half of push ordering (the shard records what arrived in ``_seqs``)."""

    #: Seconds a push waits for an earlier push of its replica session before it is applied.
    ORDER_WAIT = 5.0
    _seqs: dict[tuple[int, str], SeqTracker]
    _arrived: asyncio.Condition | None

    async def _notify(self) -> None:
        """Wake pushes waiting in :meth:`_in_order` for the one just applied."""
        if self._arrived is not None:
            async with self._arrived:
                self._arrived.notify_all()

    async def _in_order(self, replica: int, session: str, seq: int | None) -> None:
        """Wait (briefly) until this session's earlier pushes are in, so a replica's pushes are
        applied in the order it made them even when messages overtake each other.

        A push whose predecessor does not arrive within :attr:`ORDER_WAIT` seconds (its sender
        died mid-send) is applied anyway; retried and duplicate pushes pass straight through.
        """
        if seq is None:
            return
        tracker = self._seqs.get((replica, session))
        through = -1 if tracker is None else tracker.through
        if seq <= through + 1 or (tracker is not None and tracker.seen(seq)):
            return
        if self._arrived is None:  # created here: it must belong to the worker's event loop
            self._arrived = asyncio.Condition()
        deadline = time.monotonic() + self.ORDER_WAIT
        async with self._arrived:
            while True:
                tracker = self._seqs.get((replica, session))
                if tracker is not None and (tracker.through >= seq - 1 or tracker.seen(seq)):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
