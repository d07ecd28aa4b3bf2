"""The replica loop of stale synchronous (SSP) and bulk synchronous (BSP) runs.

:class:`ClockedReplicaLoop` is :class:`~.replica_loop.ReplicaLoop` with two waits on the
shards' replica clocks (:mod:`downpour_dask.ps.clock`; the rules are in
:mod:`downpour_dask.core.consistency`), around every push:

1. *before a push* (BSP only): record on every shard that this replica fetched at its clock,
   and wait until every replica has (no push of a step lands before every replica read that
   step's values);
2. *after a push*: wait for its acknowledgement (the shards' clock of this replica then counts
   it), then, on every shard, until this replica is at most ``s`` ticks ahead of the slowest;
   then fetch from every shard and install the values before the next step.

So a replica fetches after every push whatever ``n_fetch`` is (its reads must be within the
bound), and has at most one push in flight.  The waits poll (:attr:`ClockedReplicaLoop.POLL`
seconds apart), give up after the replica's ``timeout`` with a ``TimeoutError`` naming the
clocks, end when a shard reports the run stopped, and follow a lost or fenced shard to its
replacement like every other call.  A replica that runs out of steps tells the shards, so it
holds nobody back; one that fails does not, and the others wait for its restart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..core.consistency import may_fetch, may_push
from ..ps.clock import finish_clock, poll_clock
from ..ps.protocol import ShardLostError
from .replica_loop import ReplicaLoop


class ClockedReplicaLoop(ReplicaLoop):
    """A replica that keeps within ``config.staleness_bound`` clock ticks of the slowest of
    ``config.n_replicas`` (module docstring)."""

    skip_refetched = False  # (see ReplicaLoop)

    #: Seconds between two looks at a shard's clock while waiting (doubling up to ``POLL_MAX``).
    POLL = 0.0005
    POLL_MAX = 0.01

    def run(self, source: Any) -> dict[str, Any]:
        result = super().run(source)
        for channel in self.channels:  # finished: hold nobody back
            with contextlib.suppress(ShardLostError, TimeoutError):
                channel.wait(finish_clock(channel, self.cfg.run), channel.key, time.monotonic())
        return result

    def _push(self, step: int, fetch: bool = False) -> None:
        bound = self.cfg.staleness_bound
        assert bound is not None
        if not self.stop and bound == 0:  # BSP: every replica has read this step's values
            self._wait_clock(True, lambda own, _, read: may_push(own, read, bound))
        super()._push(step, fetch=False)
        for p in self.ledger.unacknowledged():  # the shards' clock now counts this push
            self._ack(p, wait=True)
        if self.stop:
            return
        self._wait_clock(False, lambda own, slowest, _: may_fetch(own, slowest, bound))
        for s in range(len(self.channels)):  # a fetch sent before the wait is too old
            while self.pulls[s] is not None:
                self._take_pull(s, wait=True)
        self._start_fetches()
        for s in range(len(self.channels)):
            while self.pulls[s] is not None:
                self._take_pull(s, wait=True)

    def _wait_clock(self, read: bool, ready: Callable[[int, int, int], bool]) -> None:
        """Poll every shard's clock until ``ready(own, slowest, slowest_read)``; with ``read``,
        each poll records that this replica fetched at its current clock."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout
        for s, channel in enumerate(self.channels):
            pause = self.POLL
            while True:
                key, sent = channel.key, time.monotonic()
                try:
                    call = poll_clock(channel, cfg.n_replicas, read, cfg.run)
                    own, slowest, slowest_read, stopped = channel.wait(call, key, sent)
                except ShardLostError as err:
                    self._switch(s, key, err)
                    continue
                if stopped:
                    self.stop = True
                    return
                if ready(own, slowest, slowest_read):
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"replica {cfg.replica} waited {cfg.timeout} s on parameter-server shard "
                        f"{channel.shard}'s clock (staleness_bound={cfg.staleness_bound}): its "
                        f"clock is {own}, the slowest replica's {slowest} (read at "
                        f"{slowest_read}); a replica stalled, or failed and was not restarted"
                    )
                time.sleep(pause)
                pause = min(2 * pause, self.POLL_MAX)
