"""Direct sockets between the partitions of a model-parallel replica (no Dask here).

Why: the partitions of a replica exchange a few MB every step (``core/partition.py`` says
what crosses).  Sent as Dask actor calls into the peer's mailbox, each message is framed and
pickled on the sender's event loop and read and unpickled on the receiver's; on a worker with
one core that event-loop time is taken from the partitions' matrix products (about 9% of a
worker's CPU at MLP 1024-4096-4096-10, batch 128).  Here a message goes from the sending
partition's array into the socket and from the socket into a fresh array on the receiver,
holding no GIL while the kernel copies.

- The receiving side is the peer's mailbox (:class:`~.model_parallel.Mailbox`), registered with
  its process's :class:`~downpour_dask.ps.service.ShardService`: one listening socket per worker,
  the run's secret checked on every connection's hello, connections and hellos bounded.  A
  served connection runs :func:`receive_messages`, which hands every message to the mailbox.
- The sending side is one :class:`PartitionSender` per peer: a connection the partition's
  thread writes each message to, in one system call.
- A message is a fixed-size head (:data:`HEAD`) and the array's bytes; the head is checked
  before anything is read or allocated (:func:`check_head`): a bad one closes the connection,
  delivers nothing, and the peer's partition fails as if its messages were lost.

Connections are one-way (the receiver never answers); a lost peer shows as a send that fails
(:class:`PartitionLinkError` at the next ``send`` or ``flush``) or as a message that never
comes (the mailbox's own timeout).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ps import frames

#: kind (0: array, 1: an output all-reduce ``(logits, penalty, stop)``), dtype code, ndim,
#: sender partition, tag, and the array's shape (two dimensions; the second is 1 for 1-D).
HEAD = struct.Struct("<BBBqqqq")
#: What follows an output all-reduce's logits: the sender's penalty and its stop vote.
OUTPUT_TAIL = struct.Struct("<d?")
ARRAY, OUTPUT = 0, 1
#: The dtypes a message may carry, by code (the model's float32, or float64).
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Largest tag a head may carry (tags count a replica's collectives from 1).
MAX_TAG = 2**62


class PartitionLinkError(ConnectionError):
    """A message to a peer partition could not be sent (its connection broke)."""


def check_head(head: tuple, partitions: int, limit: int) -> str | None:
    """What is wrong with a message head (the fields of :data:`HEAD`) for a mailbox of one of
    ``partitions`` partitions taking at most ``limit`` values per message, or None."""
    kind, dtype, ndim, sender, tag, rows, cols = head
    if kind not in (ARRAY, OUTPUT):
        return f"unknown message kind {kind}; allowed: {ARRAY} (array), {OUTPUT} (output)"
    if dtype >= len(DTYPES):
        return f"unknown dtype code {dtype}; allowed: 0 (float32), 1 (float64)"
    if ndim not in (1, 2) or (ndim == 1 and cols != 1):
        return f"a message carries a 1-D or 2-D array, got ndim {ndim} with shape {rows}x{cols}"
    if not 0 <= sender < partitions:
        return f"sender must be a partition in [0, {partitions}), got {sender}"
    if not 1 <= tag <= MAX_TAG:
        return f"tag must be in [1, 2**62], got {tag}"
    if rows < 0 or cols < 0 or rows * cols > limit:
        return f"a message carries at most {limit} values, got shape {rows}x{cols}"
    return None


def receive_messages(
    conn: socket.socket,
    deliver: Callable[[int, int, Any], None],
    partitions: int,
    limit: int,
) -> str | None:
    """Read messages from ``conn`` until the peer closes it, handing each to
    ``deliver(sender, tag, payload)``; return why the stream was abandoned (a bad head), or
    None when it ended cleanly.  A message cut off midway is not delivered: ConnectionError."""
    buffer = bytearray(HEAD.size)
    while frames.next_head(conn, buffer):
        head = HEAD.unpack(buffer)
        problem = check_head(head, partitions, limit)
        if problem is not None:
            return problem
        kind, dtype, ndim, sender, tag, rows, cols = head
        array = np.empty((rows, cols) if ndim == 2 else (rows,), DTYPES[dtype])
        frames.recv_into(conn, array)
        if kind == OUTPUT:
            penalty, stop = OUTPUT_TAIL.unpack(frames.recv(conn, OUTPUT_TAIL.size))
            deliver(sender, tag, (array, penalty, stop))
        else:
            deliver(sender, tag, array)
    return None


def encode_message(sender: int, tag: int, payload: Any) -> tuple[bytes, np.ndarray, bytes]:
    """The head, the array and the tail (empty for a plain array) of one message; TypeError
    for a payload the format cannot carry."""
    kind, tail = ARRAY, b""
    array = payload
    if isinstance(payload, tuple):
        array, penalty, stop = payload
        kind, tail = OUTPUT, OUTPUT_TAIL.pack(float(penalty), bool(stop))
    if not isinstance(array, np.ndarray) or array.dtype not in DTYPES or array.ndim not in (1, 2):
        raise TypeError(
            "a partition message is a 1-D or 2-D float32/float64 array or (logits, penalty, "
            f"stop), got {type(array).__name__}"
        )
    array = np.ascontiguousarray(array)
    rows, cols = array.shape if array.ndim == 2 else (array.shape[0], 1)
    code = DTYPES.index(array.dtype)
    return HEAD.pack(kind, code, array.ndim, sender, tag, rows, cols), array, tail


class PartitionSender:
    """One partition's connection to a peer's mailbox, written by the partition's own thread.

    A message is written at once, in one system call that holds no GIL: the peer's side reads
    every connection on a thread of its own whatever its partition is doing, so a write waits
    only for the kernel's copy, and two partitions writing to each other cannot block each
    other.  (A writer thread would let the partition compute during that copy, but on a worker
    with one core the copy takes the same core, and each hand-off to the thread costs more.)

    Parameters
    ----------
    endpoint : (host, port, id)
        The peer mailbox's registration (:meth:`~.model_parallel.Mailbox.endpoint`).
    sender : int
        This partition's index, carried in every head.
    secret : bytes
        The run's wire secret the mailbox was registered with.
    timeout : float
        The most one write may stall (a peer that stopped reading: its worker is stopped or
        hung); then the write fails with :class:`PartitionLinkError`.
    connect_timeout : float
        Seconds to connect and hear the hello accepted.
    """

    def __init__(
        self,
        endpoint: tuple[str, int, str],
        sender: int,
        secret: bytes,
        timeout: float,
        connect_timeout: float = 10.0,
    ):
        sock, _ = frames.connect(endpoint, secret, connect_timeout)  # (a mailbox has no size)
        # blocking, so that a write is one call, but a write stalls at most ``timeout``
        limit = frames.timeval(timeout)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        except BaseException:
            sock.close()
            raise
        self.sender, self.timeout = sender, timeout
        self._sock = sock
        self._error: BaseException | None = None

    def send(self, tag: int, payload: Any) -> None:
        """Write ``payload`` to the peer; PartitionLinkError if the connection broke."""
        self.flush()
        parts = [memoryview(part).cast("B") for part in encode_message(self.sender, tag, payload)]
        try:
            while parts:
                sent = self._sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts:
                    parts[0] = parts[0][sent:]
        except OSError as err:
            self._error = err
            if isinstance(err, BlockingIOError):  # SO_SNDTIMEO ran out
                self._error = TimeoutError(
                    f"the peer read nothing for {self.timeout} s (stopped or hung)"
                )
            self.flush()

    def flush(self) -> None:
        """Nothing to wait for: every message is in the socket when :meth:`send` returns; but
        a connection that broke raises PartitionLinkError here too."""
        if self._error is not None:
            raise PartitionLinkError(f"the connection to the peer broke: {self._error}")

    def close(self) -> None:
        """Close the connection (the peer's reader then ends)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
