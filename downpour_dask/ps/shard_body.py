"""A shard's arrays and the counters a push changes, in private or in shared memory.

Why: a replica on another worker of the shard's host pays, per push over the wire, for waking a
thread of the shard's process, which then competes with that process's own replica for its GIL.
A *one-sided* replica (:mod:`~downpour_dask.ps.one_sided`) wakes nothing: it applies its push to
the shard's arrays itself, in shared memory, under a lock both processes take.  What it touches
must therefore live in that memory, laid out the same in both processes: the values, the update
rule's state, the guard's bounds (:class:`~downpour_dask.core.guard.GuardedUpdate`), the version,
the stop, warmstart and retirement flags, and one *ledger* per one-sided replica session (its
process, its last applied push number, its counters, the push it is in the middle of).
:class:`ShardBody` holds them, in a private allocation until the first one-sided replica asks
(:meth:`ShardBody.shared_copy`); the shard reads and writes them through it either way.

:class:`ShardLock` is the shard's lock: a thread lock, plus, once the body is shared, an
``flock`` on its file.  A process stopped (SIGSTOP) while it holds that lock would stall the
shard, so the shard waits at most :attr:`ShardLock.lease` seconds and then takes its state back
into private memory (the shard's ``_take_back``); the stopped process later finishes writing
into memory nobody reads.  A process killed while it holds the lock loses it at once (the
kernel drops the ``flock``) and leaves its ledger marked in the middle of a push.

Linux only (``memfd_create``, ``/proc``, ``flock``).  This module does not import Dask.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import math
import mmap
import os
import stat
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..core.params import DTYPE

# -- the int64 head: a shard's version and flags ---------------------------------------------------
# DIRTY: the ledger of the push under way (-1: none); LEDGERED: pushes ledgers recorded so far.
VERSION, STOPPED, RELEASED, RETIRED_BY, REVOKED, DIRTY, LEDGERED = range(7)
HEAD = 8
#: The float64 head: the shard's recent training loss (a moving average, for progress).
RECENT_LOSS = 0
FLOAT_HEAD = 2
#: Guard bounds (float64, NaN: not measured) for at most this many arrays.
BOUNDS = 8
# -- one ledger per one-sided replica session (int64) ---------------------------------------------
# PID: the replica's process (0: not known), whose ledger is freed once it is gone.
(REPLICA, SESSION_A, SESSION_B, THROUGH, IN_PROGRESS, ACCEPTED, EXAMPLES, STALENESS_SUM,
 STALENESS_MAX, CLIPPED, PID) = range(11)  # fmt: skip
LEDGER = 11
#: One-sided sessions a shard serves at once (a replica restarted or switched gets a new one).
LEDGERS = 64
#: A ledger's REPLICA while it is free; a replica that closes its session marks it
#: ``closed_mark(replica)``, and the shard frees it once it has folded its last counts in.
FREE = -1
TOKEN_BYTES = 16
_ALIGN = 64


def closed_mark(replica: int) -> int:
    """The REPLICA value of replica ``replica``'s closed ledger (and back: it is its own
    inverse), below FREE so that open ledgers stay ``>= 0``."""
    return -2 - replica


def session_key(session: str) -> tuple[int, int]:
    """A session id's two int64 words as a ledger stores them (uuid hex, else its hash)."""
    try:
        raw = bytes.fromhex(session)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raw = hashlib.blake2b(session.encode(), digest_size=16).digest()
    a, b = np.frombuffer(raw, np.int64)
    return int(a), int(b)


