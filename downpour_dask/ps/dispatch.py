"""What each request of a direct connection calls on its shard (the shard's side of
:mod:`~downpour_dask.ps.wire`; :mod:`~downpour_dask.ps.service` reads and checks the requests).

This module does not import Dask.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import frames
from .frames import EXCHANGE, POLL_WARMSTART, PULL, PUSH


def call_shard(
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
    if op in (PUSH, EXCHANGE):
        kw = dict(seq=None if seq < 0 else seq, session=session, examples=examples, loss=loss)
        parts.append(frames.pushed(shard.apply_push(grad, fetched, replica, **kw)))
    if op == POLL_WARMSTART:
        parts.append(frames.polled(shard.warmstart_state()))
    if op in (PULL, EXCHANGE):
        parts.append(frames.pulled(shard.snapshot_into(out, replica, session)))
    return b"".join(parts)
