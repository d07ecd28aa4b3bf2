"""The Dask cluster a fit runs on: the embedded local cluster, TLS settings, the worker list,
and how the driver's data reaches the workers.

A fit given a client uses that cluster as it is; given none, it uses the current default Dask
client if there is one (as Dask and dask-ml do), and otherwise starts an embedded
:class:`~distributed.LocalCluster` of single-threaded worker processes and closes it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

from distributed import Client, LocalCluster, Security, default_client, get_worker

from .affinity import pin_workers
from .dask_client_calls import register_worker_plugin, scatter_within, scheduler_workers
from .interrupts import PLUGIN_NAME, LeaveInterruptsToTheDriver
from .profiler import warn_if_profiler_can_deadlock, without_unsafe_profiler

#: Set to ``0`` to leave an embedded cluster's workers unpinned (see :func:`cluster_client`).
PIN_VARIABLE = "DOWNPOUR_DASK_PIN_WORKERS"


def check_security(value: Any) -> None:
    """Raise TypeError unless ``value`` is None, True or a ``distributed.Security``, and a clear
    error if ``True`` cannot work because ``cryptography`` (the ``tls`` extra) is missing."""
    if value is True and importlib.util.find_spec("cryptography") is None:
        raise ValueError(
            "security=True makes temporary TLS certificates, which needs the cryptography "
            "package: pip install 'downpour-dask[tls]'"
        )
    if value is None or value is True or isinstance(value, Security):
        return
    raise TypeError(
        f"security must be None, True (a TLS-only embedded cluster with temporary certificates) "
        f"or a distributed.Security, got {value!r} ({type(value).__name__})"
    )


def current_client() -> Client | None:
    """The current default Dask client (the last ``Client`` made, or one set with
    ``client.as_current()``), as ``distributed.default_client`` finds it; None when there is none
    or it is closed."""
    try:
        client = default_client()
    except ValueError:  # no client
        return None
    return client if client.status == "running" else None


def dashboard_line(cluster: Any, pinned: dict[str, list[int]] | None = None) -> str:
    """One line naming the embedded cluster, whether its workers are ``pinned`` (each worker's
    CPUs), and where its dashboard is (or how to get one)."""
    workers = f"{len(cluster.workers)} workers"
    if pinned:
        workers += f" pinned to CPUs {', '.join(map(str, sorted(pinned.values())))}"
    link = cluster.dashboard_link if importlib.util.find_spec("bokeh") else None
    where = (
        f"dashboard at {link}"
        if link
        else "no dashboard (it needs bokeh: pip install 'downpour-dask[notebooks]')"
    )
    return f"downpour-dask: started a local Dask cluster of {workers}; {where}"


@contextlib.contextmanager
def cluster_client(
    client: Client | None,
    security: Security | bool | None = None,
    announce: bool = False,
    busy_threads: float = 0,
) -> Iterator[Client]:
    """Yield the cluster to run on: ``client``, else the current default client, else an embedded
    local cluster (worker processes) that is closed afterwards.

    As in Dask and dask-ml, ``client=None`` means "the current client" (the last ``Client()``
    made in this process, or the one made current with ``client.as_current()``); only when there
    is none is an embedded cluster started.  It has one single-threaded worker process per core
    (at least two), so parameter-server shards and replicas run in separate processes as they
    would on a real cluster.  With ``security`` (``True`` for ``Security.temporary()``, or a
    ``distributed.Security`` with certificates for every role) the embedded cluster is always
    started, listening on TLS only and refusing clients without credentials.  With ``announce``,
    a started cluster's dashboard link is printed to stderr (one line).

    A started cluster's workers ignore SIGINT, restarted ones too: a terminal's Ctrl-C stops
    the driver, which then stops them (:mod:`~downpour_dask.runtime.interrupts`).

    A started cluster's workers are pinned to CPUs of their own
    (:func:`~downpour_dask.runtime.affinity.pin_workers`) when ``busy_threads``, the replicas
    the fit runs, are at least as many as the workers: each worker's threads then stay with
    their data, and two workers' replicas never share a core while the other runs helpers.  With
    fewer replicas than workers, pinned workers could not borrow the idle cores, so they are
    left unpinned; so are they where the CPUs are fewer than the workers, where pinning fails
    or times out (it is only a speed-up), or where the environment sets
    ``DOWNPOUR_DASK_PIN_WORKERS=0``.  A cluster the caller brings is never pinned here
    (``downpour_dask.pin_workers(client)`` does that).

    Where Dask's worker profiler can deadlock a worker (CPython before 3.11.9, see
    :mod:`~downpour_dask.runtime.profiler`), a started cluster's workers run without it (restarted
    ones too), and a cluster the caller brings whose workers run it, or whose nannies would
    restart them with it, draws a ``RuntimeWarning`` (once).

    Raises
    ------
    ValueError
        If both ``client`` and ``security`` are given: a client brings its own security; or
        if ``client`` is closed.
    TypeError
        If ``client`` is not a ``distributed.Client``.
    """
    check_security(security)
    if client is not None:
        check_client(client)
        if security is not None:
            raise ValueError(
                "security= configures the embedded cluster, started only when client is None; "
                "the client given already has its own security (Client(..., security=...))"
            )
        warn_if_profiler_can_deadlock(client)
        yield client
        return
    current = current_client() if security is None else None
    if current is not None:
        warn_if_profiler_can_deadlock(current)
        yield current
        return
    n_workers = max(2, min(os.cpu_count() or 2, 8))
    tls: dict[str, Any] = {}
    if security is not None:
        tls = {
            "security": Security.temporary() if security is True else security,
            "protocol": "tls://",
        }
    cluster = LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0",
        **tls, **without_unsafe_profiler(),
    )  # fmt: skip
    with cluster, Client(cluster, security=cluster.security) as embedded:
        with contextlib.suppress(ValueError, RuntimeError, TimeoutError, asyncio.TimeoutError):
            register_worker_plugin(embedded, LeaveInterruptsToTheDriver(), PLUGIN_NAME, 30)
        pinned = None
        if busy_threads >= n_workers and os.environ.get(PIN_VARIABLE, "1") != "0":
            with contextlib.suppress(ValueError, RuntimeError, TimeoutError, asyncio.TimeoutError):
                pinned = pin_workers(embedded, timeout=30)
        if announce:
            print(dashboard_line(cluster, pinned), file=sys.stderr, flush=True)
        yield embedded


def check_client(client: Any) -> None:
    """Raise unless ``client`` is a ``distributed.Client`` that is not closed: a scheduler's
    address, say, or a closed client would otherwise fail deep inside the first Dask call."""
    if not isinstance(client, Client):
        hint = ""
        if isinstance(client, str):
            hint = f"; for a scheduler's address, pass Client({client!r})"
        raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}{hint}")
    if client.status in ("closing", "closed"):
        raise ValueError(
            f"client is {client.status}: pass an open Client, or leave client=None to use the "
            f"current Dask client or start a local cluster"
        )


def cluster_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's current workers (address -> info such as ``nthreads``), asked afresh.

    ``Client.scheduler_info(n_workers=-1)`` returns the client's cached identity, which the
    client's own periodic refresh may replace at any moment with a summary *without* per-worker
    entries (distributed 2026.8).  Under load it sometimes reported no workers at all, and a
    healthy run then looked as if every worker had left.  So ask the scheduler directly
    (:func:`~downpour_dask.runtime.dask_client_calls.scheduler_workers`).
    """
    return scheduler_workers(client)


