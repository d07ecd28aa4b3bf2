"""``downpour-dask synthetic PATH``: write a large learnable dataset as parquet files.

The data come from :mod:`downpour_dask.data.datasets` (or, with ``--criteo``, a click log from
:mod:`downpour_dask.data.criteo`); this module imports no estimator.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import datasets
from ..data.criteo import write_criteo
from .errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``synthetic`` arguments: the folder, the data's shape and seed, ``--criteo``."""
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
