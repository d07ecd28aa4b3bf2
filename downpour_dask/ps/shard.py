"""One parameter-server shard: a Dask actor owning a range of the flat parameter vector.

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
:meth:`~ParameterServerShard.snapshot_into` and :meth:`~ParameterServerShard.apply_push`
directly; replicas on other workers reach ``apply_push`` and ``snapshot_through`` (a pull sent
from the values) over a direct connection (:meth:`~ParameterServerShard.open_wire`,
:mod:`downpour_dask.ps.wire`) where the comm is plain TCP.  A lock keeps those calls atomic.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.averaging import innermost, published
from ..core.compensation import DelayCompensated, FetchedCopies
from ..core.compression import SparseGradient
from ..core.guard import GuardedUpdate, clip_norm, sum_of_squares
from ..core.optim import UpdateRule
from ..core.params import DTYPE
from ..runtime.cluster import worker_tcp_host
from ..runtime.malloc import tune_malloc
from .fencing import Incarnation
from .one_sided_host import OneSidedHost
from .ordering import InOrder, SeqTracker
from .protocol import PullReply, PushReply
from .saved_state import SavedState
from .service import serve


class ParameterServerShard(OneSidedHost, SavedState, InOrder, Incarnation):
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
    restore : dict, optional
        State to continue from (see :meth:`export_state`).
    generation : int, default 0
        Which incarnation of shard ``shard_id`` this is: 0 for the fit's first, one more for
        each replacement.  Every reply carries it (see
        :class:`~downpour_dask.ps.protocol.FencedError`).
    wire_secret : bytes, default b""
        The run's secret: a direct connection's hello must carry it, and :meth:`request_stop`
        and :meth:`retire` need it (b"" accepts any caller).
    max_grad_norm : float, optional
        Cap on the L2 norm of each pushed gradient *over this shard's slice*: a push with a
        larger norm is scaled down to it (each shard decides alone, so no shard waits for the
        others to learn the whole gradient's norm).
    """

    def __init__(
        self,
        shard_id: int,
        start: int,
        stop: int,
        values: np.ndarray,
        rule: UpdateRule,
        *,
        restore: dict[str, Any] | None = None,
        wire_secret: bytes = b"",
        generation: int = 0,
        max_grad_norm: float | None = None,
    ):
        if values.shape != (stop - start,):
            raise ValueError(
                f"shard {shard_id}: values has shape {values.shape}, expected {(stop - start,)}"
            )
        tune_malloc()  # this runs on the shard's worker: see runtime/malloc.py for why
        self.shard_id, self.start, self.stop = shard_id, start, stop
        self.rule = rule
        # values, rule state, version and flags: see one_sided_host.py
        self._open_body(np.array(values, dtype=DTYPE, copy=True), rule.init(stop - start))
        self.accepted_by_replica: Counter[int] = Counter()
        self.refused = 0
        self.duplicates = 0
        self.examples = 0
        self.staleness_sum = 0
        self.staleness_max = 0
        self.generation = int(generation)
        self.started_at = 0  # the version this incarnation started from
        self.fenced_calls = 0  # calls refused after retirement
        self.clipped = 0
        self.max_grad_norm = max_grad_norm
        if restore is not None:
            self._restore(restore)
        self.started_at = self.version
        self._guard = GuardedUpdate(rule, self.values, self.state, self._body.bounds)
        compensated = isinstance(innermost(rule), DelayCompensated)
        self._fetched = FetchedCopies() if compensated else None  # DC-ASGD
        self._seqs: dict[tuple[int, str], SeqTracker] = {}
        self._sessions: set[str] = set()  # replica sessions that pulled or pushed here
        self._events: list[tuple[float, str, str, dict[str, Any]]] = []
        self._arrived: asyncio.Condition | None = None
        # Replicas on this worker call snapshot/apply_push directly from their own threads
        # (see ps/channel.py), and replicas on other workers through wire.py's threads, concurrently
        # with the event loop serving actor calls; one-sided ones take self._lock's file lock.
        self._host = worker_tcp_host()
        self._endpoint: tuple[str, int, str] | None = None
        self._wire_secret = wire_secret  # a direct connection's hello must carry it

    # -- what replicas call (async: served on the event loop, see the module docstring) ----------
    async def pull(self, replica: int = -1, session: str = "", model: bool = False) -> PullReply:
        """A consistent copy of this shard's values, its version and the stop flag; with
        ``model`` (the driver's), of what it publishes as the model (:meth:`snapshot_model`)."""
        return self.snapshot_model() if model else self.snapshot(replica, session)

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
        ``(host, port, shard id)`` of this process's :class:`~downpour_dask.ps.wire.ShardService`,
        or None when the worker's comm is not plain TCP (e.g. TLS), so the replica keeps using
        actor calls."""
        if self._endpoint is None and self._host is not None:
            self._endpoint = serve(self, self._host, self._wire_secret)
        return self._endpoint

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
            return self._snapshot(out, replica, session)

    def snapshot_through(
        self, send: Callable[[PullReply], int], out: np.ndarray, replica: int, session: str
    ) -> tuple[PullReply, int]:
        """:meth:`snapshot_into` for a direct connection, copying only what cannot go at once.
        Under the lock, ``send`` gets the reply holding the live values, hands on what its
        connection takes without waiting (a stalled replica must not hold the lock) and returns
        how many leading bytes of the values that was; only the rest is copied into ``out``
        (the caller sends ``out``'s bytes from there).  Over loopback megabytes go at once."""
        with self._lock:
            live = self._describe(replica, session)
            taken = send(live)
            values, rest = self.values.view(np.uint8), out.view(np.uint8)
            np.copyto(rest[taken:], values[taken:])
        return live._replace(values=out), taken

    def snapshot_model(self) -> PullReply:
        """:meth:`snapshot` of what the fit publishes as its model, for the driver and watchers:
        the values, or with an averaged rule (``ema_decay``) their moving average
        (:mod:`downpour_dask.core.averaging`); replicas go on training the values."""
        with self._lock:
            live = self._describe(-1, "")
            model = published(self.rule, self.values, self.state)  # the average is a new array
            return live._replace(values=self.values.copy() if model is self.values else model)

    def _snapshot(self, out: np.ndarray, replica: int, session: str) -> PullReply:
        """:meth:`snapshot_into`'s work, for a caller holding the lock (e.g. ps/table.py's)."""
        live = self._describe(replica, session)
        np.copyto(out, self.values)
        return live._replace(values=out)

    def _describe(self, replica: int, session: str) -> PullReply:
        """A pull's reply holding the live values, for a caller holding the lock (which it must
        keep while it reads them)."""
        self._serving()
        if session:
            self._sessions.add(session)
        if self._fetched is not None:  # DC-ASGD: what this replica computes its gradient at
            self._fetched.keep(replica, self.values)
        tracker = self._seqs.get((replica, session)) or SeqTracker()
        through, ahead = tracker.through, tuple(tracker.ahead)
        return PullReply(self.values, self.version, self.stopped, through, ahead, self.generation)

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

        A gradient containing NaN or inf, or one whose update would make the parameters or the
        rule's state (e.g. Adagrad's sums of squares) non-finite, is refused: the parameters
        are left untouched, the refusal is counted and recorded as a ``gradient_refused``
        event (data ``replica``, ``non_finite``: values, ``reason``).  With ``max_grad_norm``
        a larger gradient is scaled down first.  A retired incarnation raises
        :class:`~downpour_dask.ps.protocol.FencedError` and changes nothing.  A push whose ``seq``
        this replica session already delivered is ignored, so a retried push is applied once.
        ``loss`` (the replica's mean training loss over the pushed steps) only feeds the shard's
        ``recent_loss`` for live progress displays.
        """
        with self._lock:
            return self._apply_push(grad, fetched_version, replica, seq, session, examples, loss)

    def exchange_into(
        self, grad: np.ndarray, fetched_version: int, replica: int, out: np.ndarray, **kw: Any
    ) -> tuple[PushReply, PullReply]:
        """:meth:`apply_push`, then :meth:`snapshot_into` ``out``, under one hold of the lock:
        a replica on this worker's exchange (one acquisition, and no other push between)."""
        session = kw.get("session", "")
        with self._lock:
            pushed = self._apply_push(
                grad, fetched_version, replica, kw.get("seq"), session,
                kw.get("examples", 0), kw.get("loss", math.nan),
            )  # fmt: skip
            return pushed, self._snapshot(out, replica, session)

    def _apply_push(self, grad, fetched_version, replica, seq, session, examples, loss):
        self._serving()
        if isinstance(grad, SparseGradient):  # a top-k push (core/compression.py)
            grad = grad.dense()
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
            tracker = self._seqs.setdefault((replica, session), SeqTracker())
            if tracker.seen(seq):
                self.duplicates += 1
                return self._reply(staleness, False)
            tracker.add(seq)
        self._tick(replica)  # the replica's clock (ps/clock.py), for SSP/BSP runs
        grad_sq = sum_of_squares(grad)  # NaN or inf if an element is (or if it overflows)
        if not math.isfinite(grad_sq) and not np.isfinite(grad).all():
            bad = int(np.count_nonzero(~np.isfinite(grad)))
            return self._refuse(replica, staleness, f"pushed {bad} non-finite values", bad)
        if self._fetched is not None:  # DC-ASGD: a new array, the caller's buffer stays as sent
            rule = innermost(self.rule)
            grad, grad_sq = self._fetched.compensate(rule, replica, grad, self.values), None
        if self.max_grad_norm is not None:
            grad = np.array(grad, copy=True)  # the caller's buffer (or wire.py's) stays as sent
            if clip_norm(grad, self.max_grad_norm) > self.max_grad_norm:
                self.clipped += 1
        overflow = self._guard.apply(  # (clipping only shrinks the elements: grad_sq holds)
            self.values, grad, self.state, staleness=staleness, grad_sq=grad_sq
        )
        if overflow is not None:
            reason = f"pushed a gradient that would make the {overflow} non-finite"
            return self._refuse(replica, staleness, reason, 0)
        self.version += 1
        self.accepted_by_replica[replica] += 1
        self.examples += int(examples)
        self._body.average_loss(loss)  # a moving average over recent pushes, for progress
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        return self._reply(staleness, True)

    def _reply(self, staleness: int, accepted: bool) -> PushReply:
        return PushReply(self.version, staleness, accepted, self.stopped, self.generation)

    def _refuse(self, replica: int, staleness: int, reason: str, non_finite: int) -> PushReply:
        """Count and record a refused push (``gradient_refused``); the state is unchanged."""
        self.refused += 1
        self._events.append(
            (
                time.time(),
                "gradient_refused",
                f"shard {self.shard_id}: replica {replica} {reason}; parameters left unchanged",
                {"replica": int(replica), "non_finite": non_finite, "reason": reason},
            )
        )
        return self._reply(staleness, False)

    async def current_version(self) -> int:
        """Updates applied so far."""
        return self.version

    def warmstart_state(self) -> tuple[int, bool, bool]:
        """What a replica waiting for the warmstart looks at: ``(version, stopped, released)``."""
        with self._lock:
            self._serving()
        return self.version, self.stopped, self.released

    async def poll_warmstart(self) -> tuple[int, bool, bool]:
        """:meth:`warmstart_state` as an actor call."""
        return self.warmstart_state()

    async def release_warmstart(self) -> None:
        """Let replicas waiting for the warmstart start (the driver's call when it ends, also
        when replica 0 finished before reaching it)."""
        self.released = True

    async def request_stop(self, token: bytes = b"", who: str = "") -> None:
        """Raise the stop flag that pulls and pushes report to replicas.

        Needs the run's ``wire_secret``; a call without it raises PermissionError and is
        recorded as a ``stop_refused`` event naming ``who`` said it asked."""
        asker = who or "an unnamed caller"
        self._check_token(token, "stop_refused", f"a stop requested by {asker}")
        self.stopped = True

    async def status(self) -> dict[str, Any]:
        """:meth:`counters` as an actor call."""
        return self.counters()

    def counters(self) -> dict[str, Any]:
        """Counters of this shard (read only, under the lock): version, accepted/refused/
        duplicate pushes, examples, recent training loss, staleness, generation."""
        with self._lock:
            return self._counters()

    def _counters(self) -> dict[str, Any]:
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
            "generation": self.generation,
            "started_at": self.started_at,
            "retired_by": self.retired_by,
            "fenced_calls": self.fenced_calls,
            "clipped": self.clipped,
        }

    async def events(self, since: int = 0) -> list[tuple[float, str, str, dict[str, Any]]]:
        """Events recorded by this shard (``time``, ``kind``, ``detail``, ``data``), from index
        ``since``; ``gradient_refused``'s data: ``replica``, ``non_finite`` (values)."""
        return self._events[since:]
