"""Timings fitted to real runs: :func:`calibrate` :class:`~downpour_dask.log.Experiment` logs.

Three sources, each for what it can tell:

* each run's **push log** gives its steady time per step (its replicas' examples/s in the middle
  half of the run turned back into steps, :func:`steady_step`) and how much a step varies (the
  spread of the intervals between a replica's pushes; the median over the runs);
* a **micro-benchmark** in this process times the shard's side with the shard's own code: the
  guarded update of the run's update rule (:class:`~downpour_dask.core.guard.GuardedUpdate`) and
  the copy a pull makes, each on a tiny slice and on the run's slice size, so the fixed and the
  per-parameter costs separate; a request crossing the wire is taken to cost its shard one such
  copy per parameter it carries (``Timing.wire_per_param``: decoding or encoding the slice); the
  model's step is the part of the mean step every step takes (``Timing.step_floor``: the log's
  spread is rare long pauses, not steps shorter than the gradient);
* the **gap** between the two -- the log's step against ``loss_and_grad`` and the shards'
  service: the loop around the step, the calls and their messages on both sides, the shards'
  connection threads -- is attributed by :func:`fit_costs` to four costs, fitted (least
  squares on the log of the step times) to every run given: a replica's loop per step
  (``Timing.step_seconds`` above the model's step), its CPU per request it sends to a shard
  (``Timing.message_seconds``; in-process calls do not pay it), a shard's CPU per request
  arriving over the wire (``Timing.wire_fixed``), which competes with the replicas for the
  same cores (with one shard, the core of the shard's worker: :meth:`~.timing.Timing.scales`),
  and the slowdown of crowding more replicas than cores (``Timing.crowding``).  Runs that
  differ in replicas and shards separate them: one replica leaves the shards' wire CPU a core
  of its own, two on two cores do not; more shards mean more requests per step; eight
  replicas on two cores crowd them.  A weak prior (no loop cost; the replica's and the
  shard's side of a wire request equal; no crowding; no request costing more than the runs
  need) decides what the runs cannot -- all of it with one run;
* the one cost none shows -- the round trip of a message (latency plus the wire's handling)
  -- is **fitted**: the latency whose simulations of the runs come closest to their mean
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from threadpoolctl import threadpool_limits

from ..core import models
from ..core.guard import GuardedUpdate
from ..core.model import Model
from ..core.optim import UpdateRule
from ..core.optimizer_spec import from_config, resolve
from ..log import Experiment
from .predict import predict, steady_window
from .timing import Setup, Timing

#: The file :meth:`Calibration.save` writes into a run directory.
FILENAME = "simulation.json"
#: Latencies (s) :func:`calibrate` tries: log-spaced from 1 microsecond to 0.1 s.
LATENCY_GRID = tuple(float(x) for x in np.geomspace(1e-6, 1e-1, 61))
#: Weight of :func:`fit_costs`' prior against one run's log step error.
PRIOR_WEIGHT = 0.05
#: The largest spread of step times (``step_cv``) a calibration takes from a run's log: beyond
#: it the log shows the machine stalling the run, not the steps.
STEP_CV_CAP = 2.0


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
    if any("one-sided" in kinds for kinds in transports):
        raise ValueError(
            "cannot calibrate a run with transport='one-sided': the simulator models shards "
            "called in-process, over the wire or by actor messages; calibrate an 'auto' run"
        )
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


def steady_step(setup: Setup, seen: dict[str, float]) -> float:
    """A run's seconds per step in its steady window: its replicas' examples/s turned back into
    steps (``n_replicas * batch_size / examples_per_s``), the rate the simulation predicts."""
    return setup.n_replicas * setup.batch_size / max(seen["examples_per_s"], 1e-12)


def simulated_step(setup: Setup, timing: Timing) -> float:
    """The replicas' seconds per step under ``timing`` without queueing, as
    :func:`steady_step` measures a log: ``n_replicas`` over their summed step rates (each its
    CPU stretched by the shared cores, :meth:`~.timing.Timing.scales`; a replica on the
    shards' worker also waits for its in-process calls)."""
    near_k, far_k = timing.scales(setup)
    calls = timing.shard_step(setup, True)  # every shard's service, in-process
    local = min(setup.local_replicas, setup.n_replicas)
    near = 1.0 / (timing.replica_step(setup, True) * near_k + calls)
    far = 1.0 / (timing.replica_step(setup, False) * far_k)
    return setup.n_replicas / (local * near + (setup.n_replicas - local) * far)


def fit_costs(runs: list[tuple[Setup, float]], timing: Timing) -> Timing:
    """``timing`` with the loop, per-request and wire costs that best give each run's step.

    Parameters
    ----------
    runs : list of (Setup, float)
        Each run's shape and its observed seconds per step (:func:`steady_step`).
    timing : Timing
        ``step_seconds`` is the model's own step (the micro-benchmark), with the shards'
        service and ``cores``; its ``message_seconds`` and ``wire_fixed`` are replaced.

    Returns the timing whose :func:`simulated_step` is closest to the observed ones, in log
    ratio, with a weak prior (``PRIOR_WEIGHT``): no loop cost above the model's step, a wire
    request costing its shard what it costs its replica, no crowding, and per-request costs
    no larger than the runs need.  What the runs cannot tell apart is left to the prior: the
    wire cost if no request crossed the wire, the crowding if no run had more replicas than
    cores.
    """
    if not runs:
        raise ValueError("fit_costs needs at least one run")
    unit = float(np.mean([seconds for _, seconds in runs]))

    def timing_of(x: np.ndarray) -> Timing:
        loop, message, wire = (float(v) * unit for v in x[:3])
        return timing.with_(
            step_seconds=timing.step_seconds + loop,
            message_seconds=message,
            wire_fixed=wire,
            crowding=float(x[3]),
        )

    def residuals(x: np.ndarray) -> np.ndarray:
        t = timing_of(x)
        errors = [
            math.log(simulated_step(setup, t) / max(seconds, 1e-12)) for setup, seconds in runs
        ]
        # no loop cost, the two sides of a request alike, no crowding, and no request costing
        # more than the runs need (without it a one-shard run alone can put an unbounded
        # cost on the wire replica and give the replica beside the shard all the throughput)
        prior = [x[0], x[1] - x[2], x[3], x[1], x[2]]
        return np.array([*errors, *(PRIOR_WEIGHT * p for p in prior)])

    start = np.full(4, 0.1)
    fitted = least_squares(residuals, start, bounds=(0.0, np.inf), method="trf")
    return timing_of(fitted.x)


def _floor(model_step: float, timing: Timing) -> float:
    """``Timing.step_floor``: the model's gradient (the micro-benchmark), which every step
    computes, over the mean step with its loop and requests (at most 0.9)."""
    return float(min(model_step / timing.step_seconds, 0.9))


def rule_of(config: dict[str, Any]) -> UpdateRule:
    """The shards' update rule of a run, from its config: the ``optimizer`` as the estimator
    took it (a name or spec, :mod:`~downpour_dask.core.optimizer_spec`) or a rule's
    ``get_config()``, at the run's ``learning_rate``."""
    chosen = config.get("optimizer", "adagrad")
    if isinstance(chosen, dict):
        return from_config(chosen)
    return resolve(chosen, float(config["learning_rate"]))


def calibrate(
    experiment: Experiment,
    *,
    also: Sequence[Experiment] = (),
    cores: int | None = None,
    model: Model | None = None,
    repeats: int = 20,
    seed: int = 0,
) -> Calibration:
    """Fit a :class:`Timing` to real Downpour runs (see the module docstring for how).

    Parameters
    ----------
    experiment : Experiment
        A finished run's log (``estimator.experiment_`` or ``Experiment.load(run_dir)``); the
        result's :class:`Setup` is its.
    also : sequence of Experiment
        Other runs of the same model, batch size and update rule on the same machine, with other
        replica or shard counts: fitted together with ``experiment`` they separate the replicas'
        CPU from the shards' (:func:`fit_costs`); one run leaves that to a prior.
    cores : int, optional
        Cores the runs' replicas shared; default this machine's ``os.cpu_count()``.
    model : Model, optional
        The runs' model, if the config cannot rebuild it.
    repeats : int
        Repetitions of each micro-benchmark.
    seed : int
        Seeds the simulations of the latency fit.
    """
    config = experiment.config
    model = model or models.from_config(config["model"])
    rule = rule_of(config)
    setup = setup_of(experiment, model)
    cores = cores or os.cpu_count() or 1
    bench = microbenchmark(setup, model, rule, repeats)
    runs = [(setup_of(e, model), measured(e)) for e in (experiment, *also)]
    for other, _ in runs[1:]:
        if (other.n_params, other.batch_size) != (setup.n_params, setup.batch_size):
            raise ValueError(
                "calibrate's runs must share the model and batch size: "
                f"{other.n_params} parameters, batch {other.batch_size} against "
                f"{setup.n_params}, {setup.batch_size}"
            )
    seen = runs[0][1]
    base = fit_costs(
        [(s, steady_step(s, m)) for s, m in runs],
        Timing(
            step_seconds=min(bench["step"], min(steady_step(s, m) for s, m in runs)),
            step_cv=min(float(np.median([m["step_cv"] for _, m in runs])), STEP_CV_CAP),
            push_fixed=bench["push_fixed"],
            push_per_param=bench["push_per_param"],
            pull_fixed=bench["pull_fixed"],
            pull_per_param=bench["pull_per_param"],
            wire_per_param=bench["pull_per_param"],  # a copy of what a request carries
            cores=cores,
        ),
    )
    base = base.with_(step_floor=_floor(bench["step"], base))
    best = None
    for latency in LATENCY_GRID:
        error, guesses = 0.0, []
        for one, real in runs:
            guess = predict(one.with_(steps=min(one.steps, 300)), base.with_(latency=latency), seed)
            guesses.append(guess)
            error += abs(math.log1p(guess.staleness_mean) - math.log1p(real["staleness_mean"]))
            error += abs(
                math.log(max(guess.examples_per_s, 1e-9) / max(real["examples_per_s"], 1e-9))
            )
        if best is None or error < best[0]:
            best = (error, latency, guesses)
    _, latency, guesses = best
    simulated = [
        {"examples_per_s": g.examples_per_s, "staleness_mean": g.staleness_mean} for g in guesses
    ]
    fit = {
        "measured": seen,
        "simulated": simulated[0],
        "runs": [
            {"replicas": one.n_replicas, "shards": one.n_shards, "measured": real, "simulated": sim}
            for (one, real), sim in zip(runs, simulated)
        ],
        "microbenchmark": bench,
        "cpu_count": os.cpu_count(),
    }
    return Calibration(setup, base.with_(latency=latency), fit)
