"""A direct socket path between replicas and parameter-server shards on other workers.

Why: a Dask actor call is a general message.  The caller's event loop frames and pickles it,
the shard's event loop reads, unpickles and dispatches it, and the reply goes back the same way.
Measured on the 2-core development machine (``benchmarks/bench_downpour.py``'s model, 203,530
float32 parameters, one push + pull of the result):

- Dask actor ``exchange``: 1.7-2.0 ms round trip, 2.2 ms of CPU over the two processes;
- this module: 0.26-0.36 ms round trip, 0.43 ms of CPU, the shard's update included.

On two cores that CPU is taken from the gradients, so the difference is throughput, not only
latency.  Dask still does everything else: it places the shards, starts, supervises and replaces
them, and the driver's own calls (status, evaluation pulls, checkpoints) stay actor calls.

The protocol carries exactly the calls a replica makes (``pull``, ``push``, ``exchange``, and
``poll_warmstart`` while it waits for replica 0's warmstart) with their arguments as fixed-size
fields and the arrays as raw float32 bytes:

- Each worker process holding shards runs one :class:`ShardService`: a listening TCP socket on
  the worker's own host and one thread per connection.  A shard registers with it and gets a
  random id; the id, sent first on every connection, is what selects the shard.
- A replica opens one :class:`WireClient` per remote shard.  Requests are written from the
  replica's thread; a receiver thread reads the replies, which come back in request order, and
  completes the :class:`WireCall` of each.  One connection per (replica, shard) also keeps a
  replica's pushes in order on the shard without any waiting.
- A lost shard or worker closes the connection: every call in flight fails with
  ``ConnectionError`` (an ``OSError``), which the replica treats like a lost actor.

The path is used only where Dask's own comm is plain TCP (a TLS cluster keeps actor messages)
and the replica's connection succeeds; otherwise the replica calls the actor as before.  Like
Dask's TCP comm it is unauthenticated; the shard id (128 random bits) is needed to address a
shard.  This module does not import Dask.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import struct
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from ..core.params import DTYPE
from .protocol import PullReply, PushReply


class WireError(RuntimeError):
    """The shard's side of a direct connection reported an error (or refused the shard id)."""


PULL, PUSH, EXCHANGE, POLL_WARMSTART = 1, 2, 3, 4
#: op, replica, seq (-1: none), fetched_version, examples, loss, values that follow, session bytes
_REQUEST = struct.Struct("<BiqqqdqH")
_HELLO = struct.Struct("<H")  # length of the shard id that follows
_STATUS = struct.Struct("<BI")  # 0 = ok, else error; length of the error text that follows
_SIZE = struct.Struct("<q")  # the shard's parameter count, after a successful hello
_PUSHED = struct.Struct("<qq??")  # version, staleness, accepted, stop
_PULLED = struct.Struct("<q?qI")  # version, stop, applied_through, len(applied_ahead)
_POLLED = struct.Struct("<q??")  # version, stopped, released (see poll_warmstart)


#: Ask the kernel for the whole buffer in one call where it can: a 1 MB array then costs one
#: system call and one hand-back of the GIL instead of one per arriving segment.
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


