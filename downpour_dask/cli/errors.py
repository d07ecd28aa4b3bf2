"""How a command fails: :class:`UsageError` for bad input, and errors written as one line.

Bad input ends a command with one line on stderr and exit status 2; a run that fails on the
cluster exits with 1 (see :func:`downpour_dask.cli.main`).
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit status 2)."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type's name if it has none)."""
    return " ".join(str(err).split()) or type(err).__name__
