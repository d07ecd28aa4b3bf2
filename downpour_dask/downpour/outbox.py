"""What a worker process hands its driver, each item once, even when an answer is lost.

The driver reads what worker processes keep for it (push-log rows, the results of replicas that
stopped on a leaving worker) with ``client.run`` and a bounded wait
(:data:`~.dask_cluster.RUN_TIMEOUT`).  A reading that forgot what it handed over would lose it
whenever the answer came too late: the worker ran the function, the driver had stopped waiting.
So a hand-over here is acknowledged: the driver says how many items it already holds, the worker
drops those and answers with the rest, and the driver counts as taken only what reached it.  An
answer that never arrived is given again at the next reading.

A worker restarted at the same address is a new process with a new :class:`Outbox`:
:data:`PROCESS`, a random id per process, tells the driver that its count no longer applies.
"""

from __future__ import annotations

import uuid
from typing import Any

#: This worker process's id in the driver's counts (:class:`Taken`).
PROCESS = uuid.uuid4().hex


class Outbox:
    """Items a worker process keeps for its driver, numbered from 0 in the order put."""

    def __init__(self) -> None:
        self.first = 0  # number of the oldest item still kept
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)

    def after(self, taken: int) -> tuple[int, list[Any]]:
        """Forget the items numbered below ``taken`` (the driver holds them); the number of the
        first item kept, and the items from it on."""
        drop = min(max(0, taken - self.first), len(self.items))
        del self.items[:drop]
        self.first += drop
        return self.first, list(self.items)


def answer(box: Outbox | None, process: str, taken: int) -> tuple[str, int, list[Any]]:
    """A worker's answer to a reading of ``box`` by a driver that holds ``taken`` items of
    process ``process``'s outbox: (this process, number of the first item sent, the items)."""
    if box is None:
        return PROCESS, 0, []
    first, items = box.after(taken if process == PROCESS else 0)
    return PROCESS, first, items


class Taken:
    """The driver's side: how many items of each worker's outbox it holds."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[str, int]] = {}

    def of(self, worker: str) -> tuple[str, int]:
        """(process, count) to send with the next reading of ``worker``."""
        return self.held.get(worker, ("", 0))

    def receive(self, worker: str, reply: Any) -> list[Any]:
        """The new items in ``worker``'s answer (none if it is an error), counted as taken."""
        if not isinstance(reply, tuple):
            return []
        process, first, items = reply
        self.held[worker] = (process, first + len(items))
        return items
