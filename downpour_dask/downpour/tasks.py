"""The replicas' tasks of one fit: one per *slot*, and the mailboxes of model-parallel replicas.

A replica runs as one long task (:func:`~.replica.run_replica`), or, split into P partitions
(:mod:`.model_parallel`), as P tasks -- slots ``(r, 0) .. (r, P-1)`` -- on distinct workers,
which exchange activations through one mailbox actor per partition, on that partition's worker.
:class:`ReplicaTasks` submits them, keeps each slot's task, worker and (once gathered) result,
and moves a replica: :meth:`~ReplicaTasks.stop_replica` lets its old tasks go,
:meth:`~ReplicaTasks.resume_replica` starts them again elsewhere, after the steps it pushed.
Where and when to move one is the supervisor's decision (:mod:`.supervisor`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.partition import PartitionPlan
from ..core.protocol import TrainableModel
from .model_parallel import Mailbox, Peers, run_partition
from .protocols import Cluster, Server, Task
from .replica import ReplicaConfig, run_replica
from .wind_down import WIND_DOWN, wind_down


class ReplicaTasks:
    """The slots of one fit's replicas and their tasks on ``cluster``.

    Parameters
    ----------
    cluster, server : Cluster, Server
        Where tasks run, and the parameter server they train against.
    model : TrainableModel
        The model every replica trains.
    run : str
        The fit's token; task and mailbox keys carry it.
    timeout : float
        Seconds a mailbox may take to start.
    plan : PartitionPlan, optional
        How each replica is split (None: one slot per replica).
    shard_bounds : list of int, optional
        With ``plan``: partition p's shards are ``shard_bounds[p] .. shard_bounds[p+1] - 1``.
    arrays : list of (X, y), optional
        Each replica's in-memory data, scattered again to a replica's new worker when it moves
        (its old copy died with its worker); None for streamed data, which replicas read
        themselves wherever they run.
    """

    def __init__(
        self,
        cluster: Cluster,
        server: Server,
        model: TrainableModel,
        run: str,
        timeout: float,
        plan: PartitionPlan | None = None,
        shard_bounds: list[int] | None = None,
        arrays: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ):
        self.cluster, self.server, self.model = cluster, server, model
        self.run, self.timeout, self.plan = run, timeout, plan
        self.shard_bounds = shard_bounds or [0, len(server.ranges)]
        self.arrays = arrays
        # per replica: its data (references or stream descriptors) and Dask partitions
        self.data: dict[int, Any] = {}
        self.parts: dict[int, Any] = {}
        # per slot
        self.slots: list[tuple[int, int]] = []  # (replica, partition)
        self.workers: list[str] = []
        self.configs: list[ReplicaConfig] = []
        self.tasks: list[Task] = []
        self.results: dict[int, dict[str, Any]] = {}  # gathered as each slot finishes
        self.leaving: dict[int, str] = {}  # slots on a leaving worker (.elastic collects them)
        # per model-parallel replica: its partitions' mailbox actors, and where they are
        self.mailboxes: dict[int, list[Task]] = {}
        self.mailbox_workers: dict[int, list[str]] = {}
        self.generation = 0  # one more at each move: keys stay unique
        #: Set by the driver: the part of a replica's data it reads (``DataShares.positions``),
        #: sent to a replica's new worker when it moves.
        self.share_of: Callable[[int], Any] | None = None

    # -- reading ---------------------------------------------------------------------------------
    def slots_of(self, replica: int) -> list[int]:
        """The slot indices of ``replica`` (its partitions, in order)."""
        return [i for i, (r, _) in enumerate(self.slots) if r == replica]

    def all_gathered(self) -> bool:
        """Whether every slot's task finished and its result is in hand."""
        return len(self.results) == len(self.tasks)

    def running(self) -> bool:
        """Whether any task has not ended."""
        return any(not task.done() for task in self.tasks)

    def acked_version(self, shard: int, generation: int) -> int:
        """The newest version generation ``generation`` of ``shard`` acknowledged to a replica
        whose result is in hand (0 if none)."""
        versions = [
            int(result.get("acknowledged", {}).get(str(shard), {}).get(str(generation), (0, 0))[1])
            for result in self.results.values()
        ]
        return max(versions, default=0)

    def ordered_results(self) -> list[dict[str, Any]]:
        """Every slot's result, in slot order (all must be gathered)."""
        return [self.results[i] for i in range(len(self.tasks))]

    def summary(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """What the replicas did, for the experiment's config (JSON-able): steps, pushes lost
        to lost shards, pushes each shard acknowledged to the replicas whose results are in
        (``acknowledged_pushes``: ``{shard: n}``, every generation), how each replica
        (``"r"``, or ``"r.p"`` per partition) reached each of its shards (and over which
        direct connections the arrays went through shared memory) and, with model
        parallelism, what crossed partitions and where each partition ran."""
        split = self.plan is not None
        name = "{replica}.{partition}" if split else "{replica}"
        summary: dict[str, Any] = {
            "replica_steps": [r["steps"] for r in results if r.get("partition", 0) == 0],
            "lost_pushes": sum(r.get("lost_pushes", 0) for r in results),
            "acknowledged_pushes": _acknowledged(results),
            "replica_transports": {name.format(**r): r.get("transports", []) for r in results},
            "replica_shared_memory": {name.format(**r): r.get("shared", []) for r in results},
        }
        if split:
            bounds = self.shard_bounds
            summary["partition_bytes_sent"] = sum(r.get("bytes_sent", 0) for r in results)
            summary["partition_slots"] = [  # where each partition ran, and whom it talked to
                {
                    "replica": r,
                    "partition": p,
                    "worker": worker,
                    "shards": list(range(bounds[p], bounds[p + 1])),
                    "sessions": list(result.get("sessions", [])),
                    "steps": result.get("steps", 0),  # its thread's CPU, its waits for peers
                    "cpu_seconds": result.get("cpu_seconds", 0.0),
                    "waited_seconds": result.get("waited_seconds", 0.0),
                    # how it reached each peer: "wire" (direct socket) or "actor"
                    "peers": dict(result.get("partition_transports", {})),
                }
                for (r, p), worker, result in zip(self.slots, self.workers, results)
            ]
        return summary

    # -- starting --------------------------------------------------------------------------------
    def start_replica(
        self, replica: int, workers: list[str], data: Any, parts: Any, configs: list[ReplicaConfig]
    ) -> None:
        """Start ``replica``: partition p (``configs[p]``) on ``workers[p]``, reading ``data``
        (``(X, y)`` references or a stream description) and its Dask ``parts``."""
        self.data[replica], self.parts[replica] = data, parts
        if self.plan is not None:
            self._open_mailboxes(replica, workers, configs[0])
        for config, worker in zip(configs, workers):
            self.slots.append((replica, config.partition))
            self.workers.append(worker)
            self.configs.append(config)
            self.tasks.append(self._submit(len(self.tasks)))

    def _submit(self, i: int, start_step: int | None = None) -> Task:
        """Submit slot ``i``'s loop on its worker (from ``start_step``, if given)."""
        r, p = self.slots[i]
        config = self.configs[i]
        if start_step is not None:
            config = dataclasses.replace(config, start_step=start_step)
        suffix = f"{self.run}-{self.generation}"
        if self.plan is None:
            return self.cluster.submit(
                run_replica,
                self.server.portable(),
                self.model,
                self.data[r],
                config,
                self.parts[r],
                worker=self.workers[i],
                key=f"replica-{r}-{suffix}",
            )
        peers = Peers([(m.key, w) for m, w in zip(self.mailboxes[r], self.mailbox_workers[r])])
        return self.cluster.submit(
            run_partition,
            self.server.portable(self.shard_bounds[p], self.shard_bounds[p + 1]),  # its own
            self.model,
            self.plan.partitions,
            peers,
            self.data[r],
            config,
            self.parts[r],
            worker=self.workers[i],  # its mailbox is there
            key=f"replica-{r}-partition-{p}-{suffix}",
        )

    # -- moving ----------------------------------------------------------------------------------
    def stop_replica(self, replica: int, reason: str) -> None:
        """Let ``replica``'s tasks go (and their results), and make partitions that still run
        give up: they would wait for a peer that is gone."""
        for i in self.slots_of(replica):
            self.tasks[i].cancel()
            self.results.pop(i, None)
        self.close_mailboxes(replica, reason)

    def resume_replica(self, replica: int, workers: list[str], start_step: int) -> None:
        """Start ``replica``'s partitions again, partition p on ``workers[p]``, skipping the
        first ``start_step`` steps; in-memory data is scattered to ``workers[0]`` afresh."""
        self.generation += 1
        share = None if self.share_of is None else self.share_of(replica)
        if share is not None:  # its part of its data, since a replica joined (.shares)
            self.cluster.assign_share(workers[0], replica, share)
        if self.arrays is not None:
            self.data[replica] = tuple(self.cluster.scatter(list(self.arrays[replica]), workers[0]))
        if self.plan is not None:
            self._open_mailboxes(replica, workers, self.configs[self.slots_of(replica)[0]])
        for i, worker in zip(self.slots_of(replica), workers):
            self.workers[i] = worker
            self.tasks[i] = self._submit(i, start_step)

    def end(self, request_stop: Callable[[], Any], wait: float = WIND_DOWN) -> None:
        """At the end of a fit, let every task go (:meth:`cancel_all`); if some still run (the
        fit failed), only once they ended or ``wait`` seconds passed after ``request_stop()``
        (:func:`~.wind_down.wind_down`: why)."""
        try:
            wind_down(self.tasks, request_stop, wait)
        finally:
            self.cancel_all()

    def cancel_all(self) -> None:
        """At the end of a fit: forget every task, close every mailbox."""
        for task in self.tasks:
            task.cancel()
        for r in list(self.mailboxes):
            self.close_mailboxes(r, "the run ended")

    # -- mailboxes -------------------------------------------------------------------------------
    def _open_mailboxes(self, replica: int, workers: list[str], config: ReplicaConfig) -> None:
        """Create the mailbox actors of ``replica``'s partitions, partition p's on
        ``workers[p]``, and wait until they exist.  They take direct connections carrying
        the run's wire secret, and messages up to the largest a batch of ``config`` makes."""
        assert self.plan is not None
        model = self.plan.model
        limit = config.batch_size * max(*model.hidden, model.n_outputs)
        args = (config.wire_secret, self.plan.partitions, limit)
        boxes = [
            self.cluster.start_actor(
                Mailbox, worker, *args, key=f"mailbox-{replica}-{p}-{self.run}-{self.generation}"
            )
            for p, worker in enumerate(workers)
        ]
        try:
            for box in boxes:
                box.result(timeout=self.timeout)
        except BaseException:  # a worker that does not start its mailbox: let the others go
            for box in boxes:
                box.cancel()
            raise
        self.mailboxes[replica], self.mailbox_workers[replica] = boxes, list(workers)

    def close_mailboxes(self, replica: int, reason: str) -> None:
        """Make ``replica``'s partitions that still run give up, and let its mailboxes go.

        They are cancelled, not just dropped: the actor handle a close call goes through sits
        in reference cycles of Dask's making (see ``runtime/dask_internals.release_hold``)
        and would keep its mailbox alive on the worker until Python's cycle collector ran."""
        boxes, calls = self.mailboxes.pop(replica, []), []
        for box in boxes:
            with contextlib.suppress(Exception):  # a mailbox lost with its worker: nothing to do
                if box.status == "finished":
                    calls.append(box.result(timeout=1).close(reason))
        for call in calls:
            with contextlib.suppress(Exception):
                call.result(timeout=5)
        for box in boxes:
            with contextlib.suppress(Exception):
                box.cancel()
        self.mailbox_workers.pop(replica, None)


def _acknowledged(results: list[dict[str, Any]]) -> dict[str, int]:
    """Pushes each shard accepted, by the replicas' own count, summed over replicas and
    generations (a replica whose worker died takes its count along)."""
    total: dict[str, int] = {}
    for result in results:
        for shard, by_generation in result.get("acknowledged", {}).items():
            total[shard] = total.get(shard, 0) + sum(n for n, _ in by_generation.values())
    return total
