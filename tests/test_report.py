"""Summaries and comparison plots of finished runs."""

import math

import pandas as pd
import pytest

from downpour_dask import Experiment
from downpour_dask.report import PLOTS, format_table, plot_runs, report, summarize


def run_with(accuracies, staleness, failures=0, duration=2.0):
    n = len(staleness)
    pushes = pd.DataFrame(
        {
            "time": [duration * (i + 1) / (n + 1) for i in range(n)],
            "replica": [i % 2 for i in range(n)],
            "step": list(range(n)),
            "loss": [1.0 / (i + 1) for i in range(n)],
            "examples": [10] * n,
            "staleness": staleness,
            "version": list(range(1, n + 1)),
            "accepted": [True] * n,
        }
    )
    times = [duration * (i + 1) / len(accuracies) for i in range(len(accuracies))]
    evals = pd.DataFrame(
        {
            "time": times,
            "version": list(range(len(times))),
            "examples_seen": [0] * len(times),
            "loss": [1.0] * len(times),
            "accuracy": accuracies,
        }
    )
    kinds = ["start"] + ["replica_failed"] * failures + ["stop"]
    events = pd.DataFrame(
        {"time": [0.0] * (len(kinds) - 1) + [duration], "kind": kinds, "detail": [""] * len(kinds)}
    )
    return Experiment({"estimator": "DownpourSGD"}, pushes, evals, events)


def test_summary_has_one_row_per_run_with_the_numbers_of_its_log():
    runs = {
        "slow": run_with([0.5, 0.8, 0.92, 0.91], [0, 1, 2, 3], duration=4.0),
        "fast": run_with([0.7, 0.95], [0, 0, 10, 10, 10], failures=2, duration=1.0),
    }
    table = summarize(runs, target=0.9).set_index("run")
    assert list(table.index) == ["slow", "fast"]
    assert table.loc["slow", "final_score"] == 0.91 and table.loc["slow", "best_score"] == 0.92
    assert table.loc["slow", "time_to_target"] == pytest.approx(3.0)  # third of four evals
    assert table.loc["fast", "time_to_target"] == pytest.approx(1.0)
    assert table.loc["slow", "examples_per_s"] == pytest.approx(40 / 4.0)
    assert table.loc["fast", "pushes_per_s"] == pytest.approx(5 / 1.0)
    assert table.loc["fast", "staleness_mean"] == pytest.approx(6.0)
    assert table.loc["fast", "staleness_p95"] == pytest.approx(10.0)
    assert table.loc["fast", "failures"] == 2 and table.loc["slow", "failures"] == 0
    never = summarize(runs, target=0.99)
    assert never["time_to_target"].isna().all()
    text = format_table(summarize(runs, target=0.99))
    assert "slow" in text and "-" in text  # a target never reached prints as "-"


def test_plots_are_written_for_each_kind(tmp_path):
    runs = {"a": run_with([0.5, 0.9], [0, 1, 2]), "b": run_with([0.6], [])}
    written = plot_runs(runs, tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted(PLOTS.values())
    assert all(p.stat().st_size > 1000 for p in written)
    with pytest.raises(ValueError, match="unknown plot"):
        plot_runs(runs, tmp_path, which=["histogram3d"])


def test_report_reads_run_directories_and_defaults_the_target_for_classifiers(tmp_path):
    run_with([0.5, 0.95], [0, 1]).save(tmp_path / "x")
    run_with([0.85], [2]).save(tmp_path / "y")
    table, target, written = report([tmp_path / "x", tmp_path / "y"], tmp_path / "out")
    assert target == 0.9
    assert list(table["run"]) == ["x", "y"]
    assert math.isnan(table["time_to_target"].iloc[1])
    assert (tmp_path / "out" / "summary.csv") in written
    assert pd.read_csv(tmp_path / "out" / "summary.csv")["run"].tolist() == ["x", "y"]
    with pytest.raises(ValueError, match="no run directories"):
        report([], tmp_path / "out")