def _recv_into(sock: socket.socket, buffer: Any) -> None:
    """Fill ``buffer`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    view = memoryview(buffer).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, _WAITALL)
        if n == 0:
            raise ConnectionError("the connection was closed by the other side")
        got += n


def _recv(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    _recv_into(sock, buffer)
    return bytes(buffer)


def _send_error(conn: socket.socket, text: str) -> None:
    data = text.encode("utf-8", "replace")
    conn.sendall(_STATUS.pack(1, len(data)) + data)


# -- the shard's side --------------------------------------------------------------------------
class ShardService:
    """One listening socket per worker process, serving every shard registered with it.

    Shards are held by weak reference: registering does not keep a finished fit's shard alive
    (a connection does, while it is open).
    """

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._shards: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        thread = threading.Thread(target=self._accept, name="downpour-wire-accept", daemon=True)
        thread.start()

    def register(self, shard: Any) -> tuple[str, int, str]:
        """Serve ``shard`` (it needs ``values``, ``apply_push`` and ``snapshot_into``); return
        the endpoint replicas connect to: ``(host, port, shard id)``."""
        shard_id = uuid.uuid4().hex
        self._shards[shard_id] = shard
        return self.host, self.port, shard_id

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="downpour-wire-shard", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one replica's requests, in order, until it closes the connection."""
        with conn, contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (n,) = _HELLO.unpack(_recv(conn, _HELLO.size))
            shard = self._shards.get(_recv(conn, n).decode("ascii", "replace"))
            if shard is None:
                _send_error(conn, "no such parameter-server shard on this worker (it ended)")
                return
            size = shard.values.shape[0]
            grad = np.empty(size, dtype=DTYPE)
            out = np.empty(size, dtype=DTYPE)
            conn.sendall(_STATUS.pack(0, 0) + _SIZE.pack(size))
            head = bytearray(_REQUEST.size)
            while True:
                _recv_into(conn, head)
                op, replica, seq, fetched, examples, loss, n_values, n_session = _REQUEST.unpack(
                    head
                )
                session = _recv(conn, n_session).decode("ascii", "replace")
                if n_values not in (0, size):  # the stream cannot be trusted after this
                    _send_error(conn, f"a gradient of {n_values} values for a shard of {size}")
                    return
                if n_values:
                    _recv_into(conn, grad)
                try:
                    parts = [_STATUS.pack(0, 0)]
                    if op in (PUSH, EXCHANGE):
                        kw = dict(seq=None if seq < 0 else seq, session=session)
                        pushed = shard.apply_push(
                            grad, fetched, replica, examples=examples, loss=loss, **kw
                        )
                        parts.append(_PUSHED.pack(*pushed))
                    if op == POLL_WARMSTART:
                        parts.append(_POLLED.pack(*shard.warmstart_state()))
                    if op in (PULL, EXCHANGE):
                        pulled = shard.snapshot_into(out, replica, session)
                        ahead = pulled.applied_ahead
                        parts.append(
                            _PULLED.pack(
                                pulled.version, pulled.stop, pulled.applied_through, len(ahead)
                            )
                            + struct.pack(f"<{len(ahead)}q", *ahead)
                        )
                except Exception as err:  # reported to the replica; the connection stays usable
                    _send_error(conn, f"{type(err).__name__}: {err}")
                    continue
                conn.sendall(b"".join(parts))
                if op in (PULL, EXCHANGE):
                    conn.sendall(out)


_SERVICE: ShardService | None = None
_SERVICE_LOCK = threading.Lock()


def serve(shard: Any, host: str) -> tuple[str, int, str]:
    """Serve ``shard`` on this process's :class:`ShardService` (started on first use, bound to
    ``host``); return its endpoint ``(host, port, shard id)``."""
    global _SERVICE
    with _SERVICE_LOCK:
        if _SERVICE is None or _SERVICE.host != host:
            _SERVICE = ShardService(host)
        return _SERVICE.register(shard)


