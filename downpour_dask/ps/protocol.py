"""What replicas, the driver and shards say to each other, whatever carries it.

The replies of the calls replicas make (:class:`PullReply`, :class:`PushReply`) and what a lost
shard looks like to its callers (:class:`ShardLostError`, :data:`SHARD_ERRORS`,
:func:`is_shard_lost`).  The transports -- in-process calls, :mod:`~downpour_dask.ps.wire`'s
direct connections, Dask actor messages -- all deliver these same values.  This module imports
no Dask.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import NamedTuple

import numpy as np


class PullReply(NamedTuple):
    """What a shard returns to a pull.

    ``applied_through`` / ``applied_ahead`` tell the calling replica which of its own pushes these
    values already contain: every push numbered ``<= applied_through`` and those in
    ``applied_ahead`` (pushes that overtook an earlier one on the network).
    """

    values: np.ndarray
    version: int
    stop: bool
    applied_through: int
    applied_ahead: tuple[int, ...]


class PushReply(NamedTuple):
    """What a shard returns to a push."""

    version: int  # the shard's version after this push
    staleness: int  # updates the shard applied between the pusher's fetch and this push
    accepted: bool  # False: refused (non-finite gradient, or a duplicate)
    stop: bool  # the run is over: the replica should finish


class ShardLostError(RuntimeError):
    """A parameter-server shard was lost or did not answer in time; ``shard`` is its index."""

    def __init__(self, message: str, shard: int):
        super().__init__(message)
        self.shard = shard


#: The words Dask's error starts with when the worker holding an actor died: raised by a call on
#: the actor's handle once its task is gone (``distributed/actor.py``) and set as the actor
#: task's exception by the scheduler (``distributed/scheduler.py``).  Checked in distributed
#: 2024.x to 2026.8; ``tests/test_dask_internals.py`` pins it on the installed version.
LOST_ACTOR = "Worker holding Actor was lost"

#: What callers of the parameter-server layer catch for "a shard was lost": the layer's own
#: :class:`ShardLostError` (raised by :class:`~downpour_dask.ps.server.ParameterServer` and
#: the replicas' channels for every error :func:`is_shard_lost` recognises), and the errors a
#: lost worker raises through Dask's own calls: a closed connection (``OSError``, e.g.
#: ``CommClosedError``, or the direct wire's ``ConnectionError``), no answer in time
#: (``TimeoutError``) or the actor's task cancelled as its worker is removed (``CancelledError``,
#: e.g. ``FutureCancelledError``).  Not every ``RuntimeError``: a bug in a shard method is a bug.
SHARD_ERRORS = (ShardLostError, OSError, TimeoutError, CancelledError)


def is_shard_lost(error: BaseException) -> bool:
    """Whether ``error``, raised by a call into a parameter-server shard, means the shard (its
    worker) was lost or stopped answering -- rather than a bug or bad input, which must surface.

    True for :data:`SHARD_ERRORS` and for Dask's ``RuntimeError`` about a lost actor
    (:data:`LOST_ACTOR`); False for any other error, a ``RuntimeError`` included.
    """
    if isinstance(error, SHARD_ERRORS):
        return True
    return isinstance(error, RuntimeError) and str(error).startswith(LOST_ACTOR)
