"""The rows frame kind of the direct connections: pulls and pushes of given table rows.

A self-contained addition to :mod:`~downpour_dask.ps.frames` for sparse models
(:mod:`~downpour_dask.ps.table`).  Two ops, :data:`PULL_ROWS` and :data:`PUSH_ROWS`, use the
ordinary request head (:data:`~downpour_dask.ps.frames.REQUEST`) with its value count read as
the **number of payload bytes** that follow the session (at most :data:`MAX_ROWS_BYTES`,
checked before anything is read).  All integers little-endian, arrays raw:

- pull payload: ``u32`` tables, then per table ``i64`` n and n ``i64`` row ids;
- push payload: ``i64`` dense length and the dense gradient (float32), ``u32`` tables, then per
  table ``i64`` n, ``i64`` width, n ``i64`` row ids and n x width float32 gradients;
- pull reply: the ordinary pull answer (:func:`~downpour_dask.ps.frames.pulled`), ``i64`` dense
  length and the dense values, then per table ``i64`` n, ``i64`` width, the rows (float32) and
  their versions (``i64``);
- push reply: the ordinary push answer (:func:`~downpour_dask.ps.frames.pushed`).

A payload whose lengths do not add up is refused with a ValueError naming what was wrong, and
nothing is applied; the connection stays usable (the payload's size was known).  This module
imports no Dask.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.params import DTYPE
from . import frames
from .protocol import PullReply, PushReply

PULL_ROWS, PUSH_ROWS = 16, 17
ROWS_OPS = {PULL_ROWS: "rows pull", PUSH_ROWS: "rows push"}
#: Largest payload a rows request may carry (1 GiB).
MAX_ROWS_BYTES = 1 << 30
_I64, _U32, _PAIR = struct.Struct("<q"), struct.Struct("<I"), struct.Struct("<qq")


def check_rows_request(op: int, n_bytes: int) -> str | None:
    """What is wrong with a rows request's payload size, or None."""
    if not 0 < n_bytes <= MAX_ROWS_BYTES:
        return f"a {ROWS_OPS[op]} carries 1 to {MAX_ROWS_BYTES} payload bytes, got {n_bytes}"
    return None


# -- encoding (the replica's side) -------------------------------------------------------------
def pull_payload(requests: Sequence[np.ndarray]) -> bytes:
    parts = [_U32.pack(len(requests))]
    for ids in requests:
        ids = np.ascontiguousarray(ids, np.int64)
        parts += [_I64.pack(len(ids)), ids.tobytes()]
    return b"".join(parts)


def push_payload(grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]]) -> bytes:
    grad = np.ascontiguousarray(grad, DTYPE)
    parts = [_I64.pack(len(grad)), grad.tobytes(), _U32.pack(len(pushes))]
    for ids, grads in pushes:
        ids = np.ascontiguousarray(ids, np.int64)
        grads = np.ascontiguousarray(grads, DTYPE).reshape(len(ids), -1)
        parts += [_PAIR.pack(len(ids), grads.shape[1]), ids.tobytes(), grads.tobytes()]
    return b"".join(parts)


# -- decoding, checked -----------------------------------------------------------------------
class _Reader:
    """Reads a payload front to back; ValueError if it runs out or has bytes left over."""

    def __init__(self, data: Any):
        self.view, self.at = memoryview(data).cast("B"), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.view):
            raise ValueError(f"a rows payload of {len(self.view)} bytes ends before its "
                             f"declared contents (needs {self.at + n})")
        self.at += n
        return self.view[self.at - n : self.at]

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def array(self, n: int, dtype: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        if n < 0 or n > len(self.view) // max(1, itemsize):
            raise ValueError(f"a rows payload declares {n} values, more than it holds")
        out = np.frombuffer(self.take(n * itemsize), dtype).copy()
        return out if shape is None else out.reshape(shape)

    def done(self) -> None:
        if self.at != len(self.view):
            raise ValueError(f"a rows payload has {len(self.view) - self.at} bytes left over")


def read_pull(data: Any) -> list[np.ndarray]:
    reader = _Reader(data)
    (n_tables,) = reader.unpack(_U32)
    out = []
    for _ in range(n_tables):
        (n,) = reader.unpack(_I64)
        out.append(reader.array(n, np.int64))
    reader.done()
    return out


def read_push(data: Any) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    reader = _Reader(data)
    (n_dense,) = reader.unpack(_I64)
    grad = reader.array(n_dense, DTYPE)
    (n_tables,) = reader.unpack(_U32)
    pushes = []
    for _ in range(n_tables):
        n, width = reader.unpack(_PAIR)
        if width < 1:
            raise ValueError(f"a rows push declares a table width of {width}")
        ids = reader.array(n, np.int64)
        pushes.append((ids, reader.array(n * width, DTYPE, (n, width))))
    reader.done()
    return grad, pushes


# -- the shard's side ------------------------------------------------------------------------
def answer(shard: Any, op: int, payload: Any, replica: int, session: str, head: Any) -> bytes:
    """Make a checked rows request's call on ``shard`` (a SparseShard); the whole reply."""
    if not hasattr(shard, "apply_rows"):
        raise ValueError("this parameter-server shard holds no tables")
    _, _, seq, fetched, examples, loss, _, _ = frames.REQUEST.unpack(head)
    if op == PUSH_ROWS:
        grad, pushes = read_push(payload)
        kw = dict(seq=None if seq < 0 else seq, session=session, examples=examples, loss=loss)
        return frames.OK + frames.pushed(shard.apply_rows(grad, pushes, fetched, replica, **kw))
    reply = shard.rows_into(read_pull(payload), replica, session)
    parts = [frames.OK, frames.pulled(reply.pull), _I64.pack(len(reply.pull.values)),
             np.ascontiguousarray(reply.pull.values, DTYPE).tobytes()]
    for values, versions in zip(reply.rows, reply.row_versions):
        parts += [_PAIR.pack(*values.shape), np.ascontiguousarray(values, DTYPE).tobytes(),
                  np.ascontiguousarray(versions, np.int64).tobytes()]
    return b"".join(parts)


# -- reading a reply (the replica's side) --------------------------------------------------------
def read_reply(sock: Any, op: int, n_tables: int) -> Any:
    """Read the reply to a rows request: a PushReply, or ``(PullReply, rows, versions)``."""
    frames.check_status(sock)
    if op == PUSH_ROWS:
        return PushReply(*frames.PUSHED.unpack(frames.recv(sock, frames.PUSHED.size)))
    version, stop, through, n_ahead, generation = frames.PULLED.unpack(
        frames.recv(sock, frames.PULLED.size))
    ahead = struct.unpack(f"<{n_ahead}q", frames.recv(sock, 8 * n_ahead)) if n_ahead else ()
    (n_dense,) = _I64.unpack(frames.recv(sock, _I64.size))
    values = np.empty(n_dense, DTYPE)
    frames.recv_into(sock, values)
    rows, versions = [], []
    for _ in range(n_tables):
        n, width = _PAIR.unpack(frames.recv(sock, _PAIR.size))
        block, counts = np.empty((n, width), DTYPE), np.empty(n, np.int64)
        frames.recv_into(sock, block)
        frames.recv_into(sock, counts)
        rows.append(block)
        versions.append(counts)
    pull = PullReply(values, version, stop, through, tuple(ahead), generation)
    return pull, tuple(rows), tuple(versions)
