"""Watching a running fit from elsewhere: attach to a run published by name.

``DownpourSGD(...).fit(data, publish="mnist")`` publishes the run on the cluster's scheduler
and logs a JSON record of it -- shards' keys, workers and ranges, the model's configuration, the
start time -- and its progress on the scheduler event topic ``downpour-dask/<name>``
(:mod:`downpour_dask.publishing`, re-exported here).

Any other process with a client of the same cluster -- a notebook, a script, the
``downpour-dask watch NAME --scheduler ADDRESS`` command -- calls :func:`attach` and gets a
read-only :class:`LiveRun`: ``status()`` (per-shard versions, pushes per replica, recent loss,
examples/s, staleness), ``params()`` and ``evaluate(data)``.  A sparse run
(``fit_sparse(..., publish=NAME)``) is attached and watched alike; its ``status()`` adds the
rows each shard updated, and it is evaluated by its driver (``eval_data``), not by a view.

**Read-only by construction.**  A view holds no actor handle (one can call *any* method: push,
stop...): it knows each shard by key and worker from the JSON record and reads through
:func:`read_shard`, a short task on the shard's worker calling two read-only methods.  Stopping
needs the run's secret, which only the driver holds.  Views and ``watch`` never unpickle what is
published (``get_dataset`` would, running whatever code a crafted record carries).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, TextIO

import numpy as np
import pandas as pd
from distributed import Client

from .core import models, protocol
from .core.partition import PartitionPlan
from .data.datasets import Dataset, as_dataset
from .progress import ProgressBar
from .ps.shard import ParameterServerShard
from .publishing import (
    TOPIC_PREFIX,
    check_name,
    describe,
    is_published,
    log_progress,
    progress_from_event,
    publish,
    topic,
    unpublish,
)
from .runtime.cluster import cluster_workers
from .runtime.dask_internals import local_actor

__all__ = [  # the publishing side is re-exported: live is the module users and the CLI know
    "TOPIC_PREFIX", "LiveRun", "attach", "check_name", "describe", "follow", "is_published",
    "log_progress", "progress_from_event", "publish", "read_shard", "topic", "unpublish",
]  # fmt: skip

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
        Seconds a read of a shard may take.
    model : model, optional
        The run's model, for :meth:`LiveRun.evaluate` of a model its config cannot rebuild (a
        user's own model); by default it is rebuilt from the published config.

    Returns
    -------
    LiveRun

    Raises
    ------
    ValueError
        If no run is published under ``name`` (the message lists the published names), or its
        topic holds no valid run record.
    """
    check_name(name)
    published = [str(n) for n in client.list_datasets()]
    if name not in published:
        raise ValueError(
            f"no run is published as {name!r} on {client.scheduler.address}; published: "
            f"{', '.join(sorted(published)) or 'none'}"
        )
    shards, info = _load(client, name)
    return LiveRun(name, shards, info, client, timeout, model)


#: How a view knows a shard: its actor key, worker address and range of the vector.
ShardInfo = tuple[str, str, tuple[int, int]]


def _load(client: Client, name: str) -> tuple[list[ShardInfo], dict[str, Any]]:
    """The shards and info of the newest run record on ``name``'s topic (JSON, never pickle)."""
    latest = None
    for _, message in client.get_events(topic(name)):
        if isinstance(message, dict) and message.get("kind") == "end":
            latest = None  # an earlier run of the same name ended
        elif isinstance(message, dict) and message.get("kind") == "run":
            latest = message.get("json")
    try:
        record = json.loads(latest)  # TypeError for None, ValueError for bad JSON
        shards = [
            (str(s["key"]), str(s["worker"]), (int(s["range"][0]), int(s["range"][1])))
            for s in record["shards"]
        ]
        info = dict(record["info"])
        if not isinstance(info["model"], dict):  # a config, or a user model's description
            raise TypeError(f"model is {type(info['model']).__name__}, not a JSON object")
    except (TypeError, ValueError, KeyError, IndexError) as err:
        raise ValueError(
            f"{name!r} is published on the scheduler but its topic holds no valid downpour-dask "
            f"run record ({type(err).__name__}: {err})"
        ) from None
    return shards, info


