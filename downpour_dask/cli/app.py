"""Running a ``downpour-dask`` command: parse the arguments, call the command, and turn what it
raised into one line on stderr and an exit status.

====== =====================================================================================
status meaning
====== =====================================================================================
0      done
1      the run failed on the cluster (a lost worker that could not be recovered, a failed
       fit a ``watch`` followed); nothing is written
2      bad input: a flag, a setting, a file, a run directory that exists, a scheduler that
       cannot be reached; nothing is started or written
130    interrupted (Ctrl-C); a ``train`` job says how ``--resume`` continues it
====== =====================================================================================

A warning (a fit stopped by its limit before converging, a cluster whose workers run Dask's
profiler) is one line on stderr too, ``downpour-dask COMMAND: warning: ...``, not Python's
form with the library's file and line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from .errors import Interrupted, Unreachable, one_line
from .parser import PROG, build_parser, named_command


def run(argv: list[str]) -> int:
    """Run the command ``argv`` (without the program name); return the exit status."""
    command = named_command(argv)
    parser = build_parser(load=[command] if command is not None else [])
    args = parser.parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(where)
            return args.handler(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError, Unreachable) as err:
        print(f"{where}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Interrupted as err:
        print(f"{where}: interrupted; {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, TimeoutError) as err:
        print(f"{where}: failed: {one_line(err)}", file=sys.stderr)
        return 1


def _one_line_warning(where: str) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints ``WHERE: warning: MESSAGE`` on one line."""

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        text = " ".join(str(message).split()) or category.__name__
        print(f"{where}: warning: {text}", file=sys.stderr)

    return show
