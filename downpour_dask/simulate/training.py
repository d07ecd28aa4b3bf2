"""The training mode: the library's own model and update rule, in the simulated order.

:func:`train` runs the event simulation (:mod:`.engine`) with an observer that does the real
mathematics at each event: a replica's step is ``model.loss_and_grad`` on its next minibatch (its
own contiguous part of the data, shuffled per epoch by ``minibatches`` from the same generator
seeds a real replica uses) followed by the local step ``params -= alpha * g``; a push is applied
by every shard to its slice through the same guarded :class:`~downpour_dask.core.optim.UpdateRule`
update (with the push's simulated staleness) a
:class:`~downpour_dask.ps.shard.ParameterServerShard` applies; an installed fetch is the shards'
values at the moment they served it, minus ``alpha`` times the replica's own pushes it lacks and
what the replica accrued since (as :mod:`downpour_dask.downpour.pushes` replays them).  The
shards' parameters are scored on held-out data every ``eval_every`` virtual seconds, so accuracy
against virtual time comes from the actual mathematics.

With one replica, one shard, no latency and no service time every fetch is installed before
the next step, so the result is serial SGD exactly (``tests/test_simulate.py`` pins it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..core.averaging import published
from ..core.guard import GuardedUpdate
from ..core.models import Model
from ..core.optim import UpdateRule
from ..core.params import split_range
from ..data.arrays import Dataset, minibatches
from .engine import Trace, run
from .timing import Setup, Timing


@dataclass
class TrainingResult:
    """What :func:`train` returns: the shards' final model, the curve and the trace."""

    params: np.ndarray  # what the shards publish as the model (their values, or the average)
    curve: pd.DataFrame  # time (virtual s), version, score (accuracy or R^2)
    trace: Trace

    def time_to(self, target: float) -> float:
        """First virtual time the score reached ``target`` (inf if never)."""
        hit = self.curve.loc[self.curve["score"] >= target, "time"]
        return float(hit.iloc[0]) if len(hit) else float("inf")


def _batches(X: np.ndarray, y: np.ndarray, size: int, rng: np.random.Generator) -> Iterator:
    while True:
        yield from minibatches(X, y, size, rng)


class _Mathematics:
    """The engine's :class:`~.engine.Observer` that trains (see the module docstring)."""

    def __init__(self, setup, model, rule, initial, data, test, alpha, seed, eval_every):
        self.model, self.alpha, self.test, self.eval_every = model, alpha, test, eval_every
        self.rule = rule
        self.values = np.array(initial, dtype=np.float32, copy=True)
        self.ranges = split_range(len(initial), setup.n_shards)
        self.guards, self.states = [], []
        for lo, hi in self.ranges:
            state = rule.init(hi - lo)
            self.states.append(state)
            self.guards.append(GuardedUpdate(rule, self.values[lo:hi], state))
        parts = data.partition(setup.n_replicas)
        self.batches = [
            _batches(X, y, setup.batch_size, np.random.default_rng([seed, r]))
            for r, (X, y) in enumerate(parts)
        ]
        n = setup.n_replicas
        self.params = [self.values.copy() for _ in range(n)]
        self.accrued = [np.zeros_like(self.values) for _ in range(n)]
        self.accrual = [0] * n
        self.pushes: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.snapshots: dict[int, tuple[np.ndarray, int]] = {}
        self.version, self.next_eval = 0, 0.0
        self.rows: list[tuple[float, int, float]] = []
        self.grad = np.empty_like(self.values)

    def on_step(self, replica: int, step: int) -> None:
        X, y = next(self.batches[replica])
        params = self.params[replica]
        loss, g = self.model.loss_and_grad(params, X, y, out=self.grad)
        self.accrued[replica] += g
        self.accrual[replica] += 1
        if np.isfinite(loss) and self.alpha:
            params -= np.float32(self.alpha) * g

    def on_push(self, replica: int, seq: int) -> None:
        self.pushes[replica][seq] = self.accrued[replica]
        self.accrued[replica] = np.zeros_like(self.values)
        self.accrual[replica] = 0

    def on_apply(self, time: float, replica: int, seq: int, staleness: int) -> None:
        grad = self.pushes[replica][seq]
        for (lo, hi), guard, state in zip(self.ranges, self.guards, self.states):
            guard.apply(self.values[lo:hi], grad[lo:hi], state, staleness=staleness)
        self.version += 1
        if time >= self.next_eval and self.test is not None:
            self.rows.append((time, self.version, self._score()))
            self.next_eval = time + self.eval_every

    def on_snapshot(self, replica: int, pull: int) -> None:
        self.snapshots[pull] = self.values.copy()

    def on_install(self, replica: int, pull: int, lacking: range) -> None:
        params, pushes = self.params[replica], self.pushes[replica]
        params[...] = self.snapshots.pop(pull)
        for seq in [s for s in pushes if s < lacking.start]:  # contained: no replay needed
            del pushes[seq]
        alpha = np.float32(self.alpha)
        if alpha:
            for seq in lacking:
                params -= alpha * pushes[seq]
            if self.accrual[replica]:
                params -= alpha * self.accrued[replica]

    def published(self) -> np.ndarray:
        """What the shards publish as the model: their values, or with an averaged rule
        (``ema_decay``, core/averaging.py) the average."""
        parts = zip(self.ranges, self.states)
        return np.concatenate([published(self.rule, self.values[a:b], s) for (a, b), s in parts])

    def _score(self) -> float:
        X, y = self.test
        return float(self.model.score(self.published(), X, y))


