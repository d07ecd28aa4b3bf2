"""Bringing back a parameter-server shard that was lost -- and never letting the copy it
replaces serve again.

Dask never recreates an actor lost with its worker, so :class:`ShardRecovery` does: it starts
the shard's next *incarnation* (generation) on the least-loaded surviving worker and announces
it; running replicas switch to it without restarting.  A shard that stops answering is not
necessarily dead (its worker may be stopped, or slow), so before the replacement serves, the
old incarnation is **retired** (fenced) wherever it can still be reached: it then refuses every
call, leaves the direct-connection service and reports what it had acknowledged.

- Reached within :data:`FENCE_WAIT` seconds: the replacement starts from the retired shard's
  own final state, and no update is lost.
- Not reached (a dead or stopped worker): the replacement starts from the freshest state the
  driver has -- the last checkpoint (values and update-rule state) or, when fresher, the newest
  copy of the shard's values a replica fetched.  The retirement is retried on every supervision
  step (a stopped worker may come back), and the replicas refuse the old incarnation's replies
  anyway: every reply names its generation and they learn of the new one before using it.

**Accounting.**  Updates lost = updates the old incarnation acknowledged minus those the
restored state contains, from the shards' own counters: the retired shard's version when it
was reached (exact), else the newest version any replica saw it acknowledge (kept on the
workers, :func:`~.registry.acked_version`), at least what the driver's polls saw.  A fence
that lands later corrects the count (``shard_fenced`` event); :meth:`ShardRecovery.settle` at
the end of the fit fixes the final figures (``incarnations``, per shard ``lost_updates``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..base import RunRecorder
from ..ps.protocol import SHARD_ERRORS, ShardLostError
from .checkpoints import Checkpoints
from .protocols import Cluster, Server

#: Seconds a shard may take to answer the probe that tells whether it is lost.
PROBE_TIMEOUT = 10.0
#: Seconds the retirement of a lost shard's incarnation is waited for before its replacement
#: starts from other state (a dead worker's actor call may hang rather than fail).
FENCE_WAIT = 2.0
#: Workers a replacement is tried on before the run fails.
MAX_PLACEMENTS = 3


@dataclass
class Retired:
    """One replaced incarnation of a shard, and what is known of what it acknowledged."""

    shard: int
    generation: int  # the replaced incarnation's
    worker: str
    restored_from: int  # the version its replacement started from
    acknowledged: int  # the newest version it is known to have acknowledged
    fenced: bool = False  # whether it was reached and retired (then ``acknowledged`` is exact)
    final_version: int | None = None  # its version when last asked (after the fit: settle)
    lost_updates: int = 0

    def account(self) -> int:
        """Recount the updates lost with this incarnation (and keep the count)."""
        self.lost_updates = max(0, self.acknowledged - self.restored_from)
        return self.lost_updates


class ShardRecovery:
    """Restores lost shards of ``server`` on ``cluster``, fencing the incarnations they replace,
    and records ``shard_lost`` / ``shard_restored`` / ``shard_fenced`` events.

    ``on_replaced`` is called after a shard was replaced (a published run re-publishes itself,
    so that attached views follow).  ``reported_acks(shard, generation)`` is the newest version
    that incarnation acknowledged according to the replica results the driver already holds: a
    replica that finished on the lost shard's worker took its worker-side record along, but its
    result says what it saw.
    """

    def __init__(
        self,
        cluster: Cluster,
        server: Server,
        checkpoints: Checkpoints,
        recorder: RunRecorder,
        timeout: float,
        on_replaced: Callable[[], None] | None = None,
        reported_acks: Callable[[int, int], int] | None = None,
    ):
        self.cluster, self.server, self.checkpoints = cluster, server, checkpoints
        self.recorder, self.timeout, self.on_replaced = recorder, timeout, on_replaced
        self.reported_acks = reported_acks
        #: Every replaced incarnation, in order.
        self.retired: list[Retired] = []
        self._fences: dict[int, Any] = {}  # index in ``retired`` -> its retirement in flight

    def recover_lost(self, error: BaseException) -> None:
        """After a failed shard call, find which shard(s) are lost and restore them; re-raise
        ``error`` if every shard answers (it was not a lost shard)."""
        alive = self.cluster.workers()
        if isinstance(error, ShardLostError):
            lost = [error.shard]
        else:
            lost = self.server.lost_shards(min(self.timeout, PROBE_TIMEOUT))
        if not lost:
            raise error
        for i in lost:
            self.recover(i, f"{error}", alive)

    def recover(self, shard: int, reason: str, alive: list[str], leaving: bool = False) -> None:
        """Fence ``shard``'s current incarnation and start its next one on a worker of
        ``alive`` other than its own, from the freshest state available.

        ``leaving``: its worker is retiring and still serves (a graceful migration, see
        :mod:`.elastic`); the fence then has the run's ``timeout`` to land and, when it does,
        the one event is ``shard_migrated`` ``{shard, from_worker, worker, version, generation,
        lost_updates}`` (0: the new incarnation starts from the retired one's final state).
        A fence that does not land falls back to the crash path's events below.

        Events: ``shard_lost`` ``{shard, worker, reason, generation}``, then ``shard_restored``
        ``{shard, worker, source, version, lost_updates, generation, fenced, acknowledged}``:
        ``worker`` and ``generation`` the new incarnation's, ``source`` ``"retired_shard"``,
        ``"checkpoint"`` or ``"fetched_copy"``, ``version`` the state's version,
        ``acknowledged`` the newest version the old incarnation is known to have acknowledged,
        ``fenced`` whether it was reached and retired, ``lost_updates`` the difference.
        """
        lost_worker, lost_key = self.server.workers[shard], self.server.shard_key(shard)
        generation = self.server.generation(shard)
        lost = {"shard": shard, "worker": lost_worker, "reason": reason, "generation": generation}
        what = f"shard {shard} generation {generation} on {lost_worker}: {reason}"
        if not leaving:
            self.recorder.event("shard_lost", what, **lost)
        survivors = [w for w in alive if w != lost_worker]
        if not survivors:
            raise RuntimeError(f"shard {shard} was lost and no worker survives to hold it")
        fence = self.server.start_retire(shard, generation)
        final = _outcome(fence, min(self.timeout, PROBE_TIMEOUT) if leaving else FENCE_WAIT)
        if leaving and final is None:  # the migration failed: the crash path from here
            self.recorder.event("shard_lost", what, **lost)
            leaving = False
        if final is not None:
            state, source, where = final["state"], "retired_shard", "its retired incarnation"
            acknowledged = int(final["version"])
        else:
            state, source, where = self._freshest(shard, lost_key, survivors)
            polled = self.checkpoints.known_versions[shard]
            acknowledged = max(polled, self.cluster.acknowledged(shard, lost_key) or 0)
            if self.reported_acks is not None:
                acknowledged = max(acknowledged, self.reported_acks(shard, generation))
        version = int(state["version"])
        record = Retired(shard, generation, lost_worker, version, acknowledged, final is not None)
        record.final_version = None if final is None else acknowledged
        lost_updates = record.account()
        restore = {
            "rule_state": state["rule_state"],
            "version": version,
            "counters": state.get("counters", {}),
            **({"tables": state["tables"]} if "tables" in state else {}),  # a sparse shard's rows
        }
        worker, future = self._start(shard, state["values"], restore, survivors)
        self.retired.append(record)
        if final is None:
            self._fences[len(self.retired) - 1] = fence
        self.cluster.announce_shard(shard, future, generation + 1)
        if self.on_replaced is not None:
            self.on_replaced()
        self.checkpoints.replaced(shard, {**restore, "values": np.array(state["values"])})
        if leaving:
            self.recorder.event(
                "shard_migrated",
                f"shard {shard} generation {generation + 1} moved from {lost_worker} to {worker} "
                f"at version {version}; {lost_updates} updates lost ({reason})",
                shard=shard,
                from_worker=lost_worker,
                worker=worker,
                version=version,
                generation=generation + 1,
                lost_updates=lost_updates,
            )
            return
        fenced = "fenced" if final is not None else "not reachable yet: refused by generation"
        self.recorder.event(
            "shard_restored",
            f"shard {shard} generation {generation + 1} on {worker} from {where} at version "
            f"{version}; {lost_updates} updates lost (old incarnation {fenced})",
            shard=shard,
            worker=worker,
            source=source,
            version=version,
            lost_updates=lost_updates,
            generation=generation + 1,
            fenced=final is not None,
            acknowledged=acknowledged,
        )

    def _freshest(
        self, shard: int, lost_key: str, survivors: list[str]
    ) -> tuple[dict[str, Any], str, str]:
        """The freshest state of ``shard`` the driver can get without the shard: its last
        checkpoint, or a replica's newer fetched copy of the values with the checkpoint's
        update-rule state; with the source's name and a description."""
        saved = self.checkpoints.saved[shard]
        state, source, where = dict(saved), "checkpoint", "checkpoint"
        copies = self.cluster.fetched_copies(shard, lost_key, survivors)
        for holder, copy in copies.items():
            if isinstance(copy, tuple) and copy[0] > int(state["version"]):
                state.update(version=int(copy[0]), values=copy[1])
                source, where = "fetched_copy", f"a replica's copy on {holder}"
        return state, source, where

    def poll_fences(self) -> None:
        """Take in retirements that landed since (a stopped worker came back): the old
        incarnation's exact count replaces the estimate (``shard_fenced`` event ``{shard,
        generation, version, lost_updates}``).  Retirements that failed are started again while
        their worker is in the cluster."""
        alive = None
        for index, call in list(self._fences.items()):
            if not call.done():
                continue
            record = self.retired[index]
            final = _outcome(call, 0.0)
            if final is None:
                alive = self.cluster.workers(fresh=False) if alive is None else alive
                if record.worker in alive:
                    self._fences[index] = self.server.start_retire(record.shard, record.generation)
                else:
                    del self._fences[index]  # its worker is gone: it serves nobody
                continue
            del self._fences[index]
            self._fenced(record, int(final["version"]))

    def _fenced(self, record: Retired, version: int) -> None:
        record.fenced, record.final_version = True, version
        record.acknowledged = max(record.acknowledged, version)
        before = record.lost_updates
        lost = record.account()
        self.recorder.event(
            "shard_fenced",
            f"shard {record.shard} generation {record.generation} retired at version {version}: "
            f"{lost} updates lost (estimated {before} when it was replaced)",
            shard=record.shard,
            generation=record.generation,
            version=version,
            lost_updates=lost,
        )

    def settle(self, wait: float = FENCE_WAIT) -> None:
        """At the end of the fit: the final figures of every replaced incarnation.  Waits
        briefly for retirements still in flight, asks every reachable retired incarnation its
        version once more (it must not have moved past its fence) and takes the newest
        acknowledgements the replicas noted: those in their results, all in hand now (at the
        loss, a worker's answer could come too late to count)."""
        deadline = time.monotonic() + wait
        for index, call in list(self._fences.items()):
            final = _outcome(call, max(0.0, deadline - time.monotonic()))
            if final is not None:
                self._fenced(self.retired[index], int(final["version"]))
        self._fences.clear()
        for record in self.retired:
            if record.fenced:
                again = _outcome(self.server.start_retire(record.shard, record.generation), wait)
                if again is not None:
                    record.final_version = int(again["version"])
            if self.reported_acks is not None:
                reported = self.reported_acks(record.shard, record.generation)
                record.acknowledged = max(record.acknowledged, reported)
            record.account()

    def lost_updates(self, n_shards: int) -> list[int]:
        """Updates lost per shard over the whole fit (every replaced incarnation's)."""
        lost = [0] * n_shards
        for record in self.retired:
            lost[record.shard] += record.lost_updates
        return lost

    def incarnations(self) -> list[dict[str, Any]]:
        """The replaced incarnations' records, JSON-able (the experiment's config keeps them)."""
        return [asdict(record) for record in self.retired]

    def _start(
        self, shard: int, values: Any, restore: dict[str, Any], survivors: list[str]
    ) -> tuple[str, Any]:
        """Start the replacement on the least-loaded survivor; if that worker is gone too (two
        workers dying a moment apart: ``survivors`` was asked before the scheduler noticed the
        second), on the next one, from a list asked afresh."""
        tried: list[str] = []
        lost_worker = self.server.workers[shard]
        while True:
            worker = self._least_loaded(shard, survivors)
            try:
                future = self.server.replace_shard(shard, values, worker, restore, self.timeout)
                return worker, future
            except (*SHARD_ERRORS, RuntimeError) as err:
                tried.append(worker)
                fresh = self.cluster.workers()
                survivors = [w for w in fresh if w != lost_worker and w not in tried]
                if not fresh:  # e.g. cluster.scale(0), or every worker died
                    message = (f"shard {shard} could not be restored: the cluster has no workers "
                               f"left (tried {tried}: {err})")  # fmt: skip
                    raise RuntimeError(message) from err
                if len(tried) >= MAX_PLACEMENTS or not survivors:
                    message = f"shard {shard} could not be restored on {tried}: {err}"
                    raise RuntimeError(message) from err

    def _least_loaded(self, shard: int, survivors: list[str]) -> str:
        """The survivor holding the fewest other shards (ties: the first by address)."""
        load = {w: 0 for w in survivors}
        for j, w in enumerate(self.server.workers):
            if j != shard and w in load:
                load[w] += 1
        return min(survivors, key=lambda w: (load[w], w))


def _outcome(call: Any, wait: float) -> dict[str, Any] | None:
    """The result of a retirement ``call`` within ``wait`` seconds, or None if it failed or
    did not come (an unreachable incarnation)."""
    deadline = time.monotonic() + wait
    while not call.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not call.done():
        return None
    try:
        return call.result(timeout=0.1)
    except Exception:  # noqa: BLE001 - any failure means the same: not fenced (yet)
        return None
