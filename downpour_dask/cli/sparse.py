"""``downpour-dask train-sparse``: train a sparse model on hashed click data from the shell.

It parses the flags into the settings of :mod:`downpour_dask.runs.sparse_job` (which checks them
and the files' columns before any cluster work, runs :func:`~downpour_dask.downpour.sparse_fit.
fit_sparse` and writes the run directory) and words its errors with the flags' names::

    downpour-dask synthetic clicks/ --criteo --rows 200000 --files 4
    downpour-dask train-sparse --data 'clicks/*.parquet' --label click \\
        --categorical C1,C2,...,C26 --numeric I1,...,I13 --transform log1p \\
        --model fm --n-rows 1048576 --shards 4 --replicas 2 --run-dir runs/fm
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from ..progress import ProgressBar
from ..runs.sparse_job import SPARSE_DEFAULTS, SparseJob, prepare_sparse, run_sparse
from .connection import add_connection_flags, connect, tls_credentials_given
from .errors import UsageError
from .interrupts import DeferredInterrupt

#: Flag of each setting whose flag is not simply its name with dashes.
FLAGS = {"n_shards": "--shards", "n_replicas": "--replicas", "max_epochs": "--epochs",
         "n_factors": "--factors"}


def flag_of(setting: str) -> str:
    """The ``train-sparse`` flag that sets ``setting``."""
    return FLAGS.get(setting, "--" + setting.replace("_", "-"))


def replicas(text: str) -> int | str:
    """``--replicas``: a count, or ``auto``."""
    return text if text == "auto" else int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train-sparse`` flags (defaults: :data:`~downpour_dask.runs.sparse_job.
    SPARSE_DEFAULTS`)."""
    data = parser.add_argument_group("data")
    data.add_argument("--data", required=True, metavar="FILES",
                      help="parquet/CSV files: a file, a directory or a quoted glob")
    data.add_argument("--eval-data", metavar="FILES",
                      help="held-out files, evaluated every --eval-every seconds and at the end")
    data.add_argument("--categorical", required=True, metavar="C1,C2,...",
                      help="categorical columns, each hashed to a table row id")
    data.add_argument("--numeric", metavar="I1,I2,...", help="numeric columns (default none)")
    data.add_argument("--label", metavar="COLUMN", help="the 0/1 label column (default label)")
    data.add_argument("--transform", choices=["none", "log1p"],
                      help="of the numeric columns (log1p for counts; default none)")
    data.add_argument("--hash-seed", type=int, metavar="N", help="the hash's seed (default 0)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=["logistic", "fm", "embedding_mlp"],
                       help="sparse logistic regression, factorisation machine or embeddings + "
                       "MLP (default logistic)")
    model.add_argument("--n-rows", type=int, metavar="N",
                       help="rows of the table the columns hash into (default 1048576)")
    model.add_argument("--factors", dest="n_factors", type=int, metavar="K",
                       help="[fm] factors per row (default 8)")
    model.add_argument("--dim", type=int, metavar="D", help="[embedding_mlp] embedding width")
    model.add_argument("--hidden", metavar="W1,W2", help="[embedding_mlp] hidden layer widths")
    fit = parser.add_argument_group("training")
    fit.add_argument("--shards", dest="n_shards", type=int, metavar="K",
                     help="parameter-server shards (default 2)")
    fit.add_argument("--replicas", dest="n_replicas", type=replicas, metavar="R",
                     help="replicas; each streams whole files, so at most one per file "
                     "(default 2); auto: one per worker, and one on each worker that joins "
                     "(up to --max-replicas)")
    fit.add_argument("--max-replicas", type=int, metavar="N",
                     help="a worker that joins the cluster gets a new replica while fewer than "
                     "N train, with a share of the others' files (default: none added)")
    fit.add_argument("--optimizer", help="sgd, momentum, adagrad or staleness_aware_<rule>, "
                     "options after a colon: momentum:momentum=0.5 (default adagrad)")
    fit.add_argument("--learning-rate", type=float, metavar="LR", help="(default 0.05)")
    fit.add_argument("--batch-size", type=int, metavar="B", help="(default 256)")
    fit.add_argument("--epochs", dest="max_epochs", type=int, metavar="E",
                     help="passes over the data (default 1)")
    fit.add_argument("--max-steps", type=int, metavar="N", help="steps per replica at most")
    fit.add_argument("--seed", type=int, metavar="N", help="initial rows and data order")
    fit.add_argument("--eval-every", type=float, metavar="SECONDS", help="(default 5)")
    fit.add_argument("--timeout", type=float, metavar="SECONDS",
                     help="for any one call to a shard (default 120)")
    job = parser.add_argument_group("job")
    job.add_argument("--run-dir", required=True, metavar="PATH", help="run directory to write")
    job.add_argument("--overwrite", action="store_true",
                     help="replace an existing run directory (never another directory)")
    job.add_argument("--publish", metavar="NAME",
                     help="publish the running fit as NAME for downpour-dask watch NAME")
    job.add_argument("--scheduler", metavar="ADDRESS",
                     help="train on this Dask cluster instead of an embedded one")
    job.add_argument("--quiet", action="store_true",
                     help="no progress bar and no 'connecting to' message")
    add_connection_flags(parser)


#: Parsed arguments that are not job settings.
NOT_SETTINGS = frozenset({"command", "handler", "quiet", "scheduler", "connect_timeout",
                          "tls_ca_file", "tls_cert", "tls_key"})


def flagged(message: str) -> str:
    """An error message of the job's checks with setting names written as their flags."""
    names = sorted(set(SPARSE_DEFAULTS) - {"model", "overwrite"}, key=len, reverse=True)
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?!\w)"
    return re.sub(pattern, lambda m: flag_of(m.group(1)), message)


def prepare(args: argparse.Namespace) -> SparseJob:
    """The checked job of the parsed ``args`` (UsageError naming the flag otherwise)."""
    settings: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    try:
        return prepare_sparse(settings)
    except (ValueError, TypeError) as err:
        raise UsageError(flagged(str(err))) from None


def train_sparse(args: argparse.Namespace) -> int:
    """``downpour-dask train-sparse``: train, write the run directory, print its headline."""
    job = prepare(args)  # every input error surfaces here, before any cluster work
    if args.scheduler is None and tls_credentials_given(args):
        raise UsageError("--tls-ca-file/--tls-cert/--tls-key are a client's credentials for "
                         "--scheduler")
    bar = None if args.quiet else ProgressBar(sys.stderr)
    try:
        with DeferredInterrupt(bar) as callback:  # Ctrl-C stops the fit at its next report
            if args.scheduler is None:
                result = run_sparse(job, None, callback)
            else:
                with connect(args.scheduler, args, quiet=args.quiet) as client:
                    result = run_sparse(job, client, callback)
    finally:
        if bar is not None:
            bar.close()  # a failed fit sends no last snapshot
    s = result.summary
    print(f"run directory: {result.path}")
    if "final_loss" in s:
        print(f"held-out log-loss {s['final_loss']:.4f}, AUC {s['final_auc']:.4f}, "
              f"accuracy {s['final_accuracy']:.4f}")
    print(f"{s['duration']:.2f} s, {s['examples_per_s']:,.0f} examples/s, {int(s['steps'])} "
          f"steps, staleness mean {s['staleness_mean']:.2f}, {int(s['refused_pushes'])} "
          f"refused pushes")
    return 0
