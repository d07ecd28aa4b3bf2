import json

import numpy as np
import pandas as pd
import pytest

from downpour_dask import Experiment
from downpour_dask.base import RunRecorder
from downpour_dask.log import EVENT_COLUMNS, PUSH_COLUMNS, PushRow


def _experiment():
    pushes = pd.DataFrame(
        {
            "time": [0.1, 0.2, 0.3],
            "replica": [0, 1, 0],
            "step": [0, 0, 1],
            "loss": [2.0, 1.9, 1.5],
            "examples": [32, 32, 32],
            "staleness": [0, 1, 3],
            "version": [1, 2, 3],
            "accepted": [True, True, False],
            "partition": [0, 0, 0],
        }
    )
    evals = pd.DataFrame(
        {
            "time": [0.5, 1.0],
            "version": [2, 3],
            "examples_seen": [64, 96],
            "loss": [1.8, 1.2],
            "accuracy": [0.5, 0.9],
        }
    )
    events = pd.DataFrame({"time": [0.0, 1.2], "kind": ["start", "stop"], "detail": ["", "done"]})
    return Experiment({"n_replicas": 2, "shape": (1, 2)}, pushes, evals, events)


def test_save_and_load_round_trip_without_pickles(tmp_path):
    run = _experiment()
    path = run.save(tmp_path / "runs" / "a")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "evals.parquet",
        "events.parquet",
        "pushes.parquet",
    ]
    assert json.loads((path / "config.json").read_text())["shape"] == [1, 2]
    back = Experiment.load(path)
    pd.testing.assert_frame_equal(back.pushes, run.pushes)
    pd.testing.assert_frame_equal(back.evals, run.evals)
    assert list(back.events["kind"]) == ["start", "stop"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["a"]  # no temporary left over


def test_a_run_saved_before_model_parallelism_loads_with_partition_zero(tmp_path):
    run = _experiment()
    run.pushes = run.pushes.drop(columns="partition")  # the push log as saved before
    back = Experiment.load(run.save(tmp_path / "old"))
    assert back.pushes["partition"].tolist() == [0, 0, 0]
    assert back.summary()["pushes"] == 3


def test_summary_counts_a_model_parallel_push_once_not_once_per_partition():
    run = _experiment()
    both = pd.concat([run.pushes, run.pushes.assign(partition=1)], ignore_index=True)
    split = Experiment(run.config, both, run.evals, run.events)
    assert split.summary()["pushes"] == run.summary()["pushes"] == 3
    assert split.summary()["examples"] == run.summary()["examples"] == 96


def test_save_refuses_to_overwrite_and_leaves_nothing_half_written(tmp_path):
    run = _experiment()
    run.save(tmp_path / "a")
    overwrite = r"replace it with --overwrite \(overwrite=True in Python\)"
    with pytest.raises(FileExistsError, match=overwrite):
        run.save(tmp_path / "a")
    bad = Experiment({"oops": object()}, run.pushes, run.evals, run.events)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        bad.save(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_overwrite_replaces_a_run_directory_and_never_a_users_directory(tmp_path):
    run = _experiment()
    run.save(tmp_path / "a")
    assert run.save(tmp_path / "a", overwrite=True) == tmp_path / "a"  # a run: replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="not a run directory.*nothing was deleted"):
        run.save(mine, overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "mine"]  # no staging left


def test_load_names_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run directory: missing config.json"):
        Experiment.load(tmp_path)


def test_summary_and_time_to_target():
    run = _experiment()
    s = run.summary()
    assert s["duration"] == 1.2 and s["pushes"] == 3 and s["examples"] == 96
    assert s["examples_per_s"] == pytest.approx(80.0)
    assert s["staleness_mean"] == pytest.approx(4 / 3)
    assert s["staleness_p95"] == pytest.approx(np.percentile([0, 1, 3], 95))
    assert s["refused_pushes"] == 1 and s["final_accuracy"] == 0.9 and s["best_accuracy"] == 0.9
    assert run.time_to(0.8) == 1.0 and np.isnan(run.time_to(0.95))


def test_event_data_round_trips_through_a_run_directory(tmp_path):
    run = _experiment()
    run.events["data"] = [
        {"n_replicas": 2, "n_shards": 2, "n_workers": 2},
        {"versions": [12, 15]},
    ]
    back = Experiment.load(run.save(tmp_path / "run"))
    assert list(back.events["data"]) == [
        {"n_replicas": 2, "n_shards": 2, "n_workers": 2},
        {"versions": [12, 15]},
    ]
    assert list(back.events["detail"]) == ["", "done"]


def test_a_run_directory_written_before_events_had_data_loads_with_empty_data(tmp_path):
    run = _experiment()
    path = run.save(tmp_path / "old")
    old = pd.DataFrame({"time": [0.0, 1.2], "kind": ["start", "stop"], "detail": ["", "done"]})
    old.to_parquet(path / "events.parquet", index=False)  # the events table as saved before
    back = Experiment.load(path)
    assert list(back.events["data"]) == [{}, {}]
    assert list(back.events["kind"]) == ["start", "stop"] and back.summary()["duration"] == 1.2


def test_a_recorders_experiment_has_its_documented_dtypes_rows_in_time_order():
    """What every fit returns as ``experiment_``: each column of the documented dtype (strings
    and event data as objects, not pandas' string dtype), pushes and events in time order with
    ties kept in arrival order, an evaluation without its score a NaN, each event's data a copy."""
    recorder = RunRecorder("accuracy", clock=lambda: 0.0)
    for time_, replica in ((2.0, 0), (1.0, 1), (2.0, 2), (0.5, 3)):
        recorder.push(PushRow(time_, replica, 1, 0.5, 32, 0, 7, True, 0, 100))
    data = {"shard": 1, "versions": [3, 4]}
    recorder.add_events([(3.0, "stop", "done", data), (1.0, "start", "go")])
    recorder.evaluation(time=1.5, version=4, examples_seen=64, loss=0.7)  # scored later: never
    run = recorder.experiment({"estimator": "test"})
    assert run.pushes.dtypes.to_dict() == {k: np.dtype(v) for k, v in PUSH_COLUMNS.items()}
    assert run.pushes["replica"].tolist() == [3, 1, 0, 2]
    assert run.events.dtypes.to_dict() == {k: np.dtype(v) for k, v in EVENT_COLUMNS.items()}
    assert run.events["kind"].tolist() == ["start", "stop"]
    assert run.events["data"].tolist() == [{}, {"shard": 1, "versions": [3, 4]}]
    data["shard"] = 9  # the recorder's copy, and the frame's, stay as recorded
    assert run.events["data"].iloc[1]["shard"] == 1
    assert run.evals.dtypes.to_dict() == {k: np.dtype(v) for k, v in recorder.eval_columns.items()}
    assert run.evals["version"].tolist() == [4] and np.isnan(run.evals["accuracy"].iloc[0])
    empty = RunRecorder("r2").experiment({})
    assert len(empty.pushes) == 0 and list(empty.pushes.columns) == list(PUSH_COLUMNS)
    assert empty.pushes.dtypes.to_dict() == {k: np.dtype(v) for k, v in PUSH_COLUMNS.items()}
