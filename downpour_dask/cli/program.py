"""The command's name and version line: what ``downpour-dask --version`` prints, with nothing
but :mod:`downpour_dask._version` imported."""

from __future__ import annotations

from .._version import __version__

PROG = "downpour-dask"

#: What ``--version`` prints.
VERSION = f"{PROG} {__version__}"
