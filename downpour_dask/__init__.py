"""downpour-dask: DistBelief's Downpour SGD and Sandblaster L-BFGS on Dask.

Model replicas stream their own data subsets on Dask workers and train asynchronously against a
sharded parameter server made of Dask actors (:class:`DownpourSGD`); a coordinator drives batch
L-BFGS whose vectors stay on those shards, with load-balanced portions and backup tasks
(:class:`SandblasterLBFGS`).  Every run yields a pandas experiment log (:class:`Experiment`).
"""

from . import data as datasets
from . import models, optim
from ._version import __version__
from .data import ShardedDataset
from .downpour import DownpourSGD
from .live import LiveRun, attach
from .log import Experiment, Progress
from .params import ParamLayout
from .sandblaster import SandblasterLBFGS
from .server import ParameterServer, ParameterServerShard

__all__ = [
    "__version__",
    "DownpourSGD",
    "Experiment",
    "LiveRun",
    "ParamLayout",
    "ParameterServer",
    "ParameterServerShard",
    "Progress",
    "SandblasterLBFGS",
    "ShardedDataset",
    "attach",
    "datasets",
    "models",
    "optim",
]
