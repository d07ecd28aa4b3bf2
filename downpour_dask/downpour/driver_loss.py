"""What the scheduler lets go of when a Downpour fit's driver is gone without ending the fit.

A driver ends its fit in a ``finally`` block: it stops the replicas, withdraws the published
name, unregisters its plugins, clears what the workers keep for it and releases the shards.  A
driver killed outright (SIGKILL, a restarted Jupyter kernel, a lost machine) runs none of it.
Dask then drops the driver's client and with it every future the client held, so the fit
cannot go on; but what the fit handed to the scheduler outlives the client: the shard actors
(held by the fit's ``distributed.Variable`` objects and its published dataset), the published
name (a watcher shows a frozen line; the name cannot be used again), the fit's plugins and
what every worker keeps for it (:mod:`.registry`: a copy of the freshest parameters, push-log
rows).

:class:`DriverLoss`, a ``SchedulerPlugin`` the driver registers as soon as its shards exist
(until then Dask's own release of the client's futures covers everything), hears the scheduler
remove the driver's client (``remove_client``) and lets go of all of it there.  On every worker
it raises the stop flag of the fit's shards, as a driver ending its fit does, waits for the
fit's replicas to stop and drops the worker's records of the fit (:func:`end_run_here`); it
unregisters the fit's worker plugin, deletes the fit's variables, withdraws the published
dataset if it is still the fit's (it holds one of the fit's shards) and logs the run's ``end``
record for watchers; it has the ended replicas' leftover handles let go of the shards; and it
removes the fit's scheduler plugins, itself last.  The shard actors are then deleted: nothing
holds them.  A driver that ends its fit unregisters the plugin first, so that its client's
later departure touches nothing; other clients (watchers, ``attach``) come and go without
effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin

from ..ps.shard import ParameterServerShard
from ..publishing import DRIVER_LOST, topic
from ..runtime.dask_internals import worker_actor
from ..runtime.dask_scheduler_state import (
    delete_variables,
    release_keys,
    run_on_workers,
    unregister_worker_plugin,
    variables_named,
    withdraw_dataset,
)
from .membership import plugin_name
from .registry import forget_run, run_variables, running_replicas
from .sparse_replicas import forget_records

logger = logging.getLogger(__name__)

#: The scheduler event topic on which each cleanup logs what it let go of.
TOPIC = "downpour-dask-driver-loss"
#: Seconds a worker waits for the fit's replicas on it to end (they stop at their next reply).
ENDED_WAIT = 5.0
#: Seconds the scheduler waits for each worker's answer (a stopped worker must not hold it).
TEARDOWN_WAIT = 10.0


async def end_run_here(
    run: str, shards: list[str], secret: bytes, wait: float, dask_worker: Any = None
) -> bool:
    """On a worker (run by :class:`DriverLoss`): raise the stop flag of the fit's shards that
    live here (``shards``: actor keys; ``secret``: the fit's, which a stop needs), as the
    driver does when it ends a fit, so the replicas and partitions reading from them end; wait
    at most ``wait`` seconds until no replica of fit ``run`` runs in this process; then drop
    what the process keeps for the fit.  True if no replica was running any more."""
    for key in shards:
        shard = worker_actor(dask_worker, key)
        if isinstance(shard, ParameterServerShard):
            await shard.request_stop(secret, who="the scheduler: its driver is gone")
    deadline = time.monotonic() + wait
    while running_replicas(run) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    ended = not running_replicas(run)
    forget_run(run)
    forget_records(run)
    return ended


def driver_loss_name(run: str) -> str:
    """The name :class:`DriverLoss` of fit ``run`` is registered under."""
    return f"downpour-driver-loss-{run}"


class DriverLoss(SchedulerPlugin):
    """Lets go of fit ``run``'s state on the cluster when client ``driver`` (the driver's
    ``Client.id``) is removed from the scheduler (see the module docstring).

    Parameters
    ----------
    run : str
        The fit's token.
    driver : str
        The id of the driver's client.
    shards : list of str
        The keys of the fit's shard actors (the variables hold those of replacements).
    published : str, optional
        The name the fit publishes its run under (``fit(..., publish=)``).
    secret : bytes
        The fit's wire secret, which raising its shards' stop flag needs.
    """

    def __init__(
        self,
        run: str,
        driver: str,
        shards: list[str],
        published: str | None = None,
        secret: bytes = b"",
    ):
        self.run, self.driver, self.published = run, driver, published
        self.shards, self.secret = list(shards), secret
        self.name = driver_loss_name(run)
        self.let_go: list[str] = []  # what the cleanup let go of (for the log and tests)
        self._cleanup: asyncio.Task | None = None

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        if client != self.driver or self._cleanup is not None:
            return
        if getattr(scheduler.status, "name", "running") != "running":
            return  # the scheduler is closing: its workers, actors and names go with it
        # Called on the scheduler's event loop; the cleanup waits for workers, so it runs on
        # its own (kept referenced until it ends).
        self._cleanup = asyncio.ensure_future(self._clean_up_logged(scheduler))

    async def _clean_up_logged(self, scheduler: Scheduler) -> None:
        try:
            await self.clean_up(scheduler)
        except Exception:  # the scheduler goes on; its log says what was left
            logger.exception("downpour-dask: letting go of fit %s failed", self.run)

    async def clean_up(self, scheduler: Scheduler) -> list[str]:
        """Let go of everything the fit left on the cluster; return what that was."""
        let_go = self.let_go
        # First the replicas: their shards tell them to stop, and they must end before the
        # shards go (a call to a deleted actor can hang).
        held = variables_named(scheduler, run_variables(self.run))  # (replaced shards' too)
        shards = {*self.shards, *(key for key in held.values() if key is not None)}
        ended = await run_on_workers(
            scheduler, end_run_here, self.run, sorted(shards), self.secret, ENDED_WAIT,
            timeout=TEARDOWN_WAIT,
        )  # fmt: skip
        running = {worker: answer for worker, answer in ended.items() if answer is not True}
        let_go.append(f"records on {len(ended) - len(running)} of {len(ended)} workers")
        if running:  # (False: its replicas still ran; else why it did not answer)
            logger.warning("downpour-dask: fit %s's replicas not known to have ended on %s",
                           self.run, running)  # fmt: skip
        membership = plugin_name(self.run)  # the dense fit's (.membership)
        if await unregister_worker_plugin(scheduler, membership, TEARDOWN_WAIT):
            let_go.append(f"worker plugin {membership}")
        variables = await delete_variables(scheduler, run_variables(self.run))
        let_go.extend(f"variable {name}" for name in variables)
        if self.published is not None and withdraw_dataset(scheduler, self.published, shards):
            scheduler.log_event(topic(self.published), {"kind": "end", "reason": DRIVER_LOST})
            let_go.append(f"published name {self.published}")
        if not running:  # the replicas ended: their leftover handles can go
            let_go.extend(f"shard futures of {c}" for c in release_keys(scheduler, shards))
        for name in (membership, self.name):
            with contextlib.suppress(ValueError):  # not registered (refused, or removed)
                scheduler.remove_plugin(name)
                let_go.append(f"scheduler plugin {name}")
        scheduler.log_event(TOPIC, {"run": self.run, "client": self.driver, "let_go": let_go})
        logger.warning(
            "downpour-dask: the driver of fit %s (client %s) left without ending it; let go of: %s",
            self.run,
            self.driver,
            ", ".join(let_go) or "nothing",
        )
        return let_go
