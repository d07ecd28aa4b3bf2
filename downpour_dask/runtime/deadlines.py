"""Waits on the cluster that say what they waited for when they run out of time.

Before a fit trains it waits on the cluster several times: for the distinct labels of a Dask
collection, for its persisted partitions and their row counts, for the parameter-server shards
to start.  Each wait is bounded by the estimator's ``timeout``.  Dask's own timeouts say little
(``TimeoutError()`` from ``distributed.wait``, "timed out after 5 s." from a future), and a
stopped, overloaded or lost worker is the usual cause, so :func:`waiting_for` re-raises them
naming the step, the limit and what to look at.

This module does not import Dask.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

#: What a wait on Dask raises when its time is up: the built-in ``TimeoutError`` (which
#: ``asyncio.TimeoutError`` is from Python 3.11 on; before, a class of its own).
TIMEOUTS = (TimeoutError, asyncio.TimeoutError)


@contextlib.contextmanager
def waiting_for(what: str, timeout: float) -> Iterator[None]:
    """Run the block; a timeout in it becomes a ``TimeoutError`` naming ``what`` did not finish
    within ``timeout`` seconds, with Dask's own error as its cause.

    Parameters
    ----------
    what : str
        The step waited for, as the subject of a sentence ("the label scan of ...").
    timeout : float
        The limit the block's waits were given (the estimator's ``timeout``), for the message.
    """
    try:
        yield
    except TIMEOUTS as err:
        raise TimeoutError(
            f"{what} did not finish within timeout={timeout:g} s. A worker it needs may be "
            f"stopped, overloaded or gone (the Dask dashboard shows each worker's state); on a "
            f"slow or busy cluster, give the estimator a larger timeout"
        ) from err
