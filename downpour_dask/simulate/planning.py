"""Planning: how many parameter-server shards a replica count needs.

A shard that is busy most of the time makes every push wait in its queue, and the waiting shows
up as staleness and lost throughput long before the shard is fully saturated.  :func:`recommend`
picks the fewest shards (from :data:`SHARD_CHOICES`) whose predicted utilisation stays at or
below ``max_utilisation`` (70% by default, where an M/D/1 queue's wait is still about one
service time) for a replica count, and :func:`plan` does it for several.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .predict import SWEEP_STEP_BUDGET, Prediction, predict
from .timing import Setup, Timing

#: Shard counts :func:`recommend` considers.
SHARD_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Recommendation:
    """The advice for one replica count: ``n_shards`` (None if no choice stays below the
    limit: the shards' fixed per-message cost, not their slice, is what saturates them) and
    the prediction with it (with the most shards tried when none suffices)."""

    n_replicas: int
    n_shards: int | None
    prediction: Prediction


def recommend(
    setup: Setup,
    timing: Timing,
    n_replicas: int,
    max_utilisation: float = 0.7,
    choices: Iterable[int] = SHARD_CHOICES,
    seed: int = 0,
) -> Recommendation:
    """The fewest shards keeping every shard at or below ``max_utilisation`` busy.

    Utilisation falls as shards are added (each serves a smaller slice), so the choices are
    tried in increasing order and the first one under the limit is returned.
    """
    if not 0 < max_utilisation <= 1:
        raise ValueError(f"max_utilisation must be in (0, 1], got {max_utilisation!r}")
    steps = int(np.clip(SWEEP_STEP_BUDGET // max(n_replicas, 1), 5, 400))
    last = None
    for n_shards in sorted(int(c) for c in choices):
        one = setup.with_(n_replicas=int(n_replicas), n_shards=n_shards, steps=steps)
        last = predict(one, timing, seed)
        if last.utilisation <= max_utilisation:
            return Recommendation(int(n_replicas), n_shards, last)
    if last is None:
        raise ValueError("choices is empty: give at least one shard count")
    return Recommendation(int(n_replicas), None, last)


def plan(
    setup: Setup,
    timing: Timing,
    replicas: Iterable[int],
    max_utilisation: float = 0.7,
    seed: int = 0,
) -> pd.DataFrame:
    """:func:`recommend` for each replica count: one row with the advice and its prediction."""
    rows = []
    for n_replicas in replicas:
        advice = recommend(setup, timing, n_replicas, max_utilisation, seed=seed)
        row = advice.prediction.as_dict()
        row["recommended_shards"] = advice.n_shards
        rows.append(row)
    return pd.DataFrame(rows)
