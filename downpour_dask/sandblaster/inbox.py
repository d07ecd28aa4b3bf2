"""Portion results fetched in the background as their tasks finish, for the driver to take.

A finished Dask task's result stays on its worker until the client asks for it, and
``Future.result()`` costs a round trip through the scheduler (about 2 ms on a quiet 2-core
machine, more while the workers compute).  Asked for one at a time on the driver, after
``distributed.wait``, these round trips were a fifth of a Sandblaster fit's time, and the
results of a pass's last portions waited for each other.  A :class:`ResultInbox` asks for each
result on Dask's callback thread the moment its task is done, so the driver only takes what
has already arrived.
"""

from __future__ import annotations

import queue
from typing import Any

from distributed import Future


class ResultInbox:
    """Results of watched futures, fetched as soon as each is done.

    Parameters
    ----------
    timeout : float
        Seconds one result may take to arrive before it counts as lost.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._arrived: queue.SimpleQueue[tuple[Future, Any]] = queue.SimpleQueue()

    def watch(self, future: Future) -> None:
        """Fetch ``future``'s result once it is done (on Dask's callback thread)."""
        future.add_done_callback(self._fetch)

    def _fetch(self, future: Future) -> None:
        """Deliver ``(future, result)``; the result is None when the task failed, was cancelled
        or its worker died before the result could be read (the caller looks at ``status``)."""
        result = None
        if future.status == "finished":
            try:
                result = future.result(timeout=self.timeout)
            except Exception:  # cancelled, or lost with its worker meanwhile: run again
                result = None
        self._arrived.put((future, result))

    def take(self, timeout: float) -> list[tuple[Future, Any]]:
        """Everything delivered so far, waiting up to ``timeout`` seconds for a first one (an
        empty list if none came)."""
        try:
            delivered = [self._arrived.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                delivered.append(self._arrived.get_nowait())
            except queue.Empty:
                return delivered
