"""The experiment log of one training run: pushes, evaluations and events as pandas DataFrames.

Every run of :class:`~downpour_dask.DownpourSGD` produces an :class:`Experiment`.  It is the
record a user analyses afterwards (accuracy against wall time, staleness, failures), and it is
saved in safe formats only -- parquet tables plus a JSON config -- so loading a run never
executes code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd


class PushRow(NamedTuple):
    """One acknowledged push: a row of :attr:`Experiment.pushes`.

    Replicas build these on their workers and the driver collects them; the field order is the
    column order of the table (:data:`PUSH_COLUMNS`).
    """

    time: float  # seconds since fit started, when the push was acknowledged
    replica: int
    step: int  # the replica's step count when it pushed
    loss: float  # mean training loss over the minibatches accrued in this push
    examples: int  # examples accrued in this push
    staleness: int  # max over shards of updates applied between fetch and push
    version: int  # min over shards of the version after applying this push
    accepted: bool  # False when a shard refused the push (non-finite gradient)
    # Which partition of a model-parallel replica pushed (its own parameter range); 0 without
    # model parallelism.  A replica split in P partitions makes P rows per push, one each.
    partition: int = 0
    bytes_sent: int = 0  # bytes of gradient the push sent over all shards (see top_k)


_PUSH_DTYPES = ("float64", "int64", "int64", "float64", "int64", "int64", "int64", "bool", "int64",
                "int64")  # fmt: skip
#: Columns of :attr:`Experiment.pushes` and their dtypes, one row per replica push.
PUSH_COLUMNS = dict(zip(PushRow._fields, _PUSH_DTYPES))
#: Columns of :attr:`Experiment.evals`; ``accuracy`` for classifiers, ``r2`` for regression.
EVAL_COLUMNS = {
    "time": "float64",
    "version": "int64",
    "examples_seen": "int64",
    "loss": "float64",
}


class Event(NamedTuple):
    """One row of :attr:`Experiment.events`.

    ``detail`` is the sentence a person reads; ``data`` holds the same facts as plain values
    (e.g. ``{"shard": 0, "version": 812, "lost_updates": 3}``) for code to read, so wording can
    change without breaking anyone.  Each event kind documents its keys where it is recorded.
    """

    time: float
    kind: str
    detail: str = ""
    data: dict[str, Any] | None = None


#: Columns of :attr:`Experiment.events`.  ``data`` holds a dict per row (stored as JSON).
EVENT_COLUMNS = {"time": "float64", "kind": "object", "detail": "object", "data": "object"}


def events_frame(events: Iterable[Event]) -> pd.DataFrame:
    """The events table, in time order; each row gets its own copy of its event's data."""
    rows = [e._replace(data=dict(e.data or {})) for e in events]
    return typed_frame(sorted(rows, key=lambda e: e.time), EVENT_COLUMNS)


def typed_frame(rows: list[tuple], columns: dict[str, str]) -> pd.DataFrame:
    """A DataFrame of ``rows`` (tuples in ``columns``' order) with exactly ``columns``' dtypes.

    Built column by column from typed arrays: a frame built from the rows and then cast (pandas
    infers every column, strings as its string dtype, and converts back) costs about three
    times as much, and every fit builds its experiment this way once at its end.
    """
    values = list(zip(*rows)) if rows else [()] * len(columns)
    data = {}
    for (name, dtype), column in zip(columns.items(), values):
        if dtype == "object":  # item by item: a dict or list must not become a dimension
            array = np.empty(len(rows), dtype)
            for i, value in enumerate(column):
                array[i] = value
        else:
            array = np.array(column, dtype)
        data[name] = pd.Series(array, dtype=dtype, copy=False)
    return pd.DataFrame(data)


_FILES = ("config.json", "pushes.parquet", "evals.parquet", "events.parquet")


@dataclass(frozen=True)
class Progress:
    """A snapshot of a running fit, handed to ``fit(..., callback=)`` a few times a second.

    It is what a progress bar or a notebook widget needs, read from the parameter server's
    counters (a few bytes per shard), never from the parameter vector itself.

    Attributes
    ----------
    time : float
        Seconds since fit started.
    examples : int
        Training examples in the gradients the parameter server has applied.
    pushes : int
        Pushes the parameter server has applied (counted on shard 0).
    loss : float
        Recent training loss: a moving average over the latest pushes (``nan`` before the first).
    score : float
        Latest evaluation score on ``eval_data`` (``nan`` if none yet), named by ``metric``.
    metric : str
        ``"accuracy"`` or ``"r2"``.
    fraction : float
        Estimated fraction of the run done, from whichever of ``max_epochs``/``max_steps``/
        ``max_seconds`` is nearest to its end; in [0, 1].
    phase : str
        ``"warmstart"`` while one replica trains alone, then ``"training"``, and ``"done"`` for
        the last snapshot, taken after the final evaluation.
    """

    time: float
    examples: int
    pushes: int
    loss: float
    score: float
    metric: str
    fraction: float
    phase: str

    @property
    def pushes_per_s(self) -> float:
        """Mean applied pushes per second since fit started."""
        return self.pushes / self.time if self.time > 0 else math.nan


