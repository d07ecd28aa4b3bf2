"""Workers joining and leaving a running Downpour fit, through Dask's own hooks.

Two plugins, registered by the driver for the length of a fit (both named after its token):

- :class:`MembershipPlugin` (a ``SchedulerPlugin``) tells the driver, on the run's event topic
  (:func:`membership_topic`), that a worker ``joined`` (``add_worker``), is ``leaving`` (the
  scheduler logs every worker's status change: ``closing_gracefully`` when
  ``Scheduler.retire_workers`` starts -- ``client.retire_workers``, ``Worker.close_gracefully``,
  a cluster's scale-down or ``adapt`` --, ``closing`` when a worker or its nanny closes it) or
  ``left`` (``remove_worker``).  The driver subscribes to the topic: it hears of a retirement
  the moment it starts, without polling the scheduler.
- :class:`HoldForMigration` (a ``WorkerPlugin``): a worker that closes runs its plugins'
  ``teardown`` while it still serves its actors and connections.  There it marks the run as
  leaving in the worker's registry (its replicas then stop after their next push) and waits, at
  most :data:`LEAVE_WAIT` seconds, until the driver released it: the driver has migrated its
  shards and collected its replicas.  A worker that cannot wait (killed, or a nanny whose grace
  period ends first) goes the crash path: recovery from the freshest copy.

Why both: ``retire_workers`` refuses a worker that holds an actor (Dask never moves actors; it
aborts the retirement at once), so a shard's worker is only ever *closed*, e.g. by a cluster
scaling down; and a plain close sends no signal before the worker is going.  The scheduler
plugin gives the early signal, the worker plugin the time to act on it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from distributed import Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from .registry import is_released, mark_leaving

#: Seconds a closing worker waits for the driver to release it.  Below the 4 s a nanny gives its
#: worker to close (``Nanny.close``'s default timeout of 5 s, times 0.8) before it kills it.
LEAVE_WAIT = 3.0
#: Worker statuses that mean the worker is going away.
LEAVING_STATUSES = ("closing_gracefully", "closing")


def membership_topic(run: str) -> str:
    """The event topic on which the scheduler plugin of fit ``run`` reports workers."""
    return f"downpour-{run}-membership"


def plugin_name(run: str) -> str:
    """The name both plugins of fit ``run`` are registered under."""
    return f"downpour-elastic-{run}"


class MembershipPlugin(SchedulerPlugin):
    """Reports workers that join, start leaving or left on :func:`membership_topic` as
    ``{"action": "joined" | "leaving" | "left", "worker": address, "status": ...}``."""

    def __init__(self, run: str):
        self.run = run
        self.topic = membership_topic(run)
        self.name = plugin_name(run)
        self.scheduler: Scheduler | None = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _report(self, action: str, worker: str, status: str = "") -> None:
        if self.scheduler is not None:
            self.scheduler.log_event(
                self.topic, {"action": action, "worker": worker, "status": status}
            )

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self.scheduler = scheduler
        self._report("joined", worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self._report("left", worker)

    def log_event(self, topic: str, msg: Any) -> None:
        # The scheduler logs each status change on the worker's own topic (its address).
        if topic == self.topic or not isinstance(msg, dict):
            return
        if msg.get("action") == "worker-status-change" and msg.get("status") in LEAVING_STATUSES:
            self._report("leaving", topic, str(msg["status"]))


def finish_retirement(dask_worker: Worker) -> None:
    """Run on a worker (``client.run``) whose retirement Dask aborted because it held a shard,
    once the shard moved: start its graceful close (``Worker.close_gracefully`` asks the
    scheduler to move its data again, then closes it and its nanny) without waiting for it."""
    dask_worker.loop.add_callback(
        dask_worker.close_gracefully, reason="downpour-dask: its shards moved"
    )


class HoldForMigration(WorkerPlugin):
    """Holds a closing worker (at most ``wait`` seconds) until the driver of fit ``run`` has
    taken what it needs off it (see the module docstring)."""

    def __init__(self, run: str, wait: float = LEAVE_WAIT):
        self.run, self.wait = run, wait
        self.name = plugin_name(run)

    def setup(self, worker: Worker) -> None:
        return None

    async def teardown(self, worker: Worker) -> None:
        if worker.status.name not in LEAVING_STATUSES:
            return  # the plugin is being unregistered at the end of the fit, not the worker
        mark_leaving(self.run)
        worker.log_event(
            membership_topic(self.run),
            {"action": "leaving", "worker": worker.address, "status": "teardown"},
        )
        deadline = time.monotonic() + self.wait
        while not is_released(self.run) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
