"""One BLAS thread for what a fit's driver computes while the replicas train.

A fit's driver scores the model on the evaluation data every ``eval_every`` seconds, beside the
training.  On a local cluster the workers share the driver's cores.  A multithreaded BLAS
(OpenBLAS, which numpy ships) runs a large product on all of them, and its helper threads then
spin, waiting for the next product, long after this one has finished.  Measured on a 2-core
machine, the driver of a fit that evaluated 20,000 rows four times a second took about a
quarter of a core that way, for a few milliseconds of work per evaluation, and the workers got
that much less (``benchmarks/README.md`` has the numbers).  In one thread the same product takes
about as long, and nothing spins.

:func:`one_blas_thread` limits every BLAS library loaded in the process to one thread for the
length of a ``with`` block (through ``threadpoolctl``) and then restores the earlier limits.  It
does so only in the process's main thread, where a fit called from a script or a notebook cell
runs, and leaves the limits alone in any other thread: the limit is process-wide, and OpenBLAS
(0.3.31, numpy's) ignores a change made in another thread once the main thread has made one, so a
limit set there might never be lifted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

from threadpoolctl import ThreadpoolController


@functools.cache
def _controller() -> ThreadpoolController:
    """The BLAS libraries this process has loaded, found once (numpy's is loaded by then)."""
    return ThreadpoolController()


def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """A context in which the process's BLAS runs in one thread, in the main thread only (see
    the module docstring); elsewhere a context that changes nothing.

    Examples
    --------
    >>> import numpy as np
    >>> with one_blas_thread():
    ...     product = np.ones((200, 64)) @ np.ones((64, 8))
    >>> float(product[0, 0])
    64.0
    """
    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()
    return _controller().limit(limits=1, user_api="blas")
