"""Calls on their way to a shard, as the replica loop sees them (``done()``, ``result()``).

:class:`Done` is a call that completed as it was made (the shard is in the caller's process, or
the call could not be sent); :class:`Half` is one half of an ``exchange``; :func:`start` makes a
call on a shard object or handle and turns a refusal by a fenced or lost shard into a failed
:class:`Done`.
"""

from __future__ import annotations

from typing import Any

from ..runtime.dask_internals import actor_result
from .protocol import FencedError, is_shard_lost


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


def start(target: Any, name: str, /, *args: Any, local: bool = False, **kw: Any) -> Any:
    """Call method ``name`` of a shard (``local``: the shard object itself, which returns a
    complete :class:`Done`) or of its handle (the pending call).  A retired shard's refusal or a
    lost shard's handle fails the call when it is waited for; anything else (a bug) is raised
    now.  The method is looked up here too: Dask's handle of an actor whose worker was lost
    refuses the lookup itself."""
    try:
        result = getattr(target, name)(*args, **kw)
    except FencedError as err:
        return Done(error=err)
    except Exception as err:
        if is_shard_lost(err):
            return Done(error=err)
        raise
    return Done(result) if local else result
