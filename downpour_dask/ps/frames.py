"""The byte format of :mod:`~downpour_dask.ps.wire`'s direct connections, both directions.

A connection opens with a *hello* (the shard id and the run's secret, answered by a status and
the shard's size).
Then each request is a fixed-size head (:data:`REQUEST`: op, replica, push number, fetched
version, examples, loss, how many values follow, session length), the session bytes and, for a
push, the gradient as raw float32 bytes (:func:`check_request` is what the shard's side checks
of a head before it reads on or changes anything).  Each reply is a status (ok, or an error
text), then the fixed-size parts of the op's answer, then for a pull the values as raw float32
bytes.  The arrays are never pickled or copied into a message: they go from and into numpy
buffers.

**Sparse pushes** (top-k compression, :mod:`downpour_dask.core.compression`) are ops of their
own, :data:`PUSH_SPARSE` and :data:`EXCHANGE_SPARSE`: the head's value count is the number k
of coordinates sent (1 to the shard's size), and the body is k int32 indices followed by k
float32 values (:func:`recv_sparse`); the replies are those of :data:`PUSH` and
:data:`EXCHANGE`.  A dense op is never read as a sparse one.

**Shared slots** (:mod:`~downpour_dask.ps.shared_slots`, a replica and a shard on one host):
once a :data:`SHARE` request (head, then :data:`SHARE_AREA`) was answered "mapped", the
:data:`SLOTTED` ops carry their arrays in a slot of the shared area instead of on the socket:
the head and session are followed by the slot's index (:data:`SLOT`) and no values; the reply
is that of the plain op without the values, which the shard wrote into the slot.

This module imports no Dask.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
from typing import Any

import numpy as np

from ..core.compression import INDEX, SparseGradient
from ..core.params import DTYPE
from .protocol import PullReply, PushReply


class WireError(RuntimeError):
    """The shard's side of a direct connection reported an error (or refused the shard id)."""


PULL, PUSH, EXCHANGE, POLL_WARMSTART = 1, 2, 3, 4
PUSH_SPARSE, EXCHANGE_SPARSE = 5, 6
SHARE, PULL_SLOT, PUSH_SLOT, EXCHANGE_SLOT = 7, 8, 9, 10
#: Each sparse op and the dense op whose reply it gets.
SPARSE = {PUSH_SPARSE: PUSH, EXCHANGE_SPARSE: EXCHANGE}
#: Each op whose array is in a shared slot and the dense op it is.
SLOTTED = {PULL_SLOT: PULL, PUSH_SLOT: PUSH, EXCHANGE_SLOT: EXCHANGE}
#: op, replica, seq (-1: none), fetched_version, examples, loss, values that follow, session bytes
REQUEST = struct.Struct("<BiqqqdqH")
HELLO = struct.Struct("<HH")  # lengths of the shard id and of the run's secret that follow
STATUS = struct.Struct("<BI")  # 0 = ok, else error; length of the error text that follows
SIZE = struct.Struct("<q")  # the shard's parameter count, after a successful hello
PUSHED = struct.Struct("<qq??q")  # version, staleness, accepted, stop, generation
#: version, stop, applied_through, len(applied_ahead), generation
PULLED = struct.Struct("<q?qIq")
POLLED = struct.Struct("<q??")  # version, stopped, released (see poll_warmstart)
SHARE_AREA = struct.Struct("<qqI16s")  # the replica's pid, its area's fd, slots, token
SHARED = struct.Struct("<?")  # the answer to SHARE: whether the shard mapped the area
SLOT = struct.Struct("<I")  # the slot a SLOTTED op's array is in
OK = STATUS.pack(0, 0)

#: Longest shard id and secret a hello may carry (ids are 32 hex digits, secrets 32 bytes).
MAX_KEY = 64
#: Longest session string a request may carry (32 hex digits, and in a sparse replica's first
#: sessions "S" and the step they start at: see ps/rows.py).
MAX_SESSION = 64
#: Largest push number, version or example count a request may carry (2**53: exact as float).
MAX_COUNT = 2**53
_OPS = {PULL: "pull", PUSH: "push", EXCHANGE: "exchange", POLL_WARMSTART: "warmstart poll",
        PUSH_SPARSE: "sparse push", EXCHANGE_SPARSE: "sparse exchange", SHARE: "share",
        PULL_SLOT: "slot pull", PUSH_SLOT: "slot push", EXCHANGE_SLOT: "slot exchange"}  # fmt: skip

