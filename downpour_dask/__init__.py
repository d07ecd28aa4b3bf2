"""downpour-dask: DistBelief's Downpour SGD on Dask.

Model replicas stream their own data subsets on Dask workers and train asynchronously against a
sharded parameter server made of Dask actors; every run yields a pandas experiment log.
"""

from . import data as datasets
from . import models, optim
from ._version import __version__
from .downpour import DownpourSGD
from .log import Experiment
from .params import ParamLayout
from .server import ParameterServer, ParameterServerShard

__all__ = [
    "__version__",
    "DownpourSGD",
    "Experiment",
    "ParamLayout",
    "ParameterServer",
    "ParameterServerShard",
    "datasets",
    "models",
    "optim",
]
