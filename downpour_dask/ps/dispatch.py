"""What a checked direct-wire request does on its shard: :func:`call`.

:class:`~downpour_dask.ps.service.ShardService` reads and checks a request (head, session,
gradient); this module makes the shard call the request names and encodes its reply
(:mod:`~downpour_dask.ps.frames`).  Imports no Dask.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import frames
from .frames import EXCHANGE, POLL_WARMSTART, PULL, PUSH


def call(
    shard: Any,
    op: int,
    grad: np.ndarray,
    out: np.ndarray,
    replica: int,
    session: str,
    head: bytearray,
) -> bytes:
    """Make the checked request ``head``'s call on ``shard``; its reply but the pulled values
    (which are left in ``out``)."""
    _, _, seq, fetched, examples, loss, _, _ = frames.REQUEST.unpack(head)
    parts = [frames.OK]
    op = frames.SPARSE.get(op, op)  # a sparse push's gradient is a SparseGradient
    if op in (PUSH, EXCHANGE):
        kw = dict(seq=None if seq < 0 else seq, session=session, examples=examples, loss=loss)
        parts.append(frames.pushed(shard.apply_push(grad, fetched, replica, **kw)))
    if op == POLL_WARMSTART:
        parts.append(frames.polled(shard.warmstart_state()))
    if op in (PULL, EXCHANGE):
        parts.append(frames.pulled(shard.snapshot_into(out, replica, session)))
    return b"".join(parts)
