"""Timings fitted to a real run: :func:`calibrate` an :class:`~downpour_dask.log.Experiment`.

Three sources, each for what it can tell:

* the run's **push log** gives each replica's effective time per step (from its first to its last
  push, divided by the steps in between) and how much that varies (the spread of the intervals
  between its pushes);
* a **micro-benchmark** in this process times the shard's side with the shard's own code: the
  guarded update of the run's update rule (:class:`~downpour_dask.core.guard.GuardedUpdate`) and
  the copy a pull makes, each on a tiny slice and on the run's slice size, so the fixed and the
  per-parameter costs separate;
* the **gap** between the two -- the log's step against ``loss_and_grad`` and the shards'
  service: the loop around the step, encoding and decoding messages on both sides, the shards'
  connection threads -- is split by :func:`split_step`: half is added to the replica's step
  and half becomes the shards' CPU per parameter that crosses the wire
  (``Timing.wire_per_param``), which competes for the same cores as the replicas.  Half and half
  (``REPLICA_SHARE``) is an assumption: every message is encoded on one side and decoded on the
  other, and one run cannot separate the two;
* the one cost none shows -- the round trip of a message (latency plus the wire's handling)
  -- is **fitted**: the latency whose simulation of the run comes closest to the run's mean
  staleness and throughput (the sum of their log-ratio errors; latency moves both, and matching
  staleness alone can pick an absurd latency when the run's replicas barely overlapped).

On a local cluster the replicas' steps, the shards' messages and the links' latency are taken as
sharing the machine's ``cores`` (``Timing.cores``); set ``cores=None`` on the result to plan for
machines of their own.  :meth:`Calibration.save` writes ``simulation.json`` into the run
directory and :func:`load` reads it back.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from ..core import models, optim
from ..core.guard import GuardedUpdate
from ..core.model import Model
from ..core.optim import UpdateRule
from ..log import Experiment
from .predict import predict, steady_window
from .timing import Setup, Timing

#: The file :meth:`Calibration.save` writes into a run directory.
FILENAME = "simulation.json"
#: Latencies (s) :func:`calibrate` tries: log-spaced from 1 microsecond to 0.1 s.
LATENCY_GRID = tuple(float(x) for x in np.geomspace(1e-6, 1e-1, 31))
#: The part of a message's wire CPU the replica pays (the shard pays the rest).
REPLICA_SHARE = 0.5


@dataclass(frozen=True)
class Calibration:
    """A run's :class:`Setup` and fitted :class:`Timing`, with what they were fitted to.

    ``fit`` holds the measured figures (``examples_per_s``, ``staleness_mean``), the simulated
    ones with the fitted timing, the micro-benchmark's raw timings and ``cpu_count``.
    """

    setup: Setup
    timing: Timing
    fit: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"setup": vars(self.setup).copy(), "timing": self.timing.to_dict(), "fit": self.fit}

    def save(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write ``simulation.json`` into ``run_dir`` (which must exist); return its path."""
        path = Path(run_dir) / FILENAME
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"{run_dir} is not a directory: cannot save the calibration")
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        os.replace(tmp, path)  # a reader never sees half a file
        return path


