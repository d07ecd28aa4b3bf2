"""The sharded parameter server: one Dask actor per shard, and a client-side view over all of them.

:class:`ParameterServerShard` owns one contiguous range of the flat parameter vector, the update
rule's per-coordinate state for that range (e.g. Adagrad's sums of squared gradients, which is
where the paper keeps them) and a *version*: the number of updates it has applied.  Shards know
nothing of each other, so different shards may have applied different numbers of updates at any
moment -- the second level of asynchrony in Downpour SGD.

The methods replicas call (``pull``, ``push``, ``exchange``) and the driver's (``status`` ...) are
``async``: Dask runs them on the worker's event loop as soon as a message arrives, instead of
queueing them for the single thread that *all* sync actor methods on a worker share (two shards
on one worker would otherwise wait for each other).  They never await, so each runs start to
finish without interleaving: a pull always sees a consistent slice.  ``exchange`` is a push and
a pull in one message, so a replica that pushes and fetches on the same step pays one round trip.
A replica running on the shard's own worker skips the messages altogether and calls
:meth:`snapshot` and :meth:`apply_push` directly; replicas on other workers reach the same two
methods over a direct connection (:meth:`open_wire`, :mod:`downpour_dask.wire`) where the
cluster's comm is plain TCP.  A lock keeps those calls atomic.

:class:`ParameterServer` is the view the driver and the replicas hold: it places the shards on
distinct workers, cuts pushes and assembles pulls by range, and reports per-shard statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import threading
import time
import uuid
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from distributed import Actor, Client, Future, get_worker

from ..core.optim import UpdateRule
from ..core.params import DTYPE, split_range
from ..runtime.cluster import cluster_workers
from ..runtime.malloc import tune_malloc
from .wire import PullReply, PushReply, serve


class _SeqTracker:
    """Which push numbers of one replica session a shard has processed.

    ``through`` is the largest n such that pushes 0..n were all processed; ``ahead`` holds the few
    processed pushes above it (pushes may overtake each other on the network).
    """

    __slots__ = ("through", "ahead")

    def __init__(self) -> None:
        self.through = -1
        self.ahead: set[int] = set()

    def seen(self, seq: int) -> bool:
        return seq <= self.through or seq in self.ahead

    def add(self, seq: int) -> None:
        self.ahead.add(seq)
        while self.through + 1 in self.ahead:
            self.through += 1
            self.ahead.discard(self.through)



def _tcp_host() -> str | None:
    """This worker's host if its comm is plain TCP (where wire.py may listen too), else None
    (TLS or another protocol, or not running on a worker)."""
    try:
        address = get_worker().address
    except ValueError:
        return None
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host.strip("[]")


class ParameterServerShard:
    """A Dask actor owning parameters ``[start, stop)``, their update-rule state and a version.

    Parameters
    ----------
    shard_id : int
    start, stop : int
        The element range of the flat parameter vector this shard owns.
    values : ndarray
        Initial values of that range (copied, stored as float32).
    rule : UpdateRule
        How pushed gradients are applied (see :mod:`downpour_dask.optim`).
    """

    #: Seconds a push waits for an earlier push of its replica session before it is applied.
    ORDER_WAIT = 5.0

    def __init__(
        self,
        shard_id: int,
        start: int,
        stop: int,
        values: np.ndarray,
        rule: UpdateRule,
        *,
        restore: dict[str, Any] | None = None,
    ):
        if values.shape != (stop - start,):
            raise ValueError(
                f"shard {shard_id}: values has shape {values.shape}, expected {(stop - start,)}"
            )
        tune_malloc()  # this runs on the shard's worker: see _malloc.py for why
        self.shard_id, self.start, self.stop = shard_id, start, stop
        self.values = np.array(values, dtype=DTYPE, copy=True)
        self.rule = rule
        self.state = rule.init(stop - start)
        self.version = 0
        self.stopped = False
        self.released = False  # the driver let replicas waiting for the warmstart go
        self.accepted_by_replica: Counter[int] = Counter()
        self.refused = 0
        self.duplicates = 0
        self.examples = 0
        self.recent_loss = math.nan
        self.staleness_sum = 0
        self.staleness_max = 0
        if restore is not None:
            self._restore(restore)
        self._seqs: dict[tuple[int, str], _SeqTracker] = {}
        self._sessions: set[str] = set()  # replica sessions that pulled or pushed here
        self._events: list[tuple[float, str, str]] = []
        self._arrived: asyncio.Condition | None = None
        # Replicas on this worker call snapshot/apply_push directly from their own threads
        # (see replica.py), and replicas on other workers through wire.py's threads, concurrently
        # with the event loop serving actor calls.
        self._lock = threading.Lock()
        self._host = _tcp_host()
        self._endpoint: tuple[str, int, str] | None = None

    # -- what replicas call (async: served on the event loop, see the module docstring) ----------
    async def pull(self, replica: int = -1, session: str = "") -> PullReply:
        """A consistent copy of this shard's values, its version and the stop flag."""
        return self.snapshot(replica, session)

    async def push(self, grad: np.ndarray, fetched_version: int, replica: int, **kw) -> PushReply:
        """Apply one accumulated gradient (see :meth:`apply_push` for the arguments)."""
        await self._in_order(replica, kw.get("session", ""), kw.get("seq"))
        reply = self.apply_push(grad, fetched_version, replica, **kw)
        await self._notify()
        return reply

    async def exchange(
        self, grad: np.ndarray, fetched_version: int, replica: int, **kw
    ) -> tuple[PushReply, PullReply]:
        """A push followed by a pull of the result, in one message and one round trip."""
        await self._in_order(replica, kw.get("session", ""), kw.get("seq"))
        reply = self.apply_push(grad, fetched_version, replica, **kw)
        await self._notify()
        return reply, self.snapshot(replica, kw.get("session", ""))

    async def open_wire(self) -> tuple[str, int, str] | None:
        """Where a replica on another worker can reach this shard without actor messages:
        ``(host, port, shard id)`` of this process's :class:`~downpour_dask.wire.ShardService`,
        or None when the worker's comm is not plain TCP (e.g. TLS), so the replica keeps using
        actor calls."""
        if self._endpoint is None and self._host is not None:
            self._endpoint = serve(self, self._host)
        return self._endpoint

    async def _notify(self) -> None:
        """Wake pushes waiting in :meth:`_in_order` for the one just applied."""
        if self._arrived is not None:
            async with self._arrived:
                self._arrived.notify_all()

    async def _in_order(self, replica: int, session: str, seq: int | None) -> None:
        """Wait (briefly) until this session's earlier pushes are in, so a replica's pushes are
        applied in the order it made them even when messages overtake each other.

        A push whose predecessor does not arrive within :attr:`ORDER_WAIT` seconds (its sender
        died mid-send) is applied anyway; retried and duplicate pushes pass straight through.
        """
        if seq is None:
            return
        tracker = self._seqs.get((replica, session))
        through = -1 if tracker is None else tracker.through
        if seq <= through + 1 or (tracker is not None and tracker.seen(seq)):
            return
        if self._arrived is None:  # created here: it must belong to the worker's event loop
            self._arrived = asyncio.Condition()
        deadline = time.monotonic() + self.ORDER_WAIT
        async with self._arrived:
            while True:
                tracker = self._seqs.get((replica, session))
                if tracker is not None and (tracker.through >= seq - 1 or tracker.seen(seq)):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)

    # -- the shard's state -----------------------------------------------------------------------
    def snapshot(self, replica: int = -1, session: str = "") -> PullReply:
        """A copy of the values with the version, the stop flag and which of this replica
        session's pushes they contain."""
        return self.snapshot_into(np.empty_like(self.values), replica, session)

    def snapshot_into(self, out: np.ndarray, replica: int = -1, session: str = "") -> PullReply:
        """:meth:`snapshot` for a replica on this worker, copying the values into its buffer
        ``out`` instead of a new array: a fresh array of tens of MB is page-faulted afresh on
        every pull (allocations above glibc's 32 MiB limit are always new mappings)."""
        with self._lock:
            if session:
                self._sessions.add(session)
            np.copyto(out, self.values)
            tracker = self._seqs.get((replica, session)) or _SeqTracker()
            return PullReply(out, self.version, self.stopped, tracker.through, tuple(tracker.ahead))

    def apply_push(
        self,
        grad: np.ndarray,
        fetched_version: int,
        replica: int,
        *,
        seq: int | None = None,
        session: str = "",
        examples: int = 0,
        loss: float = math.nan,
    ) -> PushReply:
        """Apply one accumulated gradient with the update rule; return the new version.

        A gradient containing NaN or inf is refused: the parameters are left untouched, the
        refusal is counted and recorded as a ``gradient_refused`` event.  A push whose ``seq``
        this replica session already delivered is ignored, so a retried push is applied once.
        ``loss`` (the replica's mean training loss over the pushed steps) only feeds the shard's
        ``recent_loss`` for live progress displays.
        """
        with self._lock:
            return self._apply_push(grad, fetched_version, replica, seq, session, examples, loss)

    def _apply_push(self, grad, fetched_version, replica, seq, session, examples, loss):
        if grad.shape != self.values.shape:
            raise ValueError(
                f"shard {self.shard_id} owns {self.values.shape[0]} parameters, got a gradient of "
                f"shape {grad.shape}"
            )
        staleness = max(0, self.version - int(fetched_version))
        if session:
            self._sessions.add(session)
        tracker = None
        if seq is not None:
            tracker = self._seqs.setdefault((replica, session), _SeqTracker())
            if tracker.seen(seq):
                self.duplicates += 1
                return PushReply(self.version, staleness, False, self.stopped)
            tracker.add(seq)
        # One fast float32 sum: it is NaN or inf if any element is.  Huge finite values can make
        # it overflow too; only then is every element checked (a temporary the grad's size).
        if not math.isfinite(float(np.add.reduce(grad))) and not np.isfinite(grad).all():
            self.refused += 1
            bad = int(np.count_nonzero(~np.isfinite(grad)))
            self._events.append(
                (
                    time.time(),
                    "gradient_refused",
                    f"shard {self.shard_id}: replica {replica} pushed {bad} non-finite values; "
                    f"parameters left unchanged",
                )
            )
            return PushReply(self.version, staleness, False, self.stopped)
        self.rule.update(self.values, grad, self.state, staleness=staleness)
        self.version += 1
        self.accepted_by_replica[replica] += 1
        self.examples += int(examples)
        if math.isfinite(loss):  # exponential moving average over recent pushes, for progress
            self.recent_loss = (
                loss if math.isnan(self.recent_loss) else (0.9 * self.recent_loss + 0.1 * loss)
            )
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        return PushReply(self.version, staleness, True, self.stopped)

    def _restore(self, saved: dict[str, Any]) -> None:
        """Continue from a state exported by :meth:`export_state` (or read from a checkpoint):
        ``version``, ``rule_state`` (arrays matching ``rule.init``), ``counters``, ``stopped``."""
        for key, array in (saved.get("rule_state") or {}).items():
            if key not in self.state or np.shape(array) != self.state[key].shape:
                raise ValueError(
                    f"shard {self.shard_id}: saved update-rule state {key!r} does not match the "
                    f"rule {type(self.rule).__name__} (state keys {sorted(self.state)})"
                )
            self.state[key] = np.array(array, dtype=self.state[key].dtype, copy=True)
        self.version = int(saved.get("version", 0))
        self.stopped = bool(saved.get("stopped", False))
        counters = saved.get("counters") or {}
        self.accepted_by_replica.update(
            {int(r): int(n) for r, n in (counters.get("accepted_by_replica") or {}).items()}
        )
        self.refused = int(counters.get("refused", 0))
        self.duplicates = int(counters.get("duplicates", 0))
        self.examples = int(counters.get("examples", 0))
        self.staleness_sum = int(counters.get("staleness_sum", 0))
        self.staleness_max = int(counters.get("staleness_max", 0))

    async def export_state(self) -> dict[str, Any]:
        """A consistent copy of everything a replacement shard needs: ``values``, ``rule_state``,
        ``version`` and ``counters`` (taken under the lock local replicas use)."""
        with self._lock:
            return {
                "values": self.values.copy(),
                "rule_state": {k: np.array(v, copy=True) for k, v in self.state.items()},
                "version": self.version,
                "counters": {
                    "accepted_by_replica": {str(r): n for r, n in self.accepted_by_replica.items()},
                    "refused": self.refused,
                    "duplicates": self.duplicates,
                    "examples": self.examples,
                    "staleness_sum": self.staleness_sum,
                    "staleness_max": self.staleness_max,
                },
            }

    async def current_version(self) -> int:
        """Updates applied so far."""
        return self.version

    def warmstart_state(self) -> tuple[int, bool, bool]:
        """What a replica waiting for the warmstart looks at: ``(version, stopped, released)``."""
        return self.version, self.stopped, self.released

    async def poll_warmstart(self) -> tuple[int, bool, bool]:
        """:meth:`warmstart_state` as an actor call."""
        return self.warmstart_state()

    async def release_warmstart(self) -> None:
        """Let replicas waiting for the warmstart start (the driver's call when it ends, also
        when replica 0 finished before reaching it)."""
        self.released = True

    async def request_stop(self) -> None:
        """Raise the stop flag that pulls and pushes report to replicas."""
        self.stopped = True

    async def status(self) -> dict[str, Any]:
        """Counters of this shard: version, accepted/refused/duplicate pushes, examples, recent
        training loss, staleness."""
        accepted = sum(self.accepted_by_replica.values())
        return {
            "shard": self.shard_id,
            "start": self.start,
            "stop": self.stop,
            "version": self.version,
            "accepted": accepted,
            "refused": self.refused,
            "duplicates": self.duplicates,
            "examples": self.examples,
            "recent_loss": self.recent_loss,
            "staleness_mean": self.staleness_sum / accepted if accepted else 0.0,
            "staleness_max": self.staleness_max,
            "accepted_by_replica": dict(self.accepted_by_replica),
            "stopped": self.stopped,
            "sessions": sorted(self._sessions),
        }

    async def events(self, since: int = 0) -> list[tuple[float, str, str]]:
        """Events recorded by this shard (``time``, ``kind``, ``detail``), from index ``since``."""
        return self._events[since:]


