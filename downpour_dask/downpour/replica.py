"""One Downpour model replica: the paper's ``DownpourSGDClient`` as a long-running Dask task.

The loop follows the paper's pseudo-code::

    step = 0; accrued = 0
    loop:
        if step % n_fetch == 0: start fetching parameters asynchronously
        g = gradient(parameters, next minibatch)
        accrued += g
        parameters -= alpha * g                 # local update between fetches
        if (step + 1) % n_push == 0: start pushing accrued asynchronously; accrued = 0
        step += 1

(The paper tests ``step % n_push``; pushing at the *end* of each n_push-step cycle instead makes
every push carry exactly n_push steps of gradient and puts it right before the next fetch.)

Fetches and pushes travel while this thread keeps computing -- the paper's three weakly
synchronised activities.  Pulls and pushes are checked without blocking at the top of every
step; the only waits are the very first fetch and a back-pressure wait when ``max_inflight``
pushes are still unacknowledged.  What keeps the communication cheap (see
``benchmarks/bench_downpour.py``): a shard on the replica's own worker is called in-process,
copying into a buffer reused for every pull; a shard on another worker is reached over a direct
connection (:mod:`downpour_dask.wire`, whose threads send and receive), or as Dask actor calls
where that is not available, whose finished results are read without a round trip through the
event loop; and a push followed by a due fetch goes as one ``exchange`` per shard (and that is
the step's fetch: none follows it).

One refinement over the paper, so that an asynchronous fetch never *undoes* the replica's own
work: a fetched slice is installed as ``fetched - alpha * (own updates it does not contain yet)``.
Each push carries a sequence number and each shard reports which of this replica's pushes its
values include, so the replica re-applies exactly the missing ones.  With one replica, plain SGD
and ``alpha`` equal to the server's rate this makes Downpour equal serial SGD whatever the timing;
with ``local_learning_rate=0`` it is the paper's plain overwrite.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Variable, get_worker, secede

from ..core.models import Model
from ..core.params import DTYPE
from ..data.stream import ArraySource, ShardStream, StreamSpec, make_source
from ..ps.protocol import SHARD_ERRORS, PullReply, PushReply
from ..ps.server import ParameterServer
from ..ps.shard import ParameterServerShard
from ..ps.wire import WireClient, WireError
from ..runtime.malloc import tune_malloc
from .registry import fetched_copy, keep_row, remember_fetched, shard_variable


@dataclass(frozen=True)
class ReplicaConfig:
    """Settings of one replica's loop (see :class:`~downpour_dask.DownpourSGD` for meanings)."""

    replica: int
    batch_size: int
    n_fetch: int
    n_push: int
    local_learning_rate: float
    seed: int
    t0: float  # wall-clock time at which fit started; log times are relative to it
    max_epochs: int | None = None
    max_steps: int | None = None
    max_inflight: int = 4
    timeout: float = 120.0
    run: str = ""  # the fit's token: names the shard variables (see shard_variable)
    start_step: int = 0  # a restarted replica skips the batches it already trained on
    topic: str = ""  # a published run's event topic: the replica logs its metrics there
    partition: int = 0  # which partition of a model-parallel replica this loop runs
    transport: str = "auto"  # "auto": wire.py's direct connections where possible; "dask": actors
    start_after_version: int = 0  # wait for replica 0's warmstart: every shard's version


def _plain(value: Any) -> Any:
    """A msgpack-friendly scalar (numpy scalars become Python numbers)."""
    return value.item() if isinstance(value, np.generic) else value


@dataclass
class _Push:
    """A push in flight or kept for replay until every shard's values are known to contain it."""

    seq: int
    step: int
    grad: np.ndarray
    calls: list
    loss: float
    examples: int
    acked: bool = False
    needed_by: set[int] = field(default_factory=set)
    keys: tuple = ()  # the shard actors the push went to
    sent: float = 0.0  # time.monotonic() when it was sent