def train(
    setup: Setup,
    timing: Timing,
    model: Model,
    rule: UpdateRule,
    data: Dataset,
    test: Dataset | None = None,
    *,
    local_learning_rate: float | None = None,
    initial: np.ndarray | None = None,
    seed: int = 0,
    eval_every: float | None = None,
) -> TrainingResult:
    """Train ``model`` with ``rule`` on ``data`` in the simulated order of ``setup``/``timing``.

    Parameters
    ----------
    setup, timing : Setup, Timing
    model : Model
        A :mod:`downpour_dask.core.models` model (its ``loss_and_grad`` makes every step).
    rule : UpdateRule
        What the shards apply (e.g. ``optim.adagrad(0.05)``).
    data, test : Dataset
        Training rows (split among replicas as a real run splits them) and held-out rows to
        score the shards' parameters on (no curve without).
    local_learning_rate : float, optional
        The replicas' ``alpha``; default the rule's learning rate (as ``DownpourSGD``).
    initial : ndarray, optional
        Starting parameters; default ``model.init(default_rng(seed))`` as a real fit draws them.
    seed : int
        Seeds the initial parameters, every replica's data order and the step times.
    eval_every : float, optional
        Virtual seconds between scores; default 1/50 of the simulated run.
    """
    if initial is None:
        initial = model.init(np.random.default_rng(seed))
    if len(initial) != model.n_params:
        raise ValueError(f"initial has {len(initial)} values, the model has {model.n_params}")
    alpha = rule.learning_rate if local_learning_rate is None else float(local_learning_rate)
    setup = setup.with_(n_params=int(model.n_params))
    if eval_every is None:
        rough = setup.steps * timing.replica_step(setup) * timing.step_scale(setup)
        eval_every = max(rough / 50, 1e-12)
    held = None if test is None else (test.X, test.y)
    maths = _Mathematics(setup, model, rule, initial, data, held, alpha, seed, eval_every)
    trace = run(setup, timing, seed, observer=maths)
    if held is not None:
        maths.rows.append((float(trace.push_applied[-1]), maths.version, maths._score()))
    curve = pd.DataFrame(maths.rows, columns=["time", "version", "score"])
    return TrainingResult(maths.published(), curve, trace)  # (concatenated: a new array)
