"""A direct socket path between replicas and parameter-server shards on other workers.

Why: a Dask actor call is a general message.  The caller's event loop frames and pickles it,
the shard's event loop reads, unpickles and dispatches it, and the reply goes back the same way;
each of those steps costs CPU in both processes, which on a small machine is taken from the
gradients.  This path carries exactly the calls a replica makes with their arrays as raw bytes
(``benchmarks/bench_transfer.py`` compares the two).  Dask still does everything else: it
places the shards, starts, supervises and replaces them, and the driver's own calls (status,
evaluation pulls, checkpoints) stay actor calls.

The calls are ``pull``, ``push``, ``exchange``, and ``poll_warmstart`` while a replica waits for
replica 0's warmstart; :mod:`~downpour_dask.ps.frames` defines their bytes.

- Each worker process holding shards runs one :class:`~downpour_dask.ps.service.ShardService`
  (:mod:`~downpour_dask.ps.service`, which also says what it guards against): a listening TCP
  socket on the worker's own host and one thread per accepted connection.  A shard registers
  with it under the run's secret and gets a random id; the id and the secret, sent first on
  every connection (the *hello*), select the shard and prove the connection is from the run.
- A replica opens one :class:`WireClient` per remote shard.  Requests whose arrays go on the
  socket are written by a sender thread, so the replica computes on meanwhile; a receiver thread
  reads the replies, which come back in request order, and completes the
  :class:`~downpour_dask.ps.wire_call.WireCall` of each.  One connection per (replica, shard)
  also keeps a replica's pushes in order on the shard without any waiting.
- A lost shard or worker closes the connection: every call in flight fails with
  ``ConnectionError`` (an ``OSError``), which the replica treats like a lost actor.
- A shard on the replica's own host maps a few slots of the replica's memory
  (:mod:`~downpour_dask.ps.shared_slots`): a push's gradient and a pull's values then go
  through a slot, and only the heads through the socket.  The replica's thread then writes
  such a request itself and its calls read their replies when asked: waking a helper thread
  for a head of a few dozen bytes costs more than the work (measured in
  ``benchmarks/README.md``).

The path is used only where Dask's own comm is plain TCP (a TLS cluster keeps actor messages)
and the replica's connection succeeds; otherwise the replica calls the actor as before.  Unlike
Dask's plain TCP comm it is authenticated by the per-run secret (sent in clear: it keeps out
processes that are not in the run, not an eavesdropper on the network; use TLS for that, which
keeps every call on Dask's comm).  This module does not import Dask.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import select
import socket
import struct
import threading
from typing import Any

import numpy as np

from ..core.compression import INDEX, SparseGradient
from ..core.params import DTYPE
from ..runtime.cpus import helper_thread
from . import frames, shared_slots
from .frames import (
    EXCHANGE,
    EXCHANGE_SPARSE,
    POLL_WARMSTART,
    PULL,
    PUSH,
    PUSH_SPARSE,
    WireError,
)
from .service import ShardService, serve, unregister
from .shared_slots import SlotArea
from .wire_call import WireCall

#: The op that carries each dense op's array in a shared slot.
_IN_SLOT = {dense: slotted for slotted, dense in frames.SLOTTED.items()}

__all__ = ["ShardService", "WireCall", "WireClient", "WireError", "serve", "unregister"]


# -- the replica's side ------------------------------------------------------------------------
class WireClient:
    """A replica's connection to one shard on another worker.

    Offers the shard's replica-facing calls with the actor's signatures -- ``pull``, ``push``,
    ``exchange`` -- each returning a :class:`WireCall` at once.

    Parameters
    ----------
    endpoint : (host, port, shard id)
        From the shard's ``open_wire()``.
    timeout : float
        Seconds to connect and to hear the shard accept the hello.
    secret : bytes
        The run's wire secret the shard was registered with (see
        :func:`~downpour_dask.ps.service.serve`).

    Attributes
    ----------
    shared : bool
        Whether the shard mapped this connection's shared slots (it runs on this host).
    """

    #: Whether to offer the shard shared slots (a subclass whose ops carry no dense arrays
    #: does not).
    offers_slots = True

    def __init__(self, endpoint: tuple[str, int, str], timeout: float = 10.0, secret: bytes = b""):
        # no timeout once connected: replies may be slow; the replica has its own deadlines
        self._sock, self.size = frames.connect(endpoint, secret, timeout)
        self._area: SlotArea | None = None
        if self.offers_slots and self.size and shared_slots.available():
            try:
                self._area = self._share(timeout)
            except BaseException:
                self._sock.close()
                raise
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[bytes, Any] | None] = queue.SimpleQueue()
        self._queued = 0  # requests handed to the sender thread and not sent yet
        self._waiting: queue.SimpleQueue[WireCall | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        helper_thread(self._send, "downpour-wire-replica").start()
        # Replies through shared slots are heads of a few dozen bytes: the calls read them
        # (read_arrived), which costs less than a thread woken for each.  Values on the socket
        # are read by a receiver thread while the replica computes.
        self._reads_itself = self._area is not None
        if not self._reads_itself:
            helper_thread(self._receive, "downpour-wire-replica").start()
        else:
            self._read_lock = threading.Lock()
            self._poller = select.poll()
            self._poller.register(self._sock, select.POLLIN)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, frames.timeval(timeout))

    @property
    def shared(self) -> bool:
        return self._area is not None

    def _share(self, timeout: float) -> SlotArea | None:
        """Offer the shard a new area of slots; the area if it mapped it (see
        :mod:`~downpour_dask.ps.shared_slots`)."""
        try:
            area = SlotArea.create(self.size, shared_slots.slots_for(self.size))
        except OSError:  # no memory file to be had (e.g. out of descriptors): stay inline
            return None
        try:
            offer = frames.SHARE_AREA.pack(os.getpid(), area.fd, area.n_slots, area.token)
            self._sock.settimeout(timeout)
            self._sock.sendall(frames.request(frames.SHARE, -1, 0, 0) + offer)
            frames.check_status(self._sock)
            (mapped,) = frames.SHARED.unpack(frames.recv(self._sock, frames.SHARED.size))
            self._sock.settimeout(None)
        finally:
            area.release_fd()
        if not mapped:
            area.close()
        return area if mapped else None

    # -- the calls, with the actor methods' signatures --------------------------------------------
    def pull(
        self, replica: int = -1, session: str = "", *, out: np.ndarray | None = None
    ) -> WireCall:
        """Pull the shard's values: into ``out`` if given (a buffer the caller does not touch
        until the reply is in), else into a new array."""
        return self._request(PULL, None, 0, replica, session=session, out=out)

    def push(self, grad: Any, fetched_version: int, replica: int, **kw: Any) -> WireCall:
        op = PUSH_SPARSE if isinstance(grad, SparseGradient) else PUSH
        return self._request(op, grad, fetched_version, replica, **kw)

    def exchange(self, grad: Any, fetched_version: int, replica: int, **kw: Any) -> WireCall:
        op = EXCHANGE_SPARSE if isinstance(grad, SparseGradient) else EXCHANGE
        return self._request(op, grad, fetched_version, replica, **kw)

    def poll_warmstart(self) -> WireCall:
        return self._request(POLL_WARMSTART, None, 0, -1)

    def close(self) -> None:
        """Close the connection; calls still waiting fail with ``ConnectionError``."""
        self._fail(ConnectionError("the connection to the shard was closed"))
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._waiting.put(None)

    # -- internals -------------------------------------------------------------------------------
    def _request(
        self,
        op: int,
        grad: np.ndarray | None,
        fetched_version: int,
        replica: int,
        *,
        out: np.ndarray | None = None,
        **fields: Any,
    ) -> WireCall:
        """Send one request (``fields``: seq, session, examples, loss; see
        :func:`~downpour_dask.ps.frames.request`) and return its call at once."""
        if out is not None and (out.dtype != DTYPE or out.shape != (self.size,)):
            raise ValueError(f"out must be a float32 array of shape ({self.size},)")
        call = self._call(op, out)
        body: Any = grad
        if isinstance(grad, SparseGradient):  # k indices, then k values (see frames.py)
            body = _sparse_body(grad, self.size)
        elif grad is not None and (
            grad.dtype != DTYPE or grad.shape != (self.size,) or not grad.flags.c_contiguous
        ):
            raise ValueError(
                f"the shard owns {self.size} float32 parameters: a gradient must be a contiguous "
                f"float32 array of shape ({self.size},), got shape {grad.shape}, dtype "
                f"{grad.dtype}"
            )
        n_values = 0 if grad is None else len(body[0]) if isinstance(body, tuple) else self.size
        slot = self._area.take() if self._area is not None and op in _IN_SLOT else None
        if slot is not None:  # the array goes into the slot (this call's alone), not the socket
            call.op, call.slot = _IN_SLOT[op], slot
            if body is not None:
                np.copyto(self._area.slot(slot), body)
                body = None
        head = frames.request(call.op, replica, fetched_version, n_values, **fields)
        if slot is not None:
            head += frames.SLOT.pack(slot)
        with self._send_lock:  # the order of _waiting is the order of the requests sent
            if self._broken is not None:
                call._finish(error=self._broken)
                return call
            self._waiting.put(call)
            if slot is None or self._queued:
                self._queue(head, body)
            else:
                self._send_now(head)
        return call

    def _call(self, op: int, out: np.ndarray | None = None) -> WireCall:
        """A new call of this connection (which its calls read the replies of, or not)."""
        return WireCall(op, out, self if self._reads_itself else None)

    def _queue(self, head: bytes, body: Any) -> None:
        """Hand a request to the sender thread (the caller holds ``_send_lock``)."""
        self._queued += 1
        self._outbox.put((head, body))

    def _send_now(self, head: bytes) -> None:
        """Send the head of a request whose array is in its slot from the calling thread, with
        the sender thread idle (the caller holds ``_send_lock``): a few dozen bytes cost less
        than waking the sender thread.  What the socket does not take at once (a stalled shard)
        goes to the sender thread, so the caller never blocks."""
        try:
            sent = self._sock.send(head, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            self._sending_failed(err)
            return
        if sent < len(head):
            self._queue(head[sent:], None)

    def _sending_failed(self, err: OSError) -> None:
        """Fail the connection: its calls, and the reading of replies (the socket shut)."""
        self._fail(ConnectionError(f"sending to the shard failed: {err}"))
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _send(self) -> None:
        """Write the requests in order (sender thread), so that the replica's thread computes
        on while a gradient is copied into the socket.  The replica leaves a pushed gradient
        untouched until its reply has arrived, which is after it was sent."""
        while True:
            item = self._outbox.get()
            if item is None:
                return
            head, grad = item
            try:
                self._sock.sendall(head)
                for part in (
                    grad if isinstance(grad, tuple) else (grad,) if grad is not None else ()
                ):
                    self._sock.sendall(part)
            except OSError as err:
                self._sending_failed(err)
                return
            with self._send_lock:
                self._queued -= 1

    def _receive(self) -> None:
        """Read the replies in request order and complete each call (receiver thread)."""
        while True:
            call = self._waiting.get()
            if call is None or not self._complete(call):
                return

    def _complete(self, call: WireCall) -> bool:
        """Read ``call``'s reply and complete it; False if the connection was lost."""
        try:
            call._finish(self._read(call))
        except WireError as err:
            call._finish(error=err)
        except (OSError, ValueError, struct.error) as err:
            error = ConnectionError(f"lost the connection to the shard: {err}")
            call._finish(error=error)
            self._fail(error)
            return False
        return True

    def read_arrived(self, wait: float | None) -> None:
        """Read the replies that have arrived, waiting up to ``wait`` seconds (None: as long as
        it takes) for the first, and complete their calls (a connection without a receiver
        thread: its :class:`WireCall` calls this).  Once a reply has begun, the rest must come
        within the connection's timeout (``SO_RCVTIMEO``): a shard stopped mid-reply loses the
        connection."""
        if not self._read_lock.acquire(timeout=-1 if wait is None else wait):
            return  # another thread is reading
        try:
            while self._broken is None:
                ms = -1 if wait is None else math.ceil(wait * 1000)  # (no spin under 1 ms)
                if not self._poller.poll(ms):
                    return
                wait = 0.0  # then only what has arrived
                call = self._waiting.get_nowait() if not self._waiting.empty() else None
                if call is None:  # nothing asked: the shard closed, or broke the protocol
                    self._fail(ConnectionError("the shard closed the connection"))
                    return
                if not self._complete(call):
                    return
        finally:
            self._read_lock.release()

    def _read(self, call: WireCall) -> Any:
        """Read the reply to ``call`` (a subclass may know other ops, e.g. ps/rows_wire.py)."""
        if call.slot is None:
            return frames.read_reply(self._sock, call.op, self.size, call.out)
        try:  # the slot is free again once its values are copied out (or it failed)
            slot = self._area.slot(call.slot)
            return frames.read_reply(self._sock, call.op, self.size, call.out, slot)
        finally:
            self._area.give(call.slot)

    def _fail(self, error: BaseException) -> None:
        """Mark the connection broken and fail every call still waiting for its reply."""
        if self._broken is None:
            self._broken = error
        while True:
            try:
                call = self._waiting.get_nowait()
            except queue.Empty:
                return
            if call is None:
                continue
            if not call.done():
                call._finish(error=error)


def _sparse_body(grad: SparseGradient, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A sparse push's body, checked: contiguous int32 indices and float32 values, 1 to
    ``size`` of them (the shard refuses an index outside its range)."""
    indices = np.ascontiguousarray(grad.indices, dtype=INDEX)
    values = np.ascontiguousarray(grad.values, dtype=DTYPE)
    if indices.shape != values.shape or not 1 <= len(indices) <= size or grad.size != size:
        raise ValueError(
            f"a sparse push to a shard of {size} parameters carries 1 to {size} indices and as "
            f"many values, got {indices.shape} and {values.shape} for size {grad.size}"
        )
    return indices, values
