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

Fetches and pushes are actor calls that run on the worker's event loop while this thread keeps
computing -- the paper's three weakly synchronised activities.  Pulls and pushes are checked
without blocking at the top of every step; the only waits are the very first fetch and a
back-pressure wait when ``max_inflight`` pushes are still unacknowledged.  Three things keep the
communication cheap (see ``benchmarks/bench_downpour.py``): a push followed by a due fetch goes
as one ``exchange`` message per shard; a shard on the replica's own worker is called in-process;
and finished calls are read without a round trip through the event loop.

One refinement over the paper, so that an asynchronous fetch never *undoes* the replica's own
work: a fetched slice is installed as ``fetched - alpha * (own updates it does not contain yet)``.
Each push carries a sequence number and each shard reports which of this replica's pushes its
values include, so the replica re-applies exactly the missing ones.  With one replica, plain SGD
and ``alpha`` equal to the server's rate this makes Downpour equal serial SGD whatever the timing;
with ``local_learning_rate=0`` it is the paper's plain overwrite.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import get_worker, secede

from ._malloc import tune_malloc
from .models import Model
from .params import DTYPE
from .server import ParameterServer, ParameterServerShard, PullReply, PushReply
from .stream import ArraySource, ShardStream, StreamSpec, make_source


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
    max_inflight: int = 2
    timeout: float = 120.0


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
        self.server, self.model, self.cfg = server, model, config
        self.session = uuid.uuid4().hex  # tells the shards apart this run of the replica
        self.params = np.empty(server.size, dtype=DTYPE)
        self.grad = np.empty(server.size, dtype=DTYPE)
        self.scratch = np.empty(server.size, dtype=DTYPE)
        self._free: list[np.ndarray] = []
        self.accrued = self._buffer()
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0
        self.base_versions = [0] * server.n_shards  # versions the accrued gradient started from
        self.versions = [0] * server.n_shards  # effective version of each local slice
        self.pulls: list = [None] * server.n_shards
        self.local = [local_shard(shard) for shard in server.shards]
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
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, cfg.replica])
        alpha = cfg.local_learning_rate
        self._start_fetches()
        for s in range(self.server.n_shards):  # the first fetch must arrive before step 0
            self._install(s, outcome(self.pulls[s], cfg.timeout))
        step, epochs = 0, 0
        while not self._done(step, epochs):
            with contextlib.closing(source.epoch(rng)) as batches:  # leaving early stops a reader
                for Xb, yb in batches:
                    if self._done(step, epochs):
                        break
                    self._poll()
                    if step % cfg.n_fetch == 0 and step > 0:
                        self._start_fetches()
                    loss, g = self.model.loss_and_grad(self.params, Xb, yb, out=self.grad)
                    if self.accrual_steps == 0:
                        self.base_versions = list(self.versions)
                    self.accrued += g
                    if np.isfinite(
                        loss
                    ):  # a diverged step is not applied locally; the shard refuses it
                        self.params -= np.multiply(g, alpha, out=self.scratch)
                    self.accrual_steps += 1
                    self.accrual_loss += float(loss)
                    self.accrual_examples += len(Xb)
                    if (step + 1) % cfg.n_push == 0:  # with the next step's fetch, if due
                        self._push(step, fetch=(step + 1) % cfg.n_fetch == 0)
                    step += 1
                else:
                    epochs += 1
        if self.accrual_steps:
            self._push(step - 1)
        for p in list(self.pending):
            if not p.acked:
                self._ack(p, wait=True)
        return {"replica": cfg.replica, "steps": step, "epochs": epochs, "pushes": self.rows}

    def _done(self, step: int, epochs: int) -> bool:
        cfg = self.cfg
        return (
            self.stop
            or (cfg.max_steps is not None and step >= cfg.max_steps)
            or (cfg.max_epochs is not None and epochs >= cfg.max_epochs)
        )

    # -- fetching --------------------------------------------------------------------------------
    def _start_fetches(self) -> None:
        for s, shard in enumerate(self.server.shards):
            if self.local[s] is not None:
                self.pulls[s] = _Done(self.local[s].snapshot(self.cfg.replica, self.session))
            elif self.pulls[s] is None:  # one pull per shard in flight; it will be fresh enough
                self.pulls[s] = shard.pull(self.cfg.replica, self.session)

    def _install(self, s: int, reply: PullReply) -> None:
        """Overwrite slice ``s`` of the local copy with fetched values plus own missing updates."""
        self.pulls[s] = None
        lo, hi = self.server.ranges[s]
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
            included = p.seq <= reply.applied_through or p.seq in reply.applied_ahead
            if not included:
                local -= np.multiply(p.grad[lo:hi], alpha, out=scratch)
                replayed += 1
            if included or p.acked:  # later pulls are issued after the ack: they contain it
                p.needed_by.discard(s)
        if self.accrual_steps:
            local -= np.multiply(self.accrued[lo:hi], alpha, out=scratch)
        self.versions[s] = reply.version + replayed
        self.stop = self.stop or reply.stop
        self._release()

    # -- pushing ---------------------------------------------------------------------------------
    def _push(self, step: int, fetch: bool = False) -> None:
        """Push the accrued gradient to every shard.  With ``fetch``, a shard with no pull in
        flight is sent an ``exchange``: the push and a pull of its result in one round trip."""
        while sum(not p.acked for p in self.pending) >= self.cfg.max_inflight:
            self._ack(next(p for p in self.pending if not p.acked), wait=True)
        grad, self.accrued = self.accrued, self._buffer()
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        loss = self.accrual_loss / self.accrual_steps
        calls = []
        for s, (shard, (lo, hi)) in enumerate(zip(self.server.shards, self.server.ranges)):
            args = (grad[lo:hi], self.base_versions[s], self.cfg.replica)
            kw = dict(seq=seq, session=self.session, examples=self.accrual_examples, loss=loss)
            if self.local[s] is not None:  # same process: no message at all
                calls.append(_Done(self.local[s].apply_push(*args, **kw)))
                if fetch:
                    self.pulls[s] = _Done(self.local[s].snapshot(self.cfg.replica, self.session))
            elif fetch and self.pulls[s] is None:
                call = shard.exchange(*args, **kw)
                calls.append(_Half(call, 0))
                self.pulls[s] = _Half(call, 1)
            else:
                calls.append(shard.push(*args, **kw))
        self.pending.append(
            _Push(
                seq,
                step,
                grad,
                calls,
                loss,
                self.accrual_examples,
                needed_by=set(range(len(calls))),
            )
        )
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0

    def _ack(self, p: _Push, wait: bool = False) -> None:
        """Record a push whose replies arrived (waiting for them if ``wait``)."""
        if not wait and not all(c.done() for c in p.calls):
            return
        replies: list[PushReply] = [outcome(c, self.cfg.timeout) for c in p.calls]
        p.acked, p.calls = True, []
        for s in range(len(replies)):
            if self.pulls[s] is None:
                p.needed_by.discard(s)
        self.rows.append(
            (
                time.time() - self.cfg.t0,
                self.cfg.replica,
                p.step,
                p.loss,
                p.examples,
                max(r.staleness for r in replies),
                min(r.version for r in replies),
                all(r.accepted for r in replies),
            )
        )
        self.stop = self.stop or any(r.stop for r in replies)
        self._release()

    def _poll(self) -> None:
        """Take in every fetch and push that has completed, without blocking."""
        for s, call in enumerate(self.pulls):
            if call is not None and call.done():
                self._install(s, outcome(call, self.cfg.timeout))
        for p in list(self.pending):
            if not p.acked:
                self._ack(p)

    # -- gradient buffers ------------------------------------------------------------------------
    def _buffer(self) -> np.ndarray:
        if self._free:
            buf = self._free.pop()
            buf.fill(0)
            return buf
        return np.zeros(self.server.size, dtype=DTYPE)

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
