"""A sparse replica that fetches every ``n_fetch`` steps and pushes every ``n_push`` steps.

The dense loop's schedule (:mod:`.replica_loop`, the paper's ``DownpourSGDClient``) for a model
of which a batch touches few rows:

* a **fetch** looks ahead over the replica's batches: it takes the next ``n_fetch`` of them
  (fewer at the end of the data or of ``max_steps``) and pulls from every shard the dense slice
  and the deduplicated union of the rows they touch -- each row once, however many of those
  batches touch it;
* between fetches the replica trains those batches on its **local copy**: after each step the
  dense vector and the rows the batch touched move by ``-alpha * gradient`` (plain SGD at the
  local rate, as the dense replica's local step; ``alpha = 0`` keeps the fetched values);
* every ``n_push`` steps it **pushes** the accrued gradient: the dense part, and per table the
  ``(row ids, summed row gradients)`` of every row touched since the last push, each row once;
  the push's staleness counts from the version of the fetch its accrual started from, as the
  dense loop's.

The loop is synchronous per shard: a fetch is sent after the previous push's reply (or right
behind the push, over local calls and direct connections, which a shard serves in the order
sent), so a fetch holds every push this replica made; the part of the accrued gradient not
pushed yet is applied to the fetched values again (``fetched - alpha * accrued``), as the dense
loop does.  With ``n_fetch = n_push = 1`` this is the schedule of :mod:`.sparse_loop`, which
runs that case.

:class:`AccruingReplica` keeps its position (the next step, the batches fetched but not yet
trained, the gradient not yet pushed) across :meth:`AccruingReplica.run` calls, so after a lost
shard the caller opens fresh links and calls ``run`` again: nothing fetched is skipped and the
accrued gradient goes to the replacement; only the push in flight when the shard was lost is
lost (on that shard).  Records are those of :mod:`.sparse_loop` (one per push and shard;
``rows`` counts the rows pushed, ``bytes`` what the push and the fetches since the previous
push moved to and from that shard; ``step`` is the last step of the push).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..core.params import DTYPE
from ..core.sparse import SparseBatch, positions, scatter_sum, unique_rows
from ..core.validation import check_int, check_positive
from ..ps.rows import RowsLink, SparseLayout
from .sparse_loop import push_replies


def check_schedule(n_fetch: Any, n_push: Any, local_learning_rate: Any) -> None:
    """TypeError/ValueError unless ``n_fetch`` and ``n_push`` are ints >= 1 and
    ``local_learning_rate`` is None or a finite number >= 0 (as
    :class:`~downpour_dask.DownpourSGD` checks)."""
    check_int("n_fetch", n_fetch, 1)
    check_int("n_push", n_push, 1)
    check_positive("local_learning_rate", local_learning_rate, allow_none=True, allow_zero=True)


def merge_rows(chunks: Sequence[tuple[np.ndarray, np.ndarray]], width: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, grads)`` chunks summed into sorted unique ids, each row once."""
    if not chunks:
        return np.empty(0, np.int64), np.empty((0, width), DTYPE)
    ids = np.concatenate([i for i, _ in chunks])
    unique = unique_rows(ids)
    grads = np.concatenate([np.asarray(g, DTYPE).reshape(len(i), width) for i, g in chunks])
    return unique, scatter_sum(positions(unique, ids), grads, len(unique))


