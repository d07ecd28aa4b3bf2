"""Shard recovery for sparse fits: the dense path's :class:`~.shard_recovery.ShardRecovery`
over the shards of :func:`~.sparse_fit.fit_sparse`.

:class:`ShardRecovery` decides everything -- fence the lost incarnation (within ``FENCE_WAIT``;
then the replacement starts from its exact final state, rows included), else restore from the
freshest state the driver has, start the next generation on the least-loaded survivor, announce
it (the dense path's ``distributed.Variable`` per shard, through
:class:`~.dask_cluster.DaskCluster`), and log ``shard_lost`` / ``shard_restored`` /
``shard_fenced``.  This module only gives it the sparse shards through the small interfaces it
expects:

- :class:`SparseServer` -- the actors of the fit by shard, their generations, retiring one,
  probing which are lost and starting a replacement :class:`~downpour_dask.ps.table.SparseShard`
  (with its table rows); also what the dense path's :class:`~.supervisor.Supervisor` asks of a
  server (a shard's counters, the stop flag), since it supervises the sparse replicas too;
- :class:`SparseSaved` -- the freshest saved state of a shard: the fit's incremental checkpoints
  replayed (:func:`~.sparse_checkpoints.read_sparse`), else the state the fit started from.

:func:`~downpour_dask.ps.replacement_lookups.await_replacement` is the replica's half: after a
lost shard it waits for the announced next generation.  :func:`supervise` is the driver's loop
while the replicas run.
:func:`settle_acknowledged` makes the lost-update count exact at the end: the
newest version each replaced incarnation acknowledged according to every replica's push records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..ps.calls import Done
from ..ps.rows import SparseLayout
from ..ps.table import SparseShard
from ..runtime.dask_internals import release_hold
from .elastic import Elastic
from .shard_recovery import ShardRecovery
from .sparse_checkpoints import PREFIX, read_sparse, restore_arguments
from .sparse_replicas import SparseTasks
from .supervisor import Supervisor


class SparseServer:
    """The sparse fit's shards as :class:`ShardRecovery` sees a server (see the module
    docstring); ``fit`` is the :class:`~.sparse_fit.SparseFit`, whose ``actors``, ``futures``
    and ``workers`` follow the replacements."""

    def __init__(self, fit: Any, rule: Any, secret: bytes):
        self.fit, self.rule, self.secret = fit, rule, secret
        self.generations = [0] * fit.layout.n_shards
        #: Actors of replaced incarnations by (shard, generation): to retire them again.
        self.replaced: dict[tuple[int, int], Any] = {}
        self.replaced_futures: dict[tuple[int, int], Any] = {}

    @property
    def workers(self) -> list[str]:
        return self.fit.workers

    def shard_key(self, shard: int) -> str:
        return self.fit.actors[shard].key

    def generation(self, shard: int) -> int:
        return self.generations[shard]

    def start_retire(self, shard: int, generation: int) -> Any:
        actor = self.replaced.get((shard, generation), self.fit.actors[shard])
        try:
            return actor.retire(generation + 1, self.secret)
        except Exception as err:  # noqa: BLE001 - a lost actor's handle may raise at once
            return Done(error=err)

    def release_replaced(self, shard: int, generation: int) -> None:
        """Let go of incarnation ``generation`` of ``shard`` (migrated: fenced, its final state
        taken), so that its worker holds no actor of the fit and Dask can retire it.  Its handle
        stays in ``replaced``: a later retire of that generation then fails, as for a lost
        shard, rather than reach the current incarnation."""
        for held in (self.replaced_futures.pop((shard, generation), None),
                     self.replaced.get((shard, generation))):
            if held is not None:
                release_hold(held)

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        """Shard ``shard``'s counters (the supervisor reads ``accepted_by_replica``)."""
        return self.fit.actors[shard].status().result(timeout=timeout)

    def request_stop(self, timeout: float) -> None:
        """Raise every shard's stop flag (with the fit's secret); a lost shard is skipped."""
        calls = []
        for actor in self.fit.actors:
            with contextlib.suppress(Exception):
                calls.append(actor.request_stop(self.secret, "driver"))
        for call in calls:
            with contextlib.suppress(Exception):
                call.result(timeout=timeout)

    def recent_pushes(self, replica: int, timeout: float) -> list[list[dict[str, Any]]]:
        """Per shard, the pushes of ``replica`` it remembers (none from a lost shard)."""
        out = []
        for actor in self.fit.actors:
            try:
                out.append(actor.recent_pushes(replica).result(timeout=timeout))
            except Exception:  # noqa: BLE001 - a lost shard remembers nothing
                out.append([])
        return out

    def lost_shards(self, timeout: float) -> list[int]:
        calls = []
        for actor in self.fit.actors:
            try:
                calls.append(actor.current_version())
            except Exception as err:  # noqa: BLE001 - a lost actor's handle raises at once
                calls.append(Done(error=err))
        lost = []
        for s, call in enumerate(calls):
            try:
                call.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - no answer in time is what "lost" means here
                lost.append(s)
        return lost

    def replace_shard(self, shard: int, values: np.ndarray, worker: str,
                      state: dict[str, Any], timeout: float) -> Any:
        """Start generation ``generation(shard) + 1`` of ``shard`` on ``worker`` from ``values``
        and ``state`` (``rule_state``, ``version``, ``counters``, ``tables``)."""
        fit, layout = self.fit, self.fit.layout
        lo, hi = layout.dense[shard]
        generation = self.generations[shard] + 1
        future = fit.client.submit(
            SparseShard, shard, lo, hi, np.asarray(values), self.rule,
            tables=layout.shard_tables(shard), seed=fit.seed, wire_secret=self.secret,
            restore=state, generation=generation, actor=True, workers=[worker],
            allow_other_workers=False, pure=False)
        actor = future.result(timeout=timeout)
        self.replaced[(shard, generation - 1)] = fit.actors[shard]
        self.replaced_futures[(shard, generation - 1)] = fit.futures[shard]
        fit.futures[shard], fit.actors[shard], fit.workers[shard] = future, actor, worker
        self.generations[shard] = generation
        return future


