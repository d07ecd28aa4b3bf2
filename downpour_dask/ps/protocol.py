"""What replicas, the driver and shards say to each other, whatever carries it.

The replies of the calls replicas make (:class:`PullReply`, :class:`PushReply`) and the errors a
call into a lost shard raises (:data:`SHARD_ERRORS`, :class:`ShardLostError`).  The transports --
in-process calls, :mod:`~downpour_dask.ps.wire`'s direct connections, Dask actor messages --
all deliver these same values.  This module imports no Dask.
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


#: Errors a call into a lost parameter-server shard raises (the worker died or did not answer;
#: the actor's task may also be cancelled as its worker is removed).
SHARD_ERRORS = (RuntimeError, OSError, TimeoutError, CancelledError)