def outcome(call: Any, timeout: float) -> Any:
    """The result of an actor call, taken directly when it has already arrived.

    ``ActorFuture.result()`` always hands a coroutine to the worker's event loop and blocks
    until the loop runs it, even for a finished call: measured inside a busy worker, four such
    hand-offs per step cost more than the gradient itself.  A finished call's outcome is read
    from the future (distributed 2024-2026 keep it in ``_out``); anything else waits normally.
    """
    out = getattr(call, "_out", None) if call.done() else None
    if out is not None and hasattr(out, "unwrap"):
        return out.unwrap()  # raises the call's exception, as result() would
    return call.result(timeout=timeout)


class _Done:
    """A shard call made in-process (the shard lives on this worker), used like an ActorFuture."""

    def __init__(self, value: Any):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


def gradient_scale(model: Model, alpha: float) -> float:
    """What a replica asks ``model.loss_and_grad`` to multiply its gradient by: ``alpha``, so
    that the local step ``params -= alpha * g`` is one pass with no scratch pass, or 1.

    1 when ``alpha`` is 0 (no local step), when the model's ``loss_and_grad`` takes no
    ``scale=`` (a user's subclass may override it without), and when ``alpha`` is so far outside
    any learning rate's range that the scaled float32 gradient could under- or overflow before
    the push divides it back out.
    """
    if not 1e-10 <= alpha <= 1e10:
        return 1.0
    try:
        takes_scale = "scale" in inspect.signature(model.loss_and_grad).parameters
    except (TypeError, ValueError):
        takes_scale = False
    return float(alpha) if takes_scale else 1.0


def local_shard(shard: Any) -> ParameterServerShard | None:
    """The shard object itself if its actor lives in this worker process, else None.

    Calling it directly saves a replica on the shard's worker the serialisation and the loopback
    round trip of an actor call.  Falls back to actor calls (None) outside a worker or if Dask's
    worker no longer exposes its actors as ``state.actors``.
    """
    try:
        worker = get_worker()
        found = worker.state.actors.get(shard.key)
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, ParameterServerShard) else None


class _Half:
    """The push or the pull half of one ``exchange`` call, used like an ActorFuture."""

    def __init__(self, call: Any, index: int):
        self.call, self.index = call, index

    def done(self) -> bool:
        return self.call.done()

    def result(self, timeout: float | None = None) -> Any:
        return outcome(self.call, timeout)[self.index]


