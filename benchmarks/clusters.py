"""The local Dask clusters the benchmarks run on, made as the library makes its own.

On an interpreter where Dask's worker profiler can deadlock a worker (CPython before 3.11.9,
see ``downpour_dask/runtime/profiler.py``), a fit's embedded cluster starts its workers without
the profiler; the benchmarks' clusters do the same, so that they measure what a fit runs on and
a benchmark run cannot hang on that bug.  Elsewhere the cluster is Dask's default.
"""

from __future__ import annotations

from typing import Any

from distributed import LocalCluster

from downpour_dask.runtime.profiler import without_unsafe_profiler


def local_cluster(**kwargs: Any) -> LocalCluster:
    """A :class:`distributed.LocalCluster` made with ``kwargs``, its workers started (and
    restarted) without the profiler where it can deadlock them."""
    with without_unsafe_profiler():
        return LocalCluster(**kwargs)
