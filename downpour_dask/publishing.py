"""Publishing a running fit by name: the driver's side of :mod:`downpour_dask.live`.

The driver publishes the shard actors' futures under the name (they keep the actors alive while
the run is published), logs a JSON record of the run on the scheduler event topic
``downpour-dask/<name>`` (:func:`describe`), a compact progress record about four times a
second (:func:`log_progress`), and an ``end`` record when the run is over.  Watchers read only
the topic's JSON and dicts, never the published futures (:mod:`downpour_dask.live`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from distributed import Client

from .log import Progress
from .ps.server import ParameterServer

#: Prefix of the scheduler event topic a published run logs its progress under.
TOPIC_PREFIX = "downpour-dask/"


def topic(name: str) -> str:
    """The scheduler event topic of the run published as ``name``."""
    return TOPIC_PREFIX + name


def check_name(name: Any) -> None:
    """Raise TypeError/ValueError unless ``name`` (given as ``publish=``) is a usable
    publication name: a non-empty str."""
    if not isinstance(name, str):
        raise TypeError(f"publish must be a non-empty str or None, got {type(name).__name__}")
    if not name.strip():
        raise ValueError(f"publish must be a non-empty str or None, got {name!r}")


def publish(
    client: Client,
    name: str,
    server: ParameterServer,
    info: dict[str, Any],
    override: bool = False,
) -> None:
    """Publish a running fit's parameter server on the cluster under ``name``.

    Parameters
    ----------
    client : distributed.Client
        The driver's client.
    name : str
        Publication name; it must not be in use on this scheduler.
    server : ParameterServer
        The run's server (as created by the driver: it holds the shard actors' futures).
    info : dict
        JSON-like facts about the run: at least ``model`` (the model's ``get_config()``) and
        ``t0`` (the wall-clock time the fit started).
    override : bool, default False
        Replace this run's own earlier publication (after a lost shard was recreated); views
        attached earlier pick the new shards up on their next failed call.

    Raises
    ------
    ValueError
        If a dataset or run is already published under ``name``.
    """
    futures = server.futures
    if not futures:
        raise RuntimeError("cannot publish a ParameterServer that does not hold its futures")
    describe(client, name, server, info)  # first: a view that sees the name finds the record
    # The futures keep the actors alive while the run is published; views never read them.
    record = {"kind": "downpour-dask run", "futures": futures}
    try:
        client.publish_dataset(**{name: record}, override=override)
    except KeyError:
        raise ValueError(
            f"publish={name!r}: a run or dataset of that name is already published on the "
            f"scheduler; choose another name"
        ) from None


def describe(client: Client, name: str, server: ParameterServer, info: dict[str, Any]) -> None:
    """Log the JSON record attached views read: ``info`` and each shard's actor key, worker and
    range (the driver logs it again now and then, as the topic keeps only its last 1000
    events).  Raises TypeError if ``info`` is not JSON-able."""
    shards = [
        {"key": actor.key, "worker": worker, "range": [int(lo), int(hi)]}
        for actor, worker, (lo, hi) in zip(server.shards, server.workers, server.ranges)
    ]
    record = json.dumps({"info": dict(info), "shards": shards})
    client.log_event(topic(name), {"kind": "run", "json": record})


def unpublish(client: Client, name: str) -> None:
    """Log the run's ``end`` record and withdraw its publication (never raises)."""
    try:
        client.log_event(topic(name), {"kind": "end"})
    except Exception:  # noqa: BLE001 - the run is over; a lost scheduler must not mask its result
        pass
    try:
        client.unpublish_dataset(name)
    except Exception:  # noqa: BLE001
        pass


#: The ``reason`` of the ``end`` record the scheduler logs for a run whose driver died
#: (:mod:`downpour_dask.downpour.driver_loss`).
DRIVER_LOST = "driver lost"


def end_reason(client: Client, name: str) -> str | None:
    """The ``reason`` of the run's last ``end`` record, if it gives one (:data:`DRIVER_LOST`)."""
    ends = [m for _, m in client.get_events(topic(name)) if isinstance(m, dict)
            and m.get("kind") == "end"]  # fmt: skip
    return ends[-1].get("reason") if ends else None


def log_progress(client: Client, name: str, progress: Progress) -> None:
    """Log one progress snapshot under the run's event topic (msgpack-able dict)."""
    record = {"kind": "progress", **dataclasses.asdict(progress)}
    try:
        client.log_event(topic(name), record)
    except Exception:  # noqa: BLE001 - live metrics are best effort, never fail the fit
        pass


def progress_from_event(message: Any) -> Progress | None:
    """The :class:`Progress` of a logged progress record (``None`` for other records)."""
    if not isinstance(message, dict) or message.get("kind") != "progress":
        return None
    fields = {f.name for f in dataclasses.fields(Progress)}
    try:
        return Progress(**{k: v for k, v in message.items() if k in fields})
    except TypeError:
        return None


def is_published(client: Client, name: str) -> bool:
    """Whether a run is currently published as ``name`` on the client's scheduler."""
    return name in client.list_datasets()
