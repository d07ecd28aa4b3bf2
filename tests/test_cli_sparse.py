"""``downpour-dask train-sparse`` and ``synthetic --criteo``: click data from the shell."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from downpour_dask.cli.app import run as cli
from downpour_dask.data.criteo import CATEGORICAL, INTEGER, write_criteo
from downpour_dask.log import Experiment
from downpour_dask.runs.sparse_job import load_sparse_tables

CATS = ",".join(CATEGORICAL[:6])
NUMS = ",".join(INTEGER[:3])


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
    root = tmp_path_factory.mktemp("clicks")  # 3 files of 1000 rows, the last of 500 held out
    write_criteo(root, 3500, rows_per_file=1000, seed=0, max_cardinality=200)
    return root


def args(clicks, run_dir, *extra):
    return ["train-sparse", "--data", str(clicks / "part-0000[0-2].parquet"), "--label", "click",
            "--categorical", CATS, "--numeric", NUMS, "--run-dir", str(run_dir), *extra]


BAD = [
    (["--data", "nowhere/*.parquet"], "--data 'nowhere/*.parquet' matches no file"),
    (["--categorical", "C1,C99"], "has no column(s) ['C99']"),
    (["--categorical", "C1,C1"], "--categorical names a column twice"),
    (["--numeric", "C1"], "a column is named twice"),
    (["--label", "clicked"], "has no column(s) ['clicked']"),
    (["--replicas", "4"], "--replicas=4 but --data has 3 file(s)"),
    (["--shards", "0"], "--shards must be an integer >= 1, got 0"),
    (["--max-replicas", "1"], "--max-replicas must be an integer >= 2, got 1"),
    (["--replicas", "all"], "argument --replicas: invalid replicas value: 'all'"),
    (["--n-rows", "0"], "--n-rows must be an integer >= 1"),
    (["--optimizer", "adamw"], "optimizer name must be one of"),
    (["--optimizer", "adam"], "it cannot update table rows; use sgd, momentum, adagrad"),
    (["--optimizer", "momentum:beta2=0.9"], "unknown option(s) ['beta2'] for --optimizer"),
    (["--optimizer", "adagrad:eps"], "'eps' is not option=value"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number > 0"),
    (["--eval-every", "0"], "--eval-every must be a number of seconds > 0"),
    (["--model", "embedding_mlp", "--hidden", "32,x"], "--hidden must be layer widths"),
    (["--eval-data", "nowhere.csv"], "--eval-data 'nowhere.csv' matches no file"),
    (["--model", "tree"], "argument --model: invalid choice: 'tree'"),
    (["--shards", "two"], "argument --shards: invalid int value: 'two'"),
]


@pytest.mark.parametrize(("extra", "message"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_one_line_status_2_and_no_run_directory(clicks, tmp_path, capsys,
                                                             extra, message):
    argv = args(clicks, tmp_path / "run", *extra)
    try:
        status = cli(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists() and list(tmp_path.iterdir()) == []


def test_a_directory_in_the_way_is_refused_and_left_alone(clicks, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert cli(args(clicks, mine)) == 2
    assert "exists" in capsys.readouterr().err
    assert cli(args(clicks, mine, "--overwrite")) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep"


def test_train_sparse_on_a_cluster_writes_a_run_directory(clicks, tmp_path, client, capsys):
    run_dir = tmp_path / "fm"
    held = str(clicks / "part-00003.parquet")
    status = cli(args(clicks, run_dir, "--eval-data", held, "--model", "fm",
                      "--factors", "4", "--n-rows", "4096", "--shards", "2", "--replicas", "auto",
                      "--transform", "log1p", "--batch-size", "100", "--epochs", "2",
                      "--max-replicas", "3", "--scheduler", client.scheduler.address))
    out, err = capsys.readouterr()
    assert status == 0 and f"run directory: {run_dir}" in out
    said, *bar = err.strip().splitlines()  # where it connects, then the progress bar's lines
    assert said.startswith("connecting to") and bar[-1].startswith("100%|")
    assert "test accuracy 0." in bar[-1] and "examples/s" in bar[-1]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.json", "evals.parquet", "events.parquet", "pushes.parquet", "tables.npz"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_config"]["type"] == "factorization_machine" and config["n_shards"] == 2
    assert config["categorical"] == CATS.split(",") and len(config["data_files"]) == 3
    assert config["max_replicas"] == 3  # (no worker joined: no replica was added)
    assert config["n_replicas"] == 2 and config["n_replicas_given"] == "auto"  # 2 workers
    evals = pd.read_parquet(run_dir / "evals.parquet")
    assert list(evals.columns) == ["time", "version", "examples_seen", "loss", "accuracy", "auc"]
    assert evals["examples_seen"].iloc[-1] == 2 * 3000
    assert f"held-out log-loss {evals['loss'].iloc[-1]:.4f}" in out
    pushes = pd.read_parquet(run_dir / "pushes.parquet")
    assert len(pushes) == 2 * 2 * 30  # (2 epochs x 3 files x 10 batches) x 2 shards
    summary = Experiment.load(run_dir).summary()  # what `downpour-dask report` shows
    assert summary["pushes"] == 60 and summary["examples"] == 2 * 3000
    assert summary["final_accuracy"] == evals["accuracy"].iloc[-1]
    dense, (rows,) = load_sparse_tables(run_dir)
    assert dense.shape == (3 + 1,)  # fm: numeric weights and a bias
    assert rows["id"].is_monotonic_increasing and rows["id"].is_unique
    assert rows["id"].between(0, 4095).all() and 0 < len(rows) < 4096
    assert rows.shape[1] == 1 + 1 + 4  # id, the weight and 4 factors


def test_synthetic_criteo_writes_click_files_and_refuses_to_replace_any(tmp_path, capsys):
    out = tmp_path / "clicks"
    assert cli(["synthetic", str(out), "--criteo", "--rows", "900", "--files", "3",
                "--max-cardinality", "50"]) == 0
    files = sorted(out.glob("*.parquet"))
    assert len(files) == 3
    frame = pd.read_parquet(files[0])
    assert len(frame) == 300 and frame.columns[0] == "click"
    assert set(CATEGORICAL) | set(INTEGER) <= set(frame.columns)
    before = [f.stat().st_mtime_ns for f in files]
    capsys.readouterr()
    assert cli(["synthetic", str(out), "--criteo", "--rows", "900"]) == 2
    assert "already holds parquet files" in capsys.readouterr().err
    assert [f.stat().st_mtime_ns for f in files] == before
    assert cli(["synthetic", str(tmp_path / "x"), "--criteo", "--rows", "9",
                "--features", "3"]) == 2
    assert "drop --features" in capsys.readouterr().err
    assert cli(["synthetic", str(tmp_path / "y"), "--rows", "9"]) == 2
    assert "--features is required" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # --files K writes K files even when the rows do not divide evenly (9 rows: 3, 2, 2, 2)
    assert cli(["synthetic", str(tmp_path / "z"), "--criteo", "--rows", "9", "--files", "4",
                "--max-cardinality", "50"]) == 0
    sizes = [len(pd.read_parquet(f)) for f in sorted((tmp_path / "z").glob("*.parquet"))]
    assert sorted(sizes, reverse=True) == [3, 2, 2, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_readme_click_example_runs_end_to_end_as_commands(tmp_path):
    def command(*argv):
        return subprocess.run([sys.executable, "-m", "downpour_dask", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=200, check=False)

    made = command("synthetic", "clicks", "--criteo", "--rows", "25000", "--files", "5")
    assert made.returncode == 0, made.stderr
    done = command("train-sparse", "--data", "clicks/part-0000[0-3].parquet",
                   "--eval-data", "clicks/part-00004.parquet",
                   "--label", "click", "--categorical", ",".join(CATEGORICAL),
                   "--numeric", ",".join(INTEGER), "--transform", "log1p", "--model", "fm",
                   "--n-rows", "65536", "--shards", "2", "--replicas", "2",
                   "--run-dir", "runs/fm", "--quiet")
    assert done.returncode == 0, done.stderr
    evals = pd.read_parquet(tmp_path / "runs" / "fm" / "evals.parquet")
    assert evals["auc"].iloc[-1] > 0.65  # chance: 0.5 (the hidden model is learnable)
    assert np.isfinite(evals["loss"]).all()
