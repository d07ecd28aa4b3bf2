"""Downpour SGD: the estimator, the driver and its collaborators, and the replica loop.

Read it top down: ``estimator`` (arguments, ``fit``) builds ``settings`` for the ``driver``, which
places the data, starts the shards and the replicas' ``tasks`` and runs the ``supervision`` loop;
the ``supervisor`` notices failures and restarts replicas or has ``shard_recovery`` bring a shard
back; ``elastic`` follows workers that join and leave (heard through ``membership``'s Dask
plugins; ``shares`` re-splits the data for a joined replica, ``replica_count`` resolves
``n_replicas="auto"``); ``divergence`` checks the result; ``checkpoints`` keeps the shards'
state; a fit that fails lets its replicas end first (``wind_down``).  The driver reaches Dask
only through the ``protocols`` that ``dask_cluster`` implements, so it is unit-tested with
fakes.  On the workers,
``replica`` runs ``replica_loop`` (with ``pushes``' bookkeeping; ``clocked_loop`` for SSP/BSP,
``easgd_loop`` for EASGD; its settings in ``config``) over one
:class:`~downpour_dask.ps.protocol.ShardChannel` per shard, and leaves what must outlive it in
``registry`` (handed to the driver through an ``outbox``: each item once, even when an answer
comes late); ``model_parallel`` runs a replica split into partitions, whose messages travel
over ``partition_wire``'s direct sockets.  Sparse models (tables
of which a batch touches few rows): ``sparse_fit`` starts table shards and replica tasks
(``sparse_task``) running ``sparse_loop`` (``sparse_accrual`` for ``n_fetch``/``n_push`` other
than 1), has the ``supervisor`` restart a replica whose worker died (``sparse_replicas``: its
task, its data, its records), ``sparse_checkpoints`` writes incremental checkpoints of the tables,
``sparse_recovery`` gives a sparse fit's shards to ``shard_recovery`` (a lost table shard comes
back on a surviving worker), ``sparse_eval`` scores held-out data pulling only the rows it
touches, ``sparse_monitor`` runs that schedule and publishes the run for ``live.attach``, and
``sparse_estimator`` wraps ``fit_sparse`` as a scikit-learn classifier.

The events of a run (``experiment_.events``; each event's ``data`` in braces): ``start``
{n_replicas, n_shards, n_workers}, ``resumed`` {path, versions, elapsed}, ``warmstart_done``
{steps}, ``replica_failed`` {replica, reason, and partition with model parallelism},
``replica_restarted`` {replica, workers, step}, ``shard_lost`` {shard, worker, reason,
generation}, ``shard_restored`` {shard, worker, source, version, lost_updates, generation,
fenced, acknowledged}, ``shard_fenced`` {shard, generation, version, lost_updates},
``replica_added`` {replica, worker, rows}, ``replica_retired`` {replica, worker, steps,
moved_to}, ``shard_migrated`` {shard, from_worker, worker, version, generation, lost_updates}
(:mod:`.elastic`),
``checkpoint`` {versions}, ``stop_requested`` {max_seconds}, ``stop`` {versions}; and the
shards' own events ({shard, ...}): ``gradient_refused`` {replica, non_finite, reason},
``stop_refused`` ..., and with ``transport="one-sided"`` (:mod:`downpour_dask.ps.one_sided`)
``torn_push`` {replica, seq}, ``one_sided_revoked`` {} and ``one_sided_refused`` {replica}.
"""