class Replica:
    """State of one running replica: local parameters, gradient accrual, fetches and pushes."""

    def __init__(self, server: ParameterServer, model: Model, config: ReplicaConfig):
        server = server.opened()  # our own handles: shards may be replaced (see _switch)
        self.server, self.model, self.cfg = server, model, config
        # A session tells apart this run of the replica; a replaced shard gets a new one, and
        # push numbers sent to it restart from 0 (seq - seq_base).
        self.sessions = [uuid.uuid4().hex for _ in range(server.n_shards)]
        self.seq_base = [0] * server.n_shards
        self.lost_pushes = 0
        self.last_metrics = -math.inf
        self.pull_sent = [0.0] * server.n_shards
        self.checked = [0.0] * server.n_shards  # last look for a replacement of each shard
        self.params = np.empty(server.size, dtype=DTYPE)
        self.grad = np.empty(server.size, dtype=DTYPE)
        self.scratch = np.empty(server.size, dtype=DTYPE)
        self._free: list[np.ndarray] = []
        # Gradients are computed times ``scale`` and accrued so until pushed; ``rate`` turns them
        # into a local step.
        self.scale = gradient_scale(model, config.local_learning_rate)
        self.rate = config.local_learning_rate / self.scale
        self.grad_kw = {"scale": self.scale} if self.scale != 1.0 else {}  # none: any model
        self.accrued = self._buffer()
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0
        self.base_versions = [0] * server.n_shards  # versions the accrued gradient started from
        self.versions = [0] * server.n_shards  # effective version of each local slice
        self.pulls: list = [None] * server.n_shards
        self.local = [local_shard(shard) for shard in server.shards]
        self.wires: list[WireClient | None] = [None] * server.n_shards  # see _open_wires
        self.wire_bufs: list[list[np.ndarray]] = [[] for _ in range(server.n_shards)]
        self.fetch_bufs: list[np.ndarray | None] = [None] * server.n_shards  # for local shards
        self.pending: list[_Push] = []
        self.next_seq = 0
        self.stop = False
        self.rows: list[tuple] = []

    # -- the loop --------------------------------------------------------------------------------
    def run(self, source: ArraySource | ShardStream) -> dict[str, Any]:
        """Train on ``source``'s epochs until the epochs/steps run out or a shard reports stop.

        ``source.epoch(rng)`` yields one epoch of minibatches: in-memory arrays
        (:class:`~downpour_dask.stream.ArraySource`) or shards streamed from files or Dask
        partitions (:class:`~downpour_dask.stream.ShardStream`).
        """
        try:
            self._open_wires(range(self.server.n_shards))
            self._await_warmstart()
            return self._train(source)
        finally:
            for wire in self.wires:
                if wire is not None:
                    wire.close()

    def _train(self, source: ArraySource | ShardStream) -> dict[str, Any]:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, cfg.replica])
        self._start_fetches()
        for s in range(self.server.n_shards):  # the first fetch must arrive before step 0
            while self.pulls[s] is not None:
                self._take_pull(s, wait=True)
        step, epochs = 0, 0
        fetched = False  # whether the last push also fetched (an exchange): no fetch needed now
        while not self._done(step, epochs):
            with contextlib.closing(source.epoch(rng)) as batches:  # leaving early stops a reader
                for Xb, yb in batches:
                    if self._done(step, epochs):
                        break
                    if step < cfg.start_step:  # a restarted replica: these were trained on
                        step += 1
                        continue
                    self._poll()
                    if step % cfg.n_fetch == 0 and step > 0 and not fetched:
                        self._start_fetches()
                    fetched = False
                    # The first step of an accrual writes straight into the accrual buffer: every
                    # pass over the parameter vector costs about 1% here.
                    first = self.accrual_steps == 0
                    if first:
                        self.base_versions = list(self.versions)
                    out = self.accrued if first else self.grad
                    loss, g = self.model.loss_and_grad(self.params, Xb, yb, out=out, **self.grad_kw)
                    if not first:
                        self.accrued += g
                    if np.isfinite(loss):  # a diverged step is not applied locally; the shard
                        self._descend(self.params, g, self.scratch)  # refuses its push
                    self.accrual_steps += 1
                    self.accrual_loss += float(loss)
                    self.accrual_examples += len(Xb)
                    if (step + 1) % cfg.n_push == 0:  # with the next step's fetch, if due
                        fetched = (step + 1) % cfg.n_fetch == 0
                        self._push(step, fetch=fetched)
                    step += 1
                else:
                    epochs += 1
        if self.accrual_steps:
            self._push(step - 1)
        for p in list(self.pending):
            if not p.acked:
                self._ack(p, wait=True)
        return {
            "replica": cfg.replica,
            "partition": cfg.partition,
            "steps": step,
            "epochs": epochs,
            "pushes": self.rows,
            "lost_pushes": self.lost_pushes,
            "sessions": self.sessions,
            "transports": self.transports(),
        }

    def transports(self) -> list[str]:
        """How this replica reaches each shard: ``"local"`` (in-process), ``"wire"`` (a direct
        connection, see :mod:`downpour_dask.wire`) or ``"actor"`` (Dask actor messages)."""
        return [
            "local" if local is not None else "wire" if wire is not None else "actor"
            for local, wire in zip(self.local, self.wires)
        ]

    def _done(self, step: int, epochs: int) -> bool:
        return self.stop or self._limit_reached(step, epochs)

    def _limit_reached(self, step: int, epochs: int) -> bool:
        cfg = self.cfg
        return (cfg.max_steps is not None and step >= cfg.max_steps) or (
            cfg.max_epochs is not None and epochs >= cfg.max_epochs
        )

    # -- reaching the shards ---------------------------------------------------------------------
    def _open_wires(self, indices: range | list[int]) -> None:
        """Connect directly (:mod:`downpour_dask.wire`) to the shards ``indices`` that live on
        other workers.  A shard that offers no endpoint (its worker's comm is not plain TCP) or
        cannot be reached that way is called through Dask's actor messages instead; a shard that
        does not answer at all is left to the first fetch, which handles lost shards."""
        if self.cfg.transport != "auto":
            return
        sent, asked = time.monotonic(), {}
        for s in indices:
            if self.local[s] is None:
                with contextlib.suppress(*SHARD_ERRORS):  # a lost actor's handle raises at once
                    asked[s] = self.server.shards[s].open_wire()
        for s, call in asked.items():
            try:
                endpoint = self._wait_call(call, s, self.server.shards[s].key, sent)
                if endpoint is not None:
                    self.wires[s] = WireClient(endpoint, timeout=min(10.0, self.cfg.timeout))
            except (*SHARD_ERRORS, WireError):
                self.wires[s] = None

    #: Seconds between looks at the shard while waiting for the warmstart.
    WARMSTART_POLL = 0.002

    def _await_warmstart(self) -> None:
        """Wait until replica 0 has pushed the warmstart (every shard's version reaches
        ``start_after_version``: its pushes reach the shards at different moments), the driver
        releases the wait or the run stops.

        The driver starts every replica together, so the others' start-up (their data, their
        connections) overlaps the warmstart, and they begin within a poll of its end instead of
        after the driver noticed it and submitted them.
        """
        target = self.cfg.start_after_version
        s = 0
        while target > 0 and s < self.server.n_shards:  # versions only grow: one shard at a time
            key, sent = self.server.shards[s].key, time.monotonic()
            try:
                if self.local[s] is not None:
                    version, stopped, released = self.local[s].warmstart_state()
                else:
                    call = self._remote(s).poll_warmstart()
                    version, stopped, released = self._wait_call(call, s, key, sent)
            except SHARD_ERRORS as err:
                self._switch(s, key, err)  # waits for the shard's replacement
                continue
            if stopped or released:
                return
            if version >= target:
                s += 1
            else:
                time.sleep(self.WARMSTART_POLL)

    def _remote(self, s: int) -> Any:
        """What to call for shard ``s`` on another worker: its direct connection, else its actor."""
        return self.wires[s] or self.server.shards[s]

    def _pull_into(self, s: int) -> dict[str, np.ndarray]:
        """For a pull over shard ``s``'s direct connection: ``out=`` a buffer reused from pull to
        pull, as for local shards (a fresh array above glibc's 32 MiB mmap limit is page-faulted
        afresh every time).  Two per shard: only one pull of a shard is in flight, and the values
        installed last may still be this process's remembered copy (``_FETCHED``), which a
        pull must not overwrite.  Actor calls take no ``out``."""
        if self.wires[s] is None:
            return {}
        bufs = self.wire_bufs[s]
        if not bufs:
            lo, hi = self.server.ranges[s]
            bufs.extend(np.empty(hi - lo, dtype=DTYPE) for _ in range(2))
        kept = fetched_copy(self.cfg.run, self.server.ids[s], self.server.shards[s].key)
        return {"out": bufs[1] if kept is not None and kept[1] is bufs[0] else bufs[0]}

    # -- fetching --------------------------------------------------------------------------------
    def _start_fetches(self) -> None:
        for s in range(self.server.n_shards):
            self._start_fetch(s)

    def _start_fetch(self, s: int) -> None:
        if self.local[s] is not None:
            self.pulls[s] = self._local_pull(s)
        elif self.pulls[s] is None:  # one pull per shard in flight; it will be fresh enough
            try:
                self.pulls[s] = self._remote(s).pull(
                    self.cfg.replica, self.sessions[s], **self._pull_into(s)
                )
            except SHARD_ERRORS as err:  # a lost actor's handle raises at once
                self._switch(s, self.server.shards[s].key, err)  # waits for the replacement
                self._start_fetch(s)
                return
            self.pull_sent[s] = time.monotonic()

    def _local_pull(self, s: int) -> _Done:
        """Fetch shard ``s``, which lives in this process, into a buffer reused every time."""
        buf = self.fetch_bufs[s]
        if buf is None:
            lo, hi = self.server.ranges[s]
            buf = self.fetch_bufs[s] = np.empty(hi - lo, dtype=DTYPE)
        return _Done(self.local[s].snapshot_into(buf, self.cfg.replica, self.sessions[s]))

    #: Seconds a call may be outstanding before the replica asks whether its shard was replaced.
    STUCK = 1.0

    def _replaced(self, s: int, key: str, sent: float) -> bool:
        """Whether shard ``s``'s actor ``key`` was replaced by the driver (it was lost).

        A call into a lost actor may never complete, so a call outstanding for more than
        :attr:`STUCK` seconds makes the replica look (at most once a second per shard) at the
        shard's variable, where the driver publishes replacements.
        """
        if self.server.shards[s].key != key:
            return True
        now = time.monotonic()
        if not self.cfg.run or now - sent < self.STUCK or now - self.checked[s] < 1.0:
            return False
        self.checked[s] = now
        future = None
        with contextlib.suppress(TimeoutError, OSError):
            future = Variable(shard_variable(self.cfg.run, self.server.ids[s])).get(
                timeout=self.cfg.timeout
            )
        return future is not None and future.key != key

    def _wait_call(self, call: Any, s: int, key: str, sent: float) -> Any:
        """The outcome of a call into shard ``s`` (actor ``key``), waiting at most ``timeout``;
        raises RuntimeError if the shard is replaced meanwhile."""
        deadline = time.monotonic() + self.cfg.timeout
        while not call.done():
            if self._replaced(s, key, sent):
                raise RuntimeError(f"parameter-server shard {s} was replaced")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"shard {s} did not answer within {self.cfg.timeout} s")
            with contextlib.suppress(TimeoutError):
                return outcome(call, min(0.5, max(0.01, deadline - time.monotonic())))
        return outcome(call, self.cfg.timeout)

    def _take_pull(self, s: int, wait: bool = False) -> None:
        """Install shard ``s``'s fetch if it arrived (or ``wait`` for it); if the shard was lost,
        switch to its replacement and fetch again."""
        call = self.pulls[s]
        if call is None:
            return
        key, sent = self.server.shards[s].key, self.pull_sent[s]
        if not (wait or call.done() or self._replaced(s, key, sent)):
            return
        try:
            reply = self._wait_call(call, s, key, sent)
        except SHARD_ERRORS as err:
            self.pulls[s] = None
            self._switch(s, key, err)
            self._start_fetch(s)
            return
        self._install(s, reply)

    def _switch(self, s: int, lost_key: str, error: BaseException) -> None:
        """Shard ``s`` (actor ``lost_key``) was lost: wait for the driver to publish its
        replacement, then talk to it with a new session; pushes it lost are dropped."""
        if self.server.shards[s].key != lost_key:
            return  # already switched
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout
        variable = Variable(shard_variable(cfg.run, self.server.ids[s])) if cfg.run else None
        while True:
            future = None
            if variable is not None:
                with contextlib.suppress(TimeoutError, OSError):
                    future = variable.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if future is not None and future.key != lost_key:
                actor = future.result(timeout=cfg.timeout)
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"replica {cfg.replica}: parameter-server shard {s} was lost and no "
                    f"replacement appeared within timeout={cfg.timeout} s: {error}"
                ) from error
            time.sleep(0.05)
        self.server.shards[s] = actor
        self.local[s] = local_shard(actor)
        if self.wires[s] is not None:
            self.wires[s].close()  # its receiver may still be writing into a buffer: new ones
            self.wires[s], self.wire_bufs[s] = None, []
        self._open_wires([s])
        self.pulls[s] = None  # a fetch from the lost actor may never complete: ask the new one
        self.sessions[s] = uuid.uuid4().hex
        self.seq_base[s] = self.next_seq
        for p in self.pending:  # the new shard never saw these: they are lost
            if s in p.needed_by:
                p.needed_by.discard(s)
            if not p.acked:
                self.lost_pushes += 1
        self._release()

    def _install(self, s: int, reply: PullReply) -> None:
        """Overwrite slice ``s`` of the local copy with fetched values plus own missing updates."""
        self.pulls[s] = None
        if self.cfg.run and self.local[s] is None:  # a local shard's copy would die with it
            key = self.server.shards[s].key
            remember_fetched(self.cfg.run, self.server.ids[s], key, reply.version, reply.values)
        lo, hi = self.server.ranges[s]
        base = self.seq_base[s]
        local, scratch, alpha = (
            self.params[lo:hi],
            self.scratch[lo:hi],
            self.cfg.local_learning_rate,
        )
        local[...] = reply.values
        replayed = 0
        for p in self.pending:
            if s not in p.needed_by:
                continue
            seq = p.seq - base
            included = seq <= reply.applied_through or seq in reply.applied_ahead
            if not included:
                local -= np.multiply(p.grad[lo:hi], alpha, out=scratch)
                replayed += 1
            if included or p.acked:  # later pulls are issued after the ack: they contain it
                p.needed_by.discard(s)
        if self.accrual_steps:
            self._descend(local, self.accrued[lo:hi], scratch)
        self.versions[s] = reply.version + replayed
        self.stop = self.stop or reply.stop
        self._release()

    def _descend(self, target: np.ndarray, accrued: np.ndarray, scratch: np.ndarray) -> None:
        """``target -= alpha * gradient`` for a gradient in accrual units (times ``scale``)."""
        if self.rate == 1.0:
            target -= accrued
        elif self.rate:
            target -= np.multiply(accrued, self.rate, out=scratch)

    # -- pushing ---------------------------------------------------------------------------------
    def _push(self, step: int, fetch: bool = False) -> None:
        """Push the accrued gradient to every shard.  With ``fetch``, a shard with no pull in
        flight is sent an ``exchange``: the push and a pull of its result in one round trip."""
        while sum(not p.acked for p in self.pending) >= self.cfg.max_inflight:
            self._ack(next(p for p in self.pending if not p.acked), wait=True)
        grad, self.accrued = self.accrued, self._buffer()
        if self.scale != 1.0:  # shards take the plain gradient
            grad *= DTYPE(1.0 / self.scale)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        loss = self.accrual_loss / self.accrual_steps
        calls = []
        for s, (lo, hi) in enumerate(self.server.ranges):
            args = (grad[lo:hi], self.base_versions[s], self.cfg.replica)
            kw = dict(
                seq=seq - self.seq_base[s],
                session=self.sessions[s],
                examples=self.accrual_examples,
                loss=loss,
            )
            if self.local[s] is not None:  # same process: no message at all
                calls.append(_Done(self.local[s].apply_push(*args, **kw)))
                if fetch:
                    self.pulls[s] = self._local_pull(s)
            elif fetch and self.pulls[s] is None:
                call = self._remote(s).exchange(*args, **kw, **self._pull_into(s))
                calls.append(_Half(call, 0))
                self.pulls[s] = _Half(call, 1)
                self.pull_sent[s] = time.monotonic()
            else:
                calls.append(self._remote(s).push(*args, **kw))
        self.pending.append(
            _Push(
                seq,
                step,
                grad,
                calls,
                loss,
                self.accrual_examples,
                needed_by=set(range(len(calls))),
                keys=tuple(shard.key for shard in self.server.shards),
                sent=time.monotonic(),
            )
        )
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0

    def _ack(self, p: _Push, wait: bool = False) -> None:
        """Record a push whose replies arrived (waiting for them if ``wait``)."""
        if not wait and not all(c.done() for c in p.calls):
            stuck = [s for s, c in enumerate(p.calls) if not c.done()]
            if not any(self._replaced(s, p.keys[s], p.sent) for s in stuck):
                return
        replies: list[PushReply] = []
        lost = False
        for s, c in enumerate(p.calls):
            try:
                replies.append(self._wait_call(c, s, p.keys[s], p.sent))
            except SHARD_ERRORS as err:  # counted in lost_pushes by _switch
                self._switch(s, p.keys[s], err)
                p.needed_by.discard(s)
                lost = True
        p.acked, p.calls = True, []
        for s in range(self.server.n_shards):
            if self.pulls[s] is None:
                p.needed_by.discard(s)
        row = (
            time.time() - self.cfg.t0,
            self.cfg.replica,
            p.step,
            p.loss,
            p.examples,
            max((r.staleness for r in replies), default=0),
            min((r.version for r in replies), default=0),
            not lost and all(r.accepted for r in replies),
            self.cfg.partition,
        )
        self.rows.append(row)
        if self.cfg.run:
            keep_row(self.cfg.run, row)
        if self.cfg.topic and row[0] - self.last_metrics >= 1.0:
            self._log_metrics(row)
        self.stop = self.stop or any(r.stop for r in replies)
        self._release()

    def _log_metrics(self, row: tuple) -> None:
        """About once a second, log this replica's latest push on the run's event topic (what
        ``downpour-dask watch`` and ``Client.get_events`` read); never fails the replica."""
        self.last_metrics = row[0]
        names = ("time", "replica", "step", "loss", "examples", "staleness", "version")
        with contextlib.suppress(Exception):
            get_worker().log_event(
                self.cfg.topic,
                {
                    "kind": "replica",
                    **dict(zip(names, map(_plain, row))),
                    "partition": self.cfg.partition,
                },
            )

    def _poll(self) -> None:
        """Take in every fetch and push that has completed, without blocking."""
        for s in range(self.server.n_shards):
            self._take_pull(s)
        for p in list(self.pending):
            if not p.acked:
                self._ack(p)

    # -- gradient buffers ------------------------------------------------------------------------
    def _buffer(self) -> np.ndarray:
        """A gradient buffer, recycled if one is free; its contents are undefined (the first
        step of an accrual overwrites it, and nothing reads it before)."""
        if self._free:
            return self._free.pop()
        return np.empty(self.server.size, dtype=DTYPE)

    def _release(self) -> None:
        """Recycle the buffers of pushes that are acknowledged and needed for no replay."""
        keep = []
        for p in self.pending:
            if p.acked and not p.needed_by:
                self._free.append(p.grad)
            else:
                keep.append(p)
        self.pending = keep


def run_replica(
    server: ParameterServer,
    model: Model,
    data: tuple[np.ndarray, np.ndarray] | StreamSpec,
    config: ReplicaConfig,
    parts: list | tuple = (),
) -> dict[str, Any]:
    """Dask task entry point: leave the worker's thread pool and run one replica to completion.

    ``data`` is the replica's in-memory ``(X, y)`` subset or a :class:`StreamSpec` naming its
    shards, which it then reads here, on its worker; ``parts`` are its Dask partitions (Dask
    resolves the futures passed in from the worker's own memory).
    """
    secede()  # a replica runs for the whole fit; it must not hold one of the worker's task slots
    tune_malloc()  # see _malloc.py: received messages must not be page-faulted afresh
    return Replica(server, model, config).run(make_source(data, config.batch_size, parts))
