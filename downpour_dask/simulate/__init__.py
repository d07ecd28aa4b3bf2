"""A calibrated discrete-event simulator of Downpour SGD, to plan runs past one machine.

Pure numpy (and pandas for tables); no Dask.  Read it in this order: ``timing`` (a run's shape,
:class:`Setup`, and its costs, :class:`Timing`), ``engine`` (the replica loop and the shard
queues on a virtual clock), ``predict`` (the timing mode: throughput, shard utilisation,
queueing, staleness, and sweeps), ``training`` (the training mode: the library's own model and
update rule driven by the simulated arrival order and staleness), ``calibration`` (timings
fitted to a real run's log plus a micro-benchmark) and ``planning`` (how many shards a replica
count needs).
"""

from .engine import Trace, run
from .predict import Prediction, predict, summarise, sweep
from .timing import Setup, Timing

__all__ = ["Prediction", "Setup", "Timing", "Trace", "predict", "run", "summarise", "sweep"]
