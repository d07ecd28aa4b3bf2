"""The replicas' clock, kept by every shard, for stale synchronous and bulk synchronous runs.

:class:`ReplicaClocks` is a mixin of :class:`~downpour_dask.ps.shard.ParameterServerShard`:
each shard counts, per replica, the pushes it received (accepted or refused, duplicates not):
that replica's *clock*.  It also remembers the clock at which each replica last fetched (its
*read clock*, recorded when the replica asks with ``read=True`` right after a fetch), and which
replicas have finished (they no longer hold anyone back; noted with the fit's token, so the
replicas of a fit resumed from a checkpoint are not taken for finished).  A replica asks with
:meth:`~ReplicaClocks.clock_state` (``(own clock, slowest clock, slowest read clock,
stopped)``); the rules that decide whether it may go on are in
:mod:`downpour_dask.core.consistency`.  Shards keep the clock, not the driver: a replica asks
the shards it talks to anyway, and every shard counts the pushes it applied itself.

The clocks travel in the shard's ``counters`` (checkpoints, a lost shard's replacement); a
shard restored from a state without them starts every replica at 0.

:func:`poll_clock` and :func:`finish_clock` are a replica's calls over a
:class:`~downpour_dask.ps.channel.DaskShardChannel`: in-process for a shard in its own worker,
else one actor message (the direct wire carries no clock calls: a clock poll is a few bytes
once per push, against the push's megabytes).  Imports no Dask.
"""

from __future__ import annotations

from typing import Any

from .calls import start

#: What :meth:`ReplicaClocks.clock_state` returns.
ClockState = tuple[int, int, int, bool]


class ReplicaClocks:
    """Per-replica push and read clocks of one shard (module docstring).  The host class
    provides ``_lock``, ``_serving()`` (fencing) and ``stopped``."""

    def _clocks(self) -> tuple[dict[int, int], dict[int, int], dict[int, str]]:
        if not hasattr(self, "_clock_pushes"):
            self._clock_pushes: dict[int, int] = {}
            self._clock_reads: dict[int, int] = {}
            self._clock_finished: dict[int, str] = {}  # replica: the token of the fit
        return self._clock_pushes, self._clock_reads, self._clock_finished

    def _tick(self, replica: int) -> None:
        """Count one push of ``replica`` (called under the lock as the push is applied)."""
        pushes = self._clocks()[0]
        pushes[replica] = pushes.get(replica, 0) + 1

    def clock_state(
        self, replica: int, n_replicas: int, read: bool = False, run: str = ""
    ) -> ClockState:
        """``(own, slowest, slowest_read, stopped)`` for ``replica`` among ``n_replicas`` of
        the fit ``run``; with ``read``, first record that ``replica`` just fetched at its
        current clock.  Replicas that finished in this fit do not count (with all finished, the
        slowest is ``own``)."""
        with self._lock:  # type: ignore[attr-defined]
            self._serving()  # type: ignore[attr-defined]
            pushes, reads, finished = self._clocks()
            own = pushes.get(replica, 0)
            if read:
                reads[replica] = own
            active = [r for r in range(n_replicas) if finished.get(r) != run]
            slowest = min((pushes.get(r, 0) for r in active), default=own)
            slowest_read = min((reads.get(r, -1) for r in active), default=own)
            return own, slowest, slowest_read, bool(self.stopped)  # type: ignore[attr-defined]

    def clock_finished(self, replica: int, run: str = "") -> None:
        """``replica`` of the fit ``run`` ran out of steps: it no longer holds the others back."""
        with self._lock:  # type: ignore[attr-defined]
            self._clocks()[2][int(replica)] = str(run)

    async def poll_clock(
        self, replica: int, n_replicas: int, read: bool = False, run: str = ""
    ) -> ClockState:
        """:meth:`clock_state` as an actor call."""
        return self.clock_state(replica, n_replicas, read, run)

    async def finish_clock(self, replica: int, run: str = "") -> None:
        """:meth:`clock_finished` as an actor call."""
        self.clock_finished(replica, run)

    def _clock_counters(self) -> dict[str, Any]:
        """The clocks as JSON-able counters (see ``export_state``)."""
        pushes, reads, finished = self._clocks()
        return {
            "clock_pushes": {str(r): n for r, n in pushes.items()},
            "clock_reads": {str(r): n for r, n in reads.items()},
            "clock_finished": {str(r): run for r, run in finished.items()},
        }

    def _restore_clocks(self, counters: dict[str, Any]) -> None:
        pushes, reads, finished = self._clocks()
        pushes.update({int(r): int(n) for r, n in (counters.get("clock_pushes") or {}).items()})
        reads.update({int(r): int(n) for r, n in (counters.get("clock_reads") or {}).items()})
        finished.update({int(r): str(t) for r, t in (counters.get("clock_finished") or {}).items()})


def _call(channel: Any, name: str, *args: Any) -> Any:
    """Call shard method ``name`` over ``channel``: in-process (complete at once) or as an actor
    message; a call its lost shard's handle refuses fails when waited for."""
    local = getattr(channel, "local", None)
    if local is not None:
        return start(local, name, *args, local=True)
    return start(channel.actor, name, *args)


def poll_clock(channel: Any, n_replicas: int, read: bool = False, run: str = "") -> Any:
    """Start asking ``channel``'s shard for its :data:`ClockState` (in the fit ``run``)."""
    local = getattr(channel, "local", None) is not None
    name = "clock_state" if local else "poll_clock"
    return _call(channel, name, channel.replica, n_replicas, read, run)


def finish_clock(channel: Any, run: str = "") -> Any:
    """Start telling ``channel``'s shard that this replica of the fit ``run`` finished."""
    local = getattr(channel, "local", None) is not None
    return _call(channel, "clock_finished" if local else "finish_clock", channel.replica, run)
