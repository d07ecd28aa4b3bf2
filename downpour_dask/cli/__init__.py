"""The ``downpour-dask`` command: ``train``, ``watch``, ``synthetic``, ``report`` and ``simulate``.

::

    downpour-dask train                                   # MLP on mnist5k, embedded cluster
    downpour-dask train --config run.toml --learning-rate 0.02
    downpour-dask train --scheduler tcp://10.0.0.5:8786 --n-replicas 16
    downpour-dask report runs/a runs/b --target 0.9
    downpour-dask synthetic big/ --rows 10000000 --features 256 --classes 10
    downpour-dask watch mnist --scheduler tcp://10.0.0.5:8786 --wait   # fit(..., publish="mnist")
    downpour-dask simulate --from runs/a --replicas 10,100,1000 --shards 1,4,16

:func:`main` answers ``--version`` at once, before Dask is imported (a deliberate deferred
import, allowed by ``tests/test_layers.py``); everything else is :mod:`.app` (exit statuses),
:mod:`.parser` (the commands, each one's module loaded only when it runs), one module per
command (:mod:`.training`, :mod:`.watching`, :mod:`.synthetic`, :mod:`.sparse`,
:mod:`.reporting`, :mod:`.simulation`), :mod:`.flags` (a ``train`` flag per estimator argument)
and :mod:`.connection` (reaching ``--scheduler``).
"""

from __future__ import annotations

import sys

from .program import PROG, VERSION

__all__ = ["PROG", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``downpour-dask`` console script; returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        print(VERSION)
        return 0
    from .app import run  # deferred: every command but --version needs Dask

    return run(args)
