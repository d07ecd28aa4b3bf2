"""What a shard saves and continues from: its update-rule state, version and counters.

:class:`SavedState` -- part of :class:`~downpour_dask.ps.shard.ParameterServerShard` -- exports a
consistent copy of everything a replacement shard or a checkpoint needs (:meth:`export_state`)
and continues from such a copy (``_restore``).  The update rule's state holds whatever the rule
keeps per coordinate: Adagrad's sums of squares, Adam's moments, an averaged rule's average
(:mod:`downpour_dask.core.averaging`); a saved state that does not match the rule is refused.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np

from ..core.optim import UpdateRule
from .clock import ReplicaClocks


class SavedState(ReplicaClocks):
    """Export and restore of one shard's state (see the module docstring); the replicas'
    clocks (:class:`~.clock.ReplicaClocks`) are part of it."""

    shard_id: int
    rule: UpdateRule
    state: dict[str, np.ndarray]
    values: np.ndarray
    version: int
    stopped: bool
    accepted_by_replica: Counter[int]
    refused: int
    duplicates: int
    examples: int
    staleness_sum: int
    staleness_max: int
    _lock: threading.Lock

    def _restore(self, saved: dict[str, Any]) -> None:
        """Continue from a state exported by :meth:`export_state` (or read from a checkpoint):
        ``version``, ``rule_state`` (arrays matching ``rule.init``), ``counters``, ``stopped``."""
        for key, array in (saved.get("rule_state") or {}).items():
            if key not in self.state or np.shape(array) != self.state[key].shape:
                raise ValueError(
                    f"shard {self.shard_id}: saved update-rule state {key!r} does not match the "
                    f"rule {type(self.rule).__name__} (state keys {sorted(self.state)}); give "
                    f"the optimizer and ema_decay of the fit that saved it"
                )
            self.state[key] = np.array(array, dtype=self.state[key].dtype, copy=True)
        self.version = int(saved.get("version", 0))
        self.stopped = bool(saved.get("stopped", False))
        counters = saved.get("counters") or {}
        self.accepted_by_replica.update(
            {int(r): int(n) for r, n in (counters.get("accepted_by_replica") or {}).items()}
        )
        for name in ("refused", "duplicates", "examples", "staleness_sum", "staleness_max"):
            setattr(self, name, int(counters.get(name, 0)))
        self._restore_clocks(counters)

    async def export_state(self) -> dict[str, Any]:
        """A consistent copy of everything a replacement shard needs: ``values``, ``rule_state``,
        ``version`` and ``counters`` (taken under the lock local replicas use)."""
        with self._lock:
            return {
                "values": self.values.copy(),
                "rule_state": {k: np.array(v, copy=True) for k, v in self.state.items()},
                "version": self.version,
                "counters": {
                    "accepted_by_replica": {str(r): n for r, n in self.accepted_by_replica.items()},
                    "refused": self.refused,
                    "duplicates": self.duplicates,
                    "examples": self.examples,
                    "staleness_sum": self.staleness_sum,
                    "staleness_max": self.staleness_max,
                    **self._clock_counters(),
                },
            }