class AccruingReplica:
    """One sparse replica's state under the ``n_fetch``/``n_push`` schedule (module docstring).

    Parameters
    ----------
    model : SparseModel
    layout : SparseLayout
    batches : iterator of SparseBatch
        The replica's batches, from the step it starts at.
    replica : int
    n_fetch, n_push : int
        Steps per fetch and per push (>= 1).
    alpha : float
        The local learning rate between fetches.
    start_step : int
        The first step's number (a restarted replica continues after the steps it pushed).
    max_steps : int, optional
        The step number to stop before (absolute, not counted from ``start_step``).
    started : float, optional
        Wall-clock start of the fit; record times are relative to it.
    records : list, optional
        Where push records go as they come.
    acked : callable, optional
        ``acked(shard, version)`` for every accepted push.
    """

    def __init__(self, model: Any, layout: SparseLayout, batches: Iterator[SparseBatch],
                 replica: int, n_fetch: int, n_push: int, alpha: float, start_step: int = 0,
                 max_steps: int | None = None, started: float | None = None,
                 records: list[dict[str, Any]] | None = None,
                 acked: Callable[[int, int], None] | None = None):
        self.model, self.layout, self.batches = model, layout, iter(batches)
        self.replica, self.n_fetch, self.n_push, self.alpha = replica, n_fetch, n_push, alpha
        self.step, self.max_steps, self.acked = start_step, max_steps, acked
        self.started = time.time() if started is None else started
        self.records = [] if records is None else records
        self.widths = [int(spec.width) for spec in layout.specs]
        self.ahead: deque[SparseBatch] = deque()  # fetched for, not trained yet
        self.pushed_steps = 0  # steps since the last push
        self.accrued = np.zeros(model.n_dense, DTYPE)
        self.accrued_rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.widths]
        self.loss_sum, self.examples = 0.0, 0
        self.base_versions = [0] * layout.n_shards  # versions the accrual started from
        self.versions = [0] * layout.n_shards  # of the last fetch
        self.pulled = [0] * layout.n_shards  # bytes pulled since the last push, per shard
        self.stop = False
        #: Rows each fetch pulled (all shards together), for counting traffic.
        self.fetched_rows: list[int] = []
        self.dense: np.ndarray | None = None
        self.local: list[tuple[np.ndarray, np.ndarray]] = []

    # -- the loop --------------------------------------------------------------------------------
    def run(self, links: Sequence[RowsLink]) -> list[dict[str, Any]]:
        """Train until the batches end, ``max_steps`` or a shard's stop flag, over ``links``
        (fresh links: their pushes are numbered from 0); the records."""
        seq = 0
        pipelined = all(link.transport != "actor" for link in links)
        pending = None  # a fetch sent right behind the last push
        self.dense = None  # fresh links: fetch again (the rows of the batches still ahead too)
        while not self.stop:
            if pending is not None or not self.ahead or self.dense is None:
                if pending is None:
                    pending = self._start_fetch(links)
                if pending is None:
                    break  # no batch left
                self._finish_fetch(links, *pending)
                pending = None
                if self.stop:
                    break
            self._train(self.ahead.popleft())
            if self.pushed_steps == self.n_push:
                follow = pipelined and not self.ahead and not self.stop
                sent = self._send_push(links, seq)
                seq += 1
                if follow:  # the next fetch goes right behind the push: one round trip
                    pending = self._start_fetch(links)
                self._finish_push(links, sent)
        if self.pushed_steps:
            self._finish_push(links, self._send_push(links, seq))
        if pending is not None:  # a stop came with the push: let the fetch finish
            for link, call in zip(links, pending[1]):
                link.wait(call)
        return self.records

    def _limit(self) -> bool:
        return self.max_steps is not None and self.step + len(self.ahead) >= self.max_steps

    # -- fetching --------------------------------------------------------------------------------
    def _start_fetch(self, links: Sequence[RowsLink]) -> tuple[list, list] | None:
        """Look ahead ``n_fetch`` batches and start pulling the union of their rows."""
        while len(self.ahead) < self.n_fetch and not self._limit():
            batch = next(self.batches, None)
            if batch is None:
                break
            self.ahead.append(batch)
        if not self.ahead:
            return None
        per_batch = [self.model.touched(b) for b in self.ahead]
        touched = [unique_rows(np.concatenate([t[i] for t in per_batch]))
                   for i in range(len(self.widths))]
        parts = self.layout.split(touched)
        self.fetched_rows.append(sum(len(ids) for ids in touched))
        return [touched, parts], [link.pull(p) for link, p in zip(links, parts)]

    def _finish_fetch(self, links: Sequence[RowsLink], wanted: list, calls: list) -> None:
        """Install the fetched values as the local copy, minus ``alpha`` times the accrued
        gradient not pushed yet."""
        touched, parts = wanted
        replies = [link.wait(call) for link, call in zip(links, calls)]
        self.dense = np.concatenate([r.pull.values for r in replies]).astype(DTYPE, copy=True)
        self.local = [(ids, np.concatenate([r.rows[t] for r in replies]).astype(DTYPE, copy=True))
                      for t, ids in enumerate(touched)]
        for s, reply in enumerate(replies):
            self.versions[s] = int(reply.pull.version)
            self.pulled[s] += (sum(8 * len(p) for p in parts[s]) + reply.pull.values.nbytes
                               + sum(r.nbytes for r in reply.rows))
            self.stop = self.stop or bool(reply.pull.stop)
        if self.pushed_steps and self.alpha:
            self.dense -= DTYPE(self.alpha) * self.accrued
            for t, (ids, values) in enumerate(self.local):
                acc_ids, acc = merge_rows(self.accrued_rows[t], self.widths[t])
                here = np.isin(acc_ids, ids)
                values[positions(ids, acc_ids[here])] -= DTYPE(self.alpha) * acc[here]

    # -- training --------------------------------------------------------------------------------
    def _train(self, batch: SparseBatch) -> None:
        """One step on ``batch`` at the local copy: accrue its gradients, take the local step."""
        assert self.dense is not None
        if self.pushed_steps == 0:
            self.base_versions = list(self.versions)
        touched = self.model.touched(batch)
        where = [positions(ids, t) for (ids, _), t in zip(self.local, touched)]
        rows = [(t, values[w]) for (_, values), t, w in zip(self.local, touched, where)]
        loss, grad, row_grads = self.model.loss_and_grad(self.dense, rows, batch)
        grad = np.asarray(grad, DTYPE)
        self.accrued += grad
        for t, (ids, g) in enumerate(row_grads):
            # (copies: a model may hand out the same workspace at every step)
            self.accrued_rows[t].append((np.array(ids, np.int64), np.array(g, DTYPE)))
        if math.isfinite(loss) and self.alpha:  # a diverged step is not applied locally
            rate = DTYPE(self.alpha)
            self.dense -= rate * grad
            for (_, values), w, (_, g) in zip(self.local, where, row_grads):
                values[w] -= rate * np.asarray(g, DTYPE)
        self.loss_sum += float(loss)
        self.examples += len(batch.y)
        self.pushed_steps += 1
        self.step += 1

    # -- pushing ---------------------------------------------------------------------------------
    def _send_push(self, links: Sequence[RowsLink], seq: int) -> tuple:
        """Start pushing the accrued gradient (each touched row once) to every shard."""
        merged = [merge_rows(chunks, w) for chunks, w in zip(self.accrued_rows, self.widths)]
        parts = self.layout.split([ids for ids, _ in merged])
        loss = self.loss_sum / self.pushed_steps
        sent = []
        for s, link in enumerate(links):
            lo, hi = self.layout.dense[s]
            pushes = []
            for t, (ids, g) in enumerate(merged):
                first = int(np.searchsorted(ids, parts[s][t][0])) if len(parts[s][t]) else 0
                pushes.append((parts[s][t], g[first : first + len(parts[s][t])]))
            call = link.push(self.accrued[lo:hi].copy(), pushes, self.base_versions[s], seq,
                             self.examples, loss)
            moved = 4 * (hi - lo) + sum(8 * len(i) + g.nbytes for i, g in pushes)
            sent.append((call, pushes, moved + self.pulled[s]))
            self.pulled[s] = 0
        pushed = (sent, self.step - 1, loss, self.examples, seq)
        self.accrued[:] = 0
        self.accrued_rows = [[] for _ in self.widths]
        self.loss_sum, self.examples, self.pushed_steps = 0.0, 0, 0
        return pushed

    def _finish_push(self, links: Sequence[RowsLink], pushed: tuple) -> None:
        """Wait for a push's replies and record it."""
        sent, step, loss, examples, seq = pushed
        for s, reply in push_replies(links, [call for call, _, _ in sent]):
            link, (_, pushes, moved) = links[s], sent[s]
            self.stop = self.stop or bool(reply.stop)
            self.records.append({
                "time": time.time() - self.started, "replica": self.replica, "step": step,
                "shard": s, "loss": loss if math.isfinite(loss) else math.nan,
                "examples": examples, "staleness": reply.staleness,
                "version": reply.version, "accepted": reply.accepted,
                "rows": sum(len(i) for i, _ in pushes), "bytes": moved,
                "generation": link.generation,
                "seq": seq, "session": link.session,  # (see sparse_replicas)
                "transport": link.transport,
            })
            if self.acked is not None and reply.accepted:
                self.acked(s, reply.version)