class _States:
    """``saved[shard]``: the freshest of the fit's checkpoint and the state it started from."""

    def __init__(self, owner: SparseSaved):
        self.owner = owner

    def __getitem__(self, shard: int) -> dict[str, Any]:
        return self.owner.state(shard)


class SparseSaved:
    """What :class:`ShardRecovery` asks of checkpoints, for a sparse fit: ``saved[shard]``,
    ``known_versions`` and ``replaced`` (see the module docstring)."""

    def __init__(self, layout: SparseLayout, initial: list[dict[str, Any]],
                 checkpoint_dir: str | Path | None):
        self.layout, self.initial, self.root = layout, initial, checkpoint_dir
        self.known_versions = [int(s["version"]) for s in initial]
        self.saved = _States(self)

    def state(self, shard: int) -> dict[str, Any]:
        """Shard ``shard``'s freshest saved state: ``values``, ``rule_state``, ``version``,
        ``tables`` (every saved row; the shard keeps those in its range) and, from a
        checkpoint, ``counters`` (the pushes it had accepted per replica then)."""
        best = self.initial[shard]
        if self.root is not None and any(Path(self.root).glob(f"{PREFIX}*/manifest.json")):
            saved = read_sparse(self.root)
            versions = saved["versions"]
            mine = restore_arguments(saved, self.layout)[shard]
            version = versions[shard] if len(versions) == self.layout.n_shards else max(versions)
            if version >= int(best["version"]):
                best = {"values": mine["values"], "rule_state": mine["restore"]["rule_state"],
                        "version": int(version), "tables": mine["restore"]["tables"]}
                accepted = saved.get("accepted_by_replica")
                if accepted is not None and len(accepted) == self.layout.n_shards:
                    best["counters"] = {"accepted_by_replica": accepted[shard]}
        return best

    def replaced(self, shard: int, state: dict[str, Any]) -> None:
        """A replacement started from ``state``: a later loss restores at least that."""
        self.initial[shard] = state
        self.known_versions[shard] = int(state["version"])


#: Seconds between the driver's looks at the cluster while the replicas run.
SUPERVISE_EVERY = 0.25


def supervise(supervisor: Supervisor, replicas: SparseTasks, fit: Any,
              recovery: ShardRecovery, checkpoint_dir: str | Path | None,
              checkpoint_every: float, tick: Callable[[], None] = lambda: None,
              elastic: Elastic | None = None) -> None:
    """Until every replica's result is in hand: let ``supervisor`` (the dense path's) restore
    every shard whose worker left the cluster on a surviving worker and restart every replica
    whose worker died (``replica_failed`` / ``replica_restarted``), collect the replicas'
    records (:class:`~.sparse_replicas.SparseTasks`), and write an increment every
    ``checkpoint_every`` seconds (with ``checkpoint_dir``), restoring a shard that does not
    answer the checkpoint's call.  ``tick`` is called every round (the fit's progress
    callback: what it raises ends the fit).  With ``elastic``, a worker that starts leaving
    (retired, scaled down, closing) first has its shards migrated to staying workers from their
    exact final state and is then let go; its replicas pause there and take the crash path
    once it is gone."""
    due = time.monotonic() + checkpoint_every
    while True:
        if elastic is not None:
            elastic.check()
        supervisor.check()
        if replicas.all_gathered():
            return
        replicas.collect()
        tick()
        if checkpoint_dir is not None and time.monotonic() >= due:
            due = time.monotonic() + checkpoint_every
            try:
                fit.checkpoint(checkpoint_dir)
            except Exception as err:  # noqa: BLE001 - recover_lost re-raises what is not a loss
                recovery.recover_lost(err)
        time.sleep(SUPERVISE_EVERY)


def settle_acknowledged(recovery: ShardRecovery, pushes: pd.DataFrame) -> None:
    """Raise each replaced incarnation's ``acknowledged`` to the newest version the replicas
    recorded it acknowledging (accepted pushes of that shard and generation), and recount."""
    for record in recovery.retired:
        if len(pushes) and "generation" in pushes:
            mine = pushes[(pushes["shard"] == record.shard)
                          & (pushes["generation"] == record.generation) & pushes["accepted"]]
            if len(mine):
                record.acknowledged = max(record.acknowledged, int(mine["version"].max()))
        record.account()
