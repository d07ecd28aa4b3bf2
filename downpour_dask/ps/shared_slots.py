"""Shared-memory slots between a replica and a shard on one host: a direct connection's arrays
without the kernel's copies.

Why: over loopback TCP each push and each pull crosses the kernel twice -- copied into the
socket's buffers by the sender, out of them by the receiver -- with the system calls and
wake-ups around it, on the same cores that compute the gradients.  When the shard runs on the
replica's own host, the replica's :class:`~downpour_dask.ps.wire.WireClient` instead creates a
small anonymous memory file (``memfd_create``) of a few *slots*, each the size of the shard,
and the shard's connection thread maps the same file through ``/proc/<pid>/fd/<n>``.  A request
then names a slot: the replica copies a gradient into it, the shard applies it from there and
writes the values a pull asks for into the same slot, and the replica copies them out.  One
copy each way instead of two, and no array bytes through the socket.

The socket still carries every request and reply head, in order, so ordering, errors, timeouts,
fencing and a lost peer stay exactly the wire's.  The file has no name (nothing in
``/dev/shm`` to leak): the kernel frees it when both processes have let go, a SIGKILL included.
The replica writes a random token at the start of the file and sends it along; the shard maps
the file only if it is a regular file of the announced size that holds that token, so a request
from another host (whose ``/proc`` paths mean something else here) or one the shard's user may
not open is answered "not mapped", and that connection sends its arrays inline as before.

Linux only (``os.memfd_create`` and ``/proc``).  This module does not import Dask.
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import stat
import threading

import numpy as np

from ..core.params import DTYPE

#: Bytes before the first slot: the token (and room to keep every slot 64-byte aligned).
HEADER = 64
TOKEN_BYTES = 16
#: At most this many slots per connection (a push or pull in flight each), and at most this
#: many bytes for them: a shard of 10 M float32 values gets 1 slot of 40 MB, not 4.
MAX_SLOTS = 4
SLOT_BUDGET = 64 << 20
#: ``DOWNPOUR_DASK_SHARED_MEMORY=0`` keeps every connection's arrays inline (on the socket).
ENV_SWITCH = "DOWNPOUR_DASK_SHARED_MEMORY"


def available() -> bool:
    """Whether this process may offer shared slots: Linux's ``memfd_create`` is there and the
    environment does not switch them off."""
    return hasattr(os, "memfd_create") and os.environ.get(ENV_SWITCH, "1") != "0"


def slots_for(n_values: int) -> int:
    """How many slots a connection to a shard of ``n_values`` float32 values gets (at least 1)."""
    slot_bytes = max(1, n_values) * DTYPE().itemsize
    return max(1, min(MAX_SLOTS, SLOT_BUDGET // slot_bytes))


def area_bytes(n_values: int, n_slots: int) -> int:
    """The size of an area of ``n_slots`` slots of ``n_values`` float32 values."""
    return HEADER + n_slots * n_values * DTYPE().itemsize


class SlotArea:
    """``n_slots`` float32 vectors of ``n_values`` in one shared mapping.

    The replica's side makes one with :meth:`create` and hands out slots with :meth:`take` and
    :meth:`give`; the shard's side maps the same file with :meth:`attach`.  Either side reads
    and writes a slot through :meth:`slot`, a numpy view.
    """

    def __init__(self, mapping: mmap.mmap, n_values: int, n_slots: int):
        self._mapping = mapping
        self.n_values, self.n_slots = n_values, n_slots
        self._slots = [
            np.frombuffer(mapping, DTYPE, n_values, HEADER + i * n_values * DTYPE().itemsize)
            for i in range(n_slots)
        ]
        self._free = list(range(n_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.fd: int | None = None  # the replica's side: open until the shard has mapped it
        self.token = b""

    @classmethod
    def create(cls, n_values: int, n_slots: int) -> SlotArea:
        """A new anonymous area (the replica's side), its token written, its file still open
        (``fd``) for the shard to map; :meth:`release_fd` once it has."""
        nbytes = area_bytes(n_values, n_slots)
        fd = os.memfd_create("downpour-dask-slots", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            area = cls(mmap.mmap(fd, nbytes), n_values, n_slots)
        except BaseException:
            os.close(fd)
            raise
        area.fd, area.token = fd, os.urandom(TOKEN_BYTES)
        area._mapping[:TOKEN_BYTES] = area.token
        return area

    @classmethod
    def attach(
        cls, pid: int, fd: int, token: bytes, n_values: int, n_slots: int
    ) -> SlotArea | None:
        """Map the area a replica announced as its process ``pid``'s file ``fd`` (the shard's
        side), or None if that is not an area of ``n_slots`` slots of ``n_values`` holding
        ``token``: another host's, one this user may not open, or anything else."""
        if not (1 <= n_slots <= MAX_SLOTS and pid > 0 and fd >= 0 and len(token) == TOKEN_BYTES):
            return None
        nbytes = area_bytes(n_values, n_slots)
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not _regular_of_size(os.stat(path), nbytes):  # never open a FIFO or a device
                return None
            opened = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not _regular_of_size(os.fstat(opened), nbytes):
                return None
            mapping = mmap.mmap(opened, nbytes)
        except (OSError, ValueError):
            return None
        finally:
            os.close(opened)
        if not hmac.compare_digest(mapping[:TOKEN_BYTES], token):
            mapping.close()
            return None
        return cls(mapping, n_values, n_slots)

    def slot(self, i: int) -> np.ndarray:
        """Slot ``i`` as a float32 view (no copy)."""
        return self._slots[i]

    def take(self) -> int | None:
        """A free slot's index (the replica's side), or None when every slot is in use."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, i: int) -> None:
        """Slot ``i`` is free again: its request's reply has been read."""
        with self._lock:
            self._free.append(i)

    def release_fd(self) -> None:
        """Close the file once the shard has mapped it (the mappings keep the memory)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Let go of the mapping (the memory is freed once the other side has too)."""
        self.release_fd()
        self._slots = []
        with contextlib.suppress(BufferError):  # a view still held elsewhere: freed with it
            self._mapping.close()


def _regular_of_size(info: os.stat_result, nbytes: int) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_size == nbytes
