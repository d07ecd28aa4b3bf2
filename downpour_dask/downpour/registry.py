"""What this worker process keeps for the driver, per run, outside any task.

Replicas leave three things here that must outlive them: the freshest shard values they fetched
(the driver restores a lost shard from the newest copy, :func:`fetched_copy`), the newest
version each shard actor acknowledged (:func:`acked_version`: how many updates a lost shard had
acknowledged) and their push-log rows not yet collected (:func:`rows_after`), so a worker that
dies loses only its newest rows.  The driver reads them with ``client.run`` and clears them
with :func:`forget_run`.  Rows and results are handed over through an :class:`~.outbox.Outbox`:
kept until the driver says it holds them, so an answer that arrives too late loses nothing.
The replicas running in the process are counted per run (:func:`replica_running`): the
scheduler's cleanup after a lost driver waits for them (:mod:`.driver_loss`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from ..log import PushRow
from .outbox import Outbox, answer

#: The freshest shard values any replica of this worker process fetched, per (run, shard, actor
#: key): (version, values).  The driver reads it (``fetched_copy``) to restore a lost shard.
_FETCHED: dict[tuple[str, int, str], tuple[int, np.ndarray]] = {}
_FETCHED_LOCK = threading.Lock()


def run_variables(run: str) -> str:
    """The prefix of the name of every ``distributed.Variable`` of fit ``run``."""
    return f"downpour-{run}-"


def shard_variable(run: str, shard: int) -> str:
    """Name of the ``distributed.Variable`` holding the current actor future of ``shard``."""
    return f"{run_variables(run)}shard-{shard}"


def remember_fetched(run: str, shard: int, key: str, version: int, values: np.ndarray) -> bool:
    """Keep ``values`` (version ``version`` of shard actor ``key``) if no fresher copy is kept;
    True if kept: the caller must then leave ``values`` untouched."""
    with _FETCHED_LOCK:
        known = _FETCHED.get((run, shard, key))
        if known is None or known[0] < version:
            _FETCHED[(run, shard, key)] = (version, values)
            return True
        return False


#: The newest version each shard actor reported to an accepted push of any replica of this
#: process, per (run, shard, actor key): what that incarnation is known to have acknowledged,
#: should it be lost before it can be asked (see ``downpour/shard_recovery.py``).
_ACKED: dict[tuple[str, int, str], int] = {}


def keep_acked(run: str, shard: int, key: str, version: int) -> None:
    """Note that shard actor ``key`` acknowledged a push with version ``version``."""
    with _FETCHED_LOCK:
        if _ACKED.get((run, shard, key), -1) < version:
            _ACKED[(run, shard, key)] = version


def acked_version(run: str, shard: int, key: str) -> int | None:
    """The newest version shard actor ``key`` acknowledged to this process's replicas, if any
    (run on workers with ``client.run`` by the driver)."""
    with _FETCHED_LOCK:
        return _ACKED.get((run, shard, key))


#: Push-log rows of this process's replicas not yet held by the driver, per run: the driver
#: takes them every few seconds (``rows_after``), so the log keeps the pushes of a replica
#: whose worker later dies and, through checkpoints, those made before a driver was killed.
_ROWS: dict[str, Outbox] = {}


def keep_row(run: str, row: PushRow) -> None:
    """Keep one push-log row of ``run`` until the driver holds it."""
    with _FETCHED_LOCK:
        _ROWS.setdefault(run, Outbox()).put(row)


def rows_after(run: str, process: str, taken: int) -> tuple[str, int, list[PushRow]]:
    """The push-log rows of ``run`` the driver does not hold yet: it holds ``taken`` of
    process ``process``'s (see :func:`~.outbox.answer`; run with ``client.run``)."""
    with _FETCHED_LOCK:
        return answer(_ROWS.get(run), process, taken)


def fetched_copy(run: str, shard: int, key: str) -> tuple[int, np.ndarray] | None:
    """The freshest (version, values) of shard actor ``key`` fetched in this process, if any
    (run on workers with ``client.run`` by the driver)."""
    with _FETCHED_LOCK:
        return _FETCHED.get((run, shard, key))


#: Runs this worker process is leaving (it is closing: see ``membership.HoldForMigration``),
#: and those whose driver released it (took what it needed off this worker).
_LEAVING: set[str] = set()
_RELEASED: set[str] = set()


def mark_leaving(run: str) -> None:
    """Note that this worker is leaving ``run``: its replicas stop after their next push."""
    with _FETCHED_LOCK:
        _LEAVING.add(run)


def is_leaving(run: str) -> bool:
    """Whether this worker is leaving ``run`` (its replicas check after every push)."""
    return run in _LEAVING


def release(run: str) -> None:
    """The driver of ``run`` took what it needed off this worker (run with ``client.run``)."""
    with _FETCHED_LOCK:
        _RELEASED.add(run)


def is_released(run: str) -> bool:
    """Whether the driver of ``run`` released this leaving worker."""
    return run in _RELEASED


#: Results of replicas of this process that stopped because it is leaving, per run: a closing
#: worker cancels its tasks, so their results reach the driver only through here.
_RETURNED: dict[str, Outbox] = {}


def keep_returned(run: str, result: dict) -> None:
    """Keep the result of a replica of ``run`` that stopped because this worker is leaving."""
    with _FETCHED_LOCK:
        _RETURNED.setdefault(run, Outbox()).put(result)


def returned_after(run: str, process: str, taken: int) -> tuple[str, int, list[dict]]:
    """The results :func:`keep_returned` kept that the driver does not hold yet (as
    :func:`rows_after`; ``client.run``)."""
    with _FETCHED_LOCK:
        return answer(_RETURNED.get(run), process, taken)


#: The share of its data each replica of a run reads (positions into its task's arrays or file
#: list), per (run, replica), when the driver re-split the data for a replica that joined.
_SHARES: dict[tuple[str, int], np.ndarray] = {}


def assign_share(run: str, replica: int, positions: np.ndarray) -> None:
    """Replica ``replica`` of ``run`` reads only ``positions`` of its data from now on (run on
    its worker with ``client.run`` by the driver; see ``downpour/shares.py``)."""
    with _FETCHED_LOCK:
        _SHARES[(run, replica)] = np.asarray(positions)


def assigned_share(run: str, replica: int) -> np.ndarray | None:
    """The positions :func:`assign_share` gave ``replica`` last, None if it reads everything."""
    return _SHARES.get((run, replica))


#: How many replica loops of each run are running in this process.
_RUNNING: dict[str, int] = {}


@contextlib.contextmanager
def replica_running(run: str) -> Iterator[None]:
    """Count a replica loop of ``run`` as running in this process while in the block."""
    with _FETCHED_LOCK:
        _RUNNING[run] = _RUNNING.get(run, 0) + 1
    try:
        yield
    finally:
        with _FETCHED_LOCK:
            _RUNNING[run] -= 1
            if not _RUNNING[run]:
                del _RUNNING[run]


def running_replicas(run: str) -> int:
    """How many replica loops of ``run`` run in this process now."""
    return _RUNNING.get(run, 0)


def forget_run(run: str) -> None:
    """Drop this process's fetched copies of ``run`` (at the end of a fit)."""
    with _FETCHED_LOCK:
        for k in [k for k in _FETCHED if k[0] == run]:
            del _FETCHED[k]
        for k in [k for k in _ACKED if k[0] == run]:
            del _ACKED[k]
        _ROWS.pop(run, None)
        _LEAVING.discard(run)
        _RELEASED.discard(run)
        _RETURNED.pop(run, None)
        for k in [k for k in _SHARES if k[0] == run]:
            del _SHARES[k]