# -- the replica's side ------------------------------------------------------------------------
class WireCall:
    """One request's reply to come, used like Dask's ``ActorFuture``: ``done()``, ``result()``."""

    __slots__ = ("_event", "_value", "_error", "op", "out")

    def __init__(self, op: int, out: np.ndarray | None = None):
        self.op, self.out = op, out  # out: where pulled values go (default: a new array)
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError(f"no reply from the shard within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()


class WireClient:
    """A replica's connection to one shard on another worker.

    Offers the shard's replica-facing calls with the actor's signatures -- ``pull``, ``push``,
    ``exchange`` -- each returning a :class:`WireCall` at once.

    Parameters
    ----------
    endpoint : (host, port, shard id)
        From the shard's ``open_wire()``.
    timeout : float
        Seconds to connect and to hear the shard accept the id.
    """

    def __init__(self, endpoint: tuple[str, int, str], timeout: float = 10.0):
        host, port, shard_id = endpoint
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = shard_id.encode("ascii")
            sock.sendall(_HELLO.pack(len(key)) + key)
            self._check_status(sock)
            (self.size,) = _SIZE.unpack(_recv(sock, _SIZE.size))
            sock.settimeout(None)  # replies may be slow; the replica has its own deadlines
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[bytes, np.ndarray | None] | None] = (
            queue.SimpleQueue()
        )
        self._waiting: queue.SimpleQueue[WireCall | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        for target in (self._send, self._receive):
            threading.Thread(target=target, name="downpour-wire-replica", daemon=True).start()

    # -- the calls, with the actor methods' signatures --------------------------------------------
    def pull(
        self, replica: int = -1, session: str = "", *, out: np.ndarray | None = None
    ) -> WireCall:
        """Pull the shard's values: into ``out`` if given (a buffer the caller does not touch
        until the reply is in), else into a new array."""
        return self._request(PULL, None, 0, replica, session=session, out=out)

    def push(self, grad: np.ndarray, fetched_version: int, replica: int, **kw: Any) -> WireCall:
        return self._request(PUSH, grad, fetched_version, replica, **kw)

    def exchange(self, grad: np.ndarray, fetched_version: int, replica: int, **kw: Any) -> WireCall:
        return self._request(EXCHANGE, grad, fetched_version, replica, **kw)

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
        seq: int | None = None,
        session: str = "",
        examples: int = 0,
        loss: float = math.nan,
        out: np.ndarray | None = None,
    ) -> WireCall:
        if out is not None and (out.dtype != DTYPE or out.shape != (self.size,)):
            raise ValueError(f"out must be a float32 array of shape ({self.size},)")
        call = WireCall(op, out)
        if grad is not None and (
            grad.dtype != DTYPE or grad.shape != (self.size,) or not grad.flags.c_contiguous
        ):
            raise ValueError(
                f"the shard owns {self.size} float32 parameters: a gradient must be a contiguous "
                f"float32 array of shape ({self.size},), got shape {grad.shape}, dtype "
                f"{grad.dtype}"
            )
        n_values = 0 if grad is None else self.size
        key = session.encode("ascii")
        head = _REQUEST.pack(
            op,
            replica,
            -1 if seq is None else seq,
            fetched_version,
            examples,
            loss,
            n_values,
            len(key),
        )
        with self._send_lock:  # the order of _waiting is the order of the requests sent
            if self._broken is not None:
                call._finish(error=self._broken)
                return call
            self._waiting.put(call)
            self._outbox.put((head + key, grad))
        return call

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
                if grad is not None:
                    self._sock.sendall(grad)
            except OSError as err:
                self._fail(ConnectionError(f"sending to the shard failed: {err}"))
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)  # ends the receiver too
                return

    def _check_status(self, sock: socket.socket) -> None:
        status, n = _STATUS.unpack(_recv(sock, _STATUS.size))
        if status:
            raise WireError(f"parameter-server shard: {_recv(sock, n).decode('utf-8', 'replace')}")

    def _receive(self) -> None:
        """Read the replies in request order and complete each call (receiver thread)."""
        while True:
            call = self._waiting.get()
            if call is None:
                return
            try:
                call._finish(self._read_reply(call.op, call.out))
            except WireError as err:
                call._finish(error=err)
            except (OSError, ValueError, struct.error) as err:
                error = ConnectionError(f"lost the connection to the shard: {err}")
                call._finish(error=error)
                self._fail(error)
                return

    def _read_reply(self, op: int, out: np.ndarray | None) -> Any:
        sock = self._sock
        self._check_status(sock)
        pushed = pulled = None
        if op in (PUSH, EXCHANGE):
            pushed = PushReply(*_PUSHED.unpack(_recv(sock, _PUSHED.size)))
        if op in (PULL, EXCHANGE):
            version, stop, through, n_ahead = _PULLED.unpack(_recv(sock, _PULLED.size))
            ahead = struct.unpack(f"<{n_ahead}q", _recv(sock, 8 * n_ahead)) if n_ahead else ()
            values = np.empty(self.size, dtype=DTYPE) if out is None else out
            _recv_into(sock, values)
            pulled = PullReply(values, version, stop, through, tuple(ahead))
        if op == POLL_WARMSTART:
            return _POLLED.unpack(_recv(sock, _POLLED.size))
        if op == EXCHANGE:
            return pushed, pulled
        return pushed if op == PUSH else pulled

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
