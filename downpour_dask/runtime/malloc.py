"""Give worker processes back glibc's reuse of freed medium-sized blocks.

Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``.  Setting any malloc tunable
turns off glibc's *dynamic* mmap threshold, so every block of 128 KiB or more (a 1 MB gradient,
a received message frame, a parameter copy) is mmapped and page-faulted afresh each time and
unmapped when freed: copies and received messages of that size become several times slower
(``benchmarks/bench_transfer.py`` measures it with and without this tuning).

The library's own hot loops preallocate their buffers, but the messages Dask receives cannot be
preallocated.  So processes that hold a parameter-server shard or run a replica raise the mmap
threshold to 32 MiB and the trim threshold to 64 MiB: blocks up to 32 MiB come from the heap and
are reused, and free memory above 64 MiB at the top of the heap is still returned to the system.

They also stop numpy from advising huge pages for its large arrays (``MADV_HUGEPAGE``, which
numpy applies to every allocation of 4 MiB or more on Linux; numpy/numpy#31590).  Where the
kernel's ``transparent_hugepage/defrag`` is ``madvise`` (a common default), the first touch of
such memory waits while the kernel compacts memory into huge pages whenever none are free:
placing a Sandblaster data block of ~100 MB, received or copied, then took a few times its
usual time in some fits and not in others.  Small pages cost a steady page fault per 4 KiB
instead, and the computations on the arrays run as fast (``benchmarks/README.md``).

Set ``DOWNPOUR_DASK_TUNE_MALLOC=0`` to leave the allocator as the cluster configured it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

try:  # numpy 2
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _set_madvise_hugepage

MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit systems
TRIM_THRESHOLD = 64 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds in this process, once; True if they are set.
    On Linux, numpy stops advising huge pages too.

    A no-op (returning False) on systems without glibc or when ``DOWNPOUR_DASK_TUNE_MALLOC=0``
    (numpy keeps its huge pages then).
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("DOWNPOUR_DASK_TUNE_MALLOC", "1") == "0" or not sys.platform.startswith(
        "linux"
    ):
        return False
    _set_madvise_hugepage(False)  # see the module docstring; numpy's own switch
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _tuned
