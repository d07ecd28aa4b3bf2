"""``downpour-dask train``: its arguments, and running a training job.

The work itself lives in :mod:`downpour_dask.runs` (training jobs and run directories); a train
flag per estimator argument comes from :mod:`.flags`.  Input errors are raised before any
cluster is involved, and a failed job leaves no run directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from ..checkpoint import has_checkpoint
from ..progress import ProgressBar
from ..runs import ALGORITHMS, DEFAULTS, Job, RunResult, misnamed_interval, prepare, resume, run
from .connection import add_connection_flags, connect, tls_credentials_given
from .errors import Interrupted, UsageError
from .flags import add_estimator_flags, flag
from .interrupts import DeferredInterrupt
from .program import PROG

#: Parsed arguments of ``train`` that are not job settings.
NOT_SETTINGS = frozenset(
    {"config", "command", "handler", "quiet", "scheduler", "connect_timeout", "resume"}
    | {"tls", "tls_ca_file", "tls_cert", "tls_key"}
)


def read_config(path: Path) -> dict[str, Any]:
    """The settings of a ``--config`` TOML file, keys written with ``_`` (``learning-rate`` is
    ``learning_rate``)."""
    try:
        with open(path, "rb") as f:
            loaded = tomllib.load(f)
    except OSError as err:
        raise UsageError(f"cannot read --config {str(path)!r}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {str(path)!r} is not valid TOML: {err}") from None
    settings = {}
    for key, value in loaded.items():
        if isinstance(value, dict):
            raise UsageError(
                f"--config {str(path)!r}: tables ([{key}]) are not supported; "
                f"write settings as top-level keys"
            )
        settings[key.replace("-", "_")] = value
    return settings


def job_settings(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """A ``train`` job's settings (the config file's, overridden by the flags given) and the
    scheduler to train on (``None``: an embedded cluster)."""
    settings = read_config(args.config) if args.config is not None else {}
    scheduler = settings.pop("scheduler", None)
    flags = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    algorithm = {**settings, **flags}.get("algorithm", DEFAULTS["algorithm"])
    wrong = misnamed_interval(algorithm, flags, spell=flag)
    if wrong is not None:
        raise UsageError(wrong)
    settings.update(flags)
    return settings, args.scheduler if args.scheduler is not None else scheduler


def train(args: argparse.Namespace) -> int:
    """``downpour-dask train``: run a training job and print where its run directory is."""
    settings, scheduler = job_settings(args)
    if args.resume is not None:
        if settings:
            raise UsageError(
                f"--resume continues a job with its own settings; do not also give "
                f"{', '.join(sorted(settings))}"
            )
        job = resume(args.resume)  # a bad checkpoint is an error here, before any cluster
    else:
        job = prepare_job(settings)  # all input errors surface here, before any cluster work
    bar = None if args.quiet else ProgressBar(sys.stderr)
    try:
        with DeferredInterrupt(bar) as callback:  # Ctrl-C stops the fit at its next report
            result = train_on(job, scheduler, args, callback)
    except KeyboardInterrupt:
        raise Interrupted(kept(job)) from None
    finally:
        if bar is not None:
            bar.close()  # a failed or interrupted fit sends no last snapshot
    print_result(result)
    return 0


def prepare_job(settings: dict[str, Any]) -> Job:
    """:func:`downpour_dask.runs.prepare`, with errors worded for the command line."""
    try:
        return prepare(settings)
    except ValueError as err:  # the data layer speaks Python: datasets.from_parquet(label=)
        raise UsageError(str(err).replace("(pass label=)", "(give --label COLUMN)")) from None


def kept(job: Job) -> str:
    """What an interrupted ``train`` job left: a checkpoint ``--resume`` continues, or nothing."""
    checkpoints = getattr(job.estimator, "checkpoint_dir", None)
    if job.partial is not None and checkpoints is not None and has_checkpoint(checkpoints):
        return (
            f"no run directory was written, but its latest checkpoint is kept: continue with "
            f"`{PROG} train --resume {job.target}`"
        )
    return "no run directory was written (the job had not reached a checkpoint)"


def train_on(
    job: Job, scheduler: str | None, args: argparse.Namespace, callback: Callable[..., Any]
) -> RunResult:
    """Run ``job`` on an embedded cluster, or on ``scheduler``'s, reporting to ``callback``."""
    if scheduler is None:
        if tls_credentials_given(args):
            raise UsageError(
                "--tls-ca-file/--tls-cert/--tls-key are a client's credentials for --scheduler; "
                "for a TLS-only embedded cluster use --tls"
            )
        if args.tls:
            job.estimator.set_params(security=True)
        return run(job, None, callback)
    if args.tls:
        raise UsageError(
            "--tls starts a TLS-only embedded cluster; with --scheduler give "
            "--tls-ca-file/--tls-cert/--tls-key (or Dask's distributed.comm.tls settings)"
        )
    with connect(scheduler, args, quiet=args.quiet) as client:
        return run(job, client, callback)