def load(run_dir: str | os.PathLike[str]) -> Calibration:
    """Read the :class:`Calibration` saved in ``run_dir`` (FileNotFoundError naming it if none)."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no {FILENAME} in {run_dir}: run simulate.calibrate first")
    data = json.loads(path.read_text())
    return Calibration(Setup(**data["setup"]), Timing.from_dict(data["timing"]), data["fit"])


def setup_of(experiment: Experiment, model: Model | None = None) -> Setup:
    """The :class:`Setup` of a Downpour run, from its config."""
    config = experiment.config
    if config.get("estimator") not in (None, "DownpourSGD"):
        raise ValueError(f"can only calibrate DownpourSGD runs, not {config.get('estimator')!r}")
    model = model or models.from_config(config["model"])
    steps = config.get("replica_steps") or [int(experiment.pushes["step"].max()) + 1]
    transports = list((config.get("replica_transports") or {}).values())
    # in-process shards of the replicas that reached some shard over the wire
    mixed = [kinds.count("local") for kinds in transports if "wire" in kinds]
    return Setup(
        n_replicas=int(config["n_replicas"]),
        n_shards=int(config["n_shards"]),
        n_params=int(model.n_params),
        batch_size=int(config["batch_size"]),
        n_fetch=int(config.get("n_fetch", 1)),
        n_push=int(config.get("n_push", 1)),
        max_inflight=int(config.get("max_inflight", 4)),
        steps=max(1, int(np.median(steps))),
        warmstart_steps=int(config.get("warmstart_steps", 0)),
        local_replicas=sum(all(t == "local" for t in kinds) for kinds in transports),
        local_shards=int(round(np.mean(mixed))) if mixed else 0,
    )


def _seconds(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def microbenchmark(setup: Setup, model: Model, rule: UpdateRule, repeats: int = 20) -> dict:
    """Seconds of a model step and of a shard's update and pull copy, on this machine.

    Returns ``step`` (one ``loss_and_grad`` on a random minibatch of ``setup.batch_size``),
    ``push_fixed``/``push_per_param`` (a guarded update on slices of 16 and of the run's slice
    size, as a line) and ``pull_fixed``/``pull_per_param`` (the same for the pull's copy).
    """
    with threadpool_limits(1):  # as Dask's nanny pins BLAS to one thread in every worker
        return _microbenchmark(setup, model, rule, repeats)


def _microbenchmark(setup: Setup, model: Model, rule: UpdateRule, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    params = model.init(rng)
    n_inputs = int(model.get_config().get("n_inputs", 1))
    X = rng.random((setup.batch_size, n_inputs), dtype=np.float32)
    y = (
        np.zeros(setup.batch_size, np.int64)
        if model.is_classifier
        else np.zeros(setup.batch_size, np.float32)
    )
    out = {"step": _seconds(lambda: model.loss_and_grad(params, X, y), repeats)}
    small, large = 16, max(17, int(math.ceil(setup.slice_params)))
    for kind in ("push", "pull"):
        cost = {}
        for size in (small, large):
            values = rng.standard_normal(size).astype(np.float32)
            grad = (rng.standard_normal(size) * 1e-6).astype(np.float32)
            state = rule.init(size)
            guard = GuardedUpdate(rule, values, state)
            target = np.empty_like(values)
            if kind == "push":
                fn = functools.partial(guard.apply, values, grad, state)
            else:
                fn = functools.partial(np.copyto, target, values)
            cost[size] = _seconds(fn, repeats)
        per = max(0.0, (cost[large] - cost[small]) / (large - small))
        out[f"{kind}_per_param"] = per
        out[f"{kind}_fixed"] = max(0.0, cost[small] - per * small)
    return out


def measured(experiment: Experiment) -> dict[str, float]:
    """The run's effective step time, its variation, examples/s and mean staleness."""
    pushes = experiment.pushes
    if "partition" in pushes:
        pushes = pushes[pushes["partition"] == 0]
    if len(pushes) < 4:
        raise ValueError(f"the run logged {len(pushes)} pushes: too few to calibrate from")
    per_step, intervals = [], []
    for _, rows in pushes.sort_values("time").groupby("replica"):
        t, s = rows["time"].to_numpy(), rows["step"].to_numpy()
        if len(rows) >= 2 and s[-1] > s[0]:
            per_step.append((t[-1] - t[0]) / (s[-1] - s[0]))
            dt, ds = np.diff(t), np.diff(s)
            intervals.extend((dt[ds > 0] / ds[ds > 0]).tolist())
    if not per_step:
        raise ValueError("no replica pushed twice: too few pushes to calibrate from")
    spread = np.asarray(intervals)
    return {
        "step_seconds": float(np.median(per_step)),
        "step_cv": float(spread.std() / spread.mean()) if spread.mean() > 0 else 0.0,
        "examples_per_s": steady_throughput(pushes),
        "staleness_mean": float(pushes["staleness"].mean()),
    }


def steady_throughput(pushes: Any) -> float:
    """Examples/s acknowledged over the run's steady window (its middle half by push count, as
    :func:`~.predict.summarise` measures a simulation)."""
    times = pushes["time"].to_numpy()
    lo, hi = steady_window(times)
    inside = pushes[(times > lo) & (times <= hi)]
    return float(inside["examples"].sum()) / max(hi - lo, 1e-9)


def split_step(setup: Setup, timing: Timing, observed: float) -> Timing:
    """``timing`` with the costs that make a simulated step last ``observed``.

    ``timing.step_seconds`` is the model's own step (the micro-benchmark); the rest of the log's
    step (the loop around it, the messages' encoding on both sides, the shards' connection
    threads) is split: ``REPLICA_SHARE`` of it is added to the replica's step, the rest is the
    shards' wire CPU (``Timing.wire_per_param``), which with ``timing.cores`` slows the steps too
    (:meth:`Timing.step_scale`).  A run without wire messages puts it all into the step.
    """
    fraction = 1.0 if timing.cores is None else setup.wire_fraction  # as Timing.wire_cost
    wired = setup.local_replicas < setup.n_replicas and fraction > 0
    params = setup.n_params * fraction * (1 / setup.n_push + 1 / setup.n_fetch)
    share = REPLICA_SHARE if wired else 1.0

    def step_with(extra: float) -> tuple[Timing, float]:
        t = timing.with_(
            step_seconds=timing.step_seconds + share * extra,
            wire_per_param=(1 - share) * extra / params if wired else 0.0,
        )
        return t, t.step_seconds * t.step_scale(setup)

    low, high = 0.0, max(observed, 1e-12) / share
    if step_with(low)[1] >= observed:
        return timing
    for _ in range(60):  # the simulated step grows with the extra cost: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if step_with(mid)[1] < observed else (low, mid)
    return step_with((low + high) / 2)[0]


def calibrate(
    experiment: Experiment,
    *,
    cores: int | None = None,
    model: Model | None = None,
    repeats: int = 20,
    seed: int = 0,
) -> Calibration:
    """Fit a :class:`Timing` to a real Downpour run (see the module docstring for how).

    Parameters
    ----------
    experiment : Experiment
        A finished run's log (``estimator.experiment_`` or ``Experiment.load(run_dir)``).
    cores : int, optional
        Cores the run's replicas shared; default this machine's ``os.cpu_count()``.
    model : Model, optional
        The run's model, if its config cannot rebuild it.
    repeats : int
        Repetitions of each micro-benchmark.
    seed : int
        Seeds the simulations of the latency fit.
    """
    config = experiment.config
    model = model or models.from_config(config["model"])
    chosen = config.get("optimizer", "adagrad")
    rate = float(config["learning_rate"])
    rule = optim.from_config(chosen) if isinstance(chosen, dict) else optim.make(chosen, rate)
    setup = setup_of(experiment, model)
    cores = cores or os.cpu_count() or 1
    bench = microbenchmark(setup, model, rule, repeats)
    seen = measured(experiment)
    base = split_step(
        setup,
        Timing(
            step_seconds=min(bench["step"], seen["step_seconds"]),
            step_cv=min(seen["step_cv"], 2.0),
            push_fixed=bench["push_fixed"],
            push_per_param=bench["push_per_param"],
            pull_fixed=bench["pull_fixed"],
            pull_per_param=bench["pull_per_param"],
            cores=cores,
        ),
        seen["step_seconds"],
    )
    short = setup.with_(steps=min(setup.steps, 300))
    best = None
    for latency in LATENCY_GRID:
        guess = predict(short, base.with_(latency=latency), seed)
        error = abs(math.log1p(guess.staleness_mean) - math.log1p(seen["staleness_mean"])) + abs(
            math.log(max(guess.examples_per_s, 1e-9) / max(seen["examples_per_s"], 1e-9))
        )
        if best is None or error < best[0]:
            best = (error, latency, guess)
    _, latency, guess = best
    fit = {
        "measured": seen,
        "simulated": {
            "examples_per_s": guess.examples_per_s,
            "staleness_mean": guess.staleness_mean,
        },
        "microbenchmark": bench,
        "cpu_count": os.cpu_count(),
    }
    return Calibration(setup, base.with_(latency=latency), fit)
