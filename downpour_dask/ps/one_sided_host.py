"""The shard's side of one-sided pushes: its body, shared on demand, and the ledgers folded in.

:class:`OneSidedHost` -- part of :class:`~downpour_dask.ps.shard.ParameterServerShard` -- keeps
the shard's values, rule state, version and flags in a :class:`~.shard_body.ShardBody`
(properties, so the rest of the shard reads and writes them as plain attributes).  When the
first replica of another worker on the same host asks (:meth:`~OneSidedHost.open_one_sided`),
the body moves into shared memory and the replica gets a ledger; from then on every time the
shard takes its lock it *folds* what one-sided replicas did since (their ledgers' new pushes)
into its own counters, sequence trackers and clocks, so everything that reads them under the
lock -- status, checkpoints, retirement, the replicas' clocks, duplicate detection -- counts
one-sided pushes exactly like the others.  A ledger whose replica closed its session is folded
in a last time and freed for the next session; so is one whose replica's process is gone (it
could not close it), when a new session finds no ledger free.

A ledger still marked in the middle of a push when the shard holds the lock belongs to a
process that died there (or that the shard took its state back from): that push counts as
applied, part of it possibly not, and a ``torn_push`` event says so.  If a one-sided process
keeps the lock past its lease, the shard takes its state back into private memory
(``one_sided_revoked`` event) and serves every replica over the wire from then on.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import numpy as np

from ..core.averaging import innermost
from ..core.compensation import DelayCompensated
from ..core.guard import GuardedUpdate
from ..core.optim import UpdateRule
from .ordering import SeqTracker
from .shard_body import (
    ACCEPTED,
    CLIPPED,
    DIRTY,
    EXAMPLES,
    FREE,
    GONE,
    IN_PROGRESS,
    LEDGERED,
    LEDGERS,
    PID,
    RECENT_LOSS,
    RELEASED,
    REPLICA,
    RETIRED_BY,
    REVOKED,
    STALENESS_MAX,
    STALENESS_SUM,
    STOPPED,
    THROUGH,
    VERSION,
    ShardBody,
    ShardLock,
    closed_mark,
    process_state,
)

#: ``DOWNPOUR_DASK_ONE_SIDED=0`` makes every shard refuse one-sided replicas.
ENV_SWITCH = "DOWNPOUR_DASK_ONE_SIDED"
#: The ledger columns whose growth is folded into the shard's counters.
_FOLDED = (THROUGH, ACCEPTED, EXAMPLES, STALENESS_SUM, CLIPPED)


def _head_flag(index: int, doc: str) -> property:
    def get(self: OneSidedHost) -> bool:
        return bool(self._body.head[index])

    def set_(self: OneSidedHost, value: bool) -> None:
        self._body.head[index] = int(bool(value))

    return property(get, set_, doc=doc)


class OneSidedHost:
    """A shard's body and its one-sided replicas' ledgers (see the module docstring)."""

    shard_id: int
    rule: UpdateRule
    generation: int
    max_grad_norm: float | None
    accepted_by_replica: Counter[int]
    examples: int
    staleness_sum: int
    staleness_max: int
    clipped: int
    _seqs: dict[tuple[int, str], SeqTracker]
    _sessions: set[str]
    _events: list[tuple[float, str, str, dict[str, Any]]]
    _guard: GuardedUpdate
    _lock: ShardLock

    def _open_body(self, values: np.ndarray, state: dict[str, np.ndarray]) -> None:
        self._body = ShardBody.private(values, state)
        self._lock = ShardLock()
        self._folded: dict[int, np.ndarray] = {}  # ledger: its row when last folded
        self._ledger_sessions: dict[int, str] = {}
        self._ledgered = 0  # the body's LEDGERED when last folded

    # -- the body's parts, as attributes ---------------------------------------------------------
    @property
    def values(self) -> np.ndarray:
        return self._body.values

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self._body.state

    @property
    def version(self) -> int:
        return int(self._body.head[VERSION])

    @version.setter
    def version(self, value: int) -> None:
        self._body.head[VERSION] = value

    @property
    def retired_by(self) -> int | None:
        by = int(self._body.head[RETIRED_BY])
        return None if by < 0 else by

    @retired_by.setter
    def retired_by(self, value: int | None) -> None:
        self._body.head[RETIRED_BY] = -1 if value is None else value

    @property
    def recent_loss(self) -> float:
        return float(self._body.float_head[RECENT_LOSS])

    @recent_loss.setter
    def recent_loss(self, value: float) -> None:
        self._body.float_head[RECENT_LOSS] = value

    stopped = _head_flag(STOPPED, "The stop flag replicas see in every reply.")
    released = _head_flag(RELEASED, "Whether the driver let replicas waiting for the warmstart go.")

    # -- opening -----------------------------------------------------------------------------
    def one_sided_possible(self) -> bool:
        """Whether this shard can take one-sided pushes: Linux, not switched off, and a rule a
        replica can apply alone (delay compensation needs what each replica fetched)."""
        return (
            hasattr(os, "memfd_create")
            and os.environ.get(ENV_SWITCH, "1") != "0"
            and not isinstance(innermost(self.rule), DelayCompensated)
        )

    async def open_one_sided(
        self, replica: int, session: str, pid: int = 0
    ) -> dict[str, Any] | None:
        """What a replica on this host needs to push to this shard one-sided
        (:class:`~downpour_dask.ps.one_sided.OneSidedShard`): the shared body's offer, its
        ledger, the rule, the norm cap and the generation; None if this shard cannot take
        one-sided pushes, has taken its state back, or has no free ledger.  ``pid``: the
        replica's process; when no ledger is free, those of processes gone are freed first."""
        if not self.one_sided_possible():
            return None
        replica, session, pid = int(replica), str(session), int(pid)
        with self._lock:
            self._serving()  # type: ignore[attr-defined]
            if int(self._body.head[REVOKED]):
                return None
            if not self._body.shared:
                self._share()
            ledger = self._body.open_ledger(replica, session, pid)
            if ledger is None and self._free_ledgers_of_the_gone():
                ledger = self._body.open_ledger(replica, session, pid)
            if ledger is None:  # (an unclosed session's replica may be stopped, not gone)
                self._event(
                    "one_sided_refused",
                    f"shard {self.shard_id}: all {LEDGERS} one-sided ledgers are taken; replica "
                    f"{replica}'s new session pushes over the wire",
                    {"replica": replica},
                )  # fmt: skip
                return None
            self._folded[ledger] = self._body.ledgers[ledger].copy()
            self._ledger_sessions[ledger] = session
            return {
                **self._body.offer(), "ledger": ledger, "rule": self.rule,
                "max_grad_norm": self.max_grad_norm, "generation": self.generation,
                "shard": self.shard_id,
            }  # fmt: skip

    def _event(self, kind: str, detail: str, data: dict[str, Any]) -> None:
        """Record a shard event (``events()``; the driver logs them)."""
        self._events.append((time.time(), kind, detail, data))

    def _free_ledgers_of_the_gone(self) -> int:
        """Close the open ledgers whose process is gone (killed, it could not close them) and
        fold them in a last time, which frees them (under the lock); how many.  A ledger whose
        process is only stopped stays: it may still write there."""
        body, gone = self._body, 0
        for i in np.flatnonzero(body.ledgers[:, REPLICA] > FREE).tolist():
            row = body.ledgers[i]
            pid = int(row[PID])
            if pid <= 0 or process_state(pid) not in GONE:
                continue
            replica = int(row[REPLICA])
            row[REPLICA] = closed_mark(replica)
            body.head[LEDGERED] += 1
            gone += 1
            self._event(
                "one_sided_freed",
                f"shard {self.shard_id}: replica {replica}'s one-sided session ended with its "
                f"process {pid}; its ledger, counted in full, is free for a new session",
                {"replica": replica, "pid": pid},
            )  # fmt: skip
        if gone:
            self._fold()
        return gone

    def _share(self) -> None:
        """Move the body into shared memory (under the lock)."""
        body = self._body.shared_copy()
        self._use(body)
        self._lock.fd, self._lock.overstayed = body.fd, self._take_back
        self._lock.entered = self._fold

    def _use(self, body: ShardBody) -> None:
        self._body = body
        self._guard.store = body.bounds

    # -- folding the ledgers in (under the lock) ---------------------------------------------------
    def _fold(self) -> None:
        body = self._body
        if body.head[DIRTY] >= 0:  # held by no live process, as the shard holds the lock
            self._settle_torn("its process died in the middle of it")
        ledgered = int(body.head[LEDGERED])
        if ledgered == self._ledgered:
            return
        self._ledgered = ledgered
        for i in np.flatnonzero(body.ledgers[:, REPLICA] != FREE).tolist():
            row, before = body.ledgers[i], self._folded.get(i)
            if before is not None and not (row[_FOLDED,] == before[_FOLDED,]).all():
                self._fold_row(i, row.copy(), before)
            if row[REPLICA] < FREE:  # its session closed: counted in full, free for a new one
                row[REPLICA] = FREE
                self._folded.pop(i, None)
                self._ledger_sessions.pop(i, None)

    def _fold_row(self, i: int, row: np.ndarray, before: np.ndarray) -> None:
        replica, session = int(row[REPLICA]), self._ledger_sessions.get(i, "")
        if replica < FREE:
            replica = closed_mark(replica)
        accepted = int(row[ACCEPTED] - before[ACCEPTED])
        self.accepted_by_replica[replica] += accepted
        for _ in range(accepted):
            self._tick(replica)  # type: ignore[attr-defined]
        self.examples += int(row[EXAMPLES] - before[EXAMPLES])
        self.staleness_sum += int(row[STALENESS_SUM] - before[STALENESS_SUM])
        self.staleness_max = max(self.staleness_max, int(row[STALENESS_MAX]))
        self.clipped += int(row[CLIPPED] - before[CLIPPED])
        if session:
            self._sessions.add(session)
            tracker = self._seqs.setdefault((replica, session), SeqTracker())
            for seq in range(int(before[THROUGH]) + 1, int(row[THROUGH]) + 1):
                tracker.add(seq)
        self._folded[i] = row

    def _settle_torn(self, why: str) -> None:
        """Count the pushes ledgers are marked in the middle of as applied (module docstring)."""
        body = self._body
        for i in np.flatnonzero(body.ledgers[:, IN_PROGRESS] >= 0).tolist():
            row = body.ledgers[i]
            seq = int(row[IN_PROGRESS])
            if row[THROUGH] < seq:  # not yet committed: count it now
                row[THROUGH] = seq
                row[ACCEPTED] += 1
                body.head[VERSION] += 1
            row[IN_PROGRESS] = -1
            body.head[LEDGERED] += 1  # folded next, whether its process got to count it or not
            replica = int(row[REPLICA])
            self._event(
                "torn_push",
                f"shard {self.shard_id}: replica {replica}'s one-sided push {seq} was cut short "
                f"({why}); it counts as applied, part of it may not be",
                {"replica": replica, "seq": seq},
            )  # fmt: skip
        body.head[DIRTY] = -1

    def _take_back(self) -> None:
        """Move the body back into private memory: a one-sided process kept the lock past its
        lease.  Replicas see the old body's ``REVOKED`` flag and go over the wire; a stopped
        one finishes its push into memory nobody reads."""
        old = self._body
        old.head[REVOKED] = 1
        time.sleep(0.01)  # a holder's writes made before it saw the flag are visible after this
        body = old.private_copy()
        self._use(body)
        self._lock.fd = self._lock.overstayed = None
        self._settle_torn("its process kept the shard's lock past the lease")
        self._fold()
        self._lock.entered = None
        self._event(
            "one_sided_revoked",
            f"shard {self.shard_id}: a one-sided replica's process kept the lock over "
            f"{self._lock.lease} s; every replica goes over the wire from now on", {},
        )  # fmt: skip
        old.close()
