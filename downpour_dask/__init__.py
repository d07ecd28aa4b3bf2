"""downpour-dask: DistBelief's Downpour SGD and Sandblaster L-BFGS on Dask.

Model replicas stream their own data subsets on Dask workers and train asynchronously against a
sharded parameter server made of Dask actors (:class:`DownpourSGD`); a coordinator drives batch
L-BFGS whose vectors stay on those shards, with load-balanced portions and backup tasks
(:class:`SandblasterLBFGS`).  Every run yields a pandas experiment log (:class:`Experiment`).

The package is layered; imports only point down:

* ``core``: numpy only -- parameter layout, models, update rules, L-BFGS, model partitions;
* ``data``: no Dask -- datasets, shard schema and assignment, streaming, synthetic data;
* ``ps``: the parameter server -- shard actor, client view, direct wire, shard channel;
* ``runtime``: the Dask cluster -- client helpers and every use of Dask's private API;
* ``downpour`` and ``sandblaster``: the two algorithms' estimators and drivers;
* ``base``, ``log``, ``checkpoint``, ``live``, ``report``, ``progress``, ``runs``, ``cli``.
"""

import importlib
import sys
from typing import Any

from ._version import __version__
from .core import models, optim
from .core.params import ParamLayout
from .data import datasets
from .data.shards import ShardedDataset
from .log import Experiment, Progress

#: Public names whose modules import Dask or scikit-learn, each loaded on first use (PEP 562
#: ``__getattr__``): ``downpour-dask --version``, ``downpour_dask.datasets`` or
#: ``Experiment.load`` do not pay for importing them (seconds on a busy machine), and
#: ``from downpour_dask import DownpourSGD`` works as ever.
ON_FIRST_USE = {
    "DownpourSGD": ".downpour.estimator",
    "LivePlot": ".liveplot",
    "LiveRun": ".live",
    "ParameterServer": ".ps.server",
    "ParameterServerShard": ".ps.shard",
    "ProgressBar": ".progress",
    "SandblasterLBFGS": ".sandblaster.estimator",
    "SparseDownpourClassifier": ".downpour.sparse_estimator",
    "attach": ".live",
    "expected_failed_checks": ".base",
    "pin_workers": ".runtime.affinity",
    "unpin_workers": ".runtime.affinity",
}


def __getattr__(name: str) -> Any:
    if name not in ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(ON_FIRST_USE[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(ON_FIRST_USE))


# The public modules keep their short names: ``import downpour_dask.models`` (or ``.datasets``,
# ``.optim``) is the very module that lives in its layer, not a copy of its names.
for _module in (datasets, models, optim):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = [
    "__version__",
    "DownpourSGD",
    "Experiment",
    "LivePlot",
    "LiveRun",
    "ParamLayout",
    "ParameterServer",
    "ParameterServerShard",
    "Progress",
    "ProgressBar",
    "SandblasterLBFGS",
    "ShardedDataset",
    "SparseDownpourClassifier",
    "attach",
    "datasets",
    "expected_failed_checks",
    "models",
    "optim",
    "pin_workers",
    "unpin_workers",
]
