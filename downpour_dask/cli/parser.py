"""The ``downpour-dask`` argument parser: its commands and the arguments of each.

``train``'s estimator flags are generated (:mod:`.flags`); the job, ``watch``, ``synthetic`` and
``report`` arguments are written out here.  Each command's parser sets ``handler``, the function
of :mod:`.commands` that runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..runs import ALGORITHMS
from .commands import compare, synthetic, train, watch
from .connection import add_connection_flags
from .flags import FLAGLESS_ARGUMENTS, add_estimator_flags
from .program import PROG, VERSION
from .simulation import add_arguments as _simulate_arguments
from .simulation import simulate
from .sparse import add_arguments as _train_sparse_arguments
from .sparse import train_sparse

__all__ = ["FLAGLESS_ARGUMENTS", "PROG", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage dump) and exit 2, and
    that takes no abbreviation (``--n-replica`` is an error, not ``--n-replicas``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``downpour-dask`` argument parser with its ``train``, ``watch``, ``synthetic`` and
    ``report`` commands."""
    parser = _Parser(prog=PROG, description="Downpour SGD on Dask: train and compare runs.")
    parser.add_argument("--version", action="version", version=VERSION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (handler, help_text, description, add_arguments) in _COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=description)
        command.set_defaults(handler=handler)
        add_arguments(command)
    return parser


def _train_arguments(parser: argparse.ArgumentParser) -> None:
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


def _watch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the name given to fit(..., publish=)")
    parser.add_argument(
        "--scheduler",
        required=True,
        metavar="ADDRESS",
        help="the Dask scheduler of the run's cluster (e.g. tcp://host:8786)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between progress lines when the output is not a terminal (default 2)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=600.0,
        default=None,
        metavar="SECONDS",
        help="wait up to SECONDS (default 600) for a run to be published as NAME, e.g. by a "
        "train --publish NAME just started",
    )
    add_connection_flags(parser)


def _synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="directory to create")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--features", type=int, default=None,
                        help="float32 features per row (required without --criteo)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=None, help="number of parquet files")
    parser.add_argument(
        "--criteo", action="store_true",
        help="write a Criteo-shaped click log instead: a click label, 13 integer columns "
        "I1..I13 and 26 categorical columns C1..C26 with skewed frequencies (for train-sparse)",
    )  # fmt: skip
    parser.add_argument("--max-cardinality", type=int, default=100_000, metavar="N",
                        help="[--criteo] distinct values of the largest categorical column")


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default="report", help="directory for the table and plots")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="score for the time-to-target column (default: 0.9 for classifiers)",
    )


#: Each command: what runs it, its one-line help, its description, what adds its arguments.
_COMMANDS: dict[str, tuple[Any, str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "train": (
        train,
        "train a model and write a run directory",
        "Train a model with Downpour SGD (or Sandblaster L-BFGS) and write "
        "runs/<name>/. With no argument: an MLP on the shipped mnist5k, 4 replicas, 2 shards, "
        "Adagrad, on an embedded local cluster.",
        _train_arguments,
    ),
    "watch": (
        watch,
        "follow a running fit published on a cluster",
        "Print progress lines of the run a fit(..., publish=NAME) published on the "
        "cluster, until it ends (exit 0 when it finished, 1 if it failed).",
        _watch_arguments,
    ),
    "synthetic": (
        synthetic,
        "write a large learnable classification dataset as parquet files",
        "Write ROWS rows of FEATURES float32 features, labelled by a fixed random "
        "teacher network, as parquet files in PATH (streamed: memory stays bounded).",
        _synthetic_arguments,
    ),
    "train-sparse": (
        train_sparse,
        "train a sparse model on hashed categorical columns and write a run directory",
        "Train sparse logistic regression, a factorisation machine or an embedding + MLP "
        "model with Downpour SGD on parquet/CSV files whose categorical columns are hashed to "
        "table rows; the table is split by rows over --shards parameter-server shards and a "
        "replica pulls and pushes only the rows its batch touches. Writes --run-dir "
        "(config.json, pushes, evals, events, tables.npz).",
        _train_sparse_arguments,
    ),
    "report": (
        compare,
        "summarise and plot finished runs",
        "Print one summary row per run and write summary.csv and comparison "
        "plots (accuracy and loss against time, staleness histogram).",
        _report_arguments,
    ),
    "simulate": (
        simulate,
        "predict a finished run at other scales and plan its shards",
        "Calibrate a discrete-event simulator on RUN_DIR (once; saved as simulation.json) and "
        "print predicted throughput, shard utilisation and staleness for each replica and "
        "shard count, and the fewest shards keeping each shard below --max-utilisation.",
        _simulate_arguments,
    ),
}
