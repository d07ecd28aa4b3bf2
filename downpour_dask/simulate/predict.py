"""The timing mode: what a Downpour configuration will do, without any mathematics.

:func:`predict` runs the event simulation (:mod:`.engine`) and summarises it as a
:class:`Prediction` -- examples/s, pushes/s per shard, shard utilisation, queueing and the
staleness distribution -- measured over the *steady window*, the middle half of the run by push
count, so start-up and wind-down do not dilute the rates.  :func:`sweep` does it for
a grid of replica and shard counts and returns a pandas table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from .engine import Trace, run
from .timing import Setup, Timing

#: Steps per replica :func:`sweep` simulates: enough for a steady window, bounded in total.
SWEEP_STEP_BUDGET = 10_000


@dataclass(frozen=True)
class Prediction:
    """Steady-state figures of one simulated configuration (see :func:`summarise`)."""

    n_replicas: int
    n_shards: int
    examples_per_s: float
    pushes_per_s: float  # per shard (every push reaches every shard)
    utilisation: float  # fraction of time each shard is busy
    queue_wait: float  # mean seconds a message waits in a shard's queue
    queue_length: float  # mean messages waiting (Little's law)
    staleness_mean: float
    staleness_p95: float
    staleness_max: float
    duration: float  # virtual seconds until the last push was acknowledged
    events: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


#: The steady window: from this fraction of a run's pushes to ``1 - STEADY`` of them.
STEADY = 0.25


def steady_window(times: np.ndarray) -> tuple[float, float]:
    """The middle half of a run, by push count: from the time its pushes (acknowledged or
    applied at ``times``) reach 25% of the total to the time they reach 75%, so neither the
    start-up (first fetches, a warmstart) nor the end (replicas finishing at different times)
    dilutes the rates.  The real log is measured the same way
    (:func:`~.calibration.steady_throughput`)."""
    if len(times) < 2:
        return 0.0, float(times.max()) if len(times) else 1.0
    lo, hi = np.quantile(np.sort(times), [STEADY, 1 - STEADY])
    return float(lo), float(hi)


def summarise(trace: Trace) -> Prediction:
    """A :class:`Prediction` from a trace, over its :func:`steady_window`."""
    setup = trace.setup
    lo, hi = steady_window(trace.push_applied)
    span = max(hi - lo, 1e-300)
    inside = (trace.push_applied > lo) & (trace.push_applied <= hi)
    busy = np.clip(trace.msg_end, lo, hi) - np.clip(trace.msg_start, lo, hi)
    in_msgs = (trace.msg_arrival > lo) & (trace.msg_arrival <= hi)
    waits = (trace.msg_start - trace.msg_arrival)[in_msgs]
    stale = trace.push_staleness[inside]
    rate = float(in_msgs.sum()) / span
    wait = float(waits.mean()) if len(waits) else 0.0
    return Prediction(
        n_replicas=setup.n_replicas,
        n_shards=setup.n_shards,
        examples_per_s=float(trace.push_examples[inside].sum()) / span,
        pushes_per_s=float(inside.sum()) / span,
        utilisation=float(busy.sum()) / span,
        queue_wait=wait,
        queue_length=rate * wait,
        staleness_mean=float(stale.mean()) if len(stale) else 0.0,
        staleness_p95=float(np.percentile(stale, 95)) if len(stale) else 0.0,
        staleness_max=float(stale.max()) if len(stale) else 0.0,
        duration=float(trace.replica_end.max()),
        events=trace.events,
    )


def predict(setup: Setup, timing: Timing, seed: int = 0) -> Prediction:
    """Simulate ``setup`` under ``timing`` and summarise its steady state."""
    return summarise(run(setup, timing, seed))


def sweep(
    setup: Setup,
    timing: Timing,
    replicas: Iterable[int],
    shards: Iterable[int],
    seed: int = 0,
    steps: int | None = None,
) -> pd.DataFrame:
    """:func:`predict` for every pair of replica and shard counts; one row each.

    Parameters
    ----------
    setup : Setup
        Everything but ``n_replicas`` and ``n_shards`` (and ``steps``, see below).
    timing : Timing
    replicas, shards : iterable of int
    seed : int
    steps : int, optional
        Steps per replica; default ``SWEEP_STEP_BUDGET / n_replicas`` clipped to [5, 400], so
        the large configurations stay cheap while keeping a steady window of many pushes.  With
        thousands of replicas that is only a few steps each, so staleness there describes a short
        run (each replica's first pushes); give ``steps`` for a longer one.
    """
    rows = []
    for n_replicas in replicas:
        n = steps or int(np.clip(SWEEP_STEP_BUDGET // max(n_replicas, 1), 5, 400))
        for n_shards in shards:
            one = setup.with_(n_replicas=int(n_replicas), n_shards=int(n_shards), steps=n)
            rows.append(predict(one, timing, seed).as_dict())
    return pd.DataFrame(rows)
