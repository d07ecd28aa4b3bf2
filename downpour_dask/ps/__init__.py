"""The parameter server: shard actors, the client-side view over them, and how replicas reach them.

``protocol`` (replies, errors, the :class:`~downpour_dask.ps.protocol.ShardChannel` interface)
imports no Dask; ``shard`` is the actor, ``server`` the view the driver holds, ``wire`` (the
replica's side), ``service`` (the shard's side) and ``frames`` the direct connections,
``channel`` one replica's line to one shard over whichever transport reaches it.  Sparse
models' tables: ``table`` (the shard that also owns row ranges) and ``rows`` (their layout, and a
replica's line to such a shard), with their frame kind on the direct connections
(``rows_frames``, ``rows_wire``; ``dispatch`` maps each request to its shard call).  Nothing here
knows of Downpour or Sandblaster.
"""