def _layout(n_values: int, spec: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, Any]:
    """Where each part of a body of ``n_values`` values and rule-state arrays ``spec``
    (``(name, dtype, shape)``) starts in its file, every part 64-byte aligned."""
    offsets: dict[str, Any] = {}
    at = _ALIGN  # the token first
    for name, nbytes in (
        ("head", HEAD * 8), ("float_head", FLOAT_HEAD * 8), ("bounds", BOUNDS * 8),
        ("ledgers", LEDGERS * LEDGER * 8), ("values", n_values * DTYPE().itemsize),
    ):  # fmt: skip
        offsets[name] = at
        at += -(-nbytes // _ALIGN) * _ALIGN
    states = {}
    for name, dtype, shape in spec:
        states[name] = at
        at += -(-(int(np.prod(shape)) * np.dtype(dtype).itemsize) // _ALIGN) * _ALIGN
    return {"parts": offsets, "states": states, "bytes": max(at, _ALIGN)}


class ShardBody:
    """A shard's values, rule state, head, guard bounds and ledgers (module docstring).

    Parameters
    ----------
    values : ndarray
        The shard's float32 values.
    state : dict
        The update rule's state arrays.
    head, float_head, bounds, ledgers : ndarray
        The int64 head, the float64 head, the guard's bounds and the ledgers (``LEDGERS`` x
        ``LEDGER``, a free one's ``REPLICA`` is -1).
    mapping : mmap, optional
        The shared file's mapping all of them view (None: private arrays).
    """

    def __init__(self, values, state, head, float_head, bounds, ledgers, mapping=None):
        self.values, self.state = values, state
        self.head, self.float_head, self.bounds, self.ledgers = head, float_head, bounds, ledgers
        self.mapping = mapping
        self.fd: int | None = None  # the shared file, open while one-sided replicas may map it
        self.token = b""

    @classmethod
    def private(cls, values: np.ndarray, state: dict[str, np.ndarray]) -> ShardBody:
        """A body in private memory around ``values`` and ``state`` (not copied)."""
        head = np.zeros(HEAD, np.int64)
        head[[RETIRED_BY, DIRTY]] = -1
        ledgers = np.zeros((LEDGERS, LEDGER), np.int64)
        ledgers[:, [REPLICA, THROUGH, IN_PROGRESS]] = -1
        float_head = np.full(FLOAT_HEAD, np.nan)
        return cls(values, state, head, float_head, np.full(BOUNDS, np.nan), ledgers)

    @property
    def shared(self) -> bool:
        return self.mapping is not None

    def spec(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """The rule state's arrays as ``(name, dtype, shape)``, in order."""
        return [(name, a.dtype.str, a.shape) for name, a in self.state.items()]

    def shared_copy(self) -> ShardBody:
        """A copy of this body in a new anonymous shared file, its token written and its file
        left open (``fd``) for one-sided replicas to map through ``/proc``."""
        layout = _layout(self.values.size, self.spec())
        fd = os.memfd_create("downpour-dask-shard", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout["bytes"])
            body = _mapped(mmap.mmap(fd, layout["bytes"]), self.values.size, self.spec(), layout)
        except BaseException:
            os.close(fd)
            raise
        body._own_file(fd)
        body.token = os.urandom(TOKEN_BYTES)
        body.mapping[:TOKEN_BYTES] = body.token
        self.copy_into(body)
        return body

    def private_copy(self) -> ShardBody:
        """A copy of this body in private memory (the shard taking its state back)."""
        body = ShardBody(
            self.values.copy(), {k: v.copy() for k, v in self.state.items()}, self.head.copy(),
            self.float_head.copy(), self.bounds.copy(), self.ledgers.copy(),
        )  # fmt: skip
        return body

    def copy_into(self, other: ShardBody) -> None:
        np.copyto(other.values, self.values)
        for name, array in self.state.items():
            np.copyto(other.state[name], array)
        np.copyto(other.head, self.head)
        np.copyto(other.float_head, self.float_head)
        np.copyto(other.bounds, self.bounds)
        np.copyto(other.ledgers, self.ledgers)

    def offer(self) -> dict[str, Any]:
        """What a one-sided replica on this host needs to map the shared body (:meth:`attach`)."""
        return {"pid": os.getpid(), "fd": self.fd, "token": self.token,
                "n_values": self.values.size, "spec": self.spec()}  # fmt: skip

    @classmethod
    def attach(cls, offer: dict[str, Any]) -> ShardBody | None:
        """Map the body a shard offered (:meth:`offer`), or None if it cannot be mapped from
        here (another host, another user) or does not hold the offer's token."""
        layout = _layout(int(offer["n_values"]), list(offer["spec"]))
        path = f"/proc/{int(offer['pid'])}/fd/{int(offer['fd'])}"
        try:
            opened = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(opened)
            if not (stat.S_ISREG(info.st_mode) and info.st_size == layout["bytes"]):
                os.close(opened)
                return None
            mapping = mmap.mmap(opened, layout["bytes"])
        except (OSError, ValueError):
            os.close(opened)
            return None
        if not hmac.compare_digest(mapping[:TOKEN_BYTES], bytes(offer["token"])):
            mapping.close()
            os.close(opened)
            return None
        body = _mapped(mapping, int(offer["n_values"]), list(offer["spec"]), layout)
        body._own_file(opened)  # this process's own open file: its flock is its own
        return body

    def _own_file(self, fd: int) -> None:
        """Hold ``fd`` open until :meth:`close`, or until this body is garbage."""
        self.fd = fd
        self._closer = weakref.finalize(self, _close_quietly, fd)

    def close(self) -> None:
        """Let go of the file and the mapping (the memory goes when every process has)."""
        if self.fd is not None:
            self._closer()
            self.fd = None
        if self.mapping is not None:
            self.values = self.state = self.head = self.float_head = None  # type: ignore[assignment]
            self.bounds = self.ledgers = None  # type: ignore[assignment]
            with contextlib.suppress(BufferError):  # a view still held elsewhere: freed with it
                self.mapping.close()

    def average_loss(self, loss: float) -> None:
        """Fold a push's training ``loss`` into the shard's moving average of recent losses
        (for progress displays; the shard's pushes and one-sided ones alike)."""
        if math.isfinite(loss):
            recent = self.float_head[RECENT_LOSS]
            self.float_head[RECENT_LOSS] = loss if math.isnan(recent) else 0.9 * recent + 0.1 * loss

    # -- ledgers ---------------------------------------------------------------------------------
    def open_ledger(self, replica: int, session: str, pid: int = 0) -> int | None:
        """A new ledger for ``session`` of process ``pid`` (under the lock), or None if all are
        taken."""
        free = np.flatnonzero(self.ledgers[:, REPLICA] == FREE)
        if not free.size:
            return None
        i = int(free[0])
        row = self.ledgers[i]
        row[:] = 0
        row[SESSION_A], row[SESSION_B] = session_key(session)
        row[THROUGH] = row[IN_PROGRESS] = -1
        row[PID] = pid
        row[REPLICA] = replica
        return i


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _mapped(mapping: mmap.mmap, n_values: int, spec: list, layout: dict[str, Any]) -> ShardBody:
    parts = layout["parts"]

    def view(dtype: Any, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(mapping, dtype, count, offset)

    state = {
        name: view(np.dtype(dtype), int(np.prod(shape)), layout["states"][name]).reshape(shape)
        for name, dtype, shape in spec
    }
    head = view(np.int64, HEAD, parts["head"])
    float_head = view(np.float64, FLOAT_HEAD, parts["float_head"])
    bounds = view(np.float64, BOUNDS, parts["bounds"])
    ledgers = view(np.int64, LEDGERS * LEDGER, parts["ledgers"]).reshape(LEDGERS, LEDGER)
    values = view(DTYPE, n_values, parts["values"])
    return ShardBody(values, state, head, float_head, bounds, ledgers, mapping)


# -- the processes sharing a body ------------------------------------------------------------------
#: Process states in ``/proc/<pid>/stat`` of a process that is gone ("": no such process).
GONE = ("", "Z", "X", "x")


def process_state(pid: int) -> str:
    """Process ``pid``'s state letter in ``/proc/<pid>/stat`` ("" if there is no such process).
    A profiler's samples (ptrace) show as "t": that process runs on."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return ""
    end = text.rfind(b")")
    return text[end + 2 : end + 3].decode()


# -- the lock --------------------------------------------------------------------------------------
#: Seconds a waiter for a shard's file lock spins (yielding its CPU) before it sleeps between tries.
SPIN = 5e-4


def take_file_lock(fd: int, within: float) -> bool:
    """``flock(fd, LOCK_EX)``, trying for at most ``within`` seconds (the holder may be a
    stopped process); False if it could not."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    start = time.monotonic()
    spin_until, deadline, pause = start + SPIN, start + within, 5e-5
    while True:
        if time.monotonic() < spin_until:
            os.sched_yield()  # a push holds it for tens of microseconds: a sleep would overshoot
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False


def drop_file_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


class ShardLock:
    """A shard's lock (module docstring): a thread lock, and while :attr:`fd` is set the
    ``flock`` on the shared body's file.  If that cannot be had within :attr:`lease` seconds,
    :attr:`overstayed` (the shard's) is called, which takes the state back and clears
    :attr:`fd`; the caller then goes on under the thread lock alone."""

    #: Seconds the shard waits for a one-sided replica's process to let go of its lock.
    lease = 2.0

    def __init__(self) -> None:
        self._thread = threading.Lock()
        self.fd: int | None = None
        self.overstayed: Any = None
        self.entered: Any = None  # called once the lock is had (the shard's look for a torn push)
        self._held_fd: int | None = None

    def __enter__(self) -> ShardLock:
        self._thread.acquire()
        try:
            fd = self.fd
            if fd is not None:
                if take_file_lock(fd, self.lease):
                    self._held_fd = fd
                else:
                    self.overstayed()
            if self.entered is not None:
                self.entered()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._held_fd is not None:
            with contextlib.suppress(OSError):  # (a file closed meanwhile has let go already)
                drop_file_lock(self._held_fd)
            self._held_fd = None
        self._thread.release()
