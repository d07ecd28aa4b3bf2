"""The client calls the package makes through Dask's private API: each waits at most a given
time, which its public counterpart cannot, or asks the scheduler afresh where the public one
answers from a cache.

Most go through ``Client.sync(coroutine, ..., callback_timeout=timeout)``, the private helper
that runs one of the client's private coroutines (``Client._run``, ``Client._scatter``...) on
its event loop and cancels it when the time is up.  Like :mod:`.dask_internals`, each function
says what it relies on and the ``distributed`` versions it was checked against, and
``tests/test_dask_internals.py`` runs every one on the installed ``distributed``: after an
upgrade, this module and that one are the only ones to fix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from distributed import Client


def scheduler_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's current workers (address -> info such as ``nthreads``), asked afresh.

    The public ``Client.scheduler_info(n_workers=-1)`` returns the client's cached identity,
    which the client's own periodic refresh may replace at any moment with a summary *without*
    per-worker entries (distributed 2026.8): under load it sometimes reported no workers at all.

    Relies on ``client.scheduler`` (the client's rpc to the scheduler), its ``identity``
    handler taking ``n_workers`` and ``Client.sync`` (checked: distributed 2024.x to 2026.8).
    Falls back to the public ``scheduler_info(n_workers=-1)`` if that call's shape changed.
    """
    try:
        identity = client.sync(client.scheduler.identity, n_workers=-1)
        return dict(identity["workers"])
    except (AttributeError, TypeError, KeyError):
        return dict(client.scheduler_info(n_workers=-1).get("workers", {}))


def run_within(
    client: Client, function: Callable[..., Any], workers: list[str] | None, timeout: float,
    nanny: bool = False,
):  # fmt: skip
    """``client.run(function, workers=workers, nanny=nanny)`` (None: every worker) waiting at most
    ``timeout`` seconds, which it cannot itself: ``Client._run`` under ``Client.sync``'s
    ``callback_timeout`` (checked: distributed 2024.x to 2026.8; a changed name fails loudly)."""
    run = client._run
    return client.sync(run, function, workers=workers, nanny=nanny, callback_timeout=timeout)


def ask_each_within(
    client: Client, questions: list[tuple[Callable[..., Any], bool]], timeout: float
) -> list[dict[str, Any]]:
    """For each ``(function, nanny)`` of ``questions``, what every worker (or its nanny, with
    ``nanny``) answered ``function()``, all asked at once and awaited at most ``timeout``
    seconds in all: a worker that does not answer in time, or fails, withholds its own
    answer only (``client.run`` waits for every worker, or fails for all).

    Relies on ``Client._run(function, workers=, nanny=, on_error=)`` and ``Client.sync``
    (checked: distributed 2024.x to 2026.8).
    """
    addresses = list(scheduler_workers(client))

    async def ask() -> list[dict[str, Any]]:
        asked = {
            asyncio.ensure_future(client._run(f, workers=[a], nanny=n, on_error="return")): i
            for i, (f, n) in enumerate(questions)
            for a in addresses
        }
        answers: list[dict[str, Any]] = [{} for _ in questions]
        if not asked:
            return answers
        done, late = await asyncio.wait(asked, timeout=timeout)
        for call in late:
            call.cancel()
        for call in done:
            if not call.cancelled() and call.exception() is None:
                found = call.result() or {}
                answers[asked[call]].update(
                    (a, v) for a, v in found.items() if not isinstance(v, BaseException)
                )
        return answers

    return client.sync(ask)


def register_worker_plugin(client: Client, plugin: Any, name: str, timeout: float) -> None:
    """``client.register_plugin(plugin, name=name)`` for a worker plugin, waiting at most
    ``timeout`` seconds; an error in a worker's ``setup`` is raised here.

    Relies on ``Client._register_worker_plugin(plugin, name, idempotent)`` (checked:
    distributed 2024.x to 2026.8).
    """
    register = client._register_worker_plugin
    client.sync(register, plugin=plugin, name=name, idempotent=False, callback_timeout=timeout)


def unregister_worker_plugin(client: Client, name: str, timeout: float) -> bool:
    """``client.unregister_worker_plugin(name)`` waiting at most ``timeout`` seconds (every
    worker's ``teardown`` runs); False, and nothing done, if no such plugin is registered.

    Relies on ``Client._unregister_worker_plugin(name)``, ``Client._run_on_scheduler`` and the
    scheduler's ``worker_plugins`` (checked: distributed 2024.x to 2026.8).  Asked first, since
    the scheduler logs an error for a name it does not have.
    """
    if not client.sync(client._run_on_scheduler, _has_plugin, name, callback_timeout=timeout):
        return False
    client.sync(client._unregister_worker_plugin, name=name, callback_timeout=timeout)
    return True


def _has_plugin(name: str, dask_scheduler: Any = None) -> bool:
    return name in dask_scheduler.worker_plugins


def scatter_within(
    client: Client, data: Any, workers: list[str] | None, direct: bool, timeout: float
) -> Any:
    """``client.scatter(data, workers=workers, direct=direct, hash=False)`` waiting at most
    ``timeout`` seconds in all.

    ``Client.scatter``'s own ``timeout`` bounds only its wait for workers to appear: a scatter
    to a worker that is stopped (SIGSTOP) or hung waits for it for ever, and so would a fit.
    Relies on ``Client._scatter`` under ``Client.sync``'s ``callback_timeout``, which cancels
    the scatter when the time is up (checked: distributed 2026.8; a changed name fails loudly).
    """
    scatter = client._scatter
    return client.sync(
        scatter, data, workers=workers, direct=direct, hash=False, callback_timeout=timeout
    )
