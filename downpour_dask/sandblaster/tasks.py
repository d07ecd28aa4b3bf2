"""Sandblaster's worker side: computing portions and scoring evaluations.

* :func:`run_portion` computes one portion's gradient, as a Dask task or called by the runner
  of the worker holding the portion's block (:mod:`~downpour_dask.sandblaster.runners`).
  It fetches the published parameters once per batch per worker (a cache keyed by run and
  version), unless the point of a small model came with the portion, and adds its gradient to
  the shards' accumulator directly, worker to worker, never through the driver; it returns
  scalars only (:class:`PortionResult`).
* :func:`evaluate_task` scores a snapshot of the iterate on the evaluation data (and, like a
  portion, stops waiting for shards once its attempt ended).
* :func:`forget_run` (run on every worker when a fit ends) drops the run's cached parameters and
  makes its straggling portions stop instead of waiting for shards that are gone; a run whose
  driver died loses its cached parameters once they went unused for :data:`STALE_AFTER`
  seconds and another run caches its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from distributed import get_worker

from ..core import protocol
from ..core.params import DTYPE
from ..core.protocol import TrainableModel
from ..ps.server import ParameterServer
from ..runtime.dask_internals import actor_result, local_actor, on_worker_loop
from ..runtime.malloc import tune_malloc
from ..runtime.xla_threads import size_xla_pools
from .shard import Finished, SandblasterShard

#: Per run token: (version, the parameters of that version, time.monotonic() of their last use).
_CACHE: dict[str, tuple[int, np.ndarray, float]] = {}
_CACHE_LOCK = threading.Lock()
#: Seconds after its last use a run's cached point is dropped once another run caches one: a
#: run whose driver died never calls :func:`forget_run`, and its point (as large as the model)
#: would stay in the worker for good.
STALE_AFTER = 600.0
_ENDED: set[str] = set()  # runs whose fit ended: their straggling portions stop waiting


class _RunEnded(Exception):
    """The fit of this portion ended; its shards are gone."""


def _call(shard: Any, method: str, *args: Any) -> Any:
    """Start a call of a :class:`SandblasterShard` method; a future of its result.

    A shard in this worker's process runs the call on the worker's event loop, where Dask would
    run the actor message, one call at a time with the others; the message itself (its
    serialisation, the loopback round trip to the same process, the dispatch) is skipped.  A
    shard elsewhere gets an actor message.  The arguments must not change until the call is
    done: a local call reads them, not a copy.
    """
    local = local_actor(shard.key)
    if isinstance(local, SandblasterShard):
        try:
            return on_worker_loop(getattr(local, method)(*args))
        except RuntimeError:  # no running asyncio loop to run it on: send a message
            pass
    return getattr(shard, method)(*args)


def _check_running(token: str) -> None:
    """Raise :class:`_RunEnded` if the fit ``token`` ended: its shards are released, and a call
    into a released actor is never answered (Dask logs the worker's KeyError instead)."""
    if token in _ENDED:
        raise _RunEnded(token)


def _reply(call: Any, token: str, timeout: float) -> Any:
    """The result of an actor call, waited for in short slices so that a straggler of a fit
    that ended stops at once: a call into a released actor may never be answered."""
    deadline = time.monotonic() + timeout
    while True:
        _check_running(token)
        try:
            return actor_result(call, max(0.01, min(0.1, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


class PortionResult(NamedTuple):
    """What a portion task returns to the driver: scalars only."""

    portion: int
    version: int
    status: str  # "done", "stale" (batch over before it ran) or "skipped" (backup not needed)
    loss_sum: float  # sum of per-example data losses
    examples: int
    worker: str
    #: (shard index, what its finish program gave) for each shard whose batch this portion's
    #: gradient completed (see :meth:`SandblasterShard.accumulate`)
    finished: tuple[tuple[int, Finished], ...] = ()


def _params_for(
    server: ParameterServer, token: str, version: int, timeout: float
) -> np.ndarray | None:
    """The published parameters of ``version``, fetched from the shards once per worker."""
    with _CACHE_LOCK:  # portions on one worker's threads share a single fetch
        hit = _CACHE.get(token)
        if hit is not None and hit[0] == version:
            _CACHE[token] = (version, hit[1], time.monotonic())
            return hit[1]
        if hit is not None and hit[0] > version:
            return None
        _check_running(token)
        calls = [_call(shard, "fetch", version) for shard in server.shards]
        pieces = [_reply(call, token, timeout) for call in calls]
        if any(p is None for p in pieces):
            return None
        params = np.concatenate(pieces).astype(DTYPE, copy=False)
        _keep(token, version, params)  # replaces the older version
        return params


def _keep(token: str, version: int, params: np.ndarray) -> None:
    """Cache ``params`` as run ``token``'s point of ``version`` and drop the points of other
    runs unused for :data:`STALE_AFTER` seconds (the caller holds the lock)."""
    now = time.monotonic()
    for other in [t for t, (_, _, used) in _CACHE.items() if now - used > STALE_AFTER]:
        del _CACHE[other]
    _CACHE[token] = (version, params, now)


def _newest(token: str, version: int, params: np.ndarray) -> bool:
    """Record ``params`` (sent with a task) as this worker's point of ``version``; False if the
    worker has seen a later version already (the task's batch is over)."""
    with _CACHE_LOCK:
        hit = _CACHE.get(token)
        if hit is not None and hit[0] > version:
            return False
        _keep(token, version, params)
        return True


def forget_run(token: str) -> None:
    """Drop a finished run's cached parameters from this worker; its portions still running
    stop waiting for its shards."""
    _ENDED.add(token)
    with _CACHE_LOCK:
        _CACHE.pop(token, None)


def run_portion(
    server: ParameterServer,
    token: str,
    version: int,
    portion: int,
    block: tuple[np.ndarray, np.ndarray],
    model: TrainableModel,
    backup: bool,
    timeout: float,
    delay: Mapping[str, float] | None = None,
    params: np.ndarray | None = None,
) -> PortionResult:
    """Add one portion's gradient at parameters ``version`` to the shards' ``acc`` (a Dask task,
    or a runner's call).

    ``model`` has ``l2 = 0``: the penalty is added once, on the shards.  ``delay`` maps worker
    addresses to seconds slept first: a fault-injection knob that makes a worker a straggler.
    ``params`` is the published point of ``version`` when the driver sent it along (a small
    model); else the task fetches it from the shards.  Either way a task whose worker has
    already seen a later version does not compute: its batch is over.
    """
    tune_malloc()  # see runtime/malloc.py: this worker may hold no shard
    size_xla_pools()  # see runtime/xla_threads.py
    server = server.opened()  # actor handles from the references the task was given
    address = get_worker().address
    if delay and delay.get(address):
        time.sleep(delay[address])
    try:
        _check_running(token)  # a straggler (or a delayed copy) of a fit that ended
        first = server.shards[0]
        if backup and not _reply(_call(first, "wanted", version, portion), token, timeout):
            return PortionResult(portion, version, "skipped", 0.0, 0, address)
        if params is None:
            params = _params_for(server, token, version, timeout)
        elif not _newest(token, version, params):
            params = None
    except _RunEnded:
        params = None
    if params is None:
        return PortionResult(portion, version, "stale", 0.0, 0, address)
    # Received blocks are often unaligned, which halves matmul speed: align (one copy) first.
    X, y = (np.require(a, requirements=["C", "A"]) for a in block)
    loss, grad = model.loss_and_grad(params, X, y)
    n = len(X)
    try:
        _check_running(token)
        calls = [
            _call(shard, "accumulate", version, portion, grad[lo:hi], n)
            for shard, (lo, hi) in zip(server.shards, server.ranges)
        ]
        # the driver may count this portion only once every shard has it
        replies = [_reply(call, token, timeout) for call in calls]
    except _RunEnded:
        return PortionResult(portion, version, "stale", 0.0, 0, address)
    finished = tuple((i, done) for i, (_, done) in enumerate(replies) if done is not None)
    return PortionResult(portion, version, "done", float(loss) * n, n, address, finished)


def evaluate_task(
    server: ParameterServer, model: TrainableModel, data: tuple, timeout: float, token: str
) -> tuple:
    """Dask task: loss and score of the snapshot ``xe`` of an iterate on ``data`` (vectors stay
    off the driver: the worker pulls ``xe`` from the shards).

    Like a portion it stops as soon as its attempt ``token`` ends: one waiting ``timeout`` for
    a dead shard would hold the worker's thread, and the replacement shard to be started on
    that worker could not start.
    """
    size_xla_pools()  # see runtime/xla_threads.py
    server = server.opened()  # actor handles from the references the task was given
    calls = [_call(shard, "vector", "xe") for shard in server.shards]
    params = np.concatenate([_reply(c, token, timeout) for c in calls]).astype(DTYPE)
    X, y = data
    return protocol.loss_and_score(model, params, X, y)