def read_shard(key: str, values: bool) -> Any:
    """A task on a shard's worker: the counters of shard actor ``key`` (a dict), or with
    ``values`` its ``(values, version)``; only read-only methods are called."""
    shard = local_actor(key)
    if not isinstance(shard, ParameterServerShard):
        raise LookupError(f"no parameter-server shard {key} on this worker (the run ended?)")
    if values:
        reply = shard.snapshot_model()
        return reply.values, reply.version
    return shard.counters()


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
        shards: list[ShardInfo],
        info: dict[str, Any],
        client: Client,
        timeout: float,
        model: Any = None,
    ):
        self.name, self.info, self._client, self._timeout = name, info, client, timeout
        self._shards: list[ShardInfo] | None = shards
        self.model, self._no_model = model, ""
        if info.get("sparse"):  # its tables stay on the shards: fit_sparse(eval_data=) scores
            self.model, self._no_model = None, (
                "a sparse run's tables stay on its shards; its driver evaluates it "
                "(fit_sparse(..., eval_data=...) logs SparseFit.evaluations)")
        elif model is None:
            try:
                self.model = models.from_config(info["model"])
            except ValueError as err:  # a user's model: only its description was published
                self._no_model = f"{err}; give it to attach(name, client, model=...)"
        self._last: tuple[float, int] | None = None

    def __repr__(self) -> str:
        state = "running" if self._shards is not None else "ended"
        return f"LiveRun({self.name!r}, {self.info.get('estimator', '?')}, {state})"

    @property
    def running(self) -> bool:
        """Whether the run is still published (it is unpublished when its fit ends)."""
        if self._shards is not None and not is_published(self._client, self.name):
            self._shards = None
        return self._shards is not None

    def _read(self, values: bool) -> list[Any]:
        """:func:`read_shard` on every shard's worker at once; after a failure, once more with
        the shards of the newest run record (the run logs one when it recreates a lost shard)."""
        if not self.running:
            raise RuntimeError(f"run {self.name!r} has ended: it is no longer published")
        try:
            return self._read_from(self._shards or [], values)
        except (RuntimeError, LookupError, OSError, TimeoutError) as err:
            failure: Exception = err
        if self.running:
            try:
                self._shards, _ = _load(self._client, self.name)
                return self._read_from(self._shards, values)
            except (RuntimeError, LookupError, ValueError, OSError, TimeoutError) as err:
                failure = err
        raise RuntimeError(f"run {self.name!r} has ended or lost a shard: {failure}") from failure

    def _read_from(self, shards: list[ShardInfo], values: bool) -> list[Any]:
        gone = set(worker for _, worker, _ in shards) - set(cluster_workers(self._client))
        if gone:  # a task pinned to a worker that left would wait for ever
            raise LookupError(f"the worker(s) {sorted(gone)} holding shards left the cluster")
        futures = [
            self._client.submit(
                read_shard, key, values, workers=[worker], allow_other_workers=False, pure=False
            )
            for key, worker, _ in shards
        ]
        try:
            return [f.result(timeout=self._timeout) for f in futures]
        except TimeoutError as err:
            raise TimeoutError(f"a shard did not answer within {self._timeout} s") from err
        finally:
            for f in futures:
                f.release()

    def _statuses(self) -> list[dict[str, Any]]:
        """Every shard's counters (see :meth:`ParameterServerShard.counters`)."""
        return self._read(values=False)

    def status(self) -> pd.DataFrame:
        """One row per shard: range, worker, version, accepted pushes (``accepted_by_replica``:
        pushes per replica), recent training loss, staleness, plus ``elapsed`` (s since the fit
        started) and ``examples_per_s`` (since the previous ``status()`` of this view, or since
        the start for the first one)."""
        rows = self._statuses()
        now = time.time()
        frame = pd.DataFrame(rows)
        assert self._shards is not None  # _statuses succeeded
        frame.insert(3, "worker", [worker for _, worker, _ in self._shards])
        elapsed = now - float(self.info.get("t0", now))
        examples = int(frame["examples"].iloc[0]) if len(frame) else 0
        since, before = (float(self.info.get("t0", now)), 0) if self._last is None else self._last
        span = now - since
        frame["elapsed"] = elapsed
        frame["examples_per_s"] = (examples - before) / span if span > 0 else math.nan
        self._last = (now, examples)
        return frame

    def params(self) -> np.ndarray:
        """The current flat parameter vector, assembled from every shard (of a sparse run:
        its dense parameters; the table rows stay on the shards)."""
        values, _ = self._pull()
        return values

    def _pull(self) -> tuple[np.ndarray, list[int]]:
        """The model's flat parameters (a model-parallel run's shards hold them partition by
        partition: see :meth:`PartitionPlan.pack`) and each shard's version."""
        replies = self._read(values=True)
        assert self._shards is not None
        values = np.empty(self._shards[-1][2][1], dtype=np.float32)
        for (_, _, (lo, hi)), (part, _) in zip(self._shards, replies):
            values[lo:hi] = part
        versions = [int(version) for _, version in replies]
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
        loss, score = protocol.loss_and_score(self.model, values, X, y)
        return {"version": min(versions), "loss": loss, metric: score}


def follow(client: Client, name: str, stream: TextIO, interval: float = 2.0) -> bool:
    """Print the progress of the run published as ``name`` until it ends.

    Reads the run's event topic (see :func:`log_progress`) a few times a second and renders
    each new snapshot with :class:`~downpour_dask.progress.ProgressBar` (redrawn in place on a
    terminal, one line at most every ``interval`` seconds otherwise).

    ``stream`` receives the progress lines, at most one every ``interval`` seconds when it is
    not a terminal.  Returns True if the run finished (its last snapshot arrived), False if it
    ended otherwise (failed, interrupted, or unpublished without an ``end`` record).
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
