"""The ``downpour-dask`` command: parse arguments, delegate to :mod:`downpour_dask.runs` and
:mod:`downpour_dask.report`.

::

    downpour-dask train                                   # MLP on mnist5k, embedded cluster
    downpour-dask train --config run.toml --learning-rate 0.02
    downpour-dask train --scheduler tcp://10.0.0.5:8786 --n-replicas 16
    downpour-dask report runs/a runs/b --target 0.9
    downpour-dask synthetic big/ --rows 10000000 --features 256 --classes 10
    downpour-dask watch mnist --scheduler tls://10.0.0.5:8786 --tls-ca-file ca.pem \\
        --tls-cert client.pem --tls-key client.key         # a run fit(..., publish="mnist")

Every estimator argument has a flag (``n_replicas`` -> ``--n-replicas``), generated from the
estimator's signature so none can be missing (:mod:`.flags`).  ``--config FILE.toml`` sets any
of them (and the job settings) with the same names; flags given on the command line win.  Bad
input ends the command with one line on stderr and exit status 2; a run that fails on the
cluster exits with 1.  Neither leaves a run directory behind.

The parser and its commands are in :mod:`.parser`, what each command does in :mod:`.commands`,
how a command reaches ``--scheduler`` in :mod:`.connection`.  This module holds :func:`main`.
"""

from __future__ import annotations

import sys

from .errors import UsageError, one_line
from .flags import FLAGLESS_ARGUMENTS
from .parser import PROG, build_parser

__all__ = ["FLAGLESS_ARGUMENTS", "PROG", "UsageError", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``downpour-dask`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        return args.handler(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as err:
        print(f"{where}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted; no run directory was written", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, TimeoutError) as err:
        print(f"{where}: failed: {one_line(err)}", file=sys.stderr)
        return 1
