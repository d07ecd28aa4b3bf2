"""What the Downpour driver needs from the outside world: a cluster and a parameter server.

The driver's collaborators -- the supervision loop (:mod:`.supervision`), the supervisor
(:mod:`.supervisor`), shard recovery (:mod:`.shard_recovery`), the replica tasks (:mod:`.tasks`)
and checkpoints (:mod:`.checkpoints`) -- reach Dask and the shards only through the three small
protocols below.  :mod:`.dask_cluster` implements them on a real Dask client; the tests implement
them with in-process fakes, so the decisions (which replica to restart where, which copy of a
lost shard to restore, when to evaluate or stop) are unit-tested without a cluster, the way
:mod:`downpour_dask.core.lbfgs` is tested against its ``Space``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Task(Protocol):
    """A submitted task (a ``distributed.Future`` is one)."""

    @property
    def key(self) -> str:
        """The task's unique name."""

    @property
    def status(self) -> str:
        """``"pending"``, ``"finished"``, ``"error"``, ``"cancelled"`` or ``"lost"``."""

    def done(self) -> bool:
        """Whether the task has ended (any way)."""

    def result(self, timeout: float | None = None) -> Any:
        """The task's return value; raises its error, or if its result was lost."""

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error an ``"error"`` task raised."""

    def cancel(self) -> Any:
        """Forget the task (a running replica cannot be interrupted: it stops on its own)."""


class Cluster(Protocol):
    """The workers of one fit, and what the driver does on them."""

    def workers(self, fresh: bool = True) -> list[str]:
        """Addresses of the live workers, sorted; without ``fresh`` a recent cached list will do
        (the supervision loop asks every few milliseconds)."""

    def silent_for(self, worker: str) -> float:
        """Seconds ``worker`` has not been heard from (its heartbeats); 0 if not known."""

    def submit(self, function: Callable[..., Any], *args: Any, worker: str, key: str) -> Task:
        """Run ``function(*args)`` on ``worker`` only, as task ``key``."""

    def start_actor(self, cls: type, worker: str, *args: Any, key: str) -> Task:
        """Create an actor ``cls(*args)`` on ``worker`` only; the task's result is its
        handle."""

    def scatter(self, values: list[Any], worker: str) -> list[Any]:
        """Place ``values`` in ``worker``'s memory; return references tasks can take."""

    def wait(self, tasks: list[Task], timeout: float) -> None:
        """Return when every task has ended or after ``timeout`` seconds, whichever is first."""

    def fetched_copies(self, shard: int, key: str, workers: list[str]) -> dict[str, Any]:
        """Per worker, the freshest ``(version, values)`` of shard actor ``key`` its replicas
        fetched (None if none, or the error asking it raised)."""

    def acknowledged(self, shard: int, key: str) -> int | None:
        """The newest version shard actor ``key`` reported to an accepted push of any replica
        on the live workers (None if none did)."""

    def drain_rows(self, last: bool = False) -> list[tuple]:
        """The push-log rows the replicas made since the last call (each row once); ``last``:
        the fit's final reading, which asks every live worker again if its answer is late."""

    def announce_shard(self, shard: int, future: Any, generation: int = 0) -> None:
        """Tell running replicas where shard ``shard`` lives now (its actor's future) and which
        incarnation that is (replies of older ones are refused)."""


class Server(Protocol):
    """The parameter server as the driver sees it: shards by index, read and steered."""

    @property
    def workers(self) -> list[str]:
        """The worker holding each shard."""

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Each shard's ``(start, stop)`` in the server's vector."""

    def shard_key(self, shard: int) -> str:
        """The key of shard ``shard``'s current actor."""

    def generation(self, shard: int) -> int:
        """The generation of shard ``shard``'s current actor (0, one more per replacement)."""

    def start_retire(self, shard: int, generation: int) -> Any:
        """Start retiring incarnation ``generation`` of ``shard`` (the current one or one
        already replaced) in favour of the next generation.  Returns a call (``done()``,
        ``result(timeout)``) whose result is what the incarnation had acknowledged:
        ``{version, state, ...}`` (see ``ParameterServerShard.retire``)."""

    def portable(self, first: int = 0, stop: int | None = None) -> Any:
        """What a replica task gets to reach shards ``first..stop-1`` (all by default)."""

    def versions(self, timeout: float) -> list[int]:
        """Each shard's version (updates applied)."""

    def pull(self, timeout: float) -> tuple[np.ndarray, list[int]]:
        """The model's parameter vector assembled from every shard, and each shard's version."""

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        """Shard ``shard``'s counters (``examples``, ``accepted``, ``accepted_by_replica``...);
        raises ``ShardLostError`` if it is lost."""

    def lost_shards(self, timeout: float) -> list[int]:
        """The shards that do not answer within ``timeout`` seconds, in order."""

    def request_stop(self, timeout: float) -> None:
        """Tell every shard to report the stop flag to the replicas."""

    def release_warmstart(self, timeout: float) -> None:
        """Let replicas waiting for replica 0's warmstart start."""

    def export_state(self, timeout: float) -> list[dict[str, Any]]:
        """Each shard's state: ``values``, ``rule_state``, ``version``, ``counters``."""

    def replace_shard(
        self, shard: int, values: np.ndarray, worker: str, state: dict[str, Any], timeout: float
    ) -> Any:
        """Start a new actor for ``shard`` on ``worker`` from ``values`` and ``state``
        (``rule_state``, ``version``, ``counters``) and use it from now on; return its future."""