def send_to_workers(
    client: Client, data: Any, workers: list[str] | None = None, *, timeout: float
) -> Any:
    """Scatter ``data`` (a list, or a dict of named values) from the driver to ``workers``
    (default: spread over all of them), straight to the workers rather than through the
    scheduler, waiting at most ``timeout`` seconds (``TimeoutError`` after that: a worker that
    is stopped or hung would otherwise hold the scatter for ever).

    Dask's own default relays a scatter from a client outside the cluster through the scheduler:
    every byte crosses the loopback or the network twice, and the scheduler process (which
    shares the cores with the workers on a local cluster) serialises each block on the way.  A
    fit's driver already talks to the workers directly (actor calls go to the worker holding the
    actor), so going direct adds no reachability requirement.  A client made with
    ``direct_to_workers=False`` (or Dask's ``distributed.client.direct-to-workers: false``) keeps
    the relay.  List items get fresh random keys (``hash=False``), so a previous fit releasing
    equal data cannot race this one.
    """
    direct = client.direct_to_workers is not False
    return scatter_within(client, data, workers, direct, timeout)


def worker_tcp_host() -> str | None:
    """This worker's host if its comm is plain TCP (where a direct socket may listen too, see
    :mod:`downpour_dask.ps.wire`), else None (TLS or another protocol, or not on a worker)."""
    try:
        address = get_worker().address
    except ValueError:
        return None
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host.strip("[]")
