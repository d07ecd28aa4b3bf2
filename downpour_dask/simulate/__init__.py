"""A calibrated discrete-event simulator of Downpour SGD, to plan runs past one machine.

Pure numpy (and pandas for tables); no Dask.  Read it in this order: ``timing`` (a run's shape,
:class:`Setup`, and its costs, :class:`Timing`), ``engine`` (the replica loop and the shard
queues on a virtual clock), ``predict`` (the timing mode: throughput, shard utilisation,
queueing, staleness, and sweeps), ``training`` (the training mode: the library's own model and
update rule driven by the simulated arrival order and staleness), ``calibration`` (timings
fitted to a real run's log plus a micro-benchmark) and ``planning`` (how many shards a replica
count needs).

    from downpour_dask import simulate
    fitted = simulate.calibrate(estimator.experiment_)       # or Experiment.load(run_dir)
    fitted.save(run_dir)                                      # simulation.json
    simulate.sweep(fitted.setup, fitted.timing.with_(cores=None), [10, 100], [1, 4])
    simulate.recommend(fitted.setup, fitted.timing.with_(cores=None), 100).n_shards
"""

from .calibration import Calibration, calibrate
from .calibration import load as load_calibration
from .engine import Trace, run
from .planning import Recommendation, plan, recommend
from .predict import Prediction, predict, summarise, sweep
from .timing import Setup, Timing
from .training import TrainingResult, train

__all__ = [
    "Calibration",
    "Prediction",
    "Recommendation",
    "Setup",
    "Timing",
    "Trace",
    "TrainingResult",
    "calibrate",
    "load_calibration",
    "plan",
    "predict",
    "recommend",
    "run",
    "summarise",
    "sweep",
    "train",
]
