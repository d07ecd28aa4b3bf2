"""How many replicas a Downpour fit starts and may grow to: ``n_replicas`` and ``max_replicas``.

``n_replicas="auto"`` makes the fit follow its cluster: one replica per worker present when the
fit starts (per ``partitions`` workers with model parallelism), and one more on each worker that
joins while it runs (:mod:`.elastic`), up to ``max_replicas``; without ``max_replicas`` there is
no limit but the cluster's size: every worker that joins gets a replica.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.validation import check_int
from ..runtime.cluster import cluster_workers
from .settings import FitSettings

#: The ``n_replicas`` that follows the cluster's size.
AUTO = "auto"


def check_replicas(n_replicas: Any, max_replicas: Any) -> None:
    """Raise unless ``n_replicas`` is an int >= 1 or ``"auto"`` (TypeError/ValueError as
    :func:`~downpour_dask.base.check_int`; a ValueError naming both forms for another string)
    and ``max_replicas`` None or an int >= ``n_replicas`` (>= 1 with ``"auto"``)."""
    allowed = "an integer >= 1 or 'auto' (one replica per worker, following the cluster)"
    if isinstance(n_replicas, str) and n_replicas != AUTO:
        raise ValueError(f"n_replicas must be {allowed}, got {n_replicas!r}")
    if n_replicas != AUTO:
        try:
            check_int("n_replicas", n_replicas, 1)
        except ValueError:  # an int below 1: say what else is allowed
            raise ValueError(f"n_replicas must be {allowed}, got {n_replicas!r}") from None
    check_int(
        "max_replicas", max_replicas, 1 if n_replicas == AUTO else n_replicas, allow_none=True
    )


def resolve(n_replicas: int | str, max_replicas: int | None, n_workers: int,
            partitions: int = 1) -> tuple[int, int | None, bool]:  # fmt: skip
    """``(n_replicas, max_replicas, follow)`` for a fit on ``n_workers`` workers: ``"auto"`` is
    one replica per ``partitions`` workers (at least 1, at most ``max_replicas``); ``follow``
    is True when each worker that joins gets a replica with no limit (``"auto"`` without
    ``max_replicas``)."""
    if n_replicas != AUTO:
        return int(n_replicas), max_replicas, False
    n = max(1, n_workers // max(1, partitions))
    if max_replicas is not None:
        return min(n, max_replicas), max_replicas, False
    return n, None, True


def resolve_settings(settings: FitSettings, client: Any) -> FitSettings:
    """``settings`` with ``n_replicas="auto"`` resolved on ``client``'s workers (see
    :func:`resolve`); other settings are returned as they are.  The experiment's config then
    records the count the fit started with as ``n_replicas`` (what a reader of the log, and
    ``downpour-dask simulate``, needs) and ``n_replicas_given="auto"``."""
    if settings.n_replicas != AUTO:
        return settings
    n_workers = len(cluster_workers(client))
    n, limit, follow = resolve(
        settings.n_replicas, settings.max_replicas, n_workers, settings.partitions
    )
    config = {**settings.config, "n_replicas": n, "n_replicas_given": AUTO}  # the count started
    return dataclasses.replace(
        settings, n_replicas=n, max_replicas=limit, follow_workers=follow, config=config
    )


def replica_limit(settings: FitSettings) -> float | None:
    """The most replicas :class:`~.elastic.Elastic` keeps training at once: ``max_replicas``
    (None: no replica is added), unbounded when the fit follows its workers."""
    return float("inf") if settings.follow_workers else settings.max_replicas
