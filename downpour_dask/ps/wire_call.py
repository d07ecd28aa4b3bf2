"""A request's reply to come over a direct connection (:mod:`~downpour_dask.ps.wire`).

:class:`WireCall` is used like Dask's ``ActorFuture`` -- ``done()``, ``result(timeout)`` -- so a
replica waits for a direct call as for an actor call.  Either a receiver thread completes it
(the connection's values arrive on its socket, read while the replica computes), or the call
reads the replies that have arrived itself when asked (a connection through shared slots,
whose replies are heads of a few dozen bytes: reading them costs less than waking a thread).

This module does not import Dask.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import numpy as np


class ReplyReader(Protocol):
    """A connection whose calls read its replies (``wait``: seconds to wait for the first,
    None: as long as it takes)."""

    def read_arrived(self, wait: float | None) -> None: ...


class WireCall:
    """One request's reply to come, used like Dask's ``ActorFuture``: ``done()``, ``result()``.

    A call of a connection without a receiver thread (``reader``: the connection) reads the
    replies that have arrived itself when asked whether it is done or for its result."""

    __slots__ = ("_event", "_value", "_error", "op", "out", "slot", "reader")

    def __init__(self, op: int, out: np.ndarray | None = None, reader: ReplyReader | None = None):
        self.op, self.out = op, out  # out: where pulled values go (default: a new array)
        self.slot: int | None = None  # the shared slot its arrays go through, if any
        self.reader = reader
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        if not self._event.is_set() and self.reader is not None:
            self.reader.read_arrived(0.0)
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if self.reader is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._event.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.reader.read_arrived(left)
        if not self._event.wait(0 if self.reader is not None else timeout):
            raise TimeoutError(f"no reply from the shard within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()
