"""The ``downpour-dask`` argument parser: its commands, each command's arguments loaded on demand.

A command lives in a module of its own (:mod:`.training`, :mod:`.watching`, :mod:`.synthetic`,
:mod:`.sparse`, :mod:`.reporting`, :mod:`.simulation`) that adds its arguments and runs it.
Only ``train`` and ``train-sparse`` need the estimators (and with them scikit-learn), which take
a Python process over a second to import: so :func:`build_parser` given the command of a command
line loads that command's module alone, and ``watch``, ``report``, ``synthetic`` and ``--help``
start without the estimators.  The other commands still appear, with their help, to list them
and to refuse a misspelt one.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterable
from typing import Any, NoReturn

from .program import PROG, VERSION

__all__ = ["COMMANDS", "PROG", "build_parser", "named_command"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage dump) and exit 2, and
    that takes no abbreviation (``--n-replica`` is an error, not ``--n-replicas``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``downpour-dask`` argument parser with all its commands; the arguments and handler
    of those named in ``load`` only (None: of every command)."""
    loaded = set(COMMANDS) if load is None else set(load)
    parser = _Parser(prog=PROG, description="Downpour SGD on Dask: train and compare runs.")
    parser.add_argument("--version", action="version", version=VERSION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (_, handler, help_text, description) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=description)
        if name in loaded:
            module = command_module(name)
            command.set_defaults(handler=getattr(module, handler))
            module.add_arguments(command)
    return parser


def command_module(name: str) -> Any:
    """The module of command ``name`` (imported now if it was not yet)."""
    return importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")


def named_command(argv: list[str]) -> str | None:
    """The command a command line names (its first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


#: Each command: the module of this package that adds its arguments (``add_arguments``) and runs
#: it (the function named next), its one-line help and its description.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "train": (
        "training", "train",
        "train a model and write a run directory",
        "Train a model with Downpour SGD (or Sandblaster L-BFGS) and write "
        "runs/<name>/. With no argument: an MLP on the shipped mnist5k, 4 replicas, 2 shards, "
        "Adagrad, on an embedded local cluster.",
    ),
    "watch": (
        "watching", "watch",
        "follow a running fit published on a cluster",
        "Print progress lines of the run a fit(..., publish=NAME) published on the "
        "cluster, until it ends (exit 0 when it finished, 1 if it failed).",
    ),
    "synthetic": (
        "synthetic", "synthetic",
        "write a large learnable classification dataset as parquet files",
        "Write ROWS rows of FEATURES float32 features, labelled by a fixed random "
        "teacher network, as parquet files in PATH (streamed: memory stays bounded).",
    ),
    "train-sparse": (
        "sparse", "train_sparse",
        "train a sparse model on hashed categorical columns and write a run directory",
        "Train sparse logistic regression, a factorisation machine or an embedding + MLP "
        "model with Downpour SGD on parquet/CSV files whose categorical columns are hashed to "
        "table rows; the table is split by rows over --shards parameter-server shards and a "
        "replica pulls and pushes only the rows its batch touches. Writes --run-dir "
        "(config.json, pushes, evals, events, tables.npz).",
    ),
    "report": (
        "reporting", "compare",
        "summarise and plot finished runs",
        "Print one summary row per run and write summary.csv and comparison "
        "plots (accuracy and loss against time, staleness histogram).",
    ),
    "simulate": (
        "simulation", "simulate",
        "predict a finished run at other scales and plan its shards",
        "Calibrate a discrete-event simulator on RUN_DIR (once; saved as simulation.json) and "
        "print predicted throughput, shard utilisation and staleness for each replica and "
        "shard count, and the fewest shards keeping each shard below --max-utilisation.",
    ),
}
