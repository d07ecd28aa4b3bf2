"""Downpour SGD: the estimator, the driver and its collaborators, and the replica loop.

Read it top down: ``estimator`` (arguments, ``fit``) builds ``settings`` for the ``driver``, which
places the data, starts the shards and the replicas' ``tasks`` and runs the ``supervision`` loop;
the ``supervisor`` notices failures and restarts replicas or has ``shard_recovery`` bring a shard
back; ``checkpoints`` keeps the shards' state.  The driver reaches Dask only through the
``protocols`` that ``dask_cluster`` implements, so it is unit-tested with fakes.  On the workers,
``replica`` runs ``replica_loop`` (with ``pushes``' bookkeeping) over one
:class:`~downpour_dask.ps.protocol.ShardChannel` per shard, and leaves what must outlive it in
``registry``; ``model_parallel`` runs a replica split into partitions.
"""
