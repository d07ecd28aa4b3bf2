"""How a Downpour run survives failures: replica restarts, shard recovery, checkpoints.

:class:`Recovery` is the part of the driver (``downpour._Run``) that keeps a run going when
workers die.  Dask re-runs tasks of a dead worker but never brings back an actor, so:

* a **replica** whose worker died (``KilledWorker``, a cancelled or lost task, its worker gone)
  is resubmitted on the least-loaded surviving worker, with its in-memory data re-scattered from
  the driver's copy, continuing after the steps it had pushed; a replica that raised an error of
  its own (a data error, a bug) still ends the run with that error.  A model-parallel replica
  runs as one task per partition (a *slot*); losing any of them restarts all of them, on
  distinct workers where possible, after their surviving peers are told to give up;
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
import math
import time
from typing import Any

import numpy as np
from distributed import Future, KilledWorker, Variable

from .. import live
from ..checkpoint import ShardState, write_checkpoint
from ..data.datasets import ShardedDataset
from ..ps.protocol import SHARD_ERRORS, ShardLostError
from ..runtime.cluster import cluster_workers
from .model_parallel import Mailbox, PartitionLost, Peers, run_partition
from .registry import drain_rows, fetched_copy, forget_run, shard_variable
from .replica import ReplicaConfig, run_replica

#: How often the driver restarts replicas whose worker died before it gives up on the run.
MAX_REPLICA_RESTARTS = 10
#: Seconds between the supervision loop's asks for the cluster's worker list.
ALIVE_EVERY = 0.5


class Recovery:
    """Failure handling and checkpoints of a Downpour driver (mixed into ``downpour._Run``).

    It relies on the driver's ``est``, ``client``, ``server``, ``rule``, ``token``, ``subsets``,
    ``placements``, ``plan``, ``futures``, ``evals``, ``events``, ``t0`` and its ``_event``
    method.  ``futures`` has one task per slot: slot ``i`` runs partition ``slots[i][1]`` of
    replica ``slots[i][0]`` on ``slot_workers[i]`` (one slot per replica without partitions).
    """

    def _start_supervision(self, initial: np.ndarray, restore: list[dict] | None) -> None:
        """Publish each shard's actor future (replicas find replacements there) and keep the
        starting state as the first in-memory checkpoint."""
        self.configs: list[ReplicaConfig] = []
        self.slots: list[tuple[int, int]] = []
        self.slot_workers: list[str] = []
        self.results: dict[int, dict] = {}  # slot -> its loop's result, gathered as it finishes
        self._alive_list: list[str] = []
        self._alive_at = -math.inf
        self.mailboxes: dict[int, list[Future]] = {}  # replica -> its partitions' mailboxes
        self.mailbox_workers: dict[int, list[str]] = {}  # ... and where they are
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
        for r in list(self.mailboxes):
            self._close_mailboxes(r, "the run ended")
        with contextlib.suppress(Exception):
            self.client.run(forget_run, self.token, on_error="ignore")
        for variable in getattr(self, "variables", []):
            with contextlib.suppress(Exception):
                variable.delete()

    def _steps_done(self, restore: list[dict] | None) -> dict[int, int]:
        """Steps each replica had pushed before a resume (from shard 0's counters)."""
        if restore is None:
            return {}
        done: dict[int, int] = {}
        for i in self._first_shards():  # a partition's first shard counts its pushes
            by_replica = restore[i].get("counters", {}).get("accepted_by_replica", {})
            for r, n in by_replica.items():
                done[int(r)] = max(done.get(int(r), 0), int(n) * self.est.n_push)
        return done

    def _first_shards(self) -> list[int]:
        """Index of each partition's first shard (shard 0 alone without partitions)."""
        if self.plan is None:
            return [0]
        counts = self.plan.shards_per_partition(self.est.n_shards)
        return [sum(counts[:p]) for p in range(len(counts))]

    def _start_slot(self, r: int, p: int, worker: str, data: Any, config: ReplicaConfig) -> None:
        """Add slot (replica ``r``, partition ``p``) and submit its task on ``worker``."""
        self.slots.append((r, p))
        self.slot_workers.append(worker)
        self.configs.append(config)
        self.futures.append(self._submit(len(self.futures), worker, data))

    def _submit(self, i: int, worker: str, data: Any, start_step: int | None = None) -> Future:
        """Submit slot ``i``'s loop on ``worker`` (a restart gets a fresh key)."""
        r, p = self.slots[i]
        config = self.configs[i]
        if start_step is not None:
            config = dataclasses.replace(config, start_step=start_step)
        parts = self.placements[r].parts  # Dask partitions, resolved on the worker holding them
        if self.plan is None:
            return self.client.submit(
                run_replica,
                self.server.portable(),
                self.est.model,
                data,  # (X, y) futures, or the replica's shard descriptors
                config,
                parts,
                workers=[worker],
                pure=False,
                key=f"replica-{r}-{self.token}-{self.restarts}",
            )
        first = self._first_shards() + [self.server.n_shards]
        return self.client.submit(
            run_partition,
            self.server.subset(first[p], first[p + 1]).portable(),  # only its own shards
            self.est.model,
            self.plan.partitions,
            Peers([(m.key, w) for m, w in zip(self.mailboxes[r], self.mailbox_workers[r])]),
            data,
            config,
            parts,
            workers=[worker],
            allow_other_workers=False,  # its mailbox is there
            pure=False,
            key=f"replica-{r}-partition-{p}-{self.token}-{self.restarts}",
        )

    def _open_mailboxes(self, r: int, workers: list[str]) -> None:
        """Create the mailbox actors of replica ``r``'s partitions, partition p's on
        ``workers[p]``."""
        futures = [
            self.client.submit(
                Mailbox,
                actor=True,
                workers=[worker],
                allow_other_workers=False,
                pure=False,
                key=f"mailbox-{r}-{p}-{self.token}-{self.restarts}",
            )
            for p, worker in enumerate(workers)
        ]
        for future in futures:
            future.result(timeout=self.est.timeout)
        self.mailboxes[r], self.mailbox_workers[r] = futures, list(workers)

    def _close_mailboxes(self, r: int, reason: str) -> None:
        """Make replica ``r``'s partitions that still run give up (their peers are gone), and
        let the mailbox actors go."""
        calls = []
        for future in self.mailboxes.pop(r, []):
            with contextlib.suppress(Exception):
                if future.status == "finished":
                    calls.append(future.result(timeout=1).close(reason))
        for call in calls:
            with contextlib.suppress(Exception):
                call.result(timeout=5)

    def _alive(self, fresh: bool = True) -> list[str]:
        """The cluster's workers; without ``fresh``, a list at most :data:`ALIVE_EVERY` old (the
        supervision loop runs up to every few ms and the list costs a scheduler round trip)."""
        now = time.monotonic()
        if fresh or now - self._alive_at >= ALIVE_EVERY:
            self._alive_list = sorted(cluster_workers(self.client))
            self._alive_at = now
        return self._alive_list

    def _check_failures(self) -> None:
        """Restore shards and restart replicas whose workers died; re-raise a replica's own
        error (a data error, a bug) as the run's failure."""
        # A cached worker list is enough to notice a dead shard within ALIVE_EVERY, but when a
        # replica needs attention the list must be fresh: lost shards are restored *before* a
        # replica is restarted, or the restart would get the dead shard's actor.
        troubled = any(
            i not in self.results and f.status != "pending" for i, f in enumerate(self.futures)
        )
        alive = self._alive(fresh=troubled)
        gone = [i for i, w in enumerate(self.server.workers) if w not in alive]
        for i in gone:
            why = f"worker {self.server.workers[i]} left the cluster"
            self._recover_shard(i, why, self._alive())
        for i, f in enumerate(self.futures):
            r, p = self.slots[i]
            if i in self.results:
                continue
            if f.status == "finished":
                # Gathered now, not at the end: a finished task's result lives on its worker,
                # and a worker that dies before the run ends would take it along.
                try:
                    self.results[i] = f.result(timeout=self.est.timeout)
                    continue
                except Exception as err:  # any way of losing it means the same
                    why = f"its result was lost with its worker ({err!r})"
            elif f.status == "error":
                error = f.exception(timeout=self.est.timeout)
                # A partition whose peer died fails with PartitionLost: restart the replica too.
                if not isinstance(error, (KilledWorker, PartitionLost)):
                    self.server.request_stop(self.est.timeout)
                    raise RuntimeError(f"replica task {f.key} failed: {error!r}") from error
                why = f"{error!r}"
            elif f.status in ("cancelled", "lost"):
                why = f"its task was {f.status}"
            elif self.slot_workers[i] not in alive:
                why = f"worker {self.slot_workers[i]} left the cluster"
            else:
                continue
            if self.plan is not None:
                why = f"partition {p}: {why}"
            self._restart_replica(r, why, self._alive())

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
        slots = [i for i, (q, _) in enumerate(self.slots) if q == r]
        for i in slots:
            self.futures[i].cancel()
            self.results.pop(i, None)
        if self.plan is not None:  # surviving partitions wait for a dead peer: release them
            self._close_mailboxes(r, f"replica {r} is restarted: {why}")
        load = {w: 0 for w in alive}
        for i, (q, _) in enumerate(self.slots):
            worker = self.slot_workers[i]
            if q != r and worker in load and self.futures[i].status != "finished":
                load[worker] += 1
        ranked = sorted(alive, key=lambda w: (load[w], w in self.server.workers, w))
        workers = [ranked[p % len(ranked)] for p in range(len(slots))]  # distinct if possible
        data = self.placements[r].data
        if not isinstance(self.subsets, ShardedDataset):  # scattered data died with the worker
            X_r, y_r = self.subsets[r]
            data = tuple(self.client.scatter([X_r, y_r], workers=[workers[0]], hash=False))
        done = 0  # steps pushed: by the partition furthest ahead (none is pushed twice)
        for shard in self._first_shards():
            status = self.server.shards[shard].status().result(timeout=est.timeout)
            done = max(done, int(status["accepted_by_replica"].get(r, 0)) * est.n_push)
        self.placements[r] = dataclasses.replace(self.placements[r], worker=workers[0], data=data)
        if self.plan is not None:
            self._open_mailboxes(r, workers)
        for i, worker in zip(slots, workers):
            self.slot_workers[i] = worker
            self.futures[i] = self._submit(i, worker, data, start_step=done)
        where = ", ".join(workers)
        self._event("replica_restarted", f"replica {r} on {where}, continuing after step {done}")

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
            "partitions": est.partitions,
            "pushes": [[_plain(v) for v in row] for row in self.rows],
            "evals": [{k: _plain(v) for k, v in e.items()} for e in self.evals],
            "events": [list(e) for e in self.events],
        }
        write_checkpoint(self.checkpoint_dir, shards, elapsed, meta)


def _plain(value: Any) -> Any:
    """A JSON-friendly scalar (numpy scalars become Python numbers)."""
    return value.item() if isinstance(value, np.generic) else value
