"""``downpour-dask report RUN_DIR...``: summarise and plot finished runs.

The table and plots come from :mod:`downpour_dask.report`; this module imports no estimator.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report import format_table, report
from .errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` arguments: the run directories, ``--out`` and ``--target``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default="report", help="directory for the table and plots")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="score for the time-to-target column (default: 0.9 for classifiers)",
    )


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
