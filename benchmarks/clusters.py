"""The local Dask clusters the benchmarks run on: Dask's defaults, without the worker profiler.

Dask's worker profiler samples the stacks of a worker's running threads 100 times a second.  On
CPython before 3.11.9 that sampling can deadlock a worker (gh-106883), so the clusters a fit
starts itself leave it out there (``downpour_dask/runtime/profiler.py``); on this project's test
machine it also cost compute-bound work 3-4% of its speed (``benchmarks/README.md``).  The
benchmarks leave it out on every interpreter: a run cannot hang on that bug, and
``bench_code_ab.py``, which runs older revisions of the library under these same scripts, measures
both sides on the same footing whatever the revision does itself.
"""

from __future__ import annotations

from typing import Any

import dask
from distributed import LocalCluster

#: Dask's setting that starts the worker profiler.
PROFILE_SETTING = "distributed.worker.profile.enabled"


def local_cluster(**kwargs: Any) -> LocalCluster:
    """A :class:`distributed.LocalCluster` made with ``kwargs``, whose nannies start (and
    restart) their workers with a copy of Dask's settings that turns the profiler off (a
    ``dask.config.set`` block would not reach a worker restarted after the block ended)."""
    settings = dask.config.merge(dask.config.config)  # a copy of every section
    dask.config.set({PROFILE_SETTING: False}, config=settings)
    return LocalCluster(config=settings, **kwargs)
