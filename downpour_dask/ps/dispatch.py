"""What each request of a direct connection calls on its shard (the shard's side of
:mod:`~downpour_dask.ps.wire`; :mod:`~downpour_dask.ps.service` reads the requests): the
checks of a request head, reading what follows it, and the call.  The ops of
:mod:`~downpour_dask.ps.frames` carry a shard-sized dense vector (or, for a top-k push, its
(indices, values)); those of
:mod:`~downpour_dask.ps.rows_frames` (sparse tables) a payload of a declared size.

This module does not import Dask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import frames, rows_frames
from .frames import EXCHANGE, POLL_WARMSTART, PULL, PUSH
from .protocol import PullReply
from .rows_frames import ROWS_OPS
from .shared_slots import SlotArea


def check_request(
    size: int, op: int, replica: int, seq: int, fetched: int, examples: int, n_values: int,
    n_session: int,
) -> str | None:
    """What is wrong with a request head, or None (:func:`frames.check_request`; for a rows
    op the value count is its payload's size in bytes)."""
    if op in ROWS_OPS:
        problem = rows_frames.check_rows_request(op, n_values)
        n_values, op = 0, PULL  # the other fields are checked as a pull's
        if problem is not None:
            return problem
    return frames.check_request(size, op, replica, seq, fetched, examples, n_values, n_session)


def read_payload(conn: Any, op: int, n_values: int, size: int, grad: np.ndarray) -> Any:
    """Read what follows a checked head: a dense gradient into ``grad`` (returned), a top-k
    push's (indices, values) (:func:`frames.recv_sparse`), or a rows payload of ``n_values``
    bytes."""
    if op in frames.SPARSE:
        return frames.recv_sparse(conn, n_values, size, grad)
    if op in ROWS_OPS:
        payload = bytearray(n_values)
        frames.recv_into(conn, payload)
        return payload
    if n_values:
        frames.recv_into(conn, grad)
    return grad


def answer_share(conn: Any, size: int) -> SlotArea | None:
    """Read a :data:`~frames.SHARE` request's area and answer whether it was mapped (see
    :mod:`~downpour_dask.ps.shared_slots`); the mapped area, or None."""
    pid, fd, n_slots, token = frames.SHARE_AREA.unpack(frames.recv(conn, frames.SHARE_AREA.size))
    area = SlotArea.attach(pid, fd, token, size, n_slots) if size else None
    conn.sendall(frames.OK + frames.SHARED.pack(area is not None))
    return area


def read_slot(conn: Any, area: SlotArea | None) -> tuple[np.ndarray | None, str | None]:
    """Read a slotted request's slot index: the slot, or what is wrong with the request."""
    (i,) = frames.SLOT.unpack(frames.recv(conn, frames.SLOT.size))
    if area is None:
        return None, "a slot op on a connection whose shared area was not mapped"
    if i >= area.n_slots:
        return None, f"slot {i} is outside the shared area's {area.n_slots} slots"
    return area.slot(i), None


class Reply(NamedTuple):
    """A request's answer as :func:`call_shard` leaves it: ``head``, the bytes still to send,
    then, for a pull, the pulled values' bytes from ``values_from`` on (of the caller's
    ``out``; None: no values follow)."""

    head: bytes
    values_from: int | None = None


def call_shard(
    conn: Any,
    shard: Any,
    op: int,
    grad: np.ndarray,
    out: np.ndarray,
    replica: int,
    session: str,
    head: bytearray,
    into: np.ndarray | None = None,
) -> Reply:
    """Make the checked request ``head``'s call on ``shard``.  A pull's answer starts on
    ``conn`` straight from the shard's values, as far as the connection takes it without
    waiting (:meth:`~downpour_dask.ps.shard.ParameterServerShard.snapshot_through`); what
    remains to send is returned.  With ``into`` (a shared slot), a pull's values are copied
    there instead and only the head is left to send."""
    if op in ROWS_OPS:
        return Reply(rows_frames.answer(shard, op, grad, replica, session, head))
    _, _, seq, fetched, examples, loss, _, _ = frames.REQUEST.unpack(head)
    parts = [frames.OK]
    op = frames.SPARSE.get(op, op)  # a top-k push's gradient is a SparseGradient
    if op in (PUSH, EXCHANGE):
        kw = dict(seq=None if seq < 0 else seq, session=session, examples=examples, loss=loss)
        parts.append(frames.pushed(shard.apply_push(grad, fetched, replica, **kw)))
    if op == POLL_WARMSTART:
        parts.append(frames.polled(shard.warmstart_state()))
    if op not in (PULL, EXCHANGE):
        return Reply(b"".join(parts))
    unsent = b""
    if into is not None:

        def fill(live: PullReply) -> int:  # under the shard's lock
            nonlocal unsent
            np.copyto(into, live.values)
            unsent = b"".join(parts) + frames.pulled(live)
            return into.nbytes

        shard.snapshot_through(fill, out, replica, session)
        return Reply(unsent)

    def send(live: PullReply) -> int:  # under the shard's lock: must not wait
        nonlocal unsent
        reply = b"".join(parts) + frames.pulled(live)
        taken = frames.send_now(conn, [reply, live.values])
        unsent = reply[taken:]
        return max(0, taken - len(reply))

    _, values_from = shard.snapshot_through(send, out, replica, session)
    return Reply(unsent, values_from)
