"""How a Downpour run survives failures: replica restarts, shard recovery, checkpoints.

:class:`Recovery` is the part of the driver (``downpour._Run``) that keeps a run going when
workers die.  Dask re-runs tasks of a dead worker but never brings back an actor, so:

* a **replica** whose worker died (``KilledWorker``, a cancelled or lost task, its worker gone)
  is resubmitted on the least-loaded surviving worker, with its in-memory data re-scattered from
  the driver's copy, continuing after the steps it had pushed; a replica that raised an error of
  its own (a data error, a bug) still ends the run with that error;
* a lost **shard** is recreated on a surviving worker from the freshest state available: the last
  checkpoint (values and update-rule state) or, when fresher, the newest copy of its values a
  replica fetched; replicas find the replacement in a per-run ``distributed.Variable`` and switch
  to it without restarting;
* every ``checkpoint_every`` seconds every shard's state is copied to the driver and, with a
  ``checkpoint_dir``, written atomically (:mod:`downpour_dask.checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import numpy as np
from distributed import Future, KilledWorker, Variable

from . import live
from .checkpoint import ShardState, write_checkpoint
from .data import ShardedDataset
from .replica import (
    SHARD_ERRORS,
    ReplicaConfig,
    drain_rows,
    fetched_copy,
    forget_run,
    run_replica,
    shard_variable,
)
from .server import ShardLostError, cluster_workers

#: How often the driver restarts replicas whose worker died before it gives up on the run.
MAX_REPLICA_RESTARTS = 10


class Recovery:
    """Failure handling and checkpoints of a Downpour driver (mixed into ``downpour._Run``).

    It relies on the driver's ``est``, ``client``, ``server``, ``rule``, ``token``, ``subsets``,
    ``placements``, ``futures``, ``evals``, ``events``, ``t0`` and its ``_event`` method.
    """

    def _start_supervision(self, initial: np.ndarray, restore: list[dict] | None) -> None:
        """Publish each shard's actor future (replicas find replacements there) and keep the
        starting state as the first in-memory checkpoint."""
        self.configs: list[ReplicaConfig] = []
        self.variables = []
        for i, future in enumerate(self.server.futures):
            variable = Variable(shard_variable(self.token, i), client=self.client)
            variable.set(future)
            self.variables.append(variable)
        self.saved = []
        for i, (lo, hi) in enumerate(self.server.ranges):
            state = (
                restore[i]
                if restore is not None
                else {"rule_state": self.rule.init(hi - lo), "version": 0, "counters": {}}
            )
            self.saved.append({**state, "values": initial[lo:hi].copy()})
        self.known_versions = [int(s["version"]) for s in self.saved]
        self.last_checkpoint = self.last_collect = time.time()

    def _end_supervision(self) -> None:
        with contextlib.suppress(Exception):
            self.client.run(forget_run, self.token, on_error="ignore")
        for variable in getattr(self, "variables", []):
            with contextlib.suppress(Exception):
                variable.delete()

    def _steps_done(self, restore: list[dict] | None) -> dict[int, int]:
        """Steps each replica had pushed before a resume (from shard 0's counters)."""
        if restore is None:
            return {}
        by_replica = restore[0].get("counters", {}).get("accepted_by_replica", {})
        return {int(r): int(n) * self.est.n_push for r, n in by_replica.items()}

    def _submit(self, r: int, worker: str, data: Any, start_step: int | None = None) -> Future:
        """Submit replica ``r``'s loop on ``worker`` (a restart gets a fresh key)."""
        config = self.configs[r]
        if start_step is not None:
            config = dataclasses.replace(config, start_step=start_step)
        return self.client.submit(
            run_replica,
            self.server,
            self.est.model,
            data,  # (X, y) futures, or the replica's shard descriptors
            config,
            self.placements[r].parts,  # Dask partitions, resolved on the worker holding them
            workers=[worker],
            pure=False,
            key=f"replica-{r}-{self.token}-{self.restarts}",
        )

    def _alive(self) -> list[str]:
        return sorted(cluster_workers(self.client))

    def _check_failures(self) -> None:
        """Restore shards and restart replicas whose workers died; re-raise a replica's own
        error (a data error, a bug) as the run's failure."""
        alive = self._alive()
        gone = [i for i, w in enumerate(self.server.workers) if w not in alive]
        for i in gone:
            self._recover_shard(i, f"worker {self.server.workers[i]} left the cluster", alive)
        for r, f in enumerate(self.futures):
            if f.status == "finished":
                continue
            if f.status == "error":
                error = f.exception(timeout=self.est.timeout)
                if not isinstance(error, KilledWorker):
                    self.server.request_stop(self.est.timeout)
                    raise RuntimeError(f"replica task {f.key} failed: {error!r}") from error
                why = f"{error!r}"
            elif f.status in ("cancelled", "lost"):
                why = f"its task was {f.status}"
            elif self.placements[r].worker not in alive:
                why = f"worker {self.placements[r].worker} left the cluster"
            else:
                continue
            self._restart_replica(r, why, alive)

    def _restart_replica(self, r: int, why: str, alive: list[str]) -> None:
        est = self.est
        self._event("replica_failed", f"replica {r}: {why}")
        if self.restarts >= MAX_REPLICA_RESTARTS:
            self.server.request_stop(est.timeout)
            raise RuntimeError(
                f"replica {r} failed ({why}) after {self.restarts} replica restarts in this run; "
                f"giving up"
            )
        self.restarts += 1
        self.futures[r].cancel()
        load = {w: 0 for w in alive}
        for q, place in enumerate(self.placements):
            if q != r and place.worker in load and self.futures[q].status != "finished":
                load[place.worker] += 1
        worker = min(alive, key=lambda w: (load[w], w in self.server.workers, w))
        data = self.placements[r].data
        if not isinstance(self.subsets, ShardedDataset):  # scattered data died with the worker
            X_r, y_r = self.subsets[r]
            data = tuple(self.client.scatter([X_r, y_r], workers=[worker], hash=False))
        status = self.server.shards[0].status().result(timeout=est.timeout)
        done = int(status["accepted_by_replica"].get(r, 0)) * est.n_push
        self.placements[r] = dataclasses.replace(self.placements[r], worker=worker, data=data)
        self.futures[r] = self._submit(r, worker, data, start_step=done)
        self._event("replica_restarted", f"replica {r} on {worker}, continuing after step {done}")

    def _recover_lost_shards(self, err: BaseException) -> None:
        """After a failed shard call, find which shard(s) are lost and restore them."""
        alive = self._alive()
        if isinstance(err, ShardLostError):
            lost = [err.shard]
        else:
            lost = []
            for i, shard in enumerate(self.server.shards):
                try:
                    shard.current_version().result(timeout=min(self.est.timeout, 10))
                except SHARD_ERRORS:
                    lost.append(i)
        if not lost:
            raise err
        for i in lost:
            self._recover_shard(i, f"{err}", alive)

    def _recover_shard(self, i: int, why: str, alive: list[str]) -> None:
        """Recreate shard ``i`` on a surviving worker from the freshest state available: the
        last checkpoint (values and update-rule state) or, when fresher, the newest copy of its
        values a replica fetched (with the checkpoint's update-rule state)."""
        est, lost_worker = self.est, self.server.workers[i]
        lost_key = self.server.shards[i].key
        self._event("shard_lost", f"shard {i} on {lost_worker}: {why}")
        saved = self.saved[i]
        version, values, source = int(saved["version"]), saved["values"], "checkpoint"
        survivors = [w for w in alive if w != lost_worker]
        if not survivors:
            raise RuntimeError(f"shard {i} was lost and no worker survives to hold it")
        copies = self.client.run(
            fetched_copy, self.token, i, lost_key, workers=survivors, on_error="return"
        )
        for worker, copy in copies.items():
            if isinstance(copy, tuple) and copy[0] > version:
                version, values = int(copy[0]), copy[1]
                source = f"a replica's copy on {worker}"
        self.known_versions[i] = max(self.known_versions[i], version)
        lost_updates = self.known_versions[i] - version
        restore = {
            "rule_state": saved["rule_state"],
            "version": version,
            "counters": saved.get("counters", {}),
            "stopped": self.stop_sent,
        }
        load = {w: 0 for w in survivors}
        for j, w in enumerate(self.server.workers):
            if j != i and w in load:
                load[w] += 1
        worker = min(survivors, key=lambda w: (load[w], w))
        future = self.server.replace_shard(
            self.client, i, values, self.rule, worker, restore, est.timeout
        )
        self.variables[i].set(future)  # replicas waiting in Replica._switch pick it up
        if self.published:  # attached live views must see the new shard, not the lost one
            with contextlib.suppress(Exception):  # best effort: never fail the recovery
                live.publish(
                    self.client, self.publish, self.server, self._live_info(), override=True
                )
        self.saved[i] = {**restore, "values": np.array(values, copy=True)}
        self.known_versions[i] = version
        self._event(
            "shard_restored",
            f"shard {i} on {worker} from {source} at version {version}; "
            f"{lost_updates} updates lost",
        )

    #: Seconds between collections of the replicas' push-log rows.
    COLLECT_EVERY = 0.5

    def _collect_rows(self, force: bool = False) -> None:
        """Take in the push-log rows replicas made since the last collection (every
        :attr:`COLLECT_EVERY` seconds): a worker that dies loses only its newest rows."""
        if not force and time.time() - self.last_collect < self.COLLECT_EVERY:
            return
        self.last_collect = time.time()
        found = self.client.run(drain_rows, self.token, on_error="ignore")
        for rows in found.values():
            self.rows.extend(tuple(row) for row in rows)

    def _maybe_checkpoint(self, force: bool = False) -> None:
        """Every ``checkpoint_every`` seconds: copy every shard's state (kept in memory to
        restore lost shards) and, with a checkpoint directory, write it atomically."""
        est = self.est
        if not force and time.time() - self.last_checkpoint < est.checkpoint_every:
            return
        states = self.server.call_all("export_state", timeout=est.timeout)
        self.last_checkpoint = time.time()
        self.saved = states
        self.known_versions = [
            max(k, int(s["version"])) for k, s in zip(self.known_versions, states)
        ]
        if self.checkpoint_dir is None:
            return
        elapsed = time.time() - self.t0
        shards = [
            ShardState(i, lo, hi, st["values"], st["rule_state"], st["version"], st["counters"])
            for i, ((lo, hi), st) in enumerate(zip(self.server.ranges, states))
        ]
        self._event("checkpoint", f"versions {[s.version for s in shards]}")
        self._collect_rows(force=True)
        meta = {
            "model": est.model.get_config(),
            "pushes": [[_plain(v) for v in row] for row in self.rows],
            "evals": [{k: _plain(v) for k, v in e.items()} for e in self.evals],
            "events": [list(e) for e in self.events],
        }
        write_checkpoint(self.checkpoint_dir, shards, elapsed, meta)


def _plain(value: Any) -> Any:
    """A JSON-friendly scalar (numpy scalars become Python numbers)."""
    return value.item() if isinstance(value, np.generic) else value
