"""The ``downpour-dask`` command: end to end as a user runs it (a subprocess; slow), and its
commands and parser in-process.

A subprocess pays the command's imports (seconds of CPU: scikit-learn alone took 1.5 s) and
starts its own workers, so the tests run one where the process is the behaviour -- a user's
first run, the version, Ctrl-C, a kill -- and call :func:`downpour_dask.cli.main` in-process
where the behaviour is the command's: its status, its output and what it writes.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from distributed import Client, LocalCluster

import downpour_dask
from downpour_dask import DownpourSGD, cli, models, runs
from downpour_dask.cli import connection, flags, parser, training
from downpour_dask.runtime.cluster import cluster_workers

SCRIPT = Path(sys.executable).with_name("downpour-dask")
SMALL = ["--dataset", "digits", "--model", "mlp:32", "--max-epochs", "1", "--n-replicas", "2"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "downpour_dask"]
    return subprocess.run(
        command + list(args), capture_output=True, text=True, timeout=timeout, check=False
    )


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``downpour-dask ARGS`` in this process: its status and what it printed, as run_cli."""
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


def config_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.spawn  # what a user's command does
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
def test_config_file_sets_arguments_and_flags_override_it(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'dataset = "digits"\nmodel = "softmax"\nn_replicas = 3\nlearning-rate = 0.02\n'
        "max_epochs = 1\nwarmstart_steps = 0\n"
    )
    done = run_main(
        capsys, "train", "--config", str(config), "--learning-rate", "0.03",
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
def test_scheduler_flag_trains_on_an_existing_cluster(tmp_path, cluster, client, capsys):
    done = run_main(
        capsys, "train", *SMALL, "--scheduler", cluster.scheduler_address,
        "--out", str(tmp_path), "--name", "remote", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workers = sorted(cluster_workers(client))
    assert config_of(tmp_path / "remote")["workers"] == workers  # not an embedded cluster


def test_a_warning_is_one_line_naming_the_command_not_a_library_file(tmp_path, cluster, capsys):
    status = cli.main(
        ["train", "--dataset", "digits", "--algorithm", "sandblaster", "--max-iter", "1",
         "--scheduler", cluster.scheduler_address, "--quiet", "--out", str(tmp_path)]
    )  # fmt: skip
    assert status == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1 and warned[0].startswith(
        "downpour-dask train: warning: SandblasterLBFGS did not converge: max_iter=1 reached"
    )
    assert ".py:" not in warned[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_command_connects_through_dasks_handshake_race(race_next_clients):
    # a command connecting while another client cancels futures (a fit restarting a replica,
    # a notebook) meets Dask's race: Client() fails an assertion, its half-made self left behind
    flags = argparse.ArgumentParser()
    connection.add_connection_flags(flags)
    args = flags.parse_args(["--connect-timeout", "30"])
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as other,
    ):
        raced = race_next_clients(other, 1)
        with connection.connect(cluster.scheduler_address, args, quiet=True) as client:
            assert raced() == 1
            assert client.status == "running"
            assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.clients)) >= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--learning-rate", "-0.1"], "learning_rate must be a finite number > 0, got -0.1"),
        (["--dataset", "imagenet"], "dataset 'imagenet' is neither a shipped dataset"),
        (["--n-replicas", "two"], "--n-replicas: expected an integer or 'auto', got 'two'"),
        (["--model", "mlp:64,x"], "hidden widths must be integers"),
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--optimizer", "rmsprop"], "optimizer"),
        (["--algorithm", "hogwild"], "invalid choice: 'hogwild'"),
        (["--scheduler", "tcp://127.0.0.1:{port}", "--connect-timeout", "2"], "cannot reach"),
        (["--config", "missing.toml"], "cannot read --config"),
        (["--model", "softmax", "--partitions", "2"], "SoftmaxRegression has no hidden layer"),
        (["--model", "mlp:8,1", "--partitions", "2"], "partitions must be between 1 and 1"),
    ],
)
def test_bad_input_is_one_line_a_nonzero_status_and_no_run_directory(
    tmp_path, capsys, args, message
):
    # in-process: the entry point itself is run as a subprocess by the other tests of this file
    args = [a.replace("{port}", str(free_port())) for a in args]
    out = tmp_path / "runs"
    try:
        status = cli.main(["train", *SMALL[:2], *args, "--out", str(out), "--name", "bad"])
    except SystemExit as exited:  # argparse's own usage errors
        status = exited.code
    assert status == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    if "--scheduler" in args:  # the wait for a scheduler is announced, then the error
        assert lines[0] == f"connecting to {args[1]} (timeout 2 s)"
        lines = lines[1:]
    assert len(lines) == 1, stderr
    assert message in lines[0] and "Traceback" not in stderr
    assert not (out / "bad").exists()
    assert not out.exists() or not any(out.iterdir())  # no temporary leftovers either


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_partitions_flag_splits_every_replica_over_two_workers(tmp_path, cluster, capsys):
    done = run_main(
        capsys, "train", *SMALL, "--partitions", "2", "--scheduler", cluster.scheduler_address,
        "--out", str(tmp_path), "--name", "split", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    experiment, model, params = runs.load_run(tmp_path / "split")
    assert config_of(tmp_path / "split")["partitions"] == 2
    assert sorted(experiment.pushes["partition"].unique()) == [0, 1]
    assert params.shape == (model.layout.size,)  # saved in the model's own layout
    test = runs.load_dataset("digits")[1]
    assert model.score(params, test.X, test.y) > 0.6


def test_an_existing_run_directory_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    done = run_main(capsys, "train", *SMALL, "--out", str(tmp_path), "--name", "taken")
    assert done.returncode == 2
    assert "run directory" in done.stderr and "exists" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_synthetic_writes_files_that_train_streams(tmp_path, capsys):
    data = tmp_path / "big"
    done = run_main(
        capsys, "synthetic", str(data), "--rows", "6000", "--features", "16", "--classes", "3",
        "--files", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in data.iterdir()) == [f"part-0000{i}.parquet" for i in range(3)]
    done = run_main(
        capsys, "train", "--dataset", str(data), "--eval-dataset", str(data / "part-00000.parquet"),
        "--model", "softmax", "--n-replicas", "3", "--max-epochs", "3", "--learning-rate", "0.2",
        "--out", str(tmp_path / "runs"), "--name", "streamed", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split("test accuracy: ")[1].split()[0]) > 0.6  # chance: ~0.33
    data_info = config_of(tmp_path / "runs" / "streamed")["data"]
    assert data_info["kind"] == "parquet" and data_info["rows"] == 6000


def train_parser():
    return parser.build_parser()._subparsers._group_actions[0].choices["train"]


def flag_help(dest: str) -> str:
    return next(action.help for action in train_parser()._actions if action.dest == dest)


def test_every_estimator_argument_has_a_flag():
    dests = {action.dest for action in train_parser()._actions}
    # Deliberately flag-less: ``security`` (a distributed.Security object, not a scalar) is set
    # by --tls (embedded TLS-only cluster) or given to the client by --tls-ca-file/-cert/-key.
    assert set(flags.FLAGLESS_ARGUMENTS) == {"security"}
    assert {"tls", "tls_ca_file", "tls_cert", "tls_key"} <= dests
    for algorithm in runs.ALGORITHMS:
        missing = set(runs.estimator_arguments(algorithm)) - dests
        assert missing == set(flags.FLAGLESS_ARGUMENTS), f"{algorithm} arguments without a flag"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_report_on_two_runs_writes_the_table_and_plots(tmp_path, client, capsys):
    for name, replicas in (("one", 1), ("two", 2)):
        runs.train(
            {"dataset": "digits", "model": "softmax", "n_replicas": replicas, "max_epochs": 1,
             "out": str(tmp_path), "name": name, "random_state": 0},
            client=client,
        )  # fmt: skip
    out = tmp_path / "report"
    done = run_main(capsys, "report", str(tmp_path / "one"), str(tmp_path / "two"), "--out",
                    str(out))
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


def test_report_names_a_directory_that_is_not_a_run(tmp_path, capsys):
    done = run_main(capsys, "report", str(tmp_path))
    assert done.returncode == 2
    assert "is not a run directory: missing config.json" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sandblaster_from_the_command_line(tmp_path, capsys):
    done = run_main(
        capsys, "train", "--algorithm", "sandblaster", "--dataset", "digits", "--model", "softmax",
        "--max-iter", "15", "--eval-every-iter", "5", "--out", str(tmp_path), "--name", "sb",
        "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "L-BFGS iterations" in done.stdout
    assert float(done.stdout.split("test accuracy: ")[1].split()[0]) > 0.85
    config = config_of(tmp_path / "sb")
    assert config["estimator"] == "SandblasterLBFGS" and config["max_iter"] == 15
    bad = run_main(
        capsys, "train", "--algorithm", "sandblaster", "--n-replicas", "4", "--out", str(tmp_path)
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


@pytest.mark.slow  # two subprocesses
def test_version_answers_without_importing_dask_or_scikit_learn():
    probe = (
        "import sys; from downpour_dask.cli import main; status = main(['--version']); "
        "heavy = {'dask', 'distributed', 'sklearn'}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy), status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.splitlines() == [f"downpour-dask {downpour_dask.__version__}", "[] 0"]
    # the package's Dask-backed names still load when used
    import_all = "from downpour_dask import *; print(DownpourSGD.__module__, attach.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", import_all], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.split() == ["downpour_dask.downpour.estimator", "attach"], done.stderr
    assert "DownpourSGD" in dir(downpour_dask)
    with pytest.raises(AttributeError, match="has no attribute 'DownpourSGDD'"):
        downpour_dask.DownpourSGDD  # noqa: B018


@pytest.mark.slow  # a subprocess
def test_commands_that_train_nothing_start_without_the_estimators():
    """``watch``, ``report``, ``synthetic`` and the help load their own module only: no
    estimator, so no scikit-learn (over a second of imports); ``train``'s flags still come from
    the estimators."""
    probe = (
        "import sys; from downpour_dask.cli import main\n"
        "for argv in (['--help'], ['watch', '--help'], ['report', '--help'], "
        "['synthetic', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as exit:\n"
        "        assert exit.code == 0, argv\n"
        "print('scikit-learn loaded:', 'sklearn' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stderr.strip() == "scikit-learn loaded: False", done.stderr
    for command in ("train", "watch", "synthetic", "train-sparse", "report", "simulate"):
        assert f"    {command} " in done.stdout  # every command listed by --help
    assert "--scheduler" in done.stdout and "--target" in done.stdout  # watch's and report's
    train_flags = parser.build_parser(load=["train"])._subparsers._group_actions[0]
    assert "--n-replicas" in train_flags.choices["train"].format_help()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--n-replica", "2"], "unrecognized arguments: --n-replica 2"),
        (["train", "--max-sec", "2"], "unrecognized arguments: --max-sec 2"),
        (["watch", "x", "--sched", "tcp://h:1"], "arguments are required: --scheduler"),
        (["--vers"], "arguments are required: command"),  # not taken for --version
    ],
)
def test_abbreviated_flags_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_each_flag_has_its_own_help_line():
    helps = {}
    for action in train_parser()._actions:
        if action.help and action.option_strings:
            helps.setdefault(action.help, []).append(action.dest)
    shared = {text: dests for text, dests in helps.items() if len(dests) > 1}
    assert not shared
    assert "passes over its own data" in flag_help("max_epochs")
    assert "steps" in flag_help("max_steps") and "passes" not in flag_help("max_steps")


def parsed_job(*argv: str) -> runs.Job:
    args = parser.build_parser().parse_args(["train", *argv])
    settings, _ = training.job_settings(args)
    return training.prepare_job(settings)


def test_max_seconds_alone_bounds_the_run_by_time_only(tmp_path):
    out = ["--out", str(tmp_path)]
    alone = parsed_job("--max-seconds", "30", *out).estimator
    assert (alone.max_epochs, alone.max_steps, alone.max_seconds) == (None, None, 30)
    default = parsed_job(*out).estimator
    assert (default.max_epochs, default.max_seconds) == (3, None)
    both = parsed_job("--max-seconds", "30", "--max-epochs", "2", *out).estimator
    assert (both.max_epochs, both.max_seconds) == (2, 30)
    steps = parsed_job("--max-steps", "50", *out).estimator
    assert (steps.max_epochs, steps.max_steps) == (None, 50)


@pytest.mark.timeout(120)
def test_a_max_seconds_job_is_stopped_by_its_time_limit(tmp_path, client):
    job = parsed_job(
        "--dataset", "digits", "--model", "softmax", "--n-replicas", "2", "--max-seconds", "1.5",
        "--out", str(tmp_path), "--name", "timed",
    )  # fmt: skip
    result = runs.run(job, client)
    kinds = list(result.estimator.experiment_.events["kind"])
    assert "stop_requested" in kinds and kinds[-1] == "stop"  # the time limit ended it
    assert config_of(tmp_path / "timed")["max_epochs"] is None


def test_label_names_the_label_column_of_data_files(tmp_path, capsys):
    train, _ = runs.load_dataset("digits")
    frame = pd.DataFrame(train.X[:300], columns=[f"x{i}" for i in range(train.X.shape[1])])
    frame["digit"] = train.y[:300]
    path = tmp_path / "digits.parquet"
    frame.to_parquet(path, index=False)
    job = parsed_job("--dataset", str(path), "--label", "digit", "--out", str(tmp_path / "r"))
    assert job.train.n_features == train.X.shape[1] and job.settings["label"] == "digit"
    status = cli.main(["train", "--dataset", str(path), "--out", str(tmp_path / "r")])
    assert status == 2
    error = capsys.readouterr().err
    assert "label column 'label' not found" in error and "(give --label COLUMN)" in error
    assert error.count("\n") == 1 and not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sent_to", ["driver", "terminal"])
def test_ctrl_c_names_the_resume_command_that_continues_from_the_checkpoint(tmp_path, sent_to):
    """Ctrl-C as a signal to the command alone, and as a terminal sends it: to the whole
    foreground process group, the embedded cluster's workers included (they ignore it, so the
    driver's clean stop finds its shards; before, they died and it failed after 120 s)."""
    out = tmp_path / "runs"
    driver = subprocess.Popen(
        [sys.executable, "-m", "downpour_dask", "train", "--quiet", *SMALL[:4],
         "--max-epochs", "none", "--max-seconds", "60", "--checkpoint-every", "0.5",
         "--out", str(out), "--name", "job"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=sent_to == "terminal",  # its own group, as a shell's foreground job
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / ".job.partial" / "checkpoints" / "LATEST").exists():
            assert driver.poll() is None, driver.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        if sent_to == "terminal":
            os.killpg(driver.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        else:
            driver.send_signal(signal.SIGINT)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, err
    assert err.splitlines()[-1] == (
        "downpour-dask train: interrupted; no run directory was written, but its latest "
        f"checkpoint is kept: continue with `downpour-dask train --resume {out / 'job'}`"
    )
    assert not (out / "job").exists()
    assert (out / ".job.partial" / "job.json").is_file()  # what --resume reads


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_watch_wait_follows_a_run_published_after_it_started(client, tmp_path):
    train, test = runs.load_dataset("digits")
    watcher = subprocess.Popen(
        [sys.executable, "-m", "downpour_dask", "watch", "later", "--wait", "120",
         "--scheduler", client.scheduler.address, "--interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "waiting up to 120 s" not in (watcher.stderr.readline() or "eof"):
            assert time.monotonic() < deadline and watcher.poll() is None
        est = DownpourSGD(
            models.SoftmaxRegression(64, 10), n_replicas=2, n_shards=1, max_seconds=3,
            random_state=0,
        )  # fmt: skip
        est.fit(train, eval_data=test, client=client, publish="later")
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, err
    assert out.splitlines()[0].startswith("watching 'later': DownpourSGD, 2 replicas")
    assert out.splitlines()[-1] == "run 'later' finished"
    late = run_cli("watch", "never", "--wait", "1", "--scheduler", client.scheduler.address)
    assert late.returncode == 2
    assert late.stderr.splitlines()[-1].endswith("no run is published as 'never' on "
                                                 f"{client.scheduler.address}; published: none")


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
