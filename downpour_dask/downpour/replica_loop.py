"""The Downpour replica loop -- the paper's ``DownpourSGDClient`` -- over one channel per shard.

The loop follows the paper's pseudo-code::

    step = 0; accrued = 0
    loop:
        if step % n_fetch == 0: start fetching parameters asynchronously
        g = gradient(parameters, next minibatch)
        accrued += g
        parameters -= alpha * g                 # local update between fetches
        if (step + 1) % n_push == 0: start pushing accrued asynchronously; accrued = 0
        step += 1

(The paper tests ``step % n_push``; pushing at the *end* of each cycle makes every push carry
exactly n_push steps of gradient, right before the next fetch.)

Fetches and pushes travel while this thread keeps computing -- the paper's three weakly
synchronised activities.  Replies are checked without blocking at the top of every step; the
only waits are the very first fetch, the warmstart gate and a back-pressure wait when
``max_inflight`` pushes are still unacknowledged.  A push followed by a due fetch goes as one
``exchange`` per shard (and that is the step's fetch: none follows it).  A fetched slice is
installed with the replica's own pushes it lacks re-applied (:mod:`.pushes`), so with one
replica, plain SGD and ``alpha`` equal to the server's rate Downpour equals serial SGD whatever
the timing; with ``local_learning_rate=0`` it is the paper's plain overwrite.

The loop knows shards only through :class:`~downpour_dask.ps.protocol.ShardChannel` and writes
what must outlive it through a :class:`~.config.ReplicaSink`; it imports no Dask.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from ..core.compression import TopK
from ..core.models import Model
from ..core.optim import axpy
from ..core.params import DTYPE
from ..log import PushRow
from ..ps.protocol import PullReply, PushReply, ShardChannel, ShardLostError
from ..runtime.cpus import let_helpers_run
from .config import ReplicaConfig, ReplicaSink
from .pushes import Push, PushLedger


class ReplicaLoop:
    """One replica: local parameters, gradient accrual, fetches and pushes over ``channels``.

    Parameters
    ----------
    channels : list of ShardChannel
        One per shard, in order.
    ranges : list of (start, stop)
        The part of the flat parameter vector each shard owns.
    model : Model
    config : ReplicaConfig
    sink : ReplicaSink
    """

    #: Seconds between looks at the shard while waiting for the warmstart.
    WARMSTART_POLL = 0.002
    #: Whether a step whose push is an ``exchange`` leaves out the local step on the slices of
    #: in-process shards: their fetch completes with the push and is installed (overwriting
    #: them) before the next step.  False where ``_push`` does not exchange or the install
    #: keeps the local values (the clocked and elastic loops).
    skip_refetched: bool = True
    #: Whether such an exchange's fetch is copied straight into the slice (not via a buffer).
    pull_into: bool = True

    def __init__(
        self,
        channels: list[ShardChannel],
        ranges: list[tuple[int, int]],
        model: Model,
        config: ReplicaConfig,
        sink: ReplicaSink,
    ):
        self.channels, self.ranges, self.model = channels, ranges, model
        self.cfg, self.sink = config, sink
        n, size = len(channels), ranges[-1][1]
        self.params = np.empty(size, dtype=DTYPE)
        self.grad = np.empty(size, dtype=DTYPE)
        self.ledger = PushLedger(size)
        self.accrued = self.ledger.buffer()
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0
        self.base_versions = [0] * n  # versions the accrued gradient started from
        self.versions = [0] * n  # effective version of each local slice
        self.pulls: list[Any] = [None] * n  # the fetch in flight from each shard
        self.pull_sent = [0.0] * n
        self.held: list[np.ndarray | None] = [None] * n  # fetched values the sink kept
        self.stop = False
        self.rows: list[PushRow] = []
        self.acked: dict[int, dict[int, list[int]]] = {}  # shard, generation: [pushes, version]
        self.topk = None if config.top_k is None else TopK(config.top_k, size)
        self.sent_bytes: dict[int, int] = {}  # push number: bytes its gradient took

    # -- the loop --------------------------------------------------------------------------------
    def run(self, source: Any) -> dict[str, Any]:
        """Train on ``source``'s epochs until the epochs/steps run out or a shard reports stop.

        ``source.epoch(rng)`` yields one epoch of ``(X, y)`` minibatches (in-memory arrays or
        shards streamed from files or Dask partitions, see :mod:`downpour_dask.data.stream`).
        """
        self._await_warmstart()
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, cfg.replica])
        self._start_fetches()
        for s in range(len(self.channels)):  # the first fetch must arrive before step 0
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
                    let_helpers_run()  # pinned: the sends and replies they hold go now
                    self._poll()
                    if step % cfg.n_fetch == 0 and step > 0 and not fetched:
                        self._start_fetches()
                    fetched = False
                    # The first step of an accrual writes straight into the accrual buffer: it
                    # saves a pass over the parameter vector, a visible part of a step's cost.
                    first = self.accrual_steps == 0
                    if first:
                        self.base_versions = list(self.versions)
                    out = self.accrued if first else self.grad
                    loss, g = self.model.loss_and_grad(self.params, Xb, yb, out=out)
                    if not first:
                        self.accrued += g
                    pushing = (step + 1) % cfg.n_push == 0  # with the next step's fetch, if due
                    fetching = pushing and (step + 1) % cfg.n_fetch == 0
                    if np.isfinite(loss):  # a diverged step is not applied locally; the shard
                        self._step_locally(g, fetching)  # refuses its push
                    self.accrual_steps += 1
                    self.accrual_loss += float(loss)
                    self.accrual_examples += len(Xb)
                    if pushing:
                        fetched = fetching
                        self._push(step, fetch=fetched)
                    step += 1
                else:
                    epochs += 1
        if self.accrual_steps:
            self._push(step - 1)
        for p in self.ledger.unacknowledged():
            self._ack(p, wait=True)
        return {
            "replica": cfg.replica,
            "partition": cfg.partition,
            "steps": step,
            "epochs": epochs,
            "pushes": self.rows,
            "lost_pushes": self.ledger.lost,
            "sessions": [channel.session for channel in self.channels],
            "acknowledged": {
                str(shard): {str(g): list(n) for g, n in by_gen.items()}
                for shard, by_gen in self.acked.items()
            },
            "transports": [channel.transport for channel in self.channels],
            "shared": [channel.shared for channel in self.channels],
        }

    def _done(self, step: int, epochs: int) -> bool:
        return self.stop or self._limit_reached(step, epochs)

    def _limit_reached(self, step: int, epochs: int) -> bool:
        cfg = self.cfg
        return (cfg.max_steps is not None and step >= cfg.max_steps) or (
            cfg.max_epochs is not None and epochs >= cfg.max_epochs
        )

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
        while target > 0 and s < len(self.channels):  # versions only grow: one shard at a time
            channel = self.channels[s]
            key, sent = channel.key, time.monotonic()
            try:
                version, stopped, released = channel.wait(channel.poll_warmstart(), key, sent)
            except ShardLostError as err:
                self._switch(s, key, err)  # waits for the shard's replacement
                continue
            if stopped or released:
                return
            if version >= target:
                s += 1
            elif self.sink.abandoned():  # the driver is gone; its shards may still answer
                self.stop = True
                return
            else:
                time.sleep(self.WARMSTART_POLL)

    # -- fetching --------------------------------------------------------------------------------
    def _start_fetches(self) -> None:
        for s in range(len(self.channels)):
            self._start_fetch(s)

    def _start_fetch(self, s: int) -> None:
        """Fetch shard ``s`` unless a fetch is in flight (it will be fresh enough); an
        in-process shard's fetch is complete at once, so a fresher one replaces it."""
        channel = self.channels[s]
        if channel.in_process or self.pulls[s] is None:
            self.pulls[s] = channel.pull(self.held[s])
            self.pull_sent[s] = time.monotonic()

    def _take_pull(self, s: int, wait: bool = False) -> None:
        """Install shard ``s``'s fetch if it arrived (or ``wait`` for it); if the shard was lost,
        switch to its replacement and fetch again."""
        call = self.pulls[s]
        if call is None:
            return
        channel = self.channels[s]
        key, sent = channel.key, self.pull_sent[s]
        if not (wait or call.done() or channel.replaced(key, sent)):
            return
        try:
            reply = channel.wait(call, key, sent)
        except ShardLostError as err:
            self.pulls[s] = None
            self._switch(s, key, err)
            self._start_fetch(s)
            return
        self._install(s, reply)

    def _install(self, s: int, reply: PullReply) -> None:
        """Overwrite slice ``s`` of the local copy with fetched values plus own missing updates."""
        self.pulls[s] = None
        channel = self.channels[s]
        if not channel.in_process and self.sink.keep_fetched(
            channel.shard, channel.key, reply.version, reply.values
        ):  # an in-process shard's copy would die with it
            self.held[s] = reply.values
        lo, hi = self.ranges[s]
        local = self.params[lo:hi]
        if not np.may_share_memory(local, reply.values):  # (fetched into the slice: installed)
            local[...] = reply.values
        alpha = self.cfg.local_learning_rate
        replayed = self.ledger.replay(s, channel, reply, local, (lo, hi), alpha)
        if self.accrual_steps:
            self._descend(local, self.accrued[lo:hi])
        self.versions[s] = reply.version + replayed
        self.stop = self.stop or reply.stop
        self.ledger.release()

    def _step_locally(self, g: np.ndarray, exchanging: bool) -> None:
        """The local step ``params -= alpha * g``, left out (with :attr:`skip_refetched`) on
        the slices an ``exchange`` with an in-process shard is about to overwrite."""
        skipping = exchanging and self.skip_refetched
        skipped = [r for r, c in zip(self.ranges, self.channels) if skipping and c.in_process]
        if not skipped:
            self._descend(self.params, g)
            return
        lo = 0
        for start, stop in [*skipped, (self.params.size, self.params.size)]:
            if start > lo:
                self._descend(self.params[lo:start], g[lo:start])
            lo = stop

    def _descend(self, target: np.ndarray, grad: np.ndarray) -> None:
        """``target -= alpha * grad``: one pass of BLAS's ``axpy`` over both, as cheap as a plain
        subtraction, so the model computes the plain gradient (no ``scale=`` asked of it) and a
        push sends the accrued sum as it stands."""
        alpha = self.cfg.local_learning_rate
        if alpha:
            axpy(-alpha, grad, target)

    def _switch(self, s: int, lost_key: str, error: ShardLostError) -> None:
        """Shard ``s`` (actor ``lost_key``) was lost: move its channel to the replacement; the
        pushes the lost shard had not acknowledged are dropped (and counted)."""
        if not self.channels[s].switch(lost_key, error):
            return  # already switched
        self.pulls[s] = None  # a fetch from the lost actor may never complete: ask the new one
        self.held[s] = None
        self.ledger.shard_switched(s)

    # -- pushing ---------------------------------------------------------------------------------
    def _push(self, step: int, fetch: bool = False) -> None:
        """Push the accrued gradient to every shard.  With ``fetch``, a shard with no pull in
        flight is sent an ``exchange``: the push and a pull of its result in one round trip."""
        ledger = self.ledger
        while ledger.in_flight() >= self.cfg.max_inflight:
            self._ack(ledger.oldest_in_flight(), wait=True)
        grad, self.accrued = self.accrued, ledger.buffer()
        seq = ledger.take_seq()
        payloads = self._payloads(grad)
        self.sent_bytes[seq] = sum(int(payload.nbytes) for payload in payloads)
        loss, examples = self.accrual_loss / self.accrual_steps, self.accrual_examples
        calls = []
        for s, channel in enumerate(self.channels):
            lo, hi = self.ranges[s]
            if fetch and (channel.in_process or self.pulls[s] is None):
                into = self.params[lo:hi] if channel.in_process and self.pull_into else None
                pushed, self.pulls[s] = channel.exchange(
                    payloads[s], self.base_versions[s], seq, examples, loss, self.held[s], into
                )
                self.pull_sent[s] = time.monotonic()
            else:
                pushed = channel.push(payloads[s], self.base_versions[s], seq, examples, loss)
            calls.append(pushed)
        keys = tuple(channel.key for channel in self.channels)
        needed_by = set(range(len(calls)))
        ledger.add(
            Push(seq, step, grad, calls, loss, examples, False, needed_by, keys, time.monotonic())
        )
        self.accrual_steps, self.accrual_loss, self.accrual_examples = 0, 0.0, 0

    def _payloads(self, grad: np.ndarray) -> list[Any]:
        """What a push sends each shard: its slice of ``grad``, or with ``top_k`` a sparse part
        of it (``grad`` is left holding what is sent, for replays; see core/compression.py)."""
        if self.topk is None:
            return [grad[lo:hi] for lo, hi in self.ranges]
        return self.topk.compress(grad, self.ranges)

    def _ack(self, p: Push, wait: bool = False) -> None:
        """Record a push whose replies arrived (waiting for them if ``wait``)."""
        if not wait and not all(c.done() for c in p.calls):
            stuck = [s for s, c in enumerate(p.calls) if not c.done()]
            if not any(self.channels[s].replaced(p.keys[s], p.sent) for s in stuck):
                return
        replies = []
        lost = False
        for s, call in enumerate(p.calls):
            try:
                reply = self.channels[s].wait(call, p.keys[s], p.sent)
                replies.append(reply)
                if reply.accepted:
                    self._acknowledged(s, p.keys[s], reply)
            except ShardLostError as err:  # counted in the ledger's lost pushes by _switch
                self._switch(s, p.keys[s], err)
                p.needed_by.discard(s)
                lost = True
        self.ledger.acknowledged(p, [s for s, pull in enumerate(self.pulls) if pull is None])
        row = PushRow(
            time=time.time() - self.cfg.t0,
            replica=self.cfg.replica,
            step=p.step,
            loss=p.loss,
            examples=p.examples,
            staleness=max((r.staleness for r in replies), default=0),
            version=min((r.version for r in replies), default=0),
            accepted=not lost and all(r.accepted for r in replies),
            partition=self.cfg.partition,
            bytes_sent=self.sent_bytes.pop(p.seq, 0),
        )
        self.rows.append(row)
        self.sink.keep_row(row)
        self.stop = self.stop or any(r.stop for r in replies)

    def _acknowledged(self, s: int, key: str, reply: PushReply) -> None:
        """Count a push shard ``s`` (actor ``key``) accepted (see ``shard_recovery``)."""
        shard = self.channels[s].shard
        counts = self.acked.setdefault(shard, {}).setdefault(reply.generation, [0, 0])
        counts[0] += 1
        counts[1] = max(counts[1], int(reply.version))
        self.sink.keep_acked(shard, key, int(reply.version))

    def _poll(self) -> None:
        """Take in every fetch and push that has completed, without blocking."""
        for s in range(len(self.channels)):
            self._take_pull(s)
        for p in self.ledger.unacknowledged():
            if not p.acked:  # acknowledged meanwhile: a switch settles the pushes it lost
                self._ack(p)
