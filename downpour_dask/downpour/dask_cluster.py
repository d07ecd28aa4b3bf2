"""The driver's protocols (:mod:`.protocols`) on a real Dask client.

:class:`DaskCluster` runs the replicas' tasks and mailboxes on workers, reads what the worker
processes keep for the driver (:mod:`.registry`: fetched shard copies, push-log rows) and tells
replicas where a replaced shard lives (a ``distributed.Variable`` per shard).
:class:`DaskServer` is the driver's view of a :class:`~downpour_dask.ps.server.ParameterServer`:
shards by index, the model's vector in its own order.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client, Future, Variable

from ..core.optim import UpdateRule
from ..core.partition import PartitionPlan
from ..ps.calls import Done
from ..ps.protocol import ShardLostError, generation_variable
from ..ps.server import ParameterServer
from ..runtime.cluster import cluster_workers, send_to_workers
from ..runtime.dask_client_calls import register_worker_plugin, unregister_worker_plugin
from ..runtime.dask_internals import wait_quietly
from ..runtime.deadlines import waiting_for
from .driver_loss import DriverLoss, driver_loss_name
from .membership import (
    HoldForMigration,
    MembershipPlugin,
    finish_retirement,
    membership_topic,
    plugin_name,
)
from .outbox import Taken
from .registry import (
    acked_version,
    assign_share,
    fetched_copy,
    forget_run,
    mark_leaving,
    release,
    returned_after,
    rows_after,
    shard_variable,
)

#: Seconds a cached worker list may be old (asking costs a scheduler round trip).
ALIVE_EVERY = 0.5
#: Seconds the driver waits for one worker's answer to a registry read; a worker that does not
#: answer (stopped, e.g. SIGSTOP) is skipped for :data:`SKIP_FOR` seconds, so it never stalls
#: the supervision loop (``client.run`` of all workers at once waits for the slowest).
RUN_TIMEOUT = 2.0
SKIP_FOR = 5.0
#: Times the fit's last reading of push-log rows asks a live worker whose answer was late.
LAST_READINGS = 2


class DaskCluster:
    """The workers of one fit (named ``run`` on the workers) through a Dask client; a scatter
    waits at most ``timeout`` seconds (the fit's)."""

    def __init__(self, client: Client, run: str, timeout: float):
        self.client, self.run, self.timeout = client, run, timeout
        self.variables: dict[int, Variable] = {}
        self._alive: list[str] = []
        self._alive_at = -math.inf
        self._skip: dict[str, float] = {}  # unresponsive worker -> until when it is skipped
        self._beats: dict[str, tuple[Any, float]] = {}  # worker -> (last_seen, when it moved)
        self._heard: deque[dict[str, Any]] = deque()  # membership events not yet taken
        self._watching = False
        self._loss_plugin = False  # whether the scheduler holds this fit's DriverLoss plugin
        self._rows_taken, self._returned_taken = Taken(), Taken()  # (see .outbox)

    def workers(self, fresh: bool = True) -> list[str]:
        now = time.monotonic()
        if fresh or now - self._alive_at >= ALIVE_EVERY:
            found = cluster_workers(self.client)
            self._alive = sorted(found)
            self._alive_at = now
            for worker, info in found.items():  # when its last heartbeat last moved
                seen = info.get("last_seen")
                if seen is None or self._beats.get(worker, (None,))[0] != seen:
                    self._beats[worker] = (seen, now)
        return list(self._alive)

    def silent_for(self, worker: str) -> float:
        """Seconds since the scheduler's time of ``worker``'s last heartbeat last moved, as
        this driver saw it at its looks at the worker list (0 for a worker not seen yet).  A
        stopped or hung worker stays in the list -- Dask does not drop it -- but falls silent."""
        beat = self._beats.get(worker)
        return 0.0 if beat is None else time.monotonic() - beat[1]

    def submit(self, function: Callable[..., Any], *args: Any, worker: str, key: str) -> Future:
        return self.client.submit(
            function, *args, workers=[worker], allow_other_workers=False, pure=False, key=key
        )

    def start_actor(self, cls: type, worker: str, *args: Any, key: str) -> Future:
        return self.client.submit(
            cls,
            *args,
            actor=True,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=key,
        )

    def scatter(self, values: list[Any], worker: str) -> list[Any]:
        what = f"sending a replica's data to worker {worker}"
        with waiting_for(what, self.timeout):
            return list(send_to_workers(self.client, values, [worker], timeout=self.timeout))

    def wait(self, tasks: list[Future], timeout: float) -> None:
        wait_quietly(tasks, timeout)  # a lost task: seen by its owner

    def _run_each(self, function: Callable[..., Any], *args: Any, workers: list[str] | None = None):
        """``function(*args)`` on each of ``workers`` (default: all live ones), each answer
        awaited at most :data:`RUN_TIMEOUT` seconds; what each answered (its error if it
        failed), without the workers that did not answer."""
        now = time.monotonic()
        found: dict[str, Any] = {}
        for worker in self.workers(fresh=False) if workers is None else workers:
            if self._skip.get(worker, -math.inf) > now:
                continue
            try:
                found.update(
                    self.client.run(
                        function, *args, workers=[worker], on_error="return",
                        callback_timeout=RUN_TIMEOUT,
                    )
                )  # fmt: skip
            except (TimeoutError, OSError) as err:
                self._skip[worker] = time.monotonic() + SKIP_FOR
                found[worker] = err.with_traceback(None)  # its traceback pins the callers
        return found

    def collect(self, function: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """``function(*args)`` on every live worker, as :meth:`_run_each` (sparse fits' records)."""
        return self._run_each(function, *args)

    def everywhere(self, function: Callable[..., Any], *args: Any) -> None:
        """``function(*args)`` on every live worker, one that answered late lately too: what
        each must do (forget a run), not a reading a slow worker may skip."""
        self._skip.clear()
        with contextlib.suppress(Exception):
            self._run_each(function, *args)

    def fetched_copies(self, shard: int, key: str, workers: list[str]) -> dict[str, Any]:
        return self._run_each(fetched_copy, self.run, shard, key, workers=workers)

    def acknowledged(self, shard: int, key: str) -> int | None:
        found = self._run_each(acked_version, self.run, shard, key)
        versions = [v for v in found.values() if isinstance(v, int)]
        return max(versions, default=None)

    def drain_rows(self, last: bool = False) -> list[tuple]:
        rows = []
        for worker in self.workers(fresh=False):
            for _ in range(LAST_READINGS if last else 1):
                if last:
                    self._skip.pop(worker, None)  # (not answering lately is no reason here)
                found = self._take(rows_after, self._rows_taken, worker)
                if found is not None:
                    rows.extend(found)
                    break
        return [tuple(row) for row in rows]

    def _take(self, after: Callable[..., Any], taken: Taken, worker: str) -> list[Any] | None:
        """The items of ``worker``'s outbox the driver does not hold yet (:mod:`.outbox`);
        None if it did not answer in time (or not at all)."""
        reply = self._run_each(after, self.run, *taken.of(worker), workers=[worker]).get(worker)
        return taken.receive(worker, reply) if isinstance(reply, tuple) else None

    def announce_shard(self, shard: int, future: Any, generation: int = 0) -> None:
        if shard not in self.variables:
            name = shard_variable(self.run, shard)
            self.variables[shard] = Variable(name, client=self.client)
            self.variables[-1 - shard] = Variable(generation_variable(name), client=self.client)
        self.variables[-1 - shard].set(generation)  # first: whoever sees the actor finds it
        self.variables[shard].set(future)  # replicas waiting for a replacement pick it up

    # -- membership (see .membership) -----------------------------------------------------------
    def watch_membership(self) -> None:
        """Listen to the fit's membership topic and register its worker and scheduler plugins.
        A refused plugin leaves the fit with less, and a warning says what: without the worker
        plugin (downpour-dask not importable on the workers, ``distributed.scheduler.pickle``
        off) leaving workers are failures; without the scheduler plugin (downpour-dask not
        importable on the scheduler) no replica is added and only closing workers, not
        retirements Dask aborted, are heard of."""
        self._watching = True
        self.client.subscribe_topic(membership_topic(self.run), self._hear)
        holder, member = HoldForMigration(self.run), MembershipPlugin(self.run)
        for plugin, register, without in (
            (holder,  # set up on every worker: bounded, a stopped one must not hold the fit
             lambda: register_worker_plugin(self.client, holder, holder.name, self.timeout),
             "workers that leave are handled as failures"),
            (member, lambda: self.client.register_plugin(member),  # the scheduler's
             "workers that join get no replica"),
        ):  # fmt: skip
            try:
                register()
            except Exception as err:  # noqa: BLE001 - any refusal (or timeout) means the same
                warnings.warn(
                    f"the Dask cluster refused {type(plugin).__name__} ({err!r}): {without}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _hear(self, event: tuple[float, Any]) -> None:
        if isinstance(event[1], dict):  # on the client's event loop: a deque append is safe
            self._heard.append(event[1])

    def membership(self) -> list[dict[str, Any]]:
        """The membership events heard since the last call, in order."""
        taken = []
        while self._heard:
            taken.append(self._heard.popleft())
        return taken

    def stop_replicas_on(self, worker: str) -> None:
        """Have the replicas on leaving ``worker`` stop after their next push (a worker whose
        retirement Dask aborted does not close, so its plugin's teardown does not say it)."""
        self._tell(worker, mark_leaving, self.run)

    def returned(self, worker: str) -> list[dict[str, Any]]:
        """Results of the replicas that stopped on leaving ``worker`` (each handed over once)."""
        return self._take(returned_after, self._returned_taken, worker) or []

    def release(self, worker: str) -> None:
        """Let leaving ``worker`` close: the driver took what it needed off it."""
        self._tell(worker, release, self.run)

    def assign_share(self, worker: str, replica: int, positions: Any) -> None:
        """Tell ``replica`` on ``worker`` which part of its data it reads from now on
        (:mod:`.shares`)."""
        self._tell(worker, assign_share, self.run, replica, positions)

    def retire(self, worker: str) -> None:
        """Complete (without waiting) a retirement of ``worker`` that Dask aborted because it
        held a shard, now that the shard moved (:func:`.membership.finish_retirement`)."""
        self._tell(worker, finish_retirement)

    def _tell(self, worker: str, function: Callable[..., Any], *args: Any) -> None:
        """Run ``function(*args)`` on ``worker``, even if it answered late lately: the skip of
        :meth:`_run_each` spares readings a slow worker, but a command skipped would leave the
        worker acting on what it was told before (a replica reading the rows a joined one
        reads too, a leaving worker's replicas not stopping)."""
        self._skip.pop(worker, None)
        self._run_each(function, *args, workers=[worker])

    def let_go_if_driver_lost(
        self, shards: list[Future], published: str | None, secret: bytes
    ) -> None:
        """Have the scheduler stop this fit's replicas and let go of what the fit leaves on the
        cluster (its variables, the name ``published`` it publishes under, its plugins, the
        workers' records, the actors of ``shards``, whose stop needs the fit's ``secret``)
        should the driver's client be removed before :meth:`forget` (:mod:`.driver_loss`).  A
        refusal (downpour-dask not importable on the scheduler) warns: a driver killed then
        leaves it all behind."""
        keys = [future.key for future in shards]
        loss = DriverLoss(self.run, self.client.id, keys, published, secret)
        try:
            self.client.register_plugin(loss)
            self._loss_plugin = True
        except Exception as err:  # noqa: BLE001 - any refusal means the same
            warnings.warn(
                f"the Dask cluster refused DriverLoss ({err!r}): should this process die "
                f"during the fit, its shards and published name stay on the cluster",
                RuntimeWarning,
                stacklevel=2,
            )

    def forget(self) -> None:
        """At the end of the fit: drop what workers keep for this run, and the variables."""
        if self._loss_plugin:  # first: the client's later departure must touch nothing
            with contextlib.suppress(Exception):
                self.client.unregister_scheduler_plugin(driver_loss_name(self.run))
        if self._watching:
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(membership_topic(self.run))
            with contextlib.suppress(Exception):
                self.client.unregister_scheduler_plugin(plugin_name(self.run))
            with contextlib.suppress(Exception):  # (a stopped worker: its teardown not awaited)
                unregister_worker_plugin(self.client, plugin_name(self.run), RUN_TIMEOUT)
        self.everywhere(forget_run, self.run)
        for variable in self.variables.values():
            with contextlib.suppress(Exception):
                variable.delete()


class DaskServer:
    """The driver's view of ``server``: shards by index, and :meth:`pull` returning the
    model's vector (unpacked by ``plan`` when the model is split into partitions)."""

    def __init__(
        self,
        server: ParameterServer,
        client: Client,
        rule: UpdateRule,
        plan: PartitionPlan | None = None,
    ):
        self.server, self.client, self.rule, self.plan = server, client, rule, plan
        #: Whether the shards were told to stop: a replacement shard is told too.
        self.stopped = False
        #: The actors of replaced incarnations, by (shard, generation): to retire them.
        self.replaced: dict[tuple[int, int], Any] = {}
        self.replaced_futures: dict[tuple[int, int], Future] = {}

    def release_replaced(self, shard: int, generation: int) -> None:
        """Let go of incarnation ``generation`` of ``shard`` (migrated: fenced with its final
        state taken), so that its worker holds no actor of the run and Dask can retire it."""
        future = self.replaced_futures.pop((shard, generation), None)
        if future is not None:
            future.release()

    @property
    def workers(self) -> list[str]:
        return self.server.workers

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return self.server.ranges

    def shard_key(self, shard: int) -> str:
        return self.server.shards[shard].key

    def generation(self, shard: int) -> int:
        return self.server.generations[shard]

    def start_retire(self, shard: int, generation: int) -> Any:
        server = self.server
        actor = self.replaced.get((shard, generation))
        if actor is None:
            actor = server.shards[shard]
        try:
            return actor.retire(generation + 1, server.wire_secret)
        except Exception as err:  # noqa: BLE001 - a lost actor's handle raises at once
            return Done(error=err)

    def portable(self, first: int = 0, stop: int | None = None) -> ParameterServer:
        if first == 0 and stop in (None, self.server.n_shards):
            return self.server.portable()
        return self.server.subset(first, stop).portable()

    def versions(self, timeout: float) -> list[int]:
        return self.server.versions(timeout)

    def pull(self, timeout: float) -> tuple[np.ndarray, list[int]]:
        values, versions = self.server.pull(timeout, model=True)
        return (values if self.plan is None else self.plan.unpack(values)), versions

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        return self.server.shard_status(shard, timeout)

    def lost_shards(self, timeout: float) -> list[int]:
        return self.server.lost_shards(timeout)

    def request_stop(self, timeout: float) -> None:
        self.stopped = True
        self.server.request_stop(timeout)

    def release_warmstart(self, timeout: float) -> None:
        self.server.release_warmstart(timeout)

    def export_state(self, timeout: float) -> list[dict[str, Any]]:
        return self.server.export_state(timeout)

    def replace_shard(
        self, shard: int, values: np.ndarray, worker: str, state: dict[str, Any], timeout: float
    ) -> Future:
        restore = {**state, "stopped": self.stopped}
        generation = self.server.generations[shard]
        self.replaced[(shard, generation)] = self.server.shards[shard]
        if shard < len(self.server.futures):
            self.replaced_futures[(shard, generation)] = self.server.futures[shard]
        return self.server.replace_shard(
            self.client, shard, values, self.rule, worker, restore, timeout
        )

    def shard_events(self, timeout: float) -> list[tuple[float, str, str, dict[str, Any]]]:
        """Every event the shards recorded (wall-clock times), each with the recording shard's
        index in its data (``{"shard": i, ...}``), in time order."""
        found = []
        for i in range(self.server.n_shards):
            try:
                events = self.server.subset(i, i + 1).events(timeout)
            except ShardLostError as err:  # numbered within the one-shard view: renumber it
                raise ShardLostError(f"shard {i}: {err}", i) from err
            for event in events:
                data = event[3] if len(event) > 3 else {}
                found.append((*event[:3], {"shard": i, **(data or {})}))
        return sorted(found, key=lambda e: e[0])
