"""Summaries and comparison plots of finished runs."""

import math

import matplotlib
import numpy as np
import pandas as pd
import pytest

from downpour_dask import Experiment
from downpour_dask import report as report_module
from downpour_dask.report import PLOTS, figures, format_table, plot_runs, report, summarize
from downpour_dask.runs.directory import save_run

matplotlib.use("Agg")  # Experiment.plot draws through pyplot: no display in tests


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


def legend_labels(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def legend_beside_the_data(fig, ax) -> bool:
    fig.draw_without_rendering()
    return ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def test_plots_have_titles_run_names_the_target_and_legends_beside_the_data():
    runs = {"adagrad-4": run_with([0.5, 0.92], [0, 1, 2]), "sgd-1": run_with([0.6, 0.8], [3])}
    drawn = figures(runs, target=0.9)
    accuracy = drawn["accuracy"].axes[0]
    assert accuracy.get_title() == "Test accuracy against time"
    assert legend_labels(accuracy) == ["adagrad-4", "sgd-1", "target 0.9"]
    target = [line for line in accuracy.lines if line.get_label() == "target 0.9"]
    assert len(target) == 1 and set(target[0].get_ydata()) == {0.9}  # a horizontal line
    loss = drawn["loss"].axes[0]
    assert loss.get_title() == "Training and test loss against time"
    assert legend_labels(loss) == [
        "adagrad-4 (training)", "adagrad-4 (test)", "sgd-1 (training)", "sgd-1 (test)",
    ]  # fmt: skip
    assert drawn["staleness"].axes[0].get_title() == "Staleness of pushes"
    assert legend_labels(drawn["staleness"].axes[0]) == ["adagrad-4", "sgd-1"]
    for kind, fig in drawn.items():
        assert legend_beside_the_data(fig, fig.axes[0]), kind
    untargeted = figures(runs, which=["accuracy"])["accuracy"].axes[0]
    assert legend_labels(untargeted) == ["adagrad-4", "sgd-1"]  # no target, no line


def test_report_draws_its_target_and_a_run_directory_names_its_run(tmp_path, monkeypatch):
    run_with([0.5, 0.95], [0, 1]).save(tmp_path / "x")
    seen = {}
    real = report_module.figures

    def spy(runs, which, target):
        seen["figures"] = real(runs, which, target)
        return seen["figures"]

    monkeypatch.setattr(report_module, "figures", spy)
    report([tmp_path / "x"], tmp_path / "out", target=0.93)
    assert "target 0.93" in legend_labels(seen["figures"]["accuracy"].axes[0])
    save_run(tmp_path / "my-run", run_with([0.5, 0.9], [0, 1]), np.zeros(3, np.float32))
    assert legend_labels(seen["figures"]["accuracy"].axes[0]) == ["my-run"]  # not "run"
    assert (tmp_path / "my-run" / "accuracy_vs_time.png").is_file()


def test_experiment_plot_labels_its_line_and_draws_the_target():
    ax = run_with([0.5, 0.9], [0]).plot(label="4 replicas", target=0.85)
    assert ax.get_title() == "Test accuracy against time"
    assert legend_labels(ax) == ["4 replicas", "target 0.85"]
    assert legend_beside_the_data(ax.figure, ax)
    again = run_with([0.6, 0.7], [0]).plot(ax=ax, label="1 replica")
    assert again is ax and legend_labels(ax)[-1] == "1 replica"
    assert legend_labels(run_with([0.5], [0]).plot()) == ["DownpourSGD"]
