"""What each command does: ``train``, ``watch``, ``synthetic`` and ``report``.

Each handler takes the parsed arguments and returns the exit status; the work itself lives in
:mod:`downpour_dask.runs` (training jobs and run directories), :mod:`downpour_dask.live`
(published runs), :mod:`downpour_dask.data.datasets` and :mod:`downpour_dask.report`.  Input
errors are raised before any cluster is involved, and a failed job leaves no run directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from ..checkpoint import has_checkpoint
from ..data import datasets
from ..data.criteo import write_criteo
from ..live import attach, check_name, follow, is_published
from ..progress import ProgressBar
from ..publishing import DRIVER_LOST, end_reason
from ..report import format_table, report
from ..runs import DEFAULTS, Job, RunResult, misnamed_interval, prepare, resume, run
from .connection import connect, tls_credentials_given
from .errors import Interrupted, UsageError
from .flags import flag
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


def watch(args: argparse.Namespace) -> int:
    """``downpour-dask watch NAME``: print a published run's progress until it ends."""
    check_name(args.name)
    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0, got {args.interval:g}")
    if args.wait is not None and not args.wait >= 0:
        raise UsageError(f"--wait must be a number of seconds >= 0, got {args.wait:g}")
    with connect(args.scheduler, args) as client:
        if args.wait is not None:
            wait_published(client, args.name, args.wait)
        view = attach(args.name, client)  # ValueError naming the published runs if absent
        info = view.info
        print(
            f"watching {args.name!r}: {info.get('estimator')}, {info.get('n_replicas')} "
            f"replicas, {info.get('n_shards')} shards on {args.scheduler}",
            flush=True,
        )
        del view  # watching needs only the event topic; do not hold the run's actors
        finished = follow(client, args.name, sys.stdout, args.interval)
        lost = not finished and end_reason(client, args.name) == DRIVER_LOST
    if lost:
        raise RuntimeError(
            f"run {args.name!r} ended without finishing: its driver died, and the scheduler "
            f"let go of the run"
        )
    if not finished:
        raise RuntimeError(f"run {args.name!r} ended without finishing (its fit failed)")
    print(f"run {args.name!r} finished", flush=True)
    return 0


def wait_published(client: Any, name: str, seconds: float) -> None:
    """Wait up to ``seconds`` for a run to be published as ``name`` (``watch --wait``); return
    at once if it is, else let :func:`attach` say that it is not."""
    if is_published(client, name):
        return
    print(f"waiting up to {seconds:g} s for a run published as {name!r}", file=sys.stderr)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not is_published(client, name):
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def synthetic(args: argparse.Namespace) -> int:
    """``downpour-dask synthetic PATH``: write a learnable dataset as parquet files (with
    ``--criteo`` a Criteo-shaped click log, :mod:`downpour_dask.data.criteo`)."""
    if args.criteo:
        return synthetic_criteo(args)
    if args.features is None:
        raise UsageError("--features is required (or --criteo for click data)")
    dataset = datasets.synthetic(
        args.path, args.rows, args.features, args.classes, seed=args.seed, n_files=args.files
    )
    print(f"wrote {dataset!r} to {args.path}")
    return 0


def synthetic_criteo(args: argparse.Namespace) -> int:
    """``synthetic PATH --criteo``: the click log in ``--files`` files (default: 10^6 rows
    each), into a folder that holds no parquet file yet (nothing is replaced)."""
    if args.features is not None:
        raise UsageError("--criteo writes 13 integer and 26 categorical columns; drop --features")
    if args.rows < 1 or (args.files is not None and not 1 <= args.files <= args.rows):
        raise UsageError(f"--rows must be >= 1 and --files in [1, --rows], got --rows "
                         f"{args.rows} --files {args.files}")
    out = Path(args.path)
    if out.exists() and (not out.is_dir() or any(out.glob("*.parquet"))):
        raise UsageError(f"{str(out)!r} is a file or already holds parquet files; give an "
                         f"empty or new folder")
    paths = write_criteo(out, args.rows, seed=args.seed, max_cardinality=args.max_cardinality,
                         n_files=args.files)
    print(f"wrote {args.rows} click rows in {len(paths)} files to {out} (label click, "
          f"numeric I1..I13, categorical C1..C26)")
    return 0


def compare(args: argparse.Namespace) -> int:
    """``downpour-dask report RUN_DIR...``: print the summary table and write it and the plots."""
    for path in args.run_dirs:
        if not Path(path).is_dir():
            raise UsageError(f"RUN_DIR {path!r} is not a directory")
    table, target, written = report(args.run_dirs, args.out, args.target)
    if target is not None:
        print(f"time_to_target: seconds from the start of fit until test score >= {target:g}")
    print(format_table(table))
    for path in written:
        print(f"wrote {path}")
    return 0
