"""The client-side view over the K shards of one parameter vector.

:class:`ParameterServer` is what the driver and the replicas hold: it places the shards on
distinct workers, cuts pushes and assembles pulls by range, and reports per-shard statistics.
It pickles to actor references only (:class:`~.refs.ActorRef`), so it can be passed to tasks.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client, Future

from ..core.optim import UpdateRule
from ..core.params import DTYPE, split_range
from ..runtime.cluster import cluster_workers, send_to_workers
from ..runtime.dask_internals import actor_result, direct_actor, release_hold
from ..runtime.deadlines import waiting_for
from .protocol import PushReply, ShardLostError, is_shard_lost
from .refs import ActorRef, refer
from .shard import ParameterServerShard

#: Initial shard values larger than this (bytes) are scattered to their worker before the shard
#: is created, rather than sent inside the task (Dask warns about graphs over 10 MB); smaller
#: ones travel with the task and save the scatter's round trip.
SCATTER_ABOVE = 4 * 2**20


class ParameterServer:
    """The client-side view over the K shards of one parameter vector.

    Build it with :meth:`create`.  It pickles to its actor handles and ranges only, so it can be
    passed to replica tasks, which then talk to the shards worker-to-worker.

    Attributes
    ----------
    shards : list of Actor
    ranges : list of (start, stop)
    workers : list of str
        Address of the worker holding each shard.
    size : int
        Length of the full parameter vector.
    """

    def __init__(
        self,
        shards: list,
        ranges: list[tuple[int, int]],
        workers: list[str],
        futures=None,
        ids: list[int] | None = None,
    ):
        self.shards, self.ranges, self.workers = shards, ranges, workers
        self.size = ranges[-1][1]
        self.ids = list(range(len(shards))) if ids is None else list(ids)
        #: Each shard's current incarnation: 0 at the start, one more per replacement.
        self.generations = [0] * len(shards)
        self.max_grad_norm: float | None = None  # what create() gave the shards
        self.shard_class: type = ParameterServerShard
        self._futures = futures or []
        self._retired: list = []  # replaced shards' futures and handles, until close()
        self.wire_secret = b""  # the run's secret for direct connections (see ps/service.py)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_futures"] = state["_retired"] = []  # the driver's: they keep the actors alive
        state["wire_secret"] = b""  # stays with the driver: replicas get it in their config
        return state

    @property
    def n_shards(self) -> int:
        """Number of shards."""
        return len(self.shards)

    def portable(self) -> ParameterServer:
        """A copy to pass to tasks: every shard is an :class:`ActorRef`, not a handle (see
        there why); the task calls :meth:`opened`."""
        view = copy.copy(self)
        view.shards = [refer(a, self.shard_class, w) for a, w in zip(self.shards, self.workers)]
        view._futures = view._retired = []
        return view

    def opened(self) -> ParameterServer:
        """A copy whose shards are actor handles (in a task: from :meth:`portable`'s refs)."""
        view = copy.copy(self)
        view.shards = [a.open() if isinstance(a, ActorRef) else a for a in self.shards]
        view._futures = view._retired = []
        return view

    def subset(self, first: int, stop: int) -> ParameterServer:
        """A view over shards ``first..stop-1`` only, as if their ranges made a vector of their
        own (the part of the parameters one model partition owns); ``ids`` keeps the shards'
        numbers in the whole server."""
        offset = self.ranges[first][0]
        view = ParameterServer(
            self.shards[first:stop],
            [(lo - offset, hi - offset) for lo, hi in self.ranges[first:stop]],
            self.workers[first:stop],
            ids=self.ids[first:stop],
        )
        view.shard_class = self.shard_class
        view.generations = self.generations[first:stop]
        return view

    @classmethod
    def create(
        cls,
        client: Client,
        initial: np.ndarray,
        n_shards: int,
        rule: UpdateRule,
        workers: list[str] | None = None,
        timeout: float = 60.0,
        shard_class: type = ParameterServerShard,
        restore: list[dict[str, Any]] | None = None,
        ranges: list[tuple[int, int]] | None = None,
        wire_secret: bytes = b"",
        max_grad_norm: float | None = None,
        **per_element: np.ndarray,
    ) -> ParameterServer:
        """Start ``n_shards`` shard actors holding ``initial``, on distinct workers where possible.

        Shard i goes to ``workers[i % len(workers)]`` (default: all the cluster's workers, sorted),
        so with at least K workers no two shards share a worker and its actor thread.
        ``shard_class`` may be a subclass of :class:`ParameterServerShard`; each array in
        ``per_element`` (as long as ``initial``) is cut like ``initial`` and passed to shard i's
        constructor as a keyword argument of the same name.  ``restore`` (one dict per shard,
        see :meth:`ParameterServerShard.export_state`) continues shards from saved state.
        ``ranges`` chooses the shards' ranges (default: ``split_range``, balanced); they must
        tile the vector in order.  ``wire_secret`` is what a direct connection to a shard must
        present (see :mod:`~downpour_dask.ps.service`); ``max_grad_norm`` caps each push's norm
        on each shard.
        """
        if workers is None:
            workers = sorted(cluster_workers(client))
        if not workers:
            raise RuntimeError("the Dask cluster has no workers to hold parameter-server shards")
        if ranges is None:
            ranges = split_range(initial.shape[0], n_shards)
        bounds = [0] + [b for r in ranges for b in r] + [initial.shape[0]]
        if len(ranges) != n_shards or any(a != b for a, b in zip(bounds[::2], bounds[1::2])):
            raise ValueError(
                f"ranges must be {n_shards} contiguous (start, stop) pairs covering "
                f"[0, {initial.shape[0]}) in order, got {ranges}"
            )
        token = uuid.uuid4().hex[:8]
        futures, placed = [], []
        for i, (lo, hi) in enumerate(ranges):
            address = workers[i % len(workers)]
            values = np.ascontiguousarray(initial[lo:hi], dtype=DTYPE)
            if values.nbytes > SCATTER_ABOVE:  # not inside the task graph the scheduler carries
                with waiting_for(f"sending shard {i}'s values to worker {address}", timeout):
                    values = send_to_workers(client, [values], [address], timeout=timeout)[0]
            futures.append(
                client.submit(
                    shard_class,
                    i,
                    lo,
                    hi,
                    values,
                    rule,
                    **{name: array[lo:hi] for name, array in per_element.items()},
                    **({} if restore is None else {"restore": restore[i]}),
                    **({"wire_secret": wire_secret} if wire_secret else {}),
                    **({} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}),
                    actor=True,
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                    key=f"{shard_class.__name__.lower()}-{i}-{token}",
                )
            )
            placed.append(address)
        try:
            with waiting_for(f"starting the {n_shards} parameter-server shard(s)", timeout):
                shards = [direct_actor(f.result(timeout=timeout), client) for f in futures]
        except BaseException:
            for f in futures:
                f.release()
            raise
        server = cls(shards, ranges, placed, futures)
        server.shard_class, server.wire_secret = shard_class, wire_secret
        server.max_grad_norm = max_grad_norm
        return server

    def call_all(
        self,
        method: Callable[..., Any],
        *args: Any,
        timeout: float,
        per_shard: list[tuple] | None = None,
    ) -> list:
        """Call ``method`` on every shard at once (with ``per_shard[i]`` as shard i's arguments,
        if given) and wait for all the replies.

        ``method`` is the method itself, e.g. ``SandblasterShard.run``, never its name: a
        renamed or mistyped method fails where it is written, not on the workers.  The
        estimators' own shard classes (e.g. Sandblaster's) call their methods through this;
        the methods every shard has are typed methods of this view (:meth:`pull`,
        :meth:`export_state`, :meth:`status`...).

        Raises
        ------
        ShardLostError
            Naming the shard and its worker, if a shard is lost or does not answer in time
            (see :func:`~downpour_dask.ps.protocol.is_shard_lost`); any other error a shard
            method raises (a bug, bad arguments) is raised as it is.
        """
        name = method.__name__
        owner = method.__qualname__.rsplit(".", 1)[0]
        if not any(cls.__qualname__ == owner for cls in self.shard_class.__mro__):
            raise TypeError(
                f"{method.__qualname__} is not a method of these shards' class "
                f"{self.shard_class.__name__}"
            )
        calls, replies = [], []
        try:
            for i, shard in enumerate(self.shards):
                calls.append(getattr(shard, name)(*(args if per_shard is None else per_shard[i])))
            for i, call in enumerate(calls):  # noqa: B007 (``i`` names a shard that fails)
                replies.append(self._reply(i, call, timeout))
            return replies
        except Exception as err:
            if is_shard_lost(err):
                raise self._lost(i, name, timeout, err) from err
            raise

    def _lost(self, i: int, method: str, timeout: float, error: Exception) -> ShardLostError:
        """The error for shard ``i`` lost during ``method``: naming the shard and its worker."""
        return ShardLostError(
            f"parameter-server shard {i} on worker {self.workers[i]} was lost or did not "
            f"answer {method}() within {timeout} s: {error}",
            i,
        )

    def lost_shards(self, timeout: float = 10.0) -> list[int]:
        """The shards that are lost: those whose version cannot be read within ``timeout``
        seconds (all asked at once), in order."""
        calls: list[Any] = []
        for shard in self.shards:
            try:
                calls.append(shard.current_version())
            except Exception as err:  # a lost actor's handle raises at once
                if not is_shard_lost(err):
                    raise
                calls.append(None)
        lost = []
        for i, call in enumerate(calls):
            try:
                if call is not None:
                    self._reply(i, call, timeout)
                    continue
            except Exception as err:
                if not is_shard_lost(err):
                    raise
            lost.append(i)
        return lost

    def replace_shard(
        self,
        client: Client,
        i: int,
        values: np.ndarray,
        rule: UpdateRule,
        worker: str,
        restore: dict[str, Any],
        timeout: float = 60.0,
    ) -> Future:
        """Start the next incarnation (generation) of shard ``i`` on ``worker`` from saved state
        (see :meth:`ParameterServerShard.export_state`) and use it from now on; return its
        future.  Only the default shard class (Downpour's) is supported.  The old actor's future
        is kept until :meth:`close`, so that it can still be retired (see
        :meth:`ParameterServerShard.retire`) should its worker come back.
        """
        lo, hi = self.ranges[i]
        generation = self.generations[i] + 1
        future = client.submit(
            ParameterServerShard,
            i,
            lo,
            hi,
            np.ascontiguousarray(values, dtype=DTYPE),
            rule,
            restore=restore,
            wire_secret=self.wire_secret,
            generation=generation,
            max_grad_norm=self.max_grad_norm,
            actor=True,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=f"parameterservershard-{i}-{uuid.uuid4().hex[:8]}",
        )
        try:
            actor = future.result(timeout=timeout)
        except BaseException:  # e.g. its worker died too: nothing of it must linger
            future.release()
            raise
        if i < len(self._futures):
            self._retired += [self._futures[i], self.shards[i]]
            self._futures[i] = future
        self.shards[i], self.workers[i] = direct_actor(actor, client), worker
        self.generations[i] = generation
        return future

    @property
    def futures(self) -> list[Future]:
        """The actors' futures (driver side only; empty in a copy sent to a task)."""
        return list(self._futures)

    def _reply(self, i: int, call: Any, timeout: float) -> Any:
        """Wait for shard ``i``'s reply; fail at once if the driver sees its actor's task gone
        (a call into an actor whose worker died may otherwise never complete)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return actor_result(call, min(1.0, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                status = self._futures[i].status if i < len(self._futures) else "finished"
                if status != "finished":
                    raise ShardLostError(f"the actor's task is {status}", i) from None

    def pull(self, timeout: float = 60.0, model: bool = False) -> tuple[np.ndarray, list[int]]:
        """The full parameter vector assembled from every shard (with ``model``, what they
        publish as the model: see ``ParameterServerShard.pull``), and each shard's version."""
        per_shard = [(-1, "", True)] * self.n_shards if model else None
        replies = self.call_all(ParameterServerShard.pull, timeout=timeout, per_shard=per_shard)
        out = np.empty(self.size, dtype=DTYPE)
        for (lo, hi), reply in zip(self.ranges, replies):
            out[lo:hi] = reply.values
        return out, [r.version for r in replies]

    def push(
        self,
        grad: np.ndarray,
        fetched_versions: list[int],
        replica: int = -1,
        timeout: float = 60.0,
    ) -> list[PushReply]:
        """Push a full-length gradient, cut by range, to every shard; wait for the replies."""
        pieces = [(grad[lo:hi], v, replica) for (lo, hi), v in zip(self.ranges, fetched_versions)]
        return self.call_all(ParameterServerShard.push, timeout=timeout, per_shard=pieces)

    def versions(self, timeout: float = 60.0) -> list[int]:
        """Each shard's version (updates applied), without transferring any parameters."""
        return self.call_all(ParameterServerShard.current_version, timeout=timeout)

    def release_warmstart(self, timeout: float = 60.0) -> None:
        """Let replicas waiting for replica 0's warmstart start, on every shard."""
        self.call_all(ParameterServerShard.release_warmstart, timeout=timeout)

    def export_state(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each shard's consistent state (see :meth:`ParameterServerShard.export_state`)."""
        return self.call_all(ParameterServerShard.export_state, timeout=timeout)

    def request_stop(self, timeout: float = 60.0, who: str = "driver") -> None:
        """Tell every shard to report the stop flag to replicas (with the run's secret, which
        only the driver holds: see :meth:`ParameterServerShard.request_stop`)."""
        self.call_all(ParameterServerShard.request_stop, self.wire_secret, who, timeout=timeout)

    def shard_status(self, i: int, timeout: float = 60.0) -> dict[str, Any]:
        """Shard ``i``'s counters, as one row of :meth:`status` (without ``worker``)."""
        try:
            return self._reply(i, self.shards[i].status(), timeout)
        except Exception as err:
            if is_shard_lost(err):
                raise self._lost(i, "status", timeout, err) from err
            raise

    def status(self, timeout: float = 60.0) -> pd.DataFrame:
        """One row per shard: range, worker, version, accepted/refused pushes, staleness."""
        rows = self.call_all(ParameterServerShard.status, timeout=timeout)
        frame = pd.DataFrame(rows)
        frame.insert(3, "worker", self.workers)
        return frame

    def events(self, timeout: float = 60.0) -> list[tuple[float, str, str, dict[str, Any]]]:
        """All events the shards recorded -- ``(time, kind, detail, data)`` -- in time order."""
        found = self.call_all(ParameterServerShard.events, timeout=timeout)
        return sorted((e for shard_events in found for e in shard_events), key=lambda e: e[0])

    def close(self) -> None:
        """Release the actors (they are deleted once no future refers to them).

        The handles go too, replaced by :class:`ActorRef` objects, their own futures of the keys
        released first: a handle that was called sits in reference cycles, which would keep its
        actor alive until Python's cycle collector ran (see ``dask_internals.release_hold``).
        """
        for held in self._futures + self._retired + self.shards:  # (an ActorRef holds nothing)
            release_hold(held)
        self._futures, self._retired = [], []
        self.shards = [refer(a, self.shard_class, w) for a, w in zip(self.shards, self.workers)]
