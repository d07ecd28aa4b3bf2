"""A replica's direct connection to a sparse shard: rows pulls and pushes over the wire.

:class:`RowsWireClient` is a :class:`~downpour_dask.ps.wire.WireClient` (same hello, secret,
sender and receiver threads, failure handling) that also sends the two ops of
:mod:`~downpour_dask.ps.rows_frames`, with the signatures of
:class:`~downpour_dask.ps.table.SparseShard`'s actor methods, so
:class:`~downpour_dask.ps.rows.RowsLink` uses it in place of the actor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import frames, rows_frames
from .rows_frames import PULL_ROWS, PUSH_ROWS, ROWS_OPS
from .table import RowsReply
from .wire import WireCall, WireClient


class RowsWireClient(WireClient):
    """A direct connection to one :class:`~downpour_dask.ps.table.SparseShard` with
    ``n_tables`` tables (see :class:`~downpour_dask.ps.wire.WireClient` for the arguments)."""

    offers_slots = False  # its rows ops carry payloads of their own size, not the shard's

    def __init__(self, endpoint: tuple[str, int, str], n_tables: int, timeout: float = 10.0,
                 secret: bytes = b""):
        self.n_tables = n_tables
        super().__init__(endpoint, timeout, secret)

    def pull_rows(self, requests: Sequence[np.ndarray], replica: int = -1,
                  session: str = "") -> WireCall:
        """Pull the dense slice and the rows ``requests[t]`` of each table."""
        payload = rows_frames.pull_payload(requests)
        return self._rows(PULL_ROWS, payload, 0, replica, session=session)

    def push_rows(self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
                  fetched_version: int, replica: int, **kw: Any) -> WireCall:
        """Push the dense gradient and ``(ids, grads)`` per table as one update."""
        payload = rows_frames.push_payload(grad, pushes)
        return self._rows(PUSH_ROWS, payload, fetched_version, replica, **kw)

    def _rows(self, op: int, payload: bytes, fetched: int, replica: int, **fields: Any) -> WireCall:
        call = self._call(op)
        head = frames.request(op, replica, fetched, len(payload), **fields)
        with self._send_lock:  # the order of _waiting is the order of the requests sent
            if self._broken is not None:
                call._finish(error=self._broken)
                return call
            self._waiting.put(call)
            self._queue(head, payload)
        return call

    def _read(self, call: WireCall) -> Any:
        if call.op not in ROWS_OPS:
            return super()._read(call)
        reply = rows_frames.read_reply(self._sock, call.op, self.n_tables)
        return reply if call.op == PUSH_ROWS else RowsReply(*reply)