#: Ask the kernel for the whole buffer in one call where it can: a 1 MB array then costs one
#: system call and one hand-back of the GIL instead of one per arriving segment.
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def recv_into(sock: socket.socket, buffer: Any) -> None:
    """Fill ``buffer`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    view = memoryview(buffer).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, _WAITALL)
        if n == 0:
            raise ConnectionError("the connection was closed by the other side")
        got += n


def send_now(sock: socket.socket, parts: list[Any]) -> int:
    """Hand ``parts`` (bytes-like) to ``sock`` in one call that does not wait: how many of their
    bytes it took (0 when its buffers are full, or where the platform has no such call; an error
    is left for the next blocking send to raise)."""
    if not _DONTWAIT or not hasattr(sock, "sendmsg"):  # e.g. Windows: never risk a wait
        return 0
    try:
        return sock.sendmsg([memoryview(part).cast("B") for part in parts], [], _DONTWAIT)
    except OSError:  # BlockingIOError included
        return 0


def recv(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``."""
    buffer = bytearray(n)
    recv_into(sock, buffer)
    return bytes(buffer)


def timeval(seconds: float) -> bytes:
    """``seconds`` as the ``struct timeval`` that ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` take: they
    bound each read or write of a socket that stays blocking (a Python timeout would make it
    non-blocking, so a large array would take many calls instead of one)."""
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


def next_head(conn: socket.socket, head: bytearray) -> bool:
    """Fill ``head`` with the next fixed-size head from ``conn``, waiting as long as it takes
    for its first byte (an authenticated peer may be idle: computing); once it has started, the
    rest must arrive within the socket's ``SO_RCVTIMEO``.  False: the other side closed."""
    got = None
    while got is None:
        with contextlib.suppress(BlockingIOError):  # SO_RCVTIMEO ran out while idle
            got = conn.recv_into(head, len(head))
    if got == 0:
        return False
    recv_into(conn, memoryview(head)[got:])  # an expired SO_RCVTIMEO raises here
    return True


def connect(
    endpoint: tuple[str, int, str], secret: bytes, timeout: float
) -> tuple[socket.socket, int]:
    """Open a direct connection to ``endpoint`` ``(host, port, id)``: connect, say the hello,
    read the status (:class:`WireError` if refused) and the size the endpoint reports.  The
    socket is returned blocking, without a timeout."""
    host, port, key = endpoint
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(hello(key, secret))
        check_status(sock)
        (size,) = SIZE.unpack(recv(sock, SIZE.size))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock, size


# -- the shard's side ----------------------------------------------------------------------------
def send_error(conn: socket.socket, text: str) -> None:
    """Answer with an error status carrying ``text`` (the replica raises it as a WireError)."""
    data = text.encode("utf-8", "replace")
    conn.sendall(STATUS.pack(1, len(data)) + data)


def check_request(
    size: int,
    op: int,
    replica: int,
    seq: int,
    fetched: int,
    examples: int,
    n_values: int,
    n_session: int,
) -> str | None:
    """What is wrong with a request head (the fields of :data:`REQUEST` but ``loss``) for a
    shard of ``size`` values, or None.  Checked before anything after the head is read or any
    state changes: a head that fails leaves the rest of the stream unreadable, so the shard's
    side answers with the text and closes the connection."""
    if op not in _OPS:
        return f"unknown op {op}; allowed: " + ", ".join(f"{k} ({v})" for k, v in _OPS.items())
    if op in SPARSE and not 1 <= n_values <= size:
        return f"a {_OPS[op]} to this shard carries 1 to {size} values, got {n_values}"
    dense = SLOTTED.get(op, op)
    want = size if dense in (PUSH, EXCHANGE) else n_values if op in SPARSE else 0
    if n_values != want:
        return f"a {_OPS[op]} to this shard carries {want} values (it owns {size}), got {n_values}"
    if n_session > MAX_SESSION:
        return f"a session is at most {MAX_SESSION} bytes, got {n_session}"
    checks = (
        ("replica", replica, -1),
        ("push number", seq, -1),
        ("fetched version", fetched, 0),
        ("examples", examples, 0),
    )
    for name, value, low in checks:
        if not low <= value <= MAX_COUNT:
            return f"{name} must be in [{low}, 2**53], got {value}"
    return None


