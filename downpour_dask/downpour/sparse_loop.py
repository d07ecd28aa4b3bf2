"""A replica of a sparse model: pull only the rows the next batch touches, push only theirs.

Each step of :func:`run_sparse_replica` asks the model which rows its batch touches
(deduplicated, per table), pulls the dense slices and those rows from every shard (the calls to
all shards start before the replica waits for any), computes the loss and gradients and pushes
to each shard its dense slice of the gradient plus ``(row ids, row gradients)`` of the rows it
owns.  Every push is recorded as the dense loop records them (``time``, ``replica``, ``step``,
``shard``, ``loss``, ``examples``, ``staleness``, ``version``, ``accepted``) with the rows it
carried and the bytes the step moved to and from that shard (ids, values, dense slice), so the
traffic is seen to follow the rows touched rather than the table.

This is the schedule ``n_fetch = n_push = 1`` (others: :mod:`.sparse_accrual`) that the
reference test checks against
:func:`~downpour_dask.core.sparse_serial.serial_train`: every pull sees the replica's previous
push.  Over local calls and direct connections, which a shard serves in the order sent, the
next batch's pull is sent right behind the push, so a step costs one round trip.  The links are
:class:`~downpour_dask.ps.rows.RowsLink` objects, so the loop runs in-process against shard
objects as well as against actors on a cluster.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..core.params import DTYPE
from ..core.sparse import SparseBatch
from ..ps.protocol import ShardLostError
from ..ps.rows import RowsLink, SparseLayout


def push_replies(links: Sequence[RowsLink], calls: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """``(shard, reply)`` for each answered call of one push (one call per link, in order),
    then the first :class:`~downpour_dask.ps.protocol.ShardLostError` if a shard was lost.

    Every shard's reply is awaited before a loss is raised: the shards that applied the push
    are recorded as having done so, and the replica, which goes on after the last step it
    recorded, does not push that step to them again (it would be applied twice: the new
    links after a loss start fresh push sessions, which a shard cannot match to the old)."""
    lost: ShardLostError | None = None
    for s, (link, call) in enumerate(zip(links, calls)):
        try:
            reply = link.wait(call)
        except ShardLostError as err:
            lost = lost or err
            continue
        yield s, reply
    if lost is not None:
        raise lost


def _pull_bytes(parts: Sequence[np.ndarray], reply: Any) -> int:
    ids = sum(8 * len(p) for p in parts)
    return ids + reply.pull.values.nbytes + sum(r.nbytes for r in reply.rows)


def run_sparse_replica(
    model: Any,
    links: Sequence[RowsLink],
    layout: SparseLayout,
    batches: Iterable[SparseBatch],
    replica: int = 0,
    max_steps: int | None = None,
    started: float | None = None,
    start_step: int = 0,
    records: list[dict[str, Any]] | None = None,
    first_seq: int | None = None,
    acked: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Train on ``batches`` until they end, ``max_steps`` steps or a shard's stop flag.

    Steps (and the pushes' numbers, by which a shard ignores a push delivered twice) count on
    from ``start_step``, for links that already pushed.  Returns one record per push (see the
    module docstring).  ``records``: a list to append them to as they come (a caller keeps
    them when a lost shard interrupts the loop); ``first_seq``: the first push's number when
    it differs from ``start_step`` (fresh links after a shard was replaced start at 0);
    ``acked(shard, version)`` is called for every accepted push (the dense path's note of what
    each shard acknowledged, for shard recovery's accounting).
    """
    started = time.time() if started is None else started
    records = [] if records is None else records
    seq_offset = 0 if first_seq is None else first_seq - start_step
    batches = iter(batches)
    batch = next(batches, None)
    if batch is None or max_steps == 0:
        return records
    # Over local calls and direct connections a shard answers a replica's calls in the order
    # sent, so the next pull may follow the push at once (one round trip per step, not two);
    # actor messages may overtake each other, so there the pull waits for the push's reply.
    pipelined = all(link.transport != "actor" for link in links)
    touched = model.touched(batch)
    parts = layout.split(touched)
    pulls = [link.pull(p) for link, p in zip(links, parts)]
    step = start_step
    while True:
        replies = [link.wait(call) for link, call in zip(links, pulls)]
        dense = np.concatenate([r.pull.values for r in replies]).astype(DTYPE, copy=False)
        rows = [(ids, np.concatenate([r.rows[t] for r in replies]))
                for t, ids in enumerate(touched)]
        loss, grad, row_grads = model.loss_and_grad(dense, rows, batch)
        grad = np.asarray(grad, DTYPE)
        sent = []
        for s, link in enumerate(links):
            lo, hi = layout.dense[s]
            pushes = []
            for t, (ids, g) in enumerate(row_grads):
                first = int(np.searchsorted(ids, parts[s][t][0])) if len(parts[s][t]) else 0
                pushes.append((parts[s][t], np.asarray(g[first : first + len(parts[s][t])], DTYPE)))
            call = link.push(grad[lo:hi], pushes, replies[s].pull.version, step + seq_offset,
                             len(batch.y), float(loss))
            sent.append((call, pushes))
        pulled = [_pull_bytes(p, r) for p, r in zip(parts, replies)]
        examples = len(batch.y)
        step += 1
        done = max_steps is not None and step - start_step >= max_steps
        batch = None if done else next(batches, None)
        if batch is not None:
            touched = model.touched(batch)
            parts = layout.split(touched)
            if pipelined:
                pulls = [link.pull(p) for link, p in zip(links, parts)]
        stop = False
        for s, reply in push_replies(links, [call for call, _ in sent]):
            link, pushes = links[s], sent[s][1]
            stop = stop or reply.stop
            lo, hi = layout.dense[s]
            moved = 4 * (hi - lo) + sum(8 * len(i) + g.nbytes for i, g in pushes)
            records.append({
                "time": time.time() - started, "replica": replica, "step": step - 1,
                "shard": s, "loss": float(loss) if math.isfinite(loss) else math.nan,
                "examples": examples, "staleness": reply.staleness,
                "version": reply.version, "accepted": reply.accepted,
                "rows": sum(len(i) for i, _ in pushes), "bytes": moved + pulled[s],
                "generation": link.generation,
                "seq": step - 1 + seq_offset, "session": link.session,  # (see sparse_replicas)
                "transport": link.transport,
            })
            if acked is not None and reply.accepted:
                acked(s, reply.version)
        if batch is None or stop:
            if pipelined and batch is not None:
                for link, call in zip(links, pulls):  # let the pull started ahead finish
                    link.wait(call)
            return records
        if not pipelined:
            pulls = [link.pull(p) for link, p in zip(links, parts)]
