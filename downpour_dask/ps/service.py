"""The shard's side of :mod:`~downpour_dask.ps.wire`: one listening socket per worker process.

:class:`ShardService` serves every shard of its process registered with it (:func:`serve`), and
every other endpoint registered with a handler of its own (a model-parallel partition's mailbox,
:mod:`downpour_dask.downpour.partition_wire`), and stays up whatever arrives on its port, which
any process on the network can reach:

- **Hellos cost no thread.**  One thread accepts connections and reads their hellos
  (non-blocking, :mod:`selectors`); a connection gets a thread only once its hello names a
  registered shard and carries that shard's run secret.  At most ``MAX_PENDING`` connections
  wait for their hello (a newer one closes the oldest), none longer than ``HELLO_TIMEOUT``.
- **Bounded threads and reads.**  At most ``MAX_CONNECTIONS`` connections are served at once
  (beyond that a hello is refused); a started request or a reply may stall ``IO_TIMEOUT``.
- **The accept loop survives running out of files** (EMFILE/ENFILE): it closes the oldest
  connection waiting for its hello, backs off and keeps accepting.
- **A per-run secret.**  The driver makes one per fit and hands it to the shards and the
  replicas over Dask's comm; a hello without it is refused (compared in constant time), so a
  process that is not in the run cannot push even on a plaintext cluster.
- **Every request head is checked before anything changes** (:func:`frames.check_request`):
  op, value count equal to the shard's size for pushes, versions and counts in range, session
  length; one session per connection, at most ``MAX_SESSIONS`` per shard.  A bad head is
  answered with an error and the connection closed, nothing applied.
- **Fencing.**  :func:`unregister` retires a shard: no new connection reaches it, its open
  connections are closed, and once it returns no call is being applied or will be.

This module does not import Dask.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import selectors
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.params import DTYPE
from ..runtime.cpus import helper_thread
from . import frames
from .dispatch import Reply, answer_share, call_shard, check_request, read_payload, read_slot

__all__ = ["ShardService", "serve", "unregister"]

#: Serves one accepted connection of an endpoint that is not a shard: ``handler(target, conn)``
#: reads (and writes) until the peer closes or it gives up; the service closes ``conn`` after.
Handler = Callable[[Any, socket.socket], Any]

#: accept() errors that mean "no file descriptor or memory for now", not "the listener is gone".
_OUT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Registration:
    """One registered shard: held weakly, with its secret, sessions and open connections."""

    __slots__ = ("shard", "secret", "handler", "sessions", "conns", "gate", "retired")

    def __init__(self, shard: Any, secret: bytes, handler: Handler | None = None):
        self.shard = weakref.ref(shard)  # registering does not keep an ended fit's shard alive
        self.secret = bytes(secret)
        self.handler = handler  # None: a shard, answered with the shard protocol
        self.sessions: set[str] = set()
        self.conns: set[socket.socket] = set()
        self.gate = threading.Lock()  # held while a call is applied; see unregister
        self.retired = False


class ShardService:
    """One listening socket per worker process, serving every shard registered with it (see the
    module docstring for what it guards against)."""

    #: Seconds a new connection has to complete its hello.
    HELLO_TIMEOUT = 5.0
    #: Seconds a started request may go without a byte arriving, and a reply without one taken.
    IO_TIMEOUT = 120.0
    #: Connections served at once (each has a thread).
    MAX_CONNECTIONS = 256
    #: Connections waiting for their hello (no thread).
    MAX_PENDING = 64
    #: Distinct sessions one shard accepts over this service.
    MAX_SESSIONS = 4096

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._shards: dict[str, _Registration] = {}
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._closed = False
        self.out_of_files = 0  # times accept() found no file descriptor (diagnostics, tests)
        helper_thread(self._greet, "downpour-wire-accept").start()

    # -- registry --------------------------------------------------------------------------------
    def register(
        self, shard: Any, secret: bytes = b"", handler: Handler | None = None
    ) -> tuple[str, int, str]:
        """Serve ``shard`` (it needs ``values``, ``apply_push``, ``snapshot_through`` and
        ``warmstart_state``) to connections whose hello carries ``secret``; return the endpoint
        replicas connect to: ``(host, port, shard id)``.  With ``handler``, ``shard`` may be
        any object: its connections are accepted like a shard's (the hello answered with a
        size of 0) and then served by ``handler(shard, conn)``."""
        if len(secret) > frames.MAX_KEY:
            raise ValueError(f"a wire secret has at most {frames.MAX_KEY} bytes")
        shard_id = uuid.uuid4().hex
        with self._lock:
            for key in [k for k, r in self._shards.items() if r.shard() is None]:
                del self._shards[key]
            self._shards[shard_id] = _Registration(shard, secret, handler)
        return self.host, self.port, shard_id

    def unregister(self, shard_id: str) -> int:
        """Retire the shard registered as ``shard_id``: refuse new connections to it, close its
        open ones and wait for a call being applied to finish; after this no call of the
        service reaches the shard.  Return how many connections were closed (0 for an unknown
        id)."""
        with self._lock:
            reg = self._shards.pop(shard_id, None)
            if reg is None:
                return 0
            reg.retired = True
            conns = list(reg.conns)
        with reg.gate:  # a call in progress finishes; later ones see ``retired``
            pass
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # its thread's read ends at once
        return len(conns)

    def served(self) -> int:
        """How many registered shards are still alive."""
        with self._lock:
            return sum(r.shard() is not None for r in self._shards.values())

    def close(self) -> None:
        """Stop accepting and drop connections waiting for their hello (served ones run on)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    # -- accepting and hellos (one thread) -------------------------------------------------------
    def _greet(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                ready = self._selector.select(0.25)
            except (OSError, ValueError):  # the listener was closed
                break
            for key, _ in ready:
                if key.fileobj is self._listener:
                    backoff = self._accept(backoff)
                elif key.fileobj in self._pending:  # (not dropped earlier in this round)
                    try:
                        self._read_hello(key.fileobj)
                    except Exception:  # whatever one connection did, the loop goes on
                        self._drop(key.fileobj)
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in self._pending.items() if deadline < now]:
                self._drop(conn)
            if backoff:
                time.sleep(backoff)
        for conn in list(self._pending):
            self._drop(conn)

    def _accept(self, backoff: float) -> float:
        """Accept what is waiting; return the back-off before the next round (0: none)."""
        for _ in range(self.MAX_PENDING):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return 0.0
            except OSError as err:
                if self._closed or err.errno == errno.EBADF:  # the listener was closed
                    self._closed = True
                    return 0.0
                if err.errno not in _OUT_OF_FILES:  # e.g. ECONNABORTED: that one is gone
                    return 0.0
                self.out_of_files += 1
                if self._pending:  # free a descriptor: the longest-waiting hello goes
                    self._drop(next(iter(self._pending)))
                return min(1.0, max(0.01, 2 * backoff))
            if len(self._pending) >= self.MAX_PENDING:
                self._drop(next(iter(self._pending)))
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + self.HELLO_TIMEOUT, bytearray())
            self._selector.register(conn, selectors.EVENT_READ)
        return 0.0

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn)
        conn.close()

    def _read_hello(self, conn: socket.socket) -> None:
        """Read what arrived of ``conn``'s hello (never past its end); act once it is whole."""
        _, data = self._pending[conn]
        need = frames.HELLO.size
        if len(data) >= need:
            id_len, secret_len = frames.HELLO.unpack_from(data)
            need += id_len + secret_len
        try:
            chunk = conn.recv(need - len(data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        data += chunk
        if len(data) == frames.HELLO.size:
            id_len, secret_len = frames.HELLO.unpack(data)
            if id_len > frames.MAX_KEY or secret_len > frames.MAX_KEY:
                self._refuse(
                    conn,
                    f"a hello's shard id and secret have at most {frames.MAX_KEY} "
                    f"bytes, got {id_len} and {secret_len}",
                )
            elif id_len + secret_len == 0:
                self._welcome(conn, bytes(data))
        elif len(data) == need:
            self._welcome(conn, bytes(data))

    def _refuse(self, conn: socket.socket, text: str) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            frames.send_error(conn, text)
        self._drop(conn)

    def _welcome(self, conn: socket.socket, data: bytes) -> None:
        """A whole hello: hand the connection to a serving thread, or refuse it."""
        id_len, _ = frames.HELLO.unpack_from(data)
        start = frames.HELLO.size
        shard_id = data[start : start + id_len].decode("ascii", "replace")
        secret = data[start + id_len :]
        with self._lock:
            reg = self._shards.get(shard_id)
        shard = None if reg is None else reg.shard()
        if shard is None:
            self._refuse(conn, "no such parameter-server shard on this worker (it ended)")
            return
        if not hmac.compare_digest(secret, reg.secret):
            self._refuse(conn, "wrong run secret: this connection is not from the shard's run")
            return
        if not self._slots.acquire(blocking=False):
            self._refuse(conn, f"too many connections (at most {self.MAX_CONNECTIONS})")
            return
        self._pending.pop(conn, None)
        self._selector.unregister(conn)
        try:
            helper_thread(self._serve, "downpour-wire-shard", (conn, reg, shard)).start()
        except RuntimeError:  # no thread to be had
            self._slots.release()
            conn.close()

    # -- serving one connection (its own thread) -------------------------------------------------
    def _serve(self, conn: socket.socket, reg: _Registration, shard: Any) -> None:
        try:
            with conn, contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    if reg.retired:
                        frames.send_error(conn, "this parameter-server shard was retired")
                        return
                    reg.conns.add(conn)
                # Bounded reads and writes, but the socket stays blocking: a Python timeout
                # would make it non-blocking, so a 10 MB gradient would take many polls and
                # recv calls instead of one MSG_WAITALL call (measured 15-40% slower).
                limit = frames.timeval(float(self.IO_TIMEOUT))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
                if reg.handler is not None:
                    conn.sendall(frames.OK + frames.SIZE.pack(0))
                    reg.handler(shard, conn)
                    return
                size = shard.values.shape[0]
                conn.sendall(frames.OK + frames.SIZE.pack(size))
                self._answer(conn, reg, shard, size)
        finally:
            with self._lock:
                reg.conns.discard(conn)
            self._slots.release()

    def _admit(self, reg: _Registration, session: str) -> str | None:
        """Why ``session`` may not be used with this shard, or None (it is recorded)."""
        if not session.isalnum():
            return "a session is made of ASCII letters and digits"
        with self._lock:
            if session not in reg.sessions and len(reg.sessions) >= self.MAX_SESSIONS:
                return f"this shard has had {self.MAX_SESSIONS} sessions, the most it accepts"
            reg.sessions.add(session)
        return None

    def _answer(self, conn: socket.socket, reg: _Registration, shard: Any, size: int) -> None:
        """Answer one replica's requests, in order, until it closes the connection."""
        grad = np.empty(size, dtype=DTYPE)
        out = np.empty(size, dtype=DTYPE)
        head = bytearray(frames.REQUEST.size)
        session = ""  # fixed by the first request that names one
        area = None  # a SHARE request's mapped slots
        while frames.next_head(conn, head):  # (an idle wait is not bounded: authenticated)
            op, replica, seq, fetched, examples, _, n_values, n_session = frames.REQUEST.unpack(
                head
            )
            problem = check_request(size, op, replica, seq, fetched, examples, n_values, n_session)
            if problem is None and n_session:
                text = frames.recv(conn, n_session).decode("ascii", "replace")
                if session and text != session:
                    problem = "one connection carries one session"
                elif not session:
                    problem = self._admit(reg, text)
                    session = text
            if problem is None and op == frames.SHARE:
                problem = "the shared area was already mapped" if area else None
                area = area or answer_share(conn, size)  # (see ps/shared_slots.py)
                if problem is None:
                    continue
            slot = None
            if problem is None and op in frames.SLOTTED:
                slot, problem = read_slot(conn, area)  # the array is there, not on the socket
                op = frames.SLOTTED[op]
            if problem is not None:  # the stream cannot be trusted after this
                frames.send_error(conn, problem)
                return
            payload = slot if slot is not None else read_payload(conn, op, n_values, size, grad)
            with reg.gate:  # nothing in here waits on the network: unregister waits for it
                retired, failed = reg.retired, None
                try:
                    call = (conn, shard, op, payload, out, replica, session, head, slot)
                    reply = Reply(b"") if retired else call_shard(*call)
                except Exception as err:  # reported to the replica; the connection stays usable
                    failed = f"{type(err).__name__}: {err}"
            if retired:
                frames.send_error(conn, "this parameter-server shard was retired")
                return
            if failed is not None:
                frames.send_error(conn, failed)
                continue
            conn.sendall(reply.head)
            if reply.values_from is not None:  # what did not go under the shard's lock
                conn.sendall(out.view(np.uint8)[reply.values_from :])


_SERVICE: ShardService | None = None
_SERVICE_LOCK = threading.Lock()


def serve(
    shard: Any, host: str, secret: bytes = b"", handler: Handler | None = None
) -> tuple[str, int, str]:
    """Serve ``shard`` on this process's :class:`ShardService` (started on first use, bound to
    ``host``) to connections that carry ``secret``; return its endpoint ``(host, port, shard
    id)``.  ``handler``: see :meth:`ShardService.register`."""
    global _SERVICE
    with _SERVICE_LOCK:
        if _SERVICE is None or _SERVICE.host != host or _SERVICE._closed:
            _SERVICE = ShardService(host)
        return _SERVICE.register(shard, secret, handler)


def unregister(shard_id: str) -> int:
    """Retire ``shard_id`` on this process's service (see :meth:`ShardService.unregister`);
    return how many of its connections were closed."""
    service = _SERVICE
    return 0 if service is None else service.unregister(shard_id)