def recv_sparse(sock: socket.socket, n: int, size: int, values: np.ndarray) -> SparseGradient:
    """Read a sparse push's body: ``n`` indices, then ``n`` values into ``values[:n]``."""
    indices = np.empty(n, dtype=INDEX)
    recv_into(sock, indices)
    recv_into(sock, values[:n])
    return SparseGradient(indices, values[:n], size)


def pushed(reply: PushReply) -> bytes:
    """The fixed-size answer to a push."""
    return PUSHED.pack(*reply)


def pulled(reply: PullReply) -> bytes:
    """The fixed-size answer to a pull (the values are sent after it, raw)."""
    ahead = reply.applied_ahead
    head = PULLED.pack(
        reply.version, reply.stop, reply.applied_through, len(ahead), reply.generation
    )
    return head + struct.pack(f"<{len(ahead)}q", *ahead)


def polled(state: tuple[int, bool, bool]) -> bytes:
    """The answer to a warmstart poll: ``(version, stopped, released)``."""
    return POLLED.pack(*state)


# -- the replica's side --------------------------------------------------------------------------
def hello(shard_id: str, secret: bytes = b"") -> bytes:
    """The first bytes of a connection: which shard of the service it is for, and the run's
    secret that shard was registered with (see :func:`~downpour_dask.ps.service.serve`)."""
    key = shard_id.encode("ascii")
    if len(key) > MAX_KEY or len(secret) > MAX_KEY:
        raise ValueError(f"a shard id and a secret have at most {MAX_KEY} bytes")
    return HELLO.pack(len(key), len(secret)) + key + bytes(secret)


def request(
    op: int,
    replica: int,
    fetched_version: int,
    n_values: int,
    *,
    seq: int | None = None,
    session: str = "",
    examples: int = 0,
    loss: float = math.nan,
) -> bytes:
    """A request's head and session (the gradient, if any, is sent after it, raw)."""
    key = session.encode("ascii")
    if len(key) > MAX_SESSION:
        raise ValueError(f"a session is at most {MAX_SESSION} bytes, got {len(key)}")
    seq = -1 if seq is None else seq
    head = REQUEST.pack(op, replica, seq, fetched_version, examples, loss, n_values, len(key))
    return head + key


def check_status(sock: socket.socket) -> None:
    """Read a reply's status; raise :class:`WireError` with the shard's text if it failed."""
    status, n = STATUS.unpack(recv(sock, STATUS.size))
    if status:
        raise WireError(f"parameter-server shard: {recv(sock, n).decode('utf-8', 'replace')}")


def read_reply(
    sock: socket.socket,
    op: int,
    size: int,
    out: np.ndarray | None,
    slot: np.ndarray | None = None,
) -> Any:
    """Read the reply to one ``op`` request: a PushReply, a PullReply (values into ``out``, or
    a new array), both for an exchange, or the warmstart poll's triple.  A :data:`SLOTTED`
    op's values are copied out of its ``slot``, where the shard wrote them."""
    check_status(sock)
    op = SLOTTED.get(op, SPARSE.get(op, op))
    push = pull = None
    if op in (PUSH, EXCHANGE):
        push = PushReply(*PUSHED.unpack(recv(sock, PUSHED.size)))
    if op in (PULL, EXCHANGE):
        version, stop, through, n_ahead, generation = PULLED.unpack(recv(sock, PULLED.size))
        ahead = struct.unpack(f"<{n_ahead}q", recv(sock, 8 * n_ahead)) if n_ahead else ()
        values = np.empty(size, dtype=DTYPE) if out is None else out
        if slot is None:
            recv_into(sock, values)
        else:
            np.copyto(values, slot)
        pull = PullReply(values, version, stop, through, tuple(ahead), generation)
    if op == POLL_WARMSTART:
        return POLLED.unpack(recv(sock, POLLED.size))
    if op == EXCHANGE:
        return push, pull
    return push if op == PUSH else pull
