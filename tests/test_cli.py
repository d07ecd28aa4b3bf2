"""The ``downpour-dask`` command: end to end as a user runs it (a subprocess; slow), and its
parser in-process."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from downpour_dask import cli, runs
from downpour_dask.runtime.cluster import cluster_workers

SCRIPT = Path(sys.executable).with_name("downpour-dask")
SMALL = ["--dataset", "digits", "--model", "mlp:32", "--max-epochs", "1", "--n-replicas", "2"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "downpour_dask"]
    return subprocess.run(
        command + list(args), capture_output=True, text=True, timeout=timeout, check=False
    )


def config_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_writes_a_complete_run_directory(tmp_path):
    done = run_cli("train", *SMALL, "--out", str(tmp_path), "--name", "small", "--seed", "3")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "small"
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.json",
        "pushes.parquet",
        "evals.parquet",
        "events.parquet",
        "params.npz",
        "accuracy_vs_time.png",
        "loss_vs_time.png",
    }
    assert f"run directory: {run_dir}" in done.stdout
    accuracy = float(done.stdout.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.6  # one epoch of two replicas: it learned (chance is 0.1)
    config = config_of(run_dir)
    assert config["n_replicas"] == 2 and config["random_state"] == 3
    assert config["model"]["hidden"] == [32] and config["dataset"] == "digits"
    assert "100%" in done.stderr  # the progress line reached the end
    experiment, model, params = runs.load_run(run_dir)
    test = runs.load_dataset("digits")[1]
    assert model.score(params, test.X, test.y) == pytest.approx(accuracy, abs=5e-4)
    assert len(experiment.pushes) > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_config_file_sets_arguments_and_flags_override_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'dataset = "digits"\nmodel = "softmax"\nn_replicas = 3\nlearning-rate = 0.02\n'
        "max_epochs = 1\nwarmstart_steps = 0\n"
    )
    done = run_cli(
        "train", "--config", str(config), "--learning-rate", "0.03",
        "--out", str(tmp_path), "--name", "cfg", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # --quiet: no progress line
    settings = config_of(tmp_path / "cfg")
    assert settings["n_replicas"] == 3  # from the file
    assert settings["learning_rate"] == 0.03  # the flag won
    assert settings["model"]["type"] == "SoftmaxRegression"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scheduler_flag_trains_on_an_existing_cluster(tmp_path, cluster, client):
    done = run_cli(
        "train", *SMALL, "--scheduler", cluster.scheduler_address,
        "--out", str(tmp_path), "--name", "remote", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workers = sorted(cluster_workers(client))
    assert config_of(tmp_path / "remote")["workers"] == workers  # not an embedded cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--learning-rate", "-0.1"], "learning_rate must be a finite number > 0, got -0.1"),
        (["--dataset", "imagenet"], "dataset 'imagenet' is neither a shipped dataset"),
        (["--n-replicas", "two"], "argument --n-replicas: expected an integer, got 'two'"),
        (["--model", "mlp:64,x"], "hidden widths must be integers"),
        (["--model", "cnn"], "unknown model 'cnn'"),
        (["--optimizer", "rmsprop"], "optimizer"),
        (["--algorithm", "hogwild"], "invalid choice: 'hogwild'"),
        (["--scheduler", "tcp://127.0.0.1:{port}", "--connect-timeout", "2"], "cannot reach"),
        (["--config", "missing.toml"], "cannot read --config"),
        (["--model", "softmax", "--partitions", "2"], "SoftmaxRegression has no hidden layer"),
        (["--model", "mlp:8,1", "--partitions", "2"], "partitions must be between 1 and 1"),
    ],
)
def test_bad_input_is_one_line_a_nonzero_status_and_no_run_directory(tmp_path, args, message):
    args = [a.replace("{port}", str(free_port())) for a in args]
    out = tmp_path / "runs"
    done = run_cli("train", *SMALL[:2], *args, "--out", str(out), "--name", "bad", timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0] and "Traceback" not in done.stderr
    assert not (out / "bad").exists()
    assert not out.exists() or not any(out.iterdir())  # no temporary leftovers either


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_partitions_flag_splits_every_replica_over_two_workers(tmp_path, cluster):
    done = run_cli(
        "train", *SMALL, "--partitions", "2", "--scheduler", cluster.scheduler_address,
        "--out", str(tmp_path), "--name", "split", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    experiment, model, params = runs.load_run(tmp_path / "split")
    assert config_of(tmp_path / "split")["partitions"] == 2
    assert sorted(experiment.pushes["partition"].unique()) == [0, 1]
    assert params.shape == (model.layout.size,)  # saved in the model's own layout
    test = runs.load_dataset("digits")[1]
    assert model.score(params, test.X, test.y) > 0.6


@pytest.mark.slow
def test_an_existing_run_directory_is_not_overwritten(tmp_path):
    (tmp_path / "taken").mkdir()
    done = run_cli("train", *SMALL, "--out", str(tmp_path), "--name", "taken")
    assert done.returncode == 2
    assert "run directory" in done.stderr and "exists" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_synthetic_writes_files_that_train_streams(tmp_path):
    data = tmp_path / "big"
    done = run_cli(
        "synthetic", str(data), "--rows", "6000", "--features", "16", "--classes", "3",
        "--files", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in data.iterdir()) == [f"part-0000{i}.parquet" for i in range(3)]
    done = run_cli(
        "train", "--dataset", str(data), "--eval-dataset", str(data / "part-00000.parquet"),
        "--model", "softmax", "--n-replicas", "3", "--max-epochs", "3", "--learning-rate", "0.2",
        "--out", str(tmp_path / "runs"), "--name", "streamed", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split("test accuracy: ")[1].split()[0]) > 0.6  # chance: ~0.33
    data_info = config_of(tmp_path / "runs" / "streamed")["data"]
    assert data_info["kind"] == "parquet" and data_info["rows"] == 6000


def train_parser():
    return cli.build_parser()._subparsers._group_actions[0].choices["train"]


def flag_help(dest: str) -> str:
    return next(action.help for action in train_parser()._actions if action.dest == dest)


def test_every_estimator_argument_has_a_flag():
    dests = {action.dest for action in train_parser()._actions}
    # Deliberately flag-less: ``security`` (a distributed.Security object, not a scalar) is set
    # by --tls (embedded TLS-only cluster) or given to the client by --tls-ca-file/-cert/-key.
    assert set(cli.FLAGLESS_ARGUMENTS) == {"security"}
    assert {"tls", "tls_ca_file", "tls_cert", "tls_key"} <= dests
    for algorithm in runs.ALGORITHMS:
        missing = set(runs.estimator_arguments(algorithm)) - dests
        assert missing == set(cli.FLAGLESS_ARGUMENTS), f"{algorithm} arguments without a flag"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_report_on_two_runs_writes_the_table_and_plots(tmp_path, client):
    for name, replicas in (("one", 1), ("two", 2)):
        runs.train(
            {"dataset": "digits", "model": "softmax", "n_replicas": replicas, "max_epochs": 1,
             "out": str(tmp_path), "name": name, "random_state": 0},
            client=client,
        )  # fmt: skip
    out = tmp_path / "report"
    done = run_cli("report", str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == {
        "summary.csv",
        "accuracy_vs_time.png",
        "loss_vs_time.png",
        "staleness_histogram.png",
    }
    rows = [line for line in done.stdout.splitlines() if line.lstrip().startswith(("one", "two"))]
    assert len(rows) == 2
    assert "final_score" in done.stdout and "time_to_target" in done.stdout
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_names_a_directory_that_is_not_a_run(tmp_path):
    done = run_cli("report", str(tmp_path))
    assert done.returncode == 2
    assert "is not a run directory: missing config.json" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sandblaster_from_the_command_line(tmp_path):
    done = run_cli(
        "train", "--algorithm", "sandblaster", "--dataset", "digits", "--model", "softmax",
        "--max-iter", "15", "--eval-every-iter", "5", "--out", str(tmp_path), "--name", "sb",
        "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "L-BFGS iterations" in done.stdout
    assert float(done.stdout.split("test accuracy: ")[1].split()[0]) > 0.85
    config = config_of(tmp_path / "sb")
    assert config["estimator"] == "SandblasterLBFGS" and config["max_iter"] == 15
    bad = run_cli(
        "train", "--algorithm", "sandblaster", "--n-replicas", "4", "--out", str(tmp_path)
    )
    assert bad.returncode == 2 and "unknown setting(s) n_replicas" in bad.stderr


def test_each_evaluation_interval_flag_states_its_own_algorithm_and_unit():
    seconds, iterations = flag_help("eval_every"), flag_help("eval_every_iter")
    assert seconds.startswith("[downpour] Seconds between evaluations")
    assert "[sandblaster]" not in seconds  # one algorithm's flag, one meaning
    assert iterations.startswith("[sandblaster]")
    assert "iterations" in iterations.split(";")[0] and "[downpour]" not in iterations


def test_an_argument_both_algorithms_describe_differently_shows_each_description():
    text = flag_help("batch_size")
    assert text.startswith("[downpour] Minibatch size of each replica step (default 32).")
    assert "[sandblaster] Rows per batch" in text and text.endswith("(default None).")
    assert flag_help("n_replicas") == (
        "[downpour] Model replicas; each trains on its own 1/n_replicas of the data (default 4)"
    )


@pytest.mark.parametrize(
    "algorithm, given, message",
    [
        ("sandblaster", "--eval-every",
         "--eval-every is downpour's evaluation interval (seconds); "
         "for algorithm sandblaster use --eval-every-iter (iterations)"),
        ("downpour", "--eval-every-iter",
         "--eval-every-iter is sandblaster's evaluation interval (iterations); "
         "for algorithm downpour use --eval-every (seconds)"),
    ],
)  # fmt: skip
def test_the_other_algorithms_evaluation_interval_is_one_line_naming_the_flag_to_use(
    tmp_path, capsys, algorithm, given, message
):
    status = cli.main(
        ["train", "--algorithm", algorithm, given, "5", *SMALL[:2], "--out", str(tmp_path)]
    )
    assert status == 2
    assert capsys.readouterr().err == f"downpour-dask train: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_config_file_with_the_other_algorithms_interval_names_the_setting_to_use(
    tmp_path, capsys
):
    config = tmp_path / "sb.toml"
    config.write_text('algorithm = "sandblaster"\ndataset = "digits"\neval_every = 2\n')
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    assert error.endswith("for algorithm sandblaster use eval_every_iter (iterations)\n")
    assert not (tmp_path / "runs").exists()


def test_overwrite_refuses_a_directory_that_is_not_a_run_and_deletes_nothing(tmp_path, capsys):
    """In-process: the refusal comes from the job's checks, before any cluster is started."""
    mine = tmp_path / "taken"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    argv = ["train", *SMALL, "--out", str(tmp_path), "--name", "taken", "--overwrite"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and "nothing was deleted" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
