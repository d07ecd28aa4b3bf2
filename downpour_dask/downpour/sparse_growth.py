"""A sparse fit that grows with its cluster: a new replica on a worker that joins.

With ``max_replicas``, :func:`~.sparse_fit.fit_sparse` hands :meth:`SparseGrowth.add` to the
dense path's :class:`~.elastic.Elastic`, which hears of workers that join (:mod:`.membership`)
and, while fewer than ``max_replicas`` replicas train, asks for a replica on each.  What is
particular to a sparse fit is the data: each replica reads its own in-memory
:class:`~downpour_dask.core.sparse.SparseBatch` or its own files of ``(paths, HashSpec)``, and
:class:`~.shares.DataShares` gives the newcomer ``1/k`` of what each of the ``k - 1`` training
replicas reads.  Those replicas hear of their smaller share on their worker
(:func:`~.registry.assign_share`) and read it from their next epoch (in memory) or their next
file (streamed), as a dense fit's do; a replica restarted elsewhere takes its share along
(:meth:`~.sparse_replicas.SparseTasks.resume_replica`).  The newcomer trains for what is left
of the others' epochs (or steps) and starts from the shards' current rows: it fetches before
its first step, as every sparse replica does.
"""

from __future__ import annotations

from typing import Any

from .elastic import newcomer_limits, training_replicas
from .shares import DataShares
from .sparse_replicas import SparseTasks


class SparseGrowth:
    """Starts replicas of a sparse fit on workers that join (see the module docstring).

    Parameters
    ----------
    cluster : DaskCluster or a fake
        Tells replicas their new share (``assign_share``).
    server : SparseServer or a fake
        ``shard_status(0, timeout)``: the examples and pushes the fit has made so far.
    replicas : SparseTasks
        The replicas' tasks; a new one is appended.
    data : list
        Each starting replica's data: a SparseBatch or ``(paths, spec)``.
    seed : int
        Seeds the split (:class:`~.shares.DataShares`).
    n_rows : int
        Rows in an epoch of the whole dataset (0 if unknown: streamed files).
    max_epochs, max_steps : int or None
        The fit's limits, per replica.
    n_push : int
        Steps per push.
    timeout : float
        Seconds a shard's answer may take.
    limits : dict, optional
        Filled in here: per added replica, its own ``(max_epochs, max_steps)`` (what the others
        had left), for the function that starts replica tasks to read.  (Given, not made here:
        that function would otherwise refer to this object, which refers to ``replicas``, which
        refers to it -- a reference cycle that would keep the replicas' data on the workers
        until Python's cycle collector ran.)
    """

    def __init__(self, cluster: Any, server: Any, replicas: SparseTasks, data: list[Any],
                 seed: int, n_rows: int, max_epochs: int | None, max_steps: int | None,
                 n_push: int, timeout: float,
                 limits: dict[int, tuple[int | None, int | None]] | None = None):
        self.cluster, self.server, self.replicas = cluster, server, replicas
        self.shares = DataShares(list(data), seed)
        self.n_rows, self.max_epochs, self.max_steps = n_rows, max_epochs, max_steps
        self.n_push, self.timeout = n_push, timeout
        self.limits = {} if limits is None else limits
        replicas.share_of = self.shares.positions

    def limits_of(self, replica: int) -> tuple[int | None, int | None]:
        """``(max_epochs, max_steps)`` of ``replica``: the fit's, or what an added one got."""
        return self.limits.get(replica, (self.max_epochs, self.max_steps))

    def add(self, replica: int, worker: str, n_active: int) -> int | None:
        """:class:`~.elastic.Elastic`'s ``add_replica``: start ``replica`` on ``worker`` with a
        fair share among ``n_active`` replicas; its rows per epoch, or None (nothing started)
        when no training replica has data to give (each reads a single file)."""
        tasks = self.replicas
        if replica != len(tasks.tasks):
            raise ValueError(f"replica {replica} cannot be added: the next is {len(tasks.tasks)}")
        split = self.shares.add(replica, training_replicas(tasks))
        if split is None:
            return None
        new, changed = split
        for r, positions in changed.items():  # they read less from their next epoch (or file)
            self.cluster.assign_share(tasks.workers[r], r, positions)
        self.limits[replica] = newcomer_limits(
            self.server.shard_status(0, self.timeout), self.n_rows, self.n_push, n_active,
            self.max_epochs, self.max_steps)
        tasks.add_replica(new, worker)
        return self.shares.rows(replica)
