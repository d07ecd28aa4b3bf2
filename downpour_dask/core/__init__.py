"""The numpy core: everything the algorithms compute, with no Dask and no I/O.

It owns the flat parameter vector and its named views (:mod:`.params`), the model protocol any
model satisfies (:mod:`.protocol`), the models and their gradients (:mod:`.models` on
:mod:`.model`, the dense passes in :mod:`.dense`, input checks in :mod:`.validation`; JAX models
in :mod:`.jax_model` and :mod:`.jax_nets`, the only modules here that import JAX, reached only
when one is built), the update rules a parameter-server shard applies (:mod:`.optim`), L-BFGS over
sharded vectors (:mod:`.lbfgs`, behind its ``Space`` protocol) and the maths of a model-parallel
MLP (:mod:`.partition`, behind its ``Link`` protocol), and sparse models -- dense parameters plus
tables of which a batch touches few rows (:mod:`.sparse`, :mod:`.sparse_models`, per-row rule
state in :mod:`.rows`, the serial reference loop in :mod:`.sparse_serial`).  Every layer above
builds on these; they are tested in one process, without a cluster.
"""