class ShardLostError(RuntimeError):
    """A parameter-server shard was lost or did not answer in time; ``shard`` is its index."""

    def __init__(self, message: str, shard: int):
        super().__init__(message)
        self.shard = shard


class ActorRef(NamedTuple):
    """What a task needs to reach an actor: its class, worker address and key.

    Task arguments carry these instead of :class:`distributed.Actor` handles.  A handle made in
    the driver holds a future of its key, and Dask's client keeps its recent messages (up to
    ``distributed.admin.low-level-log-length``, 1000), task arguments included: handles in
    arguments kept every fit's shards alive on the workers long after the fit ended (measured:
    two more actors per fit, never released).  :meth:`open` makes the handle inside the task.
    """

    cls: type
    address: str
    key: str

    def open(self) -> Actor:
        """An actor handle (call it from the task that uses it, on a worker)."""
        return Actor(self.cls, self.address, self.key)


def refer(actor: Any, cls: type, address: str) -> ActorRef:
    """An :class:`ActorRef` to ``actor`` (a handle, or already a reference)."""
    return actor if isinstance(actor, ActorRef) else ActorRef(cls, address, actor.key)


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
        self.shard_class: type = ParameterServerShard
        self._futures = futures or []

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_futures"] = []  # futures stay with the driver, which keeps the actors alive
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
        view._futures = []
        return view

    def opened(self) -> ParameterServer:
        """A copy whose shards are actor handles (in a task: from :meth:`portable`'s refs)."""
        view = copy.copy(self)
        view.shards = [a.open() if isinstance(a, ActorRef) else a for a in self.shards]
        view._futures = []
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
        tile the vector in order.
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
                values = client.scatter(values, workers=[address], hash=False)
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
                    actor=True,
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                    key=f"{shard_class.__name__.lower()}-{i}-{token}",
                )
            )
            placed.append(address)
        try:
            shards = [f.result(timeout=timeout) for f in futures]
        except BaseException:
            for f in futures:
                f.release()
            raise
        server = cls(shards, ranges, placed, futures)
        server.shard_class = shard_class
        return server

    def call_all(
        self, method: str, *args: Any, timeout: float, per_shard: list[tuple] | None = None
    ) -> list:
        """Call ``method`` on every shard at once (with ``per_shard[i]`` as shard i's arguments,
        if given) and wait for all the replies.

        Raises
        ------
        RuntimeError
            Naming the shard and its worker, if a shard is lost or does not answer in time.
        """
        calls, replies = [], []
        try:
            for i, shard in enumerate(self.shards):
                calls.append(getattr(shard, method)(*(args if per_shard is None else per_shard[i])))
            for i, call in enumerate(calls):  # noqa: B007 (``i`` names a shard that fails)
                replies.append(self._reply(i, call, timeout))
            return replies
        except (RuntimeError, OSError, TimeoutError) as err:
            raise ShardLostError(
                f"parameter-server shard {i} on worker {self.workers[i]} was lost or did not "
                f"answer {method}() within {timeout} s: {err}",
                i,
            ) from err

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
        """Start a new actor for shard ``i`` on ``worker`` from saved state (see
        :meth:`ParameterServerShard.export_state`) and use it from now on; return its future.

        Only the default shard class is supported (Downpour's); the lost actor's future is
        released.
        """
        lo, hi = self.ranges[i]
        future = client.submit(
            ParameterServerShard,
            i,
            lo,
            hi,
            np.ascontiguousarray(values, dtype=DTYPE),
            rule,
            restore=restore,
            actor=True,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=f"parameterservershard-{i}-{uuid.uuid4().hex[:8]}",
        )
        actor = future.result(timeout=timeout)
        self.shards[i], self.workers[i] = actor, worker
        if i < len(self._futures):
            self._futures[i].release()
            self._futures[i] = future
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
                return call.result(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                status = self._futures[i].status if i < len(self._futures) else "finished"
                if status != "finished":
                    raise RuntimeError(f"the actor's task is {status}") from None

    def pull(self, timeout: float = 60.0) -> tuple[np.ndarray, list[int]]:
        """The full parameter vector assembled from every shard, and each shard's version."""
        replies = self.call_all("pull", timeout=timeout)
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
        pieces = [
            (grad[lo:hi], version, replica)
            for (lo, hi), version in zip(self.ranges, fetched_versions)
        ]
        return self.call_all("push", timeout=timeout, per_shard=pieces)

    def versions(self, timeout: float = 60.0) -> list[int]:
        """Each shard's version (updates applied), without transferring any parameters."""
        return self.call_all("current_version", timeout=timeout)

    def request_stop(self, timeout: float = 60.0) -> None:
        """Tell every shard to report the stop flag to replicas."""
        self.call_all("request_stop", timeout=timeout)

    def status(self, timeout: float = 60.0) -> pd.DataFrame:
        """One row per shard: range, worker, version, accepted/refused pushes, staleness."""
        rows = self.call_all("status", timeout=timeout)
        frame = pd.DataFrame(rows)
        frame.insert(3, "worker", self.workers)
        return frame

    def events(self, timeout: float = 60.0) -> list[tuple[float, str, str]]:
        """All events the shards recorded, in time order."""
        found = self.call_all("events", timeout=timeout)
        return sorted(e for shard_events in found for e in shard_events)

    def close(self) -> None:
        """Release the actors (they are deleted once no future refers to them).

        The actor handles go too, replaced by :class:`ActorRef` objects: each handle holds a future
        of its key, and a handle caught in a reference cycle would keep its actor alive until
        Python's cyclic garbage collector happens to run.
        """
        for f in self._futures:
            f.release()
        self._futures = []
        self.shards = [refer(a, self.shard_class, w) for a, w in zip(self.shards, self.workers)]
