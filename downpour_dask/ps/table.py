"""A parameter-server shard that also owns row ranges of a sparse model's tables.

:class:`SparseShard` is a :class:`~downpour_dask.ps.shard.ParameterServerShard` (so the dense
part of the model, the version, fencing, the in-order delivery of pushes, ``retire`` and
``export_state`` work as for every shard) that also holds rows ``[lo, hi)`` of each table as a
:class:`~downpour_dask.core.rows.RowState`: values, the update rule's per-row state and a
per-row version.  Its rows are initialised on the worker from the run's seed
(:func:`~downpour_dask.core.sparse.table_rows`), never sent, so a worker's memory holds only
its own rows.

A replica pulls the rows its next batch touches (:meth:`SparseShard.pull_rows`) and pushes the
dense gradient plus ``(row ids, row gradients)`` (:meth:`SparseShard.push_rows`; both in one
round trip: :meth:`SparseShard.exchange_rows`).  One push is one update of the shard: it
raises the shard's version once, is logged with its staleness as a dense push is, and raises
the version of every row it names.  A push naming a row outside the shard's range, the same row
twice or gradients of the wrong shape raises ValueError and changes nothing; one with a
non-finite row gradient, or whose update would make a row or its state non-finite (the update
is computed on copies first), is refused (``gradient_refused``) as a dense one is.
``max_grad_norm`` caps the dense part only.

A shard remembers each replica's last :data:`RECENT_PUSHES` numbered pushes
(:meth:`SparseShard.recent_pushes`), from which the driver rebuilds the push records of a
replica lost with its worker.

For checkpoints :meth:`SparseShard.export_changed` returns the rows changed since its last call
(incremental), and ``export_state`` every row ever updated; both restore through ``restore``'s
``"tables"`` entry into shards of any row ranges (see :mod:`downpour_dask.ps.rows`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.rows import RowState
from ..core.sparse import TableSpec, all_unique, table_rows
from .protocol import PullReply, PushReply
from .shard import ParameterServerShard

#: One table's rows as exported and restored: ``ids`` (int64), ``values`` (k, width),
#: ``versions`` (k,) and ``state/<name>`` (k, width) for each array of the rule's state.
RowsExport = dict[str, np.ndarray]

#: Pushes per replica a shard remembers (:meth:`SparseShard.recent_pushes`).
RECENT_PUSHES = 2048
_RECENT_FIELDS = ("time", "session", "seq", "examples", "loss", "staleness", "version",
                  "accepted", "rows", "bytes", "generation")


class RowsReply(NamedTuple):
    """The answer to a rows pull: the dense slice's :class:`PullReply`, then per table the
    values of the rows asked for (in the order asked) and their versions."""

    pull: PullReply
    rows: tuple[np.ndarray, ...]
    row_versions: tuple[np.ndarray, ...]

    @property
    def generation(self) -> int:  # channels fence on it as on a PullReply
        return self.pull.generation


class SparseShard(ParameterServerShard):
    """A shard of the dense vector ``[start, stop)`` and of rows of each table.

    Parameters
    ----------
    shard_id, start, stop, values, rule
        As for :class:`ParameterServerShard` (``values`` may be empty: a model's dense vector
        can be shorter than the number of shards).
    tables : sequence of (TableSpec, lo, hi)
        Per table, its spec and the row range this shard owns.
    seed : int
        The run's seed: rows start from :func:`~downpour_dask.core.sparse.table_rows`.
    restore : dict, optional
        As for :class:`ParameterServerShard`, plus ``"tables"``: per table a
        :data:`RowsExport` (or a list of them, applied in order) of rows to continue from;
        rows outside this shard's range are ignored, rows not named keep their initial values.
    """

    def __init__(
        self,
        shard_id: int,
        start: int,
        stop: int,
        values: np.ndarray,
        rule: Any,
        *,
        tables: Sequence[tuple[TableSpec, int, int]],
        seed: int = 0,
        **kw: Any,
    ):
        super().__init__(shard_id, start, stop, values, rule, **kw)
        self.row_ranges = [(int(lo), int(hi)) for _, lo, hi in tables]
        self.blocks = [
            RowState(table_rows(TableSpec(*spec), t, lo, hi, seed), lo, rule)
            for t, (spec, lo, hi) in enumerate(tables)
        ]
        self.changed = [np.zeros(hi - lo, bool) for _, lo, hi in tables]
        self.rows_refused = 0
        self._recent: dict[int, deque[tuple]] = {}  # per replica, its last pushes
        for t, saved in enumerate(((kw.get("restore") or {}).get("tables")) or ()):
            for part in [saved] if isinstance(saved, dict) else saved:
                self._restore_rows(t, part)

    def _restore_rows(self, t: int, saved: RowsExport) -> None:
        block = self.blocks[t]
        ids = np.asarray(saved["ids"], np.int64)
        mine = (ids >= block.lo) & (ids < block.hi)
        local = ids[mine] - block.lo
        block.values[local] = np.asarray(saved["values"])[mine]
        block.versions[local] = np.asarray(saved["versions"])[mine]
        for name, array in block.state.items():
            array[local] = np.asarray(saved[f"state/{name}"])[mine]
        self.changed[t][local] = True  # the next increment holds them: it may be the first

    # -- what replicas call ----------------------------------------------------------------------
    async def pull_rows(
        self, requests: Sequence[np.ndarray], replica: int = -1, session: str = ""
    ) -> RowsReply:
        """The dense slice and the rows ``requests[t]`` of each table (see :meth:`rows_into`)."""
        return self.rows_into(requests, replica, session)

    async def push_rows(
        self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
        fetched_version: int, replica: int, **kw: Any,
    ) -> PushReply:
        """Apply one push of the dense gradient and the rows' (see :meth:`apply_rows`)."""
        await self._in_order(replica, kw.get("session", ""), kw.get("seq"))
        reply = self.apply_rows(grad, pushes, fetched_version, replica, **kw)
        await self._notify()
        return reply

    async def exchange_rows(
        self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
        fetched_version: int, replica: int, requests: Sequence[np.ndarray], **kw: Any,
    ) -> tuple[PushReply, RowsReply]:
        """A push, then a pull of the rows ``requests`` (the next batch's), in one message."""
        await self._in_order(replica, kw.get("session", ""), kw.get("seq"))
        reply = self.apply_rows(grad, pushes, fetched_version, replica, **kw)
        await self._notify()
        return reply, self.rows_into(requests, replica, kw.get("session", ""))

    def rows_into(
        self, requests: Sequence[np.ndarray], replica: int = -1, session: str = ""
    ) -> RowsReply:
        """A consistent copy of the dense slice and of the rows ``requests[t]`` of table t
        (ValueError, and nothing read, if a row is not this shard's)."""
        if len(requests) != len(self.blocks):
            raise ValueError(f"a rows pull names rows of {len(self.blocks)} tables, "
                             f"got {len(requests)}")
        with self._lock:
            locals_ = [self._local(t, ids) for t, ids in enumerate(requests)]
            pull = self._snapshot(np.empty_like(self.values), replica, session)
            rows = tuple(b.values[i] for b, i in zip(self.blocks, locals_))
            versions = tuple(b.versions[i] for b, i in zip(self.blocks, locals_))
        return RowsReply(pull, rows, versions)

    def _local(self, t: int, ids: np.ndarray) -> np.ndarray:
        try:
            return self.blocks[t].check_ids(ids)
        except ValueError as err:
            raise ValueError(f"parameter-server shard {self.shard_id}, table {t}: {err}") from None

    def apply_rows(
        self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
        fetched_version: int, replica: int, *, seq: int | None = None, session: str = "",
        examples: int = 0, loss: float = math.nan,
    ) -> PushReply:
        """Apply the dense gradient ``grad`` and, per table, ``(ids, grads)``: one update.

        Everything is checked before anything changes: a row id out of this shard's range, a
        repeated id or a gradient of the wrong shape raises ValueError; a non-finite row
        gradient is refused as a non-finite dense one is (see :meth:`apply_push`).  A numbered
        push of a session is remembered (:meth:`recent_pushes`)."""
        reply = self._apply_rows(grad, pushes, fetched_version, replica, seq, session, examples,
                                 loss)
        if seq is not None and session:
            moved = np.asarray(grad).nbytes + sum(8 * len(i) + np.asarray(g).nbytes
                                                  for i, g in pushes)
            with self._lock:
                self._recent.setdefault(replica, deque(maxlen=RECENT_PUSHES)).append((
                    time.time(), session, int(seq), int(examples), float(loss),
                    int(reply.staleness), int(reply.version), bool(reply.accepted),
                    sum(len(i) for i, _ in pushes), int(moved), int(reply.generation)))
        return reply

    async def recent_pushes(self, replica: int) -> list[dict[str, Any]]:
        """The last :data:`RECENT_PUSHES` numbered pushes of ``replica`` this incarnation
        received, oldest first: wall-clock ``time``, ``session``, ``seq``, what the push said
        (``examples``, ``loss``), what it got (``staleness``, ``version``, ``accepted``,
        ``generation``) and its ``rows`` and ``bytes``.  The driver rebuilds from them the push
        records a replica lost with its worker (``downpour/sparse_replicas.py``)."""
        with self._lock:
            return [dict(zip(_RECENT_FIELDS, entry)) for entry in self._recent.get(replica, ())]

    def _apply_rows(self, grad: np.ndarray, pushes: Sequence[tuple[np.ndarray, np.ndarray]],
                    fetched_version: int, replica: int, seq: int | None, session: str,
                    examples: int, loss: float) -> PushReply:
        if len(pushes) != len(self.blocks):
            raise ValueError(f"a rows push carries {len(self.blocks)} tables, got {len(pushes)}")
        with self._lock:
            self._serving()
            for t, (ids, grads) in enumerate(pushes):
                local = self._local(t, ids)
                width = self.blocks[t].values.shape[1]
                if np.shape(grads) != (len(local), width):
                    raise ValueError(f"parameter-server shard {self.shard_id}, table {t}: row "
                                     f"gradients must have shape ({len(local)}, {width}), got "
                                     f"{np.shape(grads)}")
                if not all_unique(local):
                    raise ValueError(f"parameter-server shard {self.shard_id}, table {t}: the "
                                     "row ids of one push must be unique")
            staleness = max(0, self.version - int(fetched_version))
            bad = sum(int(np.count_nonzero(~np.isfinite(g))) for _, g in pushes)
            if bad:
                self.rows_refused += 1
                return self._refuse(replica, staleness, f"pushed {bad} non-finite row values", bad)
            pending = [b.prepare(ids, g, staleness=staleness) for b, (ids, g) in
                       zip(self.blocks, pushes)]
            if not all(b.finite(p) for b, p in zip(self.blocks, pending)):
                self.rows_refused += 1
                reason = "pushed row gradients that would make table rows or their state non-finite"
                return self._refuse(replica, staleness, reason, 0)
            reply = self._apply_push(grad, fetched_version, replica, seq, session, examples, loss)
            if reply.accepted:  # (not a duplicate, nor a refused dense part)
                for t, (block, update) in enumerate(zip(self.blocks, pending)):
                    block.commit(update)
                    self.changed[t][update[0]] = True
            return reply

    # -- state -----------------------------------------------------------------------------------
    def _rows(self, t: int, local: np.ndarray) -> RowsExport:
        block = self.blocks[t]
        out = {"ids": local.astype(np.int64) + block.lo, "values": block.values[local].copy(),
               "versions": block.versions[local].copy()}
        out.update({f"state/{k}": v[local].copy() for k, v in block.state.items()})
        return out

    async def export_state(self) -> dict[str, Any]:
        """The dense state (see :class:`ParameterServerShard`) and ``"tables"``: every row ever
        updated, per table (rows never updated are their initial values)."""
        state = await super().export_state()
        with self._lock:
            state["tables"] = [
                self._rows(t, np.flatnonzero(b.versions)) for t, b in enumerate(self.blocks)
            ]
        return state

    async def export_changed(self) -> dict[str, Any]:
        """For an incremental checkpoint: the dense state and, per table, the rows changed since
        the previous call (``"tables"``); marks them unchanged.  The dense part is read under
        the lock just before the rows: a push landing in between is in the rows and in
        ``"version"`` but not in the dense part (as a lost update of an asynchronous run)."""
        state = await super().export_state()
        with self._lock:
            state["version"] = self.version
            state["tables"] = []
            for t, changed in enumerate(self.changed):
                state["tables"].append(self._rows(t, np.flatnonzero(changed)))
                changed[:] = False
        return state

    def _counters(self) -> dict[str, Any]:
        counters = super()._counters()
        counters["row_ranges"] = self.row_ranges
        counters["rows_refused"] = self.rows_refused
        counters["rows_updated"] = [int(np.count_nonzero(b.versions)) for b in self.blocks]
        return counters
