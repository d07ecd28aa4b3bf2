"""Watching a running fit from elsewhere: publish its parameter server by name, attach to it.

``DownpourSGD(...).fit(data, publish="mnist")`` publishes the run on the cluster's scheduler
(:func:`publish`): the futures of its parameter-server shard actors -- a published ``Actor``
object would not keep the actors alive, their futures do -- with their ranges, workers, the
model's configuration and the run's start time.  While it trains, the driver logs a compact
progress record about four times a second under the scheduler event topic
``downpour-dask/<name>`` (:func:`log_progress`), and a last ``end`` record when the run is over,
whether it finished or failed; then the name is unpublished.

Any other process with a client of the same cluster -- a notebook, a script, the
``downpour-dask watch NAME --scheduler ADDRESS`` command -- calls :func:`attach` and gets a
read-only :class:`LiveRun`: ``status()`` (per-shard versions, pushes per replica, recent loss,
examples/s, staleness), ``params()`` and ``evaluate(data)``.  It cannot push or stop anything.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, TextIO

import numpy as np
import pandas as pd
from distributed import Client

from .core import models, protocol
from .core.partition import PartitionPlan
from .data.datasets import Dataset, as_dataset
from .log import Progress
from .progress import ProgressBar
from .ps.server import ParameterServer
from .ps.shard import ParameterServerShard

#: Prefix of the scheduler event topic a published run logs its progress under.
TOPIC_PREFIX = "downpour-dask/"


def topic(name: str) -> str:
    """The scheduler event topic of the run published as ``name``."""
    return TOPIC_PREFIX + name


def check_name(name: Any) -> None:
    """Raise TypeError/ValueError unless ``name`` is a usable publication name (a non-empty str).

    Parameters
    ----------
    name : object
        The value given as ``publish=``.
    """
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
        Replace this run's own earlier publication (after a lost shard was recreated as a new
        actor); views attached earlier pick the new shards up on their next failed call.

    Raises
    ------
    ValueError
        If a dataset or run is already published under ``name``.
    """
    futures = server.futures
    if not futures:
        raise RuntimeError("cannot publish a ParameterServer that does not hold its futures")
    record = {
        "kind": "downpour-dask run",
        "futures": futures,  # futures, not actors: they keep the actors alive
        "ranges": [list(r) for r in server.ranges],
        "workers": list(server.workers),
        "info": dict(info),
    }
    try:
        client.publish_dataset(**{name: record}, override=override)
    except KeyError:
        raise ValueError(
            f"publish={name!r}: a run or dataset of that name is already published on the "
            f"scheduler; choose another name"
        ) from None


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


def attach(
    name: str, client: Client, timeout: float = 30.0, model: Any = None
) -> LiveRun:
    """A read-only view of the run another process published as ``name``.

    Parameters
    ----------
    name : str
        What the run's ``fit(..., publish=name)`` was given.
    client : distributed.Client
        A client of the cluster the run is on.
    timeout : float, default 30
        Seconds any call into a shard may take.
    model : model, optional
        The run's model, for :meth:`LiveRun.evaluate` of a model its config cannot rebuild (a
        user's own model); by default it is rebuilt from the published config.

    Returns
    -------
    LiveRun

    Raises
    ------
    ValueError
        If no run is published under ``name`` (the message lists the published names).
    """
    check_name(name)
    published = [str(n) for n in client.list_datasets()]
    if name not in published:
        raise ValueError(
            f"no run is published as {name!r} on {client.scheduler.address}; published: "
            f"{', '.join(sorted(published)) or 'none'}"
        )
    server, info = _load(client, name, timeout)
    return LiveRun(name, server, info, client, timeout, model)


def _load(client: Client, name: str, timeout: float) -> tuple[ParameterServer, dict[str, Any]]:
    """The published run's shards (as a ParameterServer view) and its info."""
    record = client.get_dataset(name)
    if not isinstance(record, dict) or record.get("kind") != "downpour-dask run":
        raise ValueError(f"{name!r} is published on the scheduler but is not a downpour-dask run")
    # Keep the actor handles only.  (A client-side Actor handle still refers to its key, so
    # LiveRun drops them as soon as it sees that the run is no longer published.)
    actors = [f.result(timeout=timeout) for f in record["futures"]]
    for f in record["futures"]:
        f.release()
    server = ParameterServer(actors, [tuple(r) for r in record["ranges"]], record["workers"])
    return server, record["info"]


