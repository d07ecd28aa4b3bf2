"""Compare finished runs: one summary row per run and plots of them side by side.

``downpour-dask report RUN_DIR [RUN_DIR ...]`` prints :func:`summarize`'s table and writes
:func:`plot_runs`' PNG files (the target score drawn on the accuracy plot); both work on
:class:`~downpour_dask.Experiment` objects too, and :func:`figures` returns the plots as
figures, so a notebook can compare runs it has just made without saving them.

Plots are drawn on :class:`matplotlib.figure.Figure` objects, never through ``pyplot``, so
writing them neither needs a display nor disturbs a notebook's inline backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .log import Experiment

#: Columns of the summary table, in order.
SUMMARY_COLUMNS = (
    "run",
    "algorithm",
    "metric",
    "final_score",
    "best_score",
    "time_to_target",
    "duration",
    "examples_per_s",
    "pushes_per_s",
    "staleness_mean",
    "staleness_p95",
    "failures",
)

#: The PNG files :func:`plot_runs` can write.
PLOTS = {
    "accuracy": "accuracy_vs_time.png",
    "loss": "loss_vs_time.png",
    "staleness": "staleness_histogram.png",
}


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Experiment]:
    """Load run directories, keyed by a label (the directory name, made unique if needed)."""
    runs: dict[str, Experiment] = {}
    for path in paths:
        label = Path(path).resolve().name
        while label in runs:
            label += "'"
        runs[label] = Experiment.load(path)
    if not runs:
        raise ValueError("no run directories given")
    return runs


def summarize(runs: Mapping[str, Experiment], target: float | None = None) -> pd.DataFrame:
    """One row per run: final/best score, time to ``target``, throughput, staleness, failures.

    ``time_to_target`` is the seconds from the start of fit until an evaluation first reached
    ``target`` (``nan`` if it never did or no target was given).
    """
    rows = []
    for label, run in runs.items():
        s = run.summary()
        metric = run.metric
        rows.append(
            {
                "run": label,
                "algorithm": run.config.get("estimator", ""),
                "metric": metric,
                "final_score": s.get(f"final_{metric}", np.nan),
                "best_score": s.get(f"best_{metric}", np.nan),
                "time_to_target": np.nan if target is None else run.time_to(target),
                "duration": s["duration"],
                "examples_per_s": s["examples_per_s"],
                "pushes_per_s": s["pushes_per_s"],
                "staleness_mean": s["staleness_mean"],
                "staleness_p95": s["staleness_p95"],
                "failures": int(s["failures"]),
            }
        )
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def format_table(table: pd.DataFrame) -> str:
    """The summary table as aligned text, numbers rounded for reading."""
    shown = table.copy()
    for column, digits in (
        ("final_score", 3),
        ("best_score", 3),
        ("time_to_target", 2),
        ("duration", 2),
        ("examples_per_s", 0),
        ("pushes_per_s", 0),
        ("staleness_mean", 1),
        ("staleness_p95", 1),
    ):
        shown[column] = shown[column].round(digits)
    return shown.to_string(index=False, na_rep="-")


def plot_runs(
    runs: Mapping[str, Experiment],
    out: str | os.PathLike[str],
    which: Iterable[str] = tuple(PLOTS),
    target: float | None = None,
) -> list[Path]:
    """Write comparison plots of ``runs`` into directory ``out``; return the files written.

    See :func:`figures` for what each plot shows.  Needs matplotlib (the ``plot`` extra).
    """
    drawn = figures(runs, which, target)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, fig in drawn.items():
        path = directory / PLOTS[kind]
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def figures(
    runs: Mapping[str, Experiment],
    which: Iterable[str] = tuple(PLOTS),
    target: float | None = None,
) -> dict[str, Any]:
    """The comparison plots of ``runs`` as :class:`matplotlib.figure.Figure` objects, by kind.

    ``accuracy``: the evaluation score against wall time, with ``target`` as a dashed line;
    ``loss``: training loss (pushes, smoothed) and evaluation loss against wall time;
    ``staleness``: a histogram of push staleness per run.  Every line is labelled with its run's
    name (the keys of ``runs``), in a legend beside the axes, never over the data.
    """
    from matplotlib.figure import Figure  # optional dependency: imported only when plotting

    which = list(which)
    unknown = set(which) - set(PLOTS)
    if unknown:
        raise ValueError(f"unknown plot(s) {sorted(unknown)}; allowed: {', '.join(PLOTS)}")
    drawn = {}
    for kind in which:
        fig = Figure(figsize=(7.6, 4.2), layout="constrained")
        ax = fig.add_subplot()
        _DRAW[kind](ax, runs, target)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                      fontsize="small", frameon=False)  # fmt: skip
        drawn[kind] = fig
    return drawn


def _draw_accuracy(ax: Any, runs: Mapping[str, Experiment], target: float | None) -> None:
    metrics = set()
    for label, run in runs.items():
        e = run.evals
        if len(e) and run.metric in e:
            scored = e.dropna(subset=[run.metric])
            ax.plot(scored["time"], scored[run.metric], marker=".", label=label)
            metrics.add(run.metric)
    metric = "/".join(sorted(metrics)) or "accuracy"
    if target is not None:
        ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_title(f"Test {metric} against time")
    ax.set_xlabel("seconds since fit started")
    ax.set_ylabel(f"test {metric}")
    ax.grid(alpha=0.3)


def _draw_loss(ax: Any, runs: Mapping[str, Experiment], target: float | None) -> None:
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"
        p = run.pushes
        if len(p):
            window = max(1, len(p) // 50)
            smooth = p["loss"].rolling(window, min_periods=1).median()
            ax.plot(p["time"], smooth, color=color, alpha=0.5, label=f"{label} (training)")
        e = run.evals
        if len(e):
            ax.plot(e["time"], e["loss"], color=color, marker=".", label=f"{label} (test)")
    ax.set_title("Training and test loss against time")
    ax.set_xlabel("seconds since fit started")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _draw_staleness(ax: Any, runs: Mapping[str, Experiment], target: float | None) -> None:
    stale = {label: run.pushes["staleness"].to_numpy() for label, run in runs.items()}
    top = max((int(s.max()) for s in stale.values() if len(s)), default=0)
    bins = np.arange(top + 2) - 0.5
    for label, values in stale.items():
        if len(values):
            ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=label, density=True)
    ax.set_title("Staleness of pushes")
    ax.set_xlabel("staleness (updates applied between a replica's fetch and its push)")
    ax.set_ylabel("fraction of pushes")
    ax.grid(alpha=0.3)


_DRAW = {"accuracy": _draw_accuracy, "loss": _draw_loss, "staleness": _draw_staleness}


def report(
    paths: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    target: float | None = None,
) -> tuple[pd.DataFrame, float | None, list[Path]]:
    """Summarise run directories: write ``summary.csv`` and the plots into ``out``.

    ``target`` defaults to 0.9 when every run is a classifier (none for regression runs).
    Returns the summary table, the target used and the files written.  Plots are skipped (the
    CSV is still written) when matplotlib is not installed.
    """
    runs = load_runs(paths)
    if target is None and all(run.metric == "accuracy" for run in runs.values()):
        target = 0.9
    table = summarize(runs, target)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    table.to_csv(directory / "summary.csv", index=False)
    written = [directory / "summary.csv"]
    try:
        written += plot_runs(runs, directory, target=target)
    except ImportError:
        pass
    return table, target, written
