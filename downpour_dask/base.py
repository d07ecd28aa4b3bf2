"""What every downpour-dask estimator shares: scikit-learn's parameter contract, predict/score on
the learned parameter vector, argument checks, and the :class:`RunRecorder` that turns a run's
events, evaluations and push rows into its :class:`~downpour_dask.log.Experiment` and
:class:`~downpour_dask.log.Progress` snapshots.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd

from ._version import __version__
from .core import protocol
from .data.datasets import Dataset, as_dataset
from .log import (
    EVAL_COLUMNS,
    PUSH_COLUMNS,
    Event,
    Experiment,
    Progress,
    PushRow,
    events_frame,
    plain,
)


class ParamServerEstimator:
    """Base class: ``__init__`` stores arguments only; ``fit`` sets ``params_``, ``experiment_``."""

    model: protocol.TrainableModel
    params_: np.ndarray
    security: Any  # TLS of the embedded cluster (see runtime.cluster.cluster_client)

    # -- scikit-learn parameter contract ---------------------------------------------------------
    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return [p for p in signature.parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments, as scikit-learn's ``get_params``."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> ParamServerEstimator:
        """Set constructor arguments, as scikit-learn's ``set_params``; returns ``self``."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(
                    f"invalid parameter {name!r} for {type(self).__name__}; "
                    f"valid parameters: {', '.join(valid)}"
                )
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -- using the learned parameters ------------------------------------------------------------
    def _fitted_params(self) -> np.ndarray:
        if not hasattr(self, "params_"):
            raise AttributeError(
                f"this {type(self).__name__} is not fitted yet; call fit before predict or score"
            )
        return self.params_

    def predict(self, X: np.ndarray | Dataset) -> np.ndarray:
        """Class labels (classifiers) or predicted values (regression) for ``X``."""
        params = self._fitted_params()
        if isinstance(X, Dataset):
            X = X.X
        X, _ = protocol.check_data(self.model, X)
        return self.model.predict(params, X)

    def score(self, data: np.ndarray | Dataset | tuple, y: np.ndarray | None = None) -> float:
        """Accuracy (classifiers) or R^2 (regression) on a Dataset, an ``(X, y)`` pair, or X, y."""
        params = self._fitted_params()
        dataset = as_dataset(data, y, what="data")
        X, y = protocol.check_data(self.model, dataset.X, dataset.y)
        return self.model.score(params, X, y)

    # -- what fit shares -------------------------------------------------------------------------
    def _check_data(self, data: Any, y: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
        """In-memory ``data`` (and ``y``) checked against the model; errors name ``what``."""
        dataset = as_dataset(data, y, what=what)
        try:
            return protocol.check_data(self.model, dataset.X, dataset.y)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{what}: {err}") from None

    def _config(self) -> dict[str, Any]:
        """The estimator's part of an experiment's config (JSON-able): its arguments, with the
        model as its config and ``tls`` for the Security object."""
        config = {k: v for k, v in self.get_params().items() if k not in ("model", "security")}
        config.update(
            tls=self.security is not None,  # the Security object itself is not JSON
            model=protocol.config(self.model),
            estimator=type(self).__name__,
            library_version=__version__,
        )
        return config


# -- argument checks (scikit-learn style messages) ------------------------------------------------


def check_int(
    name: str, value: Any, low: int, high: int | None = None, allow_none: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is an int in ``[low, high]`` (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_positive(
    name: str, value: Any, allow_none: bool = False, allow_zero: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is a finite number > 0 (>= 0 if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    bad = not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


# -- the record of a run -------------------------------------------------------------------------


class RunRecorder:
    """Collects what one fit records -- events, evaluations, push rows -- on the driver.

    Times are seconds since :attr:`t0`, the wall-clock start of training.  Both estimators keep
    their log here, so the tables they produce have the same columns and the same meaning.

    Parameters
    ----------
    metric : {"accuracy", "r2"}
        Name of the evaluation score column.
    extra_eval_columns : dict, optional
        Further evaluation columns and their dtypes (Sandblaster's ``objective`` ...).
    clock : callable, default time.time
        Wall-clock seconds; tests give a fake clock to drive time-dependent decisions.
    """

    def __init__(
        self,
        metric: str,
        extra_eval_columns: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.metric = metric
        self.eval_columns = {**EVAL_COLUMNS, metric: "float64", **(extra_eval_columns or {})}
        self.clock = clock
        self.t0 = clock()
        self.events: list[Event] = []
        self.evals: list[dict[str, Any]] = []
        self.pushes: list[PushRow] = []

    def elapsed(self) -> float:
        """Seconds since training started."""
        return self.clock() - self.t0

    def event(self, kind: str, detail: str = "", **data: Any) -> Event:
        """Record an event now: ``detail`` for people, ``data`` (plain values) for code."""
        event = Event(self.elapsed(), kind, detail, data)
        self.events.append(event)
        return event

    def add_events(self, events: Iterable[tuple]) -> None:
        """Add events recorded elsewhere, already timed relative to :attr:`t0`
        (``(time, kind, detail)`` or ``(time, kind, detail, data)``)."""
        for e in events:
            data = e[3] if len(e) > 3 else None
            self.events.append(Event(float(e[0]), e[1], e[2], dict(data or {})))

    def push(self, row: PushRow | tuple) -> None:
        """Record one acknowledged push."""
        self.pushes.append(PushRow(*row))

    def evaluation(self, **row: Any) -> dict[str, Any]:
        """Record one evaluation (``time`` defaults to now); returns the row, which the caller
        may still fill in (an evaluation scored later)."""
        row.setdefault("time", self.elapsed())
        self.evals.append(row)
        return row

    def last_score(self) -> float:
        """The newest evaluation score that is known (nan before the first)."""
        for row in reversed(self.evals):
            score = row.get(self.metric, math.nan)
            if not math.isnan(score):
                return float(score)
        return math.nan

    def progress(self, **fields: Any) -> Progress:
        """A :class:`Progress` snapshot with the newest score and this run's metric."""
        fields.setdefault("score", self.last_score())
        return Progress(metric=self.metric, **fields)

    def experiment(self, config: dict[str, Any]) -> Experiment:
        """The run's :class:`Experiment`: push rows in time order, evaluations, events."""
        pushes = pd.DataFrame(self.pushes, columns=list(PUSH_COLUMNS)).astype(PUSH_COLUMNS)
        pushes = pushes.sort_values("time", kind="stable").reset_index(drop=True)
        columns = self.eval_columns
        evals = pd.DataFrame(self.evals, columns=list(columns)).astype(columns)
        return Experiment(config, pushes, evals, events_frame(self.events))

    # -- checkpoints -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, list]:
        """The log so far as JSON-able lists (what a checkpoint keeps to resume from)."""
        return {
            "pushes": [[plain(v) for v in row] for row in self.pushes],
            "evals": [{k: plain(v) for k, v in e.items()} for e in self.evals],
            "events": [[e.time, e.kind, e.detail, dict(e.data or {})] for e in self.events],
        }

    def restore(self, meta: dict[str, Any], elapsed: float) -> None:
        """Continue the log of a checkpoint taken ``elapsed`` seconds into its run: the time axis
        goes on from there.  Rows written by older releases (8-field pushes, 3-field events)
        load too."""
        self.t0 = self.clock() - elapsed
        self.evals = [dict(e) for e in meta.get("evals", [])]
        self.events = []
        self.add_events(meta.get("events", []))
        self.pushes = [PushRow(*row) for row in meta.get("pushes", [])]
