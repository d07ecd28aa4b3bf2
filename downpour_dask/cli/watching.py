"""``downpour-dask watch NAME``: follow a fit published on a cluster until it ends.

The published run is read through :mod:`downpour_dask.live`; this module imports no estimator.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..live import attach, check_name, follow, is_published
from ..publishing import DRIVER_LOST, end_reason
from .connection import add_connection_flags, connect
from .errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``watch`` arguments: the published name, the scheduler, the interval, ``--wait``."""
    parser.add_argument("name", metavar="NAME", help="the name given to fit(..., publish=)")
    parser.add_argument(
        "--scheduler",
        required=True,
        metavar="ADDRESS",
        help="the Dask scheduler of the run's cluster (e.g. tcp://host:8786)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between progress lines when the output is not a terminal (default 2)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=600.0,
        default=None,
        metavar="SECONDS",
        help="wait up to SECONDS (default 600) for a run to be published as NAME, e.g. by a "
        "train --publish NAME just started",
    )
    add_connection_flags(parser)


def watch(args: argparse.Namespace) -> int:
    """``downpour-dask watch NAME``: print a published run's progress until it ends."""
    check_name(args.name)
    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0, got {args.interval:g}")
    if args.wait is not None and not args.wait >= 0:
        raise UsageError(f"--wait must be a number of seconds >= 0, got {args.wait:g}")
    with connect(args.scheduler, args) as client:
        if args.wait is not None:
            wait_published(client, args.name, args.wait)
        view = attach(args.name, client)  # ValueError naming the published runs if absent
        info = view.info
        print(
            f"watching {args.name!r}: {info.get('estimator')}, {info.get('n_replicas')} "
            f"replicas, {info.get('n_shards')} shards on {args.scheduler}",
            flush=True,
        )
        del view  # watching needs only the event topic; do not hold the run's actors
        finished = follow(client, args.name, sys.stdout, args.interval)
        lost = not finished and end_reason(client, args.name) == DRIVER_LOST
    if lost:
        raise RuntimeError(
            f"run {args.name!r} ended without finishing: its driver died, and the scheduler "
            f"let go of the run"
        )
    if not finished:
        raise RuntimeError(f"run {args.name!r} ended without finishing (its fit failed)")
    print(f"run {args.name!r} finished", flush=True)
    return 0


def wait_published(client: Any, name: str, seconds: float) -> None:
    """Wait up to ``seconds`` for a run to be published as ``name`` (``watch --wait``); return
    at once if it is, else let :func:`attach` say that it is not."""
    if is_published(client, name):
        return
    print(f"waiting up to {seconds:g} s for a run published as {name!r}", file=sys.stderr)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not is_published(client, name):
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
