"""Dask's scheduler state that a plugin running *in* the scheduler changes without a client.

A scheduler plugin has no client of its own, yet the plugin that cleans up after a fit's lost
driver (:mod:`downpour_dask.downpour.driver_loss`) must do what clients do: run a function on
every worker, delete the fit's ``distributed.Variable`` objects, withdraw its published
dataset, unregister its worker plugin and let go of futures.  Each function below does one of
them on the scheduler's side.  Like
:mod:`.dask_internals` (whose docstring describes the convention), each says what it relies on
and the ``distributed`` versions it was checked against; ``tests/test_driver_loss.py`` runs
them on the installed ``distributed``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from distributed.core import clean_exception
from distributed.protocol import pickle
from distributed.protocol.serialize import Serialize, Serialized, deserialize


def variables_named(scheduler: Any, prefix: str) -> dict[str, Any]:
    """The ``distributed.Variable`` objects whose name starts with ``prefix``: each name with
    the key of the future it holds (None for a plain value).

    Relies on the scheduler's ``extensions["variables"]`` (``VariableExtension``) keeping its
    variables in a dict ``variables`` of ``{"type": ..., "value": ...}`` records by name, the
    value of a future being its key (checked: distributed 2026.8).  Without it: ``{}``.
    """
    held = getattr(getattr(scheduler, "extensions", {}).get("variables"), "variables", {})
    return {
        name: record.get("value") if record.get("type") == "Future" else None
        for name, record in list(held.items())
        if isinstance(name, str) and name.startswith(prefix) and isinstance(record, dict)
    }


async def delete_variables(scheduler: Any, prefix: str) -> dict[str, Any]:
    """Delete the :func:`variables_named` ``prefix``, letting go of the futures they hold, with
    the ``delete(name=...)`` handler ``Variable.delete`` calls (checked: distributed 2026.8);
    return what :func:`variables_named` did."""
    found = variables_named(scheduler, prefix)
    for name in found:
        await scheduler.extensions["variables"].delete(name=name)
    return found


def withdraw_dataset(scheduler: Any, name: str, holding: Any) -> bool:
    """Withdraw the dataset published as ``name``, as ``Client.unpublish_dataset`` does, if it
    holds a future of one of the keys ``holding`` (so it is the caller's, not a later one of
    the same name); True if withdrawn.

    Relies on the scheduler's ``extensions["publish"]`` (``PublishExtension``) keeping datasets
    in a dict ``datasets`` of ``{"keys": ...}`` records by name, whose keys are wanted by the
    pseudo-client ``"published-<name>"`` (checked: distributed 2026.8).  Its
    ``delete`` handler cannot be used: it first waits for a message from the (gone) client.
    Without the dict it withdraws nothing and returns False.
    """
    datasets = getattr(getattr(scheduler, "extensions", {}).get("publish"), "datasets", {})
    record = datasets.get(name)
    if not isinstance(record, dict) or not set(record.get("keys", ())) & set(holding):
        return False
    del datasets[name]
    scheduler.client_releases_keys(keys=record["keys"], client=f"published-{name}")
    return True


async def unregister_worker_plugin(scheduler: Any, name: str, timeout: float) -> bool:
    """Unregister the worker plugin ``name`` (every worker runs its ``teardown``), waiting at
    most ``timeout`` seconds for the workers; True if it was registered.

    Calls the scheduler's ``unregister_worker_plugin(comm, name)`` handler, what
    ``Client.unregister_worker_plugin`` asks for, which forgets the plugin at once and then
    waits for every worker's answer (checked: distributed 2026.8): a stopped worker
    must not hold the scheduler's cleanup, hence the bound.
    """
    if name not in getattr(scheduler, "worker_plugins", {}):
        return False
    with contextlib.suppress(asyncio.TimeoutError, ValueError):
        await asyncio.wait_for(scheduler.unregister_worker_plugin(None, name), timeout)
    return True


def release_keys(scheduler: Any, keys: Any) -> list[str]:
    """Have every client that still wants one of ``keys`` let go of it, as its own release
    would (the tasks are forgotten once nobody wants them); return those clients.

    For the futures a finished task's leftovers still hold: a replica's actor handles sit in
    reference cycles on its worker until Python's cycle collector runs, and an idle worker's
    may never run.  Relies on the scheduler's ``tasks`` dict of ``TaskState`` objects, whose
    ``who_wants`` holds ``ClientState`` objects with a ``client_key`` (checked: distributed
    2026.8); without them it releases nothing.  The client's own later release of
    the key is then a no-op.
    """
    released = []
    for key in keys:
        state = getattr(scheduler, "tasks", {}).get(key)
        for wanting in list(getattr(state, "who_wants", None) or ()):
            scheduler.client_releases_keys(keys=[key], client=wanting.client_key)
            released.append(str(wanting.client_key))
    return sorted(set(released))


def _unwrapped(value: Any) -> Any:
    """A value of a worker's reply as sent: the scheduler passes a worker's serialised values
    on undecoded (``Serialized``), and none was encoded without a comm between (``Serialize``,
    an in-process worker)."""
    if isinstance(value, Serialized):
        return deserialize(value.header, value.frames)
    return value.data if isinstance(value, Serialize) else value


async def run_on_workers(
    scheduler: Any, function: Callable[..., Any], *args: Any, timeout: float
) -> dict[str, Any]:
    """Run ``function(*args)`` on every worker, as ``Client.run`` does, waiting at most
    ``timeout`` seconds for each; return each worker's result (its exception if it failed,
    ``TimeoutError`` if it did not answer in time: a stopped worker must not hold the
    scheduler).

    Sends each worker the message ``Client.run`` has the scheduler broadcast: ``{"op": "run",
    "function": ..., "args": ..., "kwargs": ..., "wait": True}`` pickled by
    ``distributed.protocol.pickle``, answered ``{"status": "OK", "result": ...}`` or an error
    ``distributed.core.clean_exception`` reads, whose values the scheduler leaves serialised
    (checked: distributed 2026.8); another answer counts as the worker's failure.
    """
    message = {
        "op": "run",
        "function": pickle.dumps(function),
        "args": pickle.dumps(args),
        "kwargs": pickle.dumps({}),
        "wait": True,
    }

    async def one(worker: str) -> Any:
        try:
            replies = await asyncio.wait_for(
                scheduler.broadcast(msg=message, workers=[worker], on_error="return"), timeout
            )
        except (asyncio.TimeoutError, OSError) as err:
            return err
        reply = replies.get(worker)
        if isinstance(reply, dict):
            reply = {key: _unwrapped(value) for key, value in reply.items()}
            if reply.get("status") == "OK":
                return reply.get("result")
            with contextlib.suppress(Exception):
                return clean_exception(**reply)[1]  # what the function raised
        return reply if isinstance(reply, Exception) else RuntimeError(repr(reply)[:200])

    workers = list(getattr(scheduler, "workers", {}))
    return dict(zip(workers, await asyncio.gather(*(one(w) for w in workers))))
