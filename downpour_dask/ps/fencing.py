"""A shard incarnation's generation, its retirement (fencing) and the run's control token.

:class:`Incarnation` -- part of :class:`~downpour_dask.ps.shard.ParameterServerShard` -- holds
which incarnation of its shard this actor is (``generation``), whether a newer one retired it
(``retired_by``) and the run's secret (``wire_secret``) that stopping and retiring need.  Once
retired, every call a replica makes raises :class:`~downpour_dask.ps.protocol.FencedError`: a
replacement never serves while the copy it replaces still accepts pushes, wherever that copy
can still be reached (see :mod:`downpour_dask.downpour.shard_recovery`).
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import Counter
from typing import Any

from .protocol import FencedError
from .service import unregister


class Incarnation:
    """Generation, retirement and control token of one shard actor (see the module docstring)."""

    shard_id: int
    version: int
    generation: int
    retired_by: int | None
    started_at: int
    fenced_calls: int
    accepted_by_replica: Counter[int]
    _wire_secret: bytes
    _endpoint: tuple[str, int, str] | None
    _events: list[tuple[float, str, str, dict[str, Any]]]
    _lock: threading.Lock

    async def export_state(self) -> dict[str, Any]: ...  # the shard's

    def _serving(self) -> None:
        """Raise :class:`FencedError` if this incarnation was retired (under the lock)."""
        if self.retired_by is not None:
            self.fenced_calls += 1
            raise FencedError(
                f"parameter-server shard {self.shard_id} generation {self.generation} was "
                f"retired: generation {self.retired_by} replaced it",
                self.shard_id,
            )

    def _check_token(self, token: bytes, kind: str, what: str) -> None:
        """Raise PermissionError (and record a ``kind`` event) unless ``token`` is the run's."""
        if self._wire_secret and not hmac.compare_digest(bytes(token), self._wire_secret):
            detail = f"shard {self.shard_id}: {what} without the run's token was refused"
            self._events.append((time.time(), kind, detail, {"what": what}))
            raise PermissionError(detail)

    async def retire(self, generation: int, token: bytes = b"") -> dict[str, Any]:
        """Fence this incarnation: generation ``generation`` replaces it.  From now on every
        pull, push and warmstart poll raises :class:`~downpour_dask.ps.protocol.FencedError`
        (direct connections included: the shard leaves the wire service, which closes its
        connections).  Returns what it had acknowledged: ``{shard, generation, version,
        started_at, accepted_by_replica}``, read under the lock after the last push it applied,
        and its final ``state`` (:meth:`export_state`), which a replacement can start from
        without losing an update.  Calling it again returns the same (it is idempotent).
        Needs the run's secret (``wire_secret``)."""
        self._check_token(token, "retire_refused", f"retiring generation {self.generation}")
        if generation <= self.generation:
            raise ValueError(
                f"shard {self.shard_id} generation {self.generation} can only be retired by a "
                f"newer generation, got {generation}"
            )
        with self._lock:
            if self.retired_by is None or generation > self.retired_by:
                self.retired_by = int(generation)
            final = {
                "shard": self.shard_id,
                "generation": self.generation,
                "version": self.version,
                "started_at": self.started_at,
                "accepted_by_replica": dict(self.accepted_by_replica),
            }
        if self._endpoint is not None:
            unregister(self._endpoint[2])
        return {**final, "state": await self.export_state()}  # final: nothing changes it now