def empty_frame(columns: dict[str, str]) -> pd.DataFrame:
    """An empty DataFrame with the given column dtypes."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in columns.items()})


def is_run_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory a run wrote: it holds a ``config.json`` whose content is
    a JSON object (what :meth:`Experiment.save` writes)."""
    config = Path(path) / "config.json"
    if Path(path).is_symlink() or not config.is_file():
        return False
    try:
        return isinstance(json.loads(config.read_text()), dict)
    except (ValueError, OSError):
        return False


def check_replaceable(target: str | os.PathLike[str], overwrite: bool) -> None:
    """Refuse to write run directory ``target`` over something it may not replace.

    Raises
    ------
    FileExistsError
        If ``target`` exists and ``overwrite`` is False, or it exists and is not a run
        directory (see :func:`is_run_directory`): ``overwrite`` replaces only a run directory.
        Nothing is deleted either way.
    """
    target = Path(target)
    if not (target.exists() or target.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(
            f"run directory {str(target)!r} exists; choose another name, or replace it with "
            f"--overwrite (overwrite=True in Python)"
        )
    if not is_run_directory(target):
        what = "a directory" if target.is_dir() else "a file"
        raise FileExistsError(
            f"{str(target)!r} exists and is {what} without a run's config.json, so it is not a "
            f"run directory: --overwrite (overwrite=True) replaces only a run directory; "
            f"nothing was deleted, choose another name or remove it yourself"
        )



class Experiment:
    """Pushes, evaluations and events of one run, plus the run's configuration.

    Parameters
    ----------
    config : dict
        JSON-serialisable description of the run (estimator arguments, model, data sizes).
    pushes, evals, events : DataFrame, optional
        The three logs; see :data:`PUSH_COLUMNS`, :data:`EVAL_COLUMNS`, :data:`EVENT_COLUMNS`.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        pushes: pd.DataFrame | None = None,
        evals: pd.DataFrame | None = None,
        events: pd.DataFrame | None = None,
    ):
        self.config: dict[str, Any] = dict(config or {})
        self.pushes = pushes if pushes is not None else empty_frame(PUSH_COLUMNS)
        self.evals = evals if evals is not None else empty_frame(EVAL_COLUMNS)
        self.events = events if events is not None else empty_frame(EVENT_COLUMNS)
        if "data" not in self.events:  # a log written before events carried data
            self.events = self.events.assign(data=[{} for _ in range(len(self.events))])

    def __repr__(self) -> str:
        return (
            f"Experiment(pushes={len(self.pushes)} rows, evals={len(self.evals)} rows, "
            f"events={len(self.events)} rows)"
        )

    # -- summary ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """Headline numbers of the run: final/best score, throughput and staleness.

        Returns
        -------
        dict
            ``duration`` (s), ``pushes``, ``examples``, ``examples_per_s``, ``pushes_per_s``,
            ``staleness_mean``, ``staleness_p95``, ``refused_pushes``, ``failures`` and, when
            the run was evaluated, ``final_<metric>`` / ``best_<metric>`` / ``final_loss``.
        """
        p, e = self.pushes, self.evals
        first = p[p["partition"] == 0] if "partition" in p else p  # one row per replica push
        if "shard" in p:  # a sparse fit's log (fit_sparse): a row per push and shard
            first = p[p["shard"] == 0]
        stop = self.events.loc[self.events["kind"] == "stop", "time"]
        duration = float(stop.iloc[-1]) if len(stop) else float(p["time"].max() if len(p) else 0)
        out: dict[str, float] = {
            "duration": duration,
            "pushes": float(len(first)),
            "examples": float(first["examples"].sum()) if len(first) else 0.0,
        }
        out["examples_per_s"] = out["examples"] / duration if duration > 0 else float("nan")
        out["pushes_per_s"] = out["pushes"] / duration if duration > 0 else float("nan")
        stale = p["staleness"].to_numpy() if len(p) else np.zeros(0)
        out["staleness_mean"] = float(stale.mean()) if len(stale) else float("nan")
        out["staleness_p95"] = float(np.percentile(stale, 95)) if len(stale) else float("nan")
        out["refused_pushes"] = float((~p["accepted"].astype(bool)).sum()) if len(p) else 0.0
        failure_kinds = ("replica_failed", "shard_lost", "worker_lost")
        out["failures"] = float(self.events["kind"].isin(failure_kinds).sum())
        metric = self.metric
        if len(e) and metric in e:
            out[f"final_{metric}"] = float(e[metric].iloc[-1])
            out[f"best_{metric}"] = float(e[metric].max())
            out["final_loss"] = float(e["loss"].iloc[-1])
        return out

    @property
    def metric(self) -> str:
        """Name of the evaluation score column: ``"accuracy"`` or ``"r2"``."""
        return "r2" if "r2" in self.evals.columns else "accuracy"

    def time_to(self, target: float) -> float:
        """Seconds from the start of fit until an evaluation first reached ``target`` score.

        Returns ``nan`` if the run never reached it.
        """
        e = self.evals
        if not len(e) or self.metric not in e:
            return float("nan")
        hit = e.loc[e[self.metric] >= target, "time"]
        return float(hit.iloc[0]) if len(hit) else float("nan")

    # -- persistence -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the run to directory ``path`` as ``config.json`` plus three parquet files.

        The files are written into a temporary sibling directory that is renamed into place, so an
        interrupted save never leaves a half-written run directory behind.

        Raises
        ------
        FileExistsError
            If ``path`` exists and ``overwrite`` is False, or it is not a run directory
            (:func:`check_replaceable`: ``overwrite`` never replaces a user's directory).
        """
        target = Path(path)
        check_replaceable(target, overwrite)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        tmp.chmod(directory_mode())  # mkdtemp makes it private; a run directory is not
        try:
            with open(tmp / "config.json", "w") as f:
                json.dump(self.config, f, indent=2, sort_keys=True, default=_json_default)
            self.pushes.to_parquet(tmp / "pushes.parquet", index=False)
            self.evals.to_parquet(tmp / "evals.parquet", index=False)
            events = self.events.astype({"kind": str, "detail": str})
            events["data"] = [_dump_data(d) for d in events["data"]]
            events.to_parquet(tmp / "events.parquet", index=False)
            if target.exists() or target.is_symlink():
                check_replaceable(target, overwrite)  # it may have changed meanwhile
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Experiment:
        """Read a run directory written by :meth:`save` (parquet and JSON only: no pickles).

        Raises
        ------
        FileNotFoundError
            If ``path`` is not a run directory (names the missing file).
        """
        src = Path(path)
        missing = [name for name in _FILES if not (src / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{str(src)!r} is not a run directory: missing {', '.join(missing)}"
            )
        with open(src / "config.json") as f:
            config = json.load(f)
        pushes = pd.read_parquet(src / "pushes.parquet")
        if "partition" not in pushes:  # written before model parallelism existed
            pushes["partition"] = np.zeros(len(pushes), dtype="int64")
        events = pd.read_parquet(src / "events.parquet")
        if "data" in events:
            events["data"] = [json.loads(d) if d else {} for d in events["data"]]
        return cls(config, pushes, pd.read_parquet(src / "evals.parquet"), events)

    # -- plots -----------------------------------------------------------------------------------
    def plot(self, ax: Any = None, label: str | None = None, target: float | None = None) -> Any:
        """Plot the evaluation score against wall time (needs matplotlib, the ``plot`` extra).

        Parameters
        ----------
        ax : matplotlib Axes, optional
            Where to draw (default: a new figure); call once per run on the same ``ax`` to
            compare runs.
        label : str, optional
            The line's name in the legend (default: the estimator's name from the config).
        target : float, optional
            A score to draw as a dashed horizontal line.

        Returns
        -------
        matplotlib Axes
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        metric = self.metric
        if label is None:
            label = str(self.config.get("estimator") or "run")
        if len(self.evals) and metric in self.evals:
            scored = self.evals.dropna(subset=[metric])
            ax.plot(scored["time"], scored[metric], marker=".", label=label)
        if target is not None:
            ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_title(f"Test {metric} against time")
        ax.set_xlabel("seconds since fit started")
        ax.set_ylabel(f"test {metric}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                  fontsize="small", frameon=False)  # beside the axes, not over the data
        return ax


def directory_mode() -> int:
    """The permissions a new directory gets under the process's umask (e.g. 0o755)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def plain(value: Any) -> Any:
    """A JSON- and msgpack-friendly scalar: numpy scalars become Python numbers."""
    return value.item() if isinstance(value, np.generic) else value


def _dump_data(data: Any) -> str:
    """An event's data dict as JSON text (parquet holds no free-form dicts)."""
    return json.dumps(data or {}, sort_keys=True, default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"config value of type {type(obj).__name__} is not JSON-serialisable")
