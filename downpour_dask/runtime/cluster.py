"""The Dask cluster a fit runs on: the embedded local cluster, TLS settings, the worker list.

A fit given no client starts an embedded :class:`~distributed.LocalCluster` of single-threaded
worker processes and closes it afterwards; a fit given a client uses that cluster as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from distributed import Client, LocalCluster, Security

from .dask_internals import scheduler_workers


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


@contextlib.contextmanager
def cluster_client(
    client: Client | None, security: Security | bool | None = None
) -> Iterator[Client]:
    """Yield ``client``, or start an embedded local cluster (worker processes) and close it after.

    The embedded cluster has one single-threaded worker process per core (at least two), so
    parameter-server shards and replicas run in separate processes as they would on a real cluster.
    With ``security`` (``True`` for ``Security.temporary()``, or a ``distributed.Security`` with
    certificates for every role) it listens on TLS only and refuses clients without credentials.

    Raises
    ------
    ValueError
        If both ``client`` and ``security`` are given: a client brings its own security.
    """
    check_security(security)
    if client is not None:
        if security is not None:
            raise ValueError(
                "security= configures the embedded cluster, started only when client is None; "
                "the client given already has its own security (Client(..., security=...))"
            )
        yield client
        return
    n_workers = max(2, min(os.cpu_count() or 2, 8))
    tls: dict[str, Any] = {}
    if security is not None:
        tls = {
            "security": Security.temporary() if security is True else security,
            "protocol": "tls://",
        }
    with (
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            **tls,
        ) as cluster,
        Client(cluster, security=cluster.security) as embedded,
    ):
        yield embedded

def cluster_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's current workers (address -> info such as ``nthreads``), asked afresh.

    ``Client.scheduler_info(n_workers=-1)`` returns the client's cached identity, which the
    client's own periodic refresh may replace at any moment with a summary *without* per-worker
    entries (distributed 2026.8).  Under load it sometimes reported no workers at all, and a
    healthy run then looked as if every worker had left.  So ask the scheduler directly
    (:func:`~downpour_dask.runtime.dask_internals.scheduler_workers`).
    """
    return scheduler_workers(client)