class LiveRun:
    """Read-only view of a published, running fit; from :func:`attach`.

    Attributes
    ----------
    name : str
    info : dict
        What the run published about itself: ``model`` config, ``t0``, ``estimator``,
        ``n_replicas``, ``n_shards``...
    model : model or None
        The run's model: the one given to :func:`attach`, else rebuilt from its configuration
        (None when the config cannot rebuild it: a user's own model).
    """

    def __init__(
        self,
        name: str,
        server: ParameterServer,
        info: dict[str, Any],
        client: Client,
        timeout: float,
        model: Any = None,
    ):
        self.name, self.info, self._client, self._timeout = name, info, client, timeout
        self._server: ParameterServer | None = server
        self.model, self._no_model = model, ""
        if model is None:
            try:
                self.model = models.from_config(info["model"])
            except ValueError as err:  # a user's model: only its description was published
                self._no_model = f"{err}; give it to attach(name, client, model=...)"
        self._last: tuple[float, int] | None = None

    def __repr__(self) -> str:
        state = "running" if self._server is not None else "ended"
        return f"LiveRun({self.name!r}, {self.info.get('estimator', '?')}, {state})"

    @property
    def running(self) -> bool:
        """Whether the run is still published (it is unpublished when its fit ends)."""
        if self._server is not None and not is_published(self._client, self.name):
            self._server = None  # drop the actor handles: they would keep the actors alive
        return self._server is not None

    def _live_server(self) -> ParameterServer:
        if not self.running:
            raise RuntimeError(f"run {self.name!r} has ended: it is no longer published")
        assert self._server is not None
        return self._server

    def _statuses(self) -> list[dict[str, Any]]:
        """Every shard's counters (see :meth:`ParameterServerShard.status`)."""
        return self._retrying(
            lambda server: server.call_all(ParameterServerShard.status, timeout=self._timeout)
        )

    def _retrying(self, call: Any) -> Any:
        """``call(server)``; after a failure, once more with the shards published now (the
        run re-publishes itself when it recreates a lost shard)."""
        server = self._live_server()  # raises if the run has ended
        try:
            return call(server)
        except RuntimeError as err:
            failure = err
        if self.running:
            try:
                self._server, _ = _load(self._client, self.name, self._timeout)
                return call(self._server)
            except (RuntimeError, ValueError, OSError, TimeoutError) as err:
                failure = err
        raise RuntimeError(f"run {self.name!r} has ended or lost a shard: {failure}") from failure

    def status(self) -> pd.DataFrame:
        """One row per shard: range, worker, version, accepted pushes (``accepted_by_replica``:
        pushes per replica), recent training loss, staleness, plus ``elapsed`` (s since the fit
        started) and ``examples_per_s`` (since the previous ``status()`` of this view, or since
        the start for the first one)."""
        rows = self._statuses()
        now = time.time()
        frame = pd.DataFrame(rows)
        assert self._server is not None  # _statuses succeeded
        frame.insert(3, "worker", self._server.workers)
        elapsed = now - float(self.info.get("t0", now))
        examples = int(frame["examples"].iloc[0]) if len(frame) else 0
        since, before = (float(self.info.get("t0", now)), 0) if self._last is None else self._last
        span = now - since
        frame["elapsed"] = elapsed
        frame["examples_per_s"] = (examples - before) / span if span > 0 else math.nan
        self._last = (now, examples)
        return frame

    def params(self) -> np.ndarray:
        """The current flat parameter vector, assembled from every shard."""
        values, _ = self._pull()
        return values

    def _pull(self) -> tuple[np.ndarray, list[int]]:
        """The model's flat parameters (a model-parallel run's shards hold them partition by
        partition: see :meth:`PartitionPlan.pack`) and each shard's version."""
        values, versions = self._retrying(lambda server: server.pull(self._timeout))
        partitions = int(self.info.get("partitions", 1))
        if partitions > 1:
            values = PartitionPlan(self.model, partitions).unpack(values)
        return values, versions

    def evaluate(self, data: Dataset | tuple, y: np.ndarray | None = None) -> dict[str, float]:
        """Loss and accuracy (classifiers) or R^2 (regression) of the current parameters.

        Parameters
        ----------
        data : Dataset or (X, y), or X with ``y``
            Data to evaluate on (in this process).

        Returns
        -------
        dict
            ``version`` (minimum over shards), ``loss`` and ``accuracy`` or ``r2``.
        """
        if self.model is None:
            raise ValueError(f"cannot evaluate run {self.name!r}: {self._no_model}")
        dataset = as_dataset(data, y, what="data")
        X, y = protocol.check_data(self.model, dataset.X, dataset.y)
        values, versions = self._pull()
        metric = "accuracy" if self.model.is_classifier else "r2"
        return {
            "version": min(versions),
            "loss": float(protocol.loss(self.model, values, X, y)),
            metric: float(self.model.score(values, X, y)),
        }


def follow(client: Client, name: str, stream: TextIO, interval: float = 2.0) -> bool:
    """Print the progress of the run published as ``name`` until it ends.

    Reads the run's event topic (see :func:`log_progress`) a few times a second and renders
    each new snapshot with :class:`~downpour_dask.progress.ProgressBar` (redrawn in place on a
    terminal, one line at most every ``interval`` seconds otherwise).

    Parameters
    ----------
    client : distributed.Client
    name : str
    stream : file
        Where the progress lines go.
    interval : float, default 2
        Seconds between lines when ``stream`` is not a terminal.

    Returns
    -------
    bool
        True if the run finished (its last snapshot arrived), False if it ended otherwise
        (failed, interrupted, or unpublished without an ``end`` record).
    """
    bar = ProgressBar(stream, log_every=interval)
    name_topic = topic(name)
    events = client.get_events(name_topic)
    # Events of earlier runs published under the same name stay on the topic: skip them.
    ends = [t for t, m in events if isinstance(m, dict) and m.get("kind") == "end"]
    seen = max(ends, default=-math.inf)
    while True:
        published = is_published(client, name)
        events = [(t, m) for t, m in client.get_events(name_topic) if t > seen]
        if events:
            seen = events[-1][0]
        for _, message in events:
            progress = progress_from_event(message)
            if progress is not None:
                bar(progress)
                if progress.phase == "done":
                    return True
            elif isinstance(message, dict) and message.get("kind") == "end":
                return False
        if not published:  # unpublished, and the events read after that show no end record
            return False
        time.sleep(min(0.25, interval))
