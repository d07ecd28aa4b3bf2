"""What a training job can be told: its algorithms, defaults and the settings each accepts.

A job's settings are the estimator's constructor arguments plus the job settings
(:data:`JOB_SETTINGS`); a setting not given comes from :data:`DEFAULTS` and
:data:`ALGORITHM_DEFAULTS`, else from the estimator's own default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ..downpour.estimator import DownpourSGD
from ..sandblaster.estimator import SandblasterLBFGS

#: Estimators a job can use, by the name given as ``algorithm``.
ALGORITHMS: dict[str, type] = {"downpour": DownpourSGD, "sandblaster": SandblasterLBFGS}

#: What a job does when a setting is not given: the command line's "no argument" run.
DEFAULTS: dict[str, Any] = {
    "algorithm": "downpour",
    "dataset": "mnist5k",
    "model": "mlp:128",
    "out": "runs",
}

#: Estimator arguments a job sets unless told otherwise (else the estimator's own defaults):
#: Downpour + Adagrad with a warmstart, the setting that works on the shipped data.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "downpour": {
        "n_replicas": 4,
        "n_shards": 2,
        "optimizer": "adagrad",
        "learning_rate": 0.05,
        "batch_size": 32,
        "warmstart_steps": 100,
        "max_epochs": 3,
    },
    "sandblaster": {"max_iter": 60},
}

#: The estimator argument that sets how often each algorithm evaluates, and in what unit.
EVALUATION_INTERVALS: dict[str, tuple[str, str]] = {
    "eval_every": ("downpour", "seconds"),
    "eval_every_iter": ("sandblaster", "iterations"),
}

#: Settings of a job that are not estimator arguments.
JOB_SETTINGS = (
    "algorithm", "dataset", "eval_dataset", "label", "model", "out", "name", "overwrite",
    "publish",
)  # fmt: skip

#: The limits of a run.  A job given any of them gets none of :data:`ALGORITHM_DEFAULTS`'
#: limits: ``max_seconds=30`` alone trains for 30 s, not for the default 3 epochs.
LIMITS = ("max_epochs", "max_steps", "max_seconds")


#: Constructor arguments a job does not set: the job builds the model from its spec, shows its
#: own progress (``--quiet`` turns it off) and always starts a new fit (``--resume`` continues one).
NOT_JOB_SETTINGS = ("self", "model", "verbose", "warm_start")


def estimator_arguments(algorithm: str) -> dict[str, inspect.Parameter]:
    """The constructor arguments of an algorithm's estimator a job can set (all but
    :data:`NOT_JOB_SETTINGS`)."""
    cls = estimator_class(algorithm)
    parameters = inspect.signature(cls.__init__).parameters
    return {name: p for name, p in parameters.items() if name not in NOT_JOB_SETTINGS}


def misnamed_interval(
    algorithm: str, names: Iterable[str], spell: Callable[[str], str] = str
) -> str | None:
    """A one-line complaint if ``names`` hold the other algorithm's evaluation interval.

    Downpour evaluates every ``eval_every`` seconds, Sandblaster every ``eval_every_iter``
    iterations (:data:`EVALUATION_INTERVALS`): the names differ because the units do, and a job
    giving one algorithm the other's is told which name it takes.

    Parameters
    ----------
    algorithm : str
        The job's algorithm.
    names : iterable of str
        The settings the job was given.
    spell : callable, default str
        How the caller's user writes a setting (the command line: ``--eval-every``).

    Returns
    -------
    str or None
        The complaint, or ``None`` if ``names`` hold no misplaced interval.
    """
    accepted = estimator_arguments(algorithm)
    own = [n for n, (a, _) in EVALUATION_INTERVALS.items() if a == algorithm and n in accepted]
    for name in names:
        if own and name in EVALUATION_INTERVALS and name not in accepted:
            other, unit = EVALUATION_INTERVALS[name]
            return (
                f"{spell(name)} is {other}'s evaluation interval ({unit}); for algorithm "
                f"{algorithm} use {spell(own[0])} ({EVALUATION_INTERVALS[own[0]][1]})"
            )
    return None


def estimator_class(algorithm: str) -> type:
    """The estimator class of ``algorithm``; a ValueError names the algorithms there are."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return ALGORITHMS[algorithm]
