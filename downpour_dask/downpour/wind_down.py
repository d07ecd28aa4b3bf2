"""How a fit that failed (or was stopped by its callback) lets its replicas end.

Stopped replicas still take their last replies: acknowledgements whose fencing look-ups read the
variables naming the shards' replacements, and (sparse) the shards' answers themselves.  Let go
at once, a replica could find those gone and wait out its timeout, or train on against shards
nobody reads: a thread left running on its worker long after ``fit`` returned.  So the fit asks
the shards to stop the replicas and waits, a bounded time, for their tasks to end before it lets
them and the shards go.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from .protocols import Task

#: Seconds a failed fit waits for its replicas to end.
WIND_DOWN = 5.0
#: Seconds between two looks at whether they have.
POLL = 0.02


def wind_down(
    tasks: Sequence[Task], request_stop: Callable[[], Any], wait: float = WIND_DOWN
) -> bool:
    """If any of ``tasks`` still runs: ``request_stop()`` (its errors ignored: a lost shard),
    then wait up to ``wait`` seconds for all of them to end.  Whether they all did."""
    if all(task.done() for task in tasks):
        return True
    with contextlib.suppress(Exception):
        request_stop()
    deadline = time.monotonic() + wait
    while not all(task.done() for task in tasks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
    return True
