"""Where a sparse model's rows live among the shards, and a replica's line to one sparse shard.

:class:`SparseLayout` cuts the dense vector by element ranges (empty ranges allowed: a sparse
model's dense part may be shorter than the number of shards) and each table by row ranges, and
splits a batch's sorted row ids into each shard's part (a ``searchsorted``; the parts, put back
in shard order, are the ids in their original order).

:class:`RowsLink` reaches one :class:`~downpour_dask.ps.table.SparseShard` in the replica's
own process (``"local"``: direct calls) or by Dask actor messages (``"actor"``); ``wire`` takes
a client of a direct connection with the same methods (``pull_rows``, ``push_rows``).  Its
calls return at once (``done()``/``result()``), so a replica starts its pulls and pushes on
every shard before waiting for any.  Errors that mean a lost shard become
:class:`~downpour_dask.ps.protocol.ShardLostError`; a reply from an incarnation older than the
newest seen is a :class:`~downpour_dask.ps.protocol.FencedError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.sparse import TableSpec
from ..runtime.dask_internals import actor_result, local_actor
from .calls import start
from .protocol import FencedError, ShardLostError, is_fenced, is_shard_lost
from .table import SparseShard


def even_ranges(size: int, n_parts: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into ``n_parts`` contiguous ranges differing by at most one element
    (some empty when ``size < n_parts``)."""
    if isinstance(n_parts, bool) or not isinstance(n_parts, (int, np.integer)) or n_parts < 1:
        raise ValueError(f"n_shards must be an int >= 1, got {n_parts!r}")
    bounds = [size * i // n_parts for i in range(n_parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class SparseLayout(NamedTuple):
    """Which shard owns which part: ``dense[s]`` elements and ``tables[t][s]`` rows."""

    dense: list[tuple[int, int]]
    tables: list[list[tuple[int, int]]]
    specs: list[TableSpec]

    @classmethod
    def build(cls, n_dense: int, specs: Sequence[TableSpec], n_shards: int) -> SparseLayout:
        """Balanced ranges of the dense vector and of every table over ``n_shards`` shards."""
        if any(spec.n_rows < n_shards for spec in specs):
            raise ValueError(f"every table needs at least n_shards={n_shards} rows, got "
                             f"{[spec.n_rows for spec in specs]}")
        return cls(even_ranges(n_dense, n_shards),
                   [even_ranges(spec.n_rows, n_shards) for spec in specs],
                   [TableSpec(*spec) for spec in specs])

    @property
    def n_shards(self) -> int:
        return len(self.dense)

    def shard_tables(self, s: int) -> list[tuple[TableSpec, int, int]]:
        """Shard ``s``'s ``tables`` argument: per table its spec and row range."""
        return [(spec, *ranges[s]) for spec, ranges in zip(self.specs, self.tables)]

    def split(self, ids: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        """Per shard, per table, the part of the sorted ids ``ids[t]`` that shard owns."""
        parts: list[list[np.ndarray]] = [[] for _ in self.dense]
        for t, table_ids in enumerate(ids):
            starts = [lo for lo, _ in self.tables[t][1:]]
            for s, part in enumerate(np.split(table_ids, np.searchsorted(table_ids, starts))):
                parts[s].append(part)
        return parts


#: What separates a session id (lowercase hex) from the step its pushes are numbered from (see
#: RowsLink): a letter, as the wire takes sessions of letters and digits only.
_STARTS_AT = "S"


def session_start(session: str) -> int | None:
    """The step the pushes of ``session`` are numbered from, if its id says (a replica task's
    first links), else None."""
    _, at, step = session.rpartition(_STARTS_AT)
    return int(step) if at and step.isdigit() else None


class RowsLink:
    """A replica's line to one sparse shard (see the module docstring).

    Parameters
    ----------
    shard : SparseShard or distributed.Actor
        The shard object itself (in-process: tests, or found on this worker) or its handle.
    index : int
        The shard's number (names it in errors).
    replica : int
    timeout : float
        Seconds a call may take before the shard counts as lost.
    wire : object, optional
        A :class:`~downpour_dask.ps.rows_wire.RowsWireClient` to the shard.
    first_step : int, optional
        For the links a replica task starts with: the step its pushes are numbered from.  The
        session id carries it (:func:`session_start`), so the shards' memory of the pushes
        can be numbered without any of the replica's own records
        (``downpour/sparse_replicas.fill_gap``).
    """

    def __init__(self, shard: Any, index: int, replica: int, timeout: float, wire: Any = None,
                 first_step: int | None = None):
        if not isinstance(shard, SparseShard):
            found = local_actor(shard.key)
            shard = found if isinstance(found, SparseShard) else shard
        self.shard, self.index, self.replica, self.timeout = shard, index, replica, timeout
        self.local = isinstance(shard, SparseShard)
        self.wire = None if self.local else wire
        self.session = uuid.uuid4().hex
        if first_step is not None:
            self.session += f"{_STARTS_AT}{int(first_step)}"
        self.generation = 0

    @property
    def transport(self) -> str:
        return "local" if self.local else "wire" if self.wire is not None else "actor"

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        if self.local:
            return start(self.shard, _LOCAL[name], *args, local=True, **kw)
        target = self.wire if self.wire is not None else self.shard
        return start(target, name, *args, **kw)

    def pull(self, requests: Sequence[np.ndarray]) -> Any:
        """Start pulling the dense slice and the rows ``requests[t]`` of each table."""
        return self._call("pull_rows", list(requests), self.replica, self.session)

    def push(self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
             fetched: int, seq: int, examples: int, loss: float) -> Any:
        """Start pushing the dense gradient and ``(ids, grads)`` per table."""
        kw = {"seq": seq, "session": self.session, "examples": examples, "loss": loss}
        return self._call("push_rows", grad, list(pushes), fetched, self.replica, **kw)

    def wait(self, call: Any) -> Any:
        """The outcome of ``call``: ShardLostError for a lost shard, FencedError for a reply of
        an incarnation older than one this link already heard from."""
        try:
            reply = actor_result(call, self.timeout)
        except Exception as err:
            if is_fenced(err):
                raise FencedError(str(err), self.index) from err
            if is_shard_lost(err):
                raise ShardLostError(
                    f"parameter-server shard {self.index} was lost: {err}", self.index
                ) from err
            raise
        generation = getattr(reply, "generation", None)
        if generation is not None:
            if generation < self.generation:
                raise FencedError(f"a reply of shard {self.index} generation {generation} was "
                                  f"refused: generation {self.generation} replaced it", self.index)
            self.generation = generation
        return reply

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()


_LOCAL = {"pull_rows": "rows_into", "push_rows": "apply_rows"}
