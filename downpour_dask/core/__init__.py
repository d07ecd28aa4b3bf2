"""The numpy core: everything the algorithms compute, with no Dask and no I/O.

It owns the flat parameter vector and its named views (:mod:`.params`), the model protocol any
model satisfies (:mod:`.protocol`), the models and their gradients (:mod:`.models` on
:mod:`.model`, the dense passes in :mod:`.dense`, input checks in :mod:`.validation`; JAX models
in :mod:`.jax_model` and :mod:`.jax_nets`, the only modules here that import JAX, reached only
when one is built), the update rules a parameter-server shard applies (:mod:`.optim`), L-BFGS over
sharded vectors (:mod:`.lbfgs`, behind its ``Space`` protocol) and the maths of a model-parallel
MLP (:mod:`.partition`, behind its ``Link`` protocol).  Every layer above builds on these; they
are tested in one process, without a cluster.
"""
