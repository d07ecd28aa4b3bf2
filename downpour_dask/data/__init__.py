"""The data layer: every way data reaches the replicas, in plain numpy and pyarrow (no Dask).

It owns the public :mod:`downpour_dask.datasets` module (:mod:`.datasets`: ``load``,
``from_arrays``, ``from_parquet``, ``from_npy``, ``from_csv``, ``from_dask``, ``synthetic``) and
what stands behind it, each module one concept:

* :mod:`.arrays` -- in-memory :class:`Dataset` and its shuffled minibatches;
* :mod:`.schema` -- shard descriptors, the schema they share, the errors that name them;
* :mod:`.scan` -- files' metadata read and checked up front (parquet, npy, csv);
* :mod:`.shards` -- :class:`ShardedDataset`, data that stays where it is;
* :mod:`.dask_collections` -- Dask collections described from their metadata, never changed;
* :mod:`.assignment` -- the one place that splits data among replicas;
* :mod:`.readers` and :mod:`.stream` -- a replica's chunks, shuffle buffer and prefetch thread;
* :mod:`.synthetic` and :mod:`.shipped` -- generated and shipped datasets;
* :mod:`.hashing` -- categorical columns of parquet/CSV hashed to table row ids (sparse models);
* :mod:`.criteo` -- a Criteo-shaped synthetic click log written as parquet files.

What needs a cluster (persisting a collection, placing replicas next to their data) lives in
:mod:`downpour_dask.runtime.placement`.
"""
