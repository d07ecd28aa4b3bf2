"""Consistency models of Downpour: asynchronous, stale synchronous parallel, bulk synchronous.

:class:`Consistency` names the point on the spectrum a fit runs at (``DownpourSGD(consistency=
..., staleness_bound=...)``):

- ``"async"`` -- Downpour as in the paper (the default): no replica ever waits for another.
- ``"ssp"`` -- stale synchronous parallel (Ho et al., NIPS 2013) with bound ``s``: every push is
  one *clock tick* of its replica, counted by each shard; a replica that has pushed more than
  ``s`` ticks beyond the slowest replica blocks before its next fetch until that one catches
  up.  Each fetch then contains every replica's pushes up to ``own clock - s``.
- ``"bsp"`` -- bulk synchronous, ``s = 0``: every replica's push of step t is applied before
  any replica's fetch for step t+1, and (so that it equals synchronous minibatch SGD) no push
  of step t+1 is applied before every replica has fetched for it.

In the push log's ``staleness`` column (updates a shard applied between a replica's fetch and
its push) the bound shows as :func:`max_staleness`: with ``n`` replicas every other replica can
push at most ``2s + 1`` times between a fetch and the next push, so staleness is at most
``(n - 1) * (2s + 1)`` (``n - 1`` under BSP).  This module is numpy-free bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Values of ``DownpourSGD(consistency=...)``.
CONSISTENCIES = ("async", "ssp", "bsp")

#: The bound of ``consistency="ssp"`` when ``staleness_bound`` is not given.
DEFAULT_BOUND = 3


@dataclass(frozen=True)
class Consistency:
    """A consistency model: ``mode`` one of :data:`CONSISTENCIES`, ``bound`` its ``s`` (None
    for ``"async"``, 0 for ``"bsp"``)."""

    mode: str = "async"
    bound: int | None = None

    @property
    def synchronised(self) -> bool:
        """Whether replicas wait on the shards' clock at all."""
        return self.bound is not None

    def config(self) -> dict[str, Any]:
        """The run config's record of it (JSON-able)."""
        return {"consistency": self.mode, "staleness_bound": self.bound}


ASYNC = Consistency()


def resolve(
    consistency: Any, staleness_bound: Any = None, warmstart_steps: int = 0, partitions: int = 1
) -> Consistency:
    """Check ``DownpourSGD``'s ``consistency`` / ``staleness_bound`` and return the model.

    SSP and BSP take neither a warmstart (replica 0 alone would run past any bound) nor model
    parallelism (``partitions`` > 1: its partitions' loop has no clock).

    Raises
    ------
    ValueError, TypeError
        Naming what was wrong and what is allowed.
    """
    if isinstance(consistency, Consistency):
        consistency, staleness_bound = consistency.mode, consistency.bound
    if consistency not in CONSISTENCIES:
        raise ValueError(
            f"consistency must be one of {', '.join(map(repr, CONSISTENCIES))}, got {consistency!r}"
        )
    if staleness_bound is not None and (
        isinstance(staleness_bound, bool) or not isinstance(staleness_bound, int)
    ):
        raise TypeError(
            f"staleness_bound must be an int >= 0 or None, got "
            f"{type(staleness_bound).__name__} {staleness_bound!r}"
        )
    if consistency == "async":
        if staleness_bound is not None:
            raise ValueError(
                f"staleness_bound={staleness_bound} needs consistency='ssp' (or 'bsp', which is "
                f"staleness_bound=0); consistency='async' has no bound"
            )
        return ASYNC
    if consistency == "bsp":
        if staleness_bound not in (None, 0):
            raise ValueError(
                f"consistency='bsp' is staleness_bound=0, got staleness_bound={staleness_bound}; "
                f"use consistency='ssp' for a bound above 0"
            )
    else:
        staleness_bound = DEFAULT_BOUND if staleness_bound is None else staleness_bound
        if staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
    for name, value, allowed in (
        ("warmstart_steps", warmstart_steps, 0),
        ("partitions", partitions, 1),
    ):
        if value != allowed:
            raise ValueError(
                f"consistency={consistency!r} cannot be combined with {name}={value} (only "
                f"{name}={allowed}): use consistency='async' for it"
            )
    return Consistency(consistency, staleness_bound or 0)


def max_staleness(bound: int, n_replicas: int) -> int:
    """The largest ``staleness`` a push can show under bound ``bound`` with ``n_replicas``."""
    return (n_replicas - 1) * (2 * bound + 1)


def may_fetch(own: int, slowest: int, bound: int) -> bool:
    """Whether a replica that has pushed ``own`` clock ticks may fetch when the slowest
    replica has pushed ``slowest``: at most ``bound`` ticks ahead."""
    return own - slowest <= bound


def may_push(own: int, slowest_read: int, bound: int) -> bool:
    """Under BSP (``bound`` 0) a replica at clock ``own`` pushes its next step only once every
    replica has fetched at clock ``own`` (``slowest_read``): no push of a step lands before
    every replica read the values of that step.  SSP (``bound`` > 0) does not wait here."""
    return bound > 0 or slowest_read >= own
