"""The ``downpour-dask`` argument parser: its commands and the arguments of each.

``train``'s estimator flags are generated (:mod:`.flags`); the job, ``watch``, ``synthetic`` and
``report`` arguments are written out here.  Each command's parser sets ``handler``, the function
of :mod:`.commands` that runs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from .._version import __version__
from ..runs import ALGORITHMS
from .commands import compare, synthetic, train, watch
from .connection import add_connection_flags
from .flags import add_estimator_flags

PROG = "downpour-dask"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``downpour-dask`` argument parser with its ``train``, ``watch``, ``synthetic`` and
    ``report`` commands."""
    parser = _Parser(prog=PROG, description="Downpour SGD on Dask: train and compare runs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(commands)
    _add_watch(commands)
    _add_synthetic(commands)
    _add_report(commands)
    return parser


def _add_train(commands: argparse._SubParsersAction) -> None:
    train_parser = commands.add_parser(
        "train",
        help="train a model and write a run directory",
        description="Train a model with Downpour SGD (or Sandblaster L-BFGS) and write "
        "runs/<name>/. With no argument: an MLP on the shipped mnist5k, 4 replicas, 2 shards, "
        "Adagrad, on an embedded local cluster.",
    )
    job = train_parser.add_argument_group("job")
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
        help="a shipped dataset (digits, mnist5k) or parquet/CSV file(s) with a 'label' column "
        "(default mnist5k)",
    )
    job.add_argument(
        "--eval-dataset",
        default=argparse.SUPPRESS,
        metavar="NAME|PATH",
        help="evaluation data (default: the shipped dataset's test split)",
    )
    job.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="SPEC",
        help="mlp:128,64 | mlp | softmax | logistic | linear (default mlp:128)",
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
    job.add_argument("--quiet", action="store_true", help="no progress line")
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
    add_connection_flags(train_parser)
    add_estimator_flags(train_parser)
    train_parser.set_defaults(handler=train)


def _add_watch(commands: argparse._SubParsersAction) -> None:
    watch_parser = commands.add_parser(
        "watch",
        help="follow a running fit published on a cluster",
        description="Print progress lines of the run a fit(..., publish=NAME) published on the "
        "cluster, until it ends (exit 0 when it finished, 1 if it failed).",
    )
    watch_parser.add_argument("name", metavar="NAME", help="the name given to fit(..., publish=)")
    watch_parser.add_argument(
        "--scheduler",
        required=True,
        metavar="ADDRESS",
        help="the Dask scheduler of the run's cluster (e.g. tcp://host:8786)",
    )
    watch_parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between progress lines when the output is not a terminal (default 2)",
    )
    add_connection_flags(watch_parser)
    watch_parser.set_defaults(handler=watch)


def _add_synthetic(commands: argparse._SubParsersAction) -> None:
    synthetic_parser = commands.add_parser(
        "synthetic",
        help="write a large learnable classification dataset as parquet files",
        description="Write ROWS rows of FEATURES float32 features, labelled by a fixed random "
        "teacher network, as parquet files in PATH (streamed: memory stays bounded).",
    )
    synthetic_parser.add_argument("path", metavar="PATH", help="directory to create")
    synthetic_parser.add_argument("--rows", type=int, required=True)
    synthetic_parser.add_argument("--features", type=int, required=True)
    synthetic_parser.add_argument("--classes", type=int, default=10)
    synthetic_parser.add_argument("--seed", type=int, default=0)
    synthetic_parser.add_argument("--files", type=int, default=None, help="number of parquet files")
    synthetic_parser.set_defaults(handler=synthetic)


def _add_report(commands: argparse._SubParsersAction) -> None:
    report_parser = commands.add_parser(
        "report",
        help="summarise and plot finished runs",
        description="Print one summary row per run and write summary.csv and comparison "
        "plots (accuracy and loss against time, staleness histogram).",
    )
    report_parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report_parser.add_argument("--out", default="report", help="directory for the table and plots")
    report_parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="score for the time-to-target column (default: 0.9 for classifiers)",
    )
    report_parser.set_defaults(handler=compare)
