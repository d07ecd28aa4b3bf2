"""How a command fails: :class:`UsageError` for bad input, :class:`Unreachable` for a scheduler
that cannot be reached, :class:`Interrupted` for Ctrl-C, and errors written as one line.

Bad input and an unreachable scheduler end a command with one line on stderr and exit status 2;
a run that fails on the cluster exits with 1; Ctrl-C with 130 (see :mod:`downpour_dask.cli.app`).
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit status 2)."""


class Unreachable(Exception):
    """The ``--scheduler`` could not be reached in ``--connect-timeout`` (exit status 2)."""


class Interrupted(Exception):
    """Ctrl-C stopped a command; the message says what was kept and how to go on (status 130)."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type's name if it has none)."""
    return " ".join(str(err).split()) or type(err).__name__
