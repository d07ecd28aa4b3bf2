"""Calls on their way to a shard, as the replica loop sees them (``done()``, ``result()``).

:class:`Done` is a call that completed as it was made (the shard is in the caller's process, or
the call could not be sent); :class:`Half` is one half of an ``exchange``.
"""

from __future__ import annotations

from typing import Any

from ..runtime.dask_internals import actor_result


class Done:
    """A call that completed as it was made: the shard is in this process, or (with ``error``)
    the call could not even be sent because its shard is lost, and its result raises."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value, self.error = value, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Half:
    """The push (0) or the pull (1) half of one ``exchange`` call."""

    __slots__ = ("call", "index")

    def __init__(self, call: Any, index: int):
        self.call, self.index = call, index

    def done(self) -> bool:
        return self.call.done()

    def result(self, timeout: float | None = None) -> Any:
        return actor_result(self.call, timeout)[self.index]
