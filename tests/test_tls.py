"""TLS: training on a TLS-only cluster, refusing clients without credentials, the CLI's flags."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, LocalCluster, Security, deploy

from downpour_dask import DownpourSGD, SandblasterLBFGS, cli, datasets, models
from downpour_dask.runtime.cluster import cluster_workers

SMALL = ["--dataset", "digits", "--model", "softmax", "--max-epochs", "1", "--n-replicas", "2"]


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``downpour-dask ARGS`` in this process (the command's own ``main``; tests/test_cli.py
    runs it as a subprocess): its status and what it printed."""
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        security=Security.temporary(),
        protocol="tls://",
        dashboard_address=":0",
    ) as cluster:
        yield cluster


def softmax_estimator(train, **kw) -> DownpourSGD:
    model = models.SoftmaxRegression(train.n_features, 10)
    return DownpourSGD(model, n_replicas=2, n_shards=2, max_epochs=2, random_state=0, **kw)


@pytest.mark.slow  # its own TLS cluster or a CLI subprocess
@pytest.mark.timeout(120)
def test_training_on_a_tls_only_cluster(tls_cluster, digits):
    train, test = digits
    assert tls_cluster.scheduler_address.startswith("tls://")
    with Client(tls_cluster, security=tls_cluster.security, timeout=30) as client:
        workers = cluster_workers(client)
        assert workers and all(w.startswith("tls://") for w in workers)
        est = softmax_estimator(train).fit(train, eval_data=test, client=client)
        split = DownpourSGD(
            models.MLP(train.n_features, (16,), 10), n_replicas=1, n_shards=2, partitions=2,
            max_steps=10, random_state=0,
        ).fit(train, client=client)  # fmt: skip
    assert est.score(test) > 0.8
    # no plain-TCP side channel next to TLS: remote shards were reached as actor messages
    routes = [t for ts in est.experiment_.config["replica_transports"].values() for t in ts]
    assert "wire" not in routes and "actor" in routes
    # and model-parallel partitions sent their messages as actor calls
    peers = [slot["peers"] for slot in split.experiment_.config["partition_slots"]]
    assert peers == [{"1": "actor"}, {"0": "actor"}]
    assert est.experiment_.config["tls"] is False  # the estimator did not start the cluster


def _connect(address: str, **kwargs) -> None:
    """Connect a client to ``address`` and close it, in an event loop of its own.

    Asynchronous, so that a refused client leaves nothing behind: a synchronous ``Client`` that
    failed to connect closes itself on the shared loop when it is collected, and after a few of
    them the next one could wait 10 s and fail with an ``AssertionError`` from
    ``distributed``'s ``LoopRunner`` (seen once in ~70 refusals in a loop).
    """

    async def connect() -> None:
        async with Client(address, asynchronous=True, timeout=5, **kwargs):
            pass

    asyncio.run(connect())


@pytest.mark.slow  # its own TLS cluster or a CLI subprocess
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # refused clients
def test_a_client_without_the_credentials_is_refused(tls_cluster):
    address = tls_cluster.scheduler_address
    with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):
        _connect(address)
    with pytest.raises(OSError):  # plain TCP to the TLS listener
        _connect(address.replace("tls://", "tcp://"))
    with pytest.raises(OSError, match="TLS certificate does not match"):  # someone else's certs
        _connect(address, security=Security.temporary())
    _connect(address, security=tls_cluster.security)  # the cluster's own credentials are let in


@pytest.mark.slow  # its own TLS cluster or a CLI subprocess
@pytest.mark.timeout(180)
def test_security_true_runs_an_embedded_tls_cluster(digits, monkeypatch):
    started = []
    real = deploy.LocalCluster.__init__

    def spy(self, *args, **kwargs):
        started.append(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(deploy.LocalCluster, "__init__", spy)
    train, test = digits
    est = softmax_estimator(train, security=True).fit(train, eval_data=test)
    assert est.score(test) > 0.8
    assert est.experiment_.config["tls"] is True
    assert all(w.startswith("tls://") for w in est.experiment_.config["workers"])
    assert started[0]["protocol"] == "tls://" and started[0]["security"].require_encryption


def test_security_is_checked_before_cluster_work(digits, client):
    train, _ = digits
    with pytest.raises(TypeError, match="security must be None, True"):
        softmax_estimator(train, security="yes").fit(train)
    with pytest.raises(TypeError, match="security must be None, True"):
        SandblasterLBFGS(models.SoftmaxRegression(64, 10), security=1).fit(train)
    with pytest.raises(ValueError, match="security= configures the embedded cluster"):
        softmax_estimator(train, security=True).fit(train, client=client)


def write_credentials(security: Security, directory: Path) -> dict[str, str]:
    """The in-memory PEMs of ``Security.temporary()`` as files, as a real deployment has."""
    paths = {}
    for flag, pem in (
        ("--tls-ca-file", security.tls_ca_file),
        ("--tls-cert", security.tls_client_cert),
        ("--tls-key", security.tls_client_key),
    ):
        path = directory / (flag.strip("-") + ".pem")
        path.write_text(pem)
        paths[flag] = str(path)
    return paths


@pytest.mark.slow  # its own TLS cluster or a CLI subprocess
@pytest.mark.timeout(180)
def test_cli_trains_on_a_tls_scheduler_with_credential_files(tls_cluster, tmp_path, capsys):
    credentials = write_credentials(tls_cluster.security, tmp_path)
    flags = [item for pair in credentials.items() for item in pair]
    address = tls_cluster.scheduler_address
    out = ["--out", str(tmp_path / "runs"), "--quiet"]
    done = run_main(capsys, "train", *SMALL, *out, "--name", "tls", "--scheduler", address,
                    *flags)
    assert done.returncode == 0, done.stderr
    assert "test accuracy" in done.stdout and (tmp_path / "runs" / "tls").is_dir()
    # without the credentials: exit 2 (a scheduler that cannot be reached), one line, no run
    # directory (--quiet leaves out the "connecting to" line)
    done = run_main(
        capsys, "train", *SMALL, *out, "--name", "no", "--scheduler", address,
        "--connect-timeout", "5",
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot reach the Dask scheduler" in done.stderr
    assert not (tmp_path / "runs" / "no").exists()


def test_cli_tls_flag_misuse_is_a_usage_error(tmp_path, capsys):
    """Refused before any cluster work, in one line (in-process: the command's own ``main``)."""

    def usage_error(*args: str) -> str:
        assert cli.main(["train", *SMALL, *args]) == 2
        return capsys.readouterr().err

    error = usage_error("--tls", "--scheduler", "tls://127.0.0.1:1")
    assert "--tls starts a TLS-only embedded cluster" in error
    assert "is not a file" in usage_error("--scheduler", "x", "--tls-cert", str(tmp_path / "no"))
    (tmp_path / "c.pem").write_text("x")
    error = usage_error("--tls-cert", str(tmp_path / "c.pem"))
    assert "credentials for --scheduler" in error and error.count("\n") == 1


@pytest.mark.slow  # its own TLS cluster or a CLI subprocess
@pytest.mark.timeout(180)
def test_cli_tls_flag_trains_on_an_embedded_tls_cluster(tmp_path, capsys):
    done = run_main(capsys, "train", *SMALL, "--tls", "--quiet", "--out", str(tmp_path), "--name",
                    "t")
    assert done.returncode == 0, done.stderr
    assert '"tls": true' in (tmp_path / "t" / "config.json").read_text()
