"""What a task needs to reach an actor, instead of an actor handle: :class:`ActorRef`."""

from __future__ import annotations

from typing import Any, NamedTuple

from distributed import Actor

from ..runtime.dask_internals import actor_handle


class ActorRef(NamedTuple):
    """What a task needs to reach an actor: its class, worker address and key.

    Task arguments carry these instead of :class:`distributed.Actor` handles.  A handle made in
    the driver holds a future of its key, and Dask's client keeps its recent messages (up to
    ``distributed.admin.low-level-log-length``, 1000), task arguments included: handles in
    arguments kept every fit's shards alive on the workers long after the fit ended (they were
    never released).  :meth:`open` makes the handle inside the task.
    """

    cls: type
    address: str
    key: str

    def open(self) -> Actor:
        """An actor handle (call it from the task that uses it, on a worker)."""
        return actor_handle(self.cls, self.address, self.key)


def refer(actor: Any, cls: type, address: str) -> ActorRef:
    """An :class:`ActorRef` to ``actor`` (a handle, or already a reference)."""
    return actor if isinstance(actor, ActorRef) else ActorRef(cls, address, actor.key)
