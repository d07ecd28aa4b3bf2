"""A worker's JAX computes in as many threads as the worker has, as its BLAS does.

Dask's nanny starts every worker with ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and
``OPENBLAS_NUM_THREADS`` at 1: a worker's parallelism is its own threads, and a library that
also spread each call over every core would oversubscribe the machine.  XLA ignores those
variables.  Its CPU client sizes its thread pools (the intra-op pool that runs compiled code,
the ``tf_XLAEigen`` threads) by the cores the process may run on, unless ``PJRT_NPROC`` names
a number (XLA's ``DefaultThreadPoolSize``).  On a 2-core machine with two single-threaded
workers, a small JAX model's steps then took many times their single-thread time, for seconds
at a time, while the pool threads spun, and CPU-bound ones used 1.7 cores for 1.6 times the
speed of one: ``bench_models.py`` in ``benchmarks/README.md`` measures both.

So a task that computes a model on a worker calls :func:`size_xla_pools` first: it sets
``PJRT_NPROC`` to the worker's thread count in that process, before JAX creates its CPU client
there (the pools are sized once, when the client is created).  It leaves alone a
``PJRT_NPROC`` that is set already (by the user, or the cluster's
``distributed.nanny.pre-spawn-environ``), and is too late, and harmless, in a process where JAX
already computed.  With ``n`` threads the pools have ``n`` threads, so ``n`` replicas in one
worker still compute at once.
"""

from __future__ import annotations

import os

from distributed import get_worker

#: XLA's variable for the size of its CPU client's thread pools.
VARIABLE = "PJRT_NPROC"


def size_xla_pools() -> str | None:
    """In a Dask worker, have XLA size its thread pools to the worker's threads; returns the
    value of ``PJRT_NPROC`` in this process afterwards (None outside a worker, where nothing
    is changed: the driver's process is the user's)."""
    try:
        threads = get_worker().state.nthreads
    except ValueError:  # not in a worker
        return None
    return os.environ.setdefault(VARIABLE, str(max(1, int(threads))))
