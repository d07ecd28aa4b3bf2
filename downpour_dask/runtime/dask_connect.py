"""Dask clients made through Dask's handshake race: for a command connecting to a cluster where
other clients work (:func:`connect_client`), and for a task on a worker (:func:`worker_client`).

Both make the client again when the race fails it (:func:`_through_handshake_race` tells the
race).  Like :mod:`.dask_internals`, this module relies on Dask's private API, and
``tests/test_dask_internals.py`` makes the race on purpose to check it still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from distributed import Client, get_client, get_worker
from distributed import client as _dask_client

#: How often a client is made again after Dask's handshake race (:func:`connect_client`).
CLIENT_TRIES = 3
_CLIENT_LOCK = threading.Lock()


def _through_handshake_race(connect: Callable[[], Client], timeout: float | None) -> Client:
    """``connect()`` -- a new client, or the worker's -- made again when Dask's handshake race
    fails it, up to :data:`CLIENT_TRIES` times.

    A new client sends ``register-client`` and expects the scheduler's greeting alone.  If the
    scheduler broadcasts to all clients (a cancel, from any client: a driver restarting a
    replica, a notebook) in the same turn of its event loop, the greeting arrives in a batch of
    two and the client's constructor fails its ``assert len(msg) == 1``.  The half-made client
    stays registered as the default client, never connected: the next ``get_client()`` returns
    it.  So it is forgotten and closed before the next try.

    Relies on ``distributed.client._global_clients`` (the registry of default clients),
    ``_del_global_client``, a half-made client's ``status`` staying ``"connecting"``, and the
    ``AssertionError`` itself (checked: distributed 2026.8; the tests make the race on purpose).
    """
    with _CLIENT_LOCK:  # one client made at a time, so a half-made one is this call's
        for attempt in range(CLIENT_TRIES):
            before = list(_dask_client._global_clients.values())
            try:
                return connect()
            except AssertionError:
                if attempt == CLIENT_TRIES - 1:
                    raise
                for client in list(_dask_client._global_clients.values()):
                    if client not in before and client.status == "connecting":
                        _dask_client._del_global_client(client)
                        with contextlib.suppress(Exception):
                            client.close(timeout=timeout)
    raise AssertionError("unreachable")


def connect_client(address: str, timeout: float, **kwargs: Any) -> Client:
    """``distributed.Client(address, timeout=timeout, **kwargs)``, made again when Dask's
    handshake race fails it (see :func:`_through_handshake_race`): for a command connecting
    to a cluster where other clients work."""
    return _through_handshake_race(lambda: Client(address, timeout=timeout, **kwargs), timeout)


def worker_client(timeout: float | None = None) -> Client:
    """The Dask client of the worker running this task, connected to the scheduler.

    What ``distributed.get_client()`` returns inside a task, made again when Dask's handshake
    race fails it (see :func:`_through_handshake_race`).  A worker makes its client the first
    time a task asks for one (an actor handle, a ``Variable``): a replica's task on a fresh
    worker, restarted there while its driver cancels the old tasks, met the race in CI.
    Outside a worker it is ``get_client()``, and so it is on an event loop, where Dask makes a
    client that connects only when awaited (and where the lock could wait for a thread that
    waits for the loop).
    """
    made = _made_worker_client()
    if made is not None:  # every call but a worker's first: no lock, no look-up
        return made
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _through_handshake_race(lambda: get_client(timeout=timeout), timeout)
    return get_client(timeout=timeout)


def _made_worker_client() -> Client | None:
    """The client of the worker running this task if it made one that is connected, else None
    (relies on ``Worker._client``, where ``get_client`` keeps it)."""
    try:
        client = get_worker()._client
    except (ValueError, AttributeError):
        return None
    return client if client is not None and client.status == "running" else None