def print_result(result: RunResult) -> None:
    """Print a finished job's run directory, test score and headline numbers."""
    s = result.summary
    metric = result.estimator.experiment_.metric
    score = s.get(f"final_{metric}")
    print(f"run directory: {result.path}")
    if score is not None:
        print(f"test {metric}: {score:.4f} (best {s[f'best_{metric}']:.4f})")
    if hasattr(result.estimator, "objective_"):  # Sandblaster L-BFGS
        est = result.estimator
        print(
            f"{s['duration']:.2f} s, {s['examples_per_s']:,.0f} examples/s, {est.n_iter_} "
            f"L-BFGS iterations, objective {est.objective_:.6g}, {int(s['failures'])} failures"
        )
    else:
        print(
            f"{s['duration']:.2f} s, {s['examples_per_s']:,.0f} examples/s, "
            f"{s['pushes_per_s']:,.0f} pushes/s, staleness mean {s['staleness_mean']:.1f} "
            f"p95 {s['staleness_p95']:.0f}, {int(s['refused_pushes'])} refused pushes, "
            f"{int(s['failures'])} failures"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` arguments: the job's (data, model, run directory, cluster) and a flag per
    estimator argument (:mod:`.flags`)."""
    job = parser.add_argument_group("job")
    job.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    job.add_argument(
        "--algorithm",
        choices=list(ALGORITHMS),
        default=argparse.SUPPRESS,
        help="downpour (Downpour SGD) or sandblaster (Sandblaster L-BFGS); default downpour",
    )
    job.add_argument(
        "--dataset",
        default=argparse.SUPPRESS,
        metavar="NAME|PATH",
        help="a shipped dataset (digits, mnist5k) or parquet/CSV file(s) with a label column "
        "(see --label; default mnist5k)",
    )
    job.add_argument(
        "--eval-dataset",
        default=argparse.SUPPRESS,
        metavar="NAME|PATH",
        help="evaluation data (default: the shipped dataset's test split)",
    )
    job.add_argument(
        "--label",
        default=argparse.SUPPRESS,
        metavar="COLUMN",
        help="the label column of --dataset/--eval-dataset files (default label)",
    )
    job.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="SPEC",
        help="mlp:128,64 | mlp | softmax | logistic | linear | cnn (JAX) | "
        "package.module:factory, called as factory(n_features=, n_classes=) (default mlp:128)",
    )
    job.add_argument("--out", default=argparse.SUPPRESS, help="parent of run directories (runs)")
    job.add_argument("--name", default=argparse.SUPPRESS, help="run directory name")
    job.add_argument(
        "--overwrite",
        action="store_true",
        default=argparse.SUPPRESS,
        help="replace an existing run directory of the same name",
    )
    job.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="train on an existing Dask cluster (e.g. tcp://host:8786) instead of an embedded one",
    )
    job.add_argument(
        "--publish", default=argparse.SUPPRESS, metavar="NAME",
        help="publish the running job on the cluster as NAME, for downpour-dask watch NAME and "
        "downpour_dask.attach (downpour only)",
    )  # fmt: skip
    job.add_argument(
        "--quiet", action="store_true", help="no progress bar and no 'connecting to' message"
    )
    job.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the interrupted job that was writing RUN_DIR from its latest checkpoint "
        "(with that job's settings: give no other settings)",
    )
    job.add_argument(
        "--tls",
        action="store_true",
        help="run the embedded cluster on TLS only, with temporary self-signed certificates",
    )
    add_connection_flags(parser)
    add_estimator_flags(parser)
