"""A process's CPUs and its helper threads' scheduling, with no Dask: the part of pinning
(:mod:`.affinity`) a worker process does to itself.

Linux keeps a CPU affinity and a scheduling policy per *thread*, so :func:`pin_threads` sets
every thread of the process (threads started later inherit the affinity of the thread that
starts them).  In a pinned process a replica computes on the same CPU as the helper threads that
serve its connections and its shard (``ps/wire.py``, ``ps/service.py``, which start them with
:func:`helper_thread`).  Linux lets a woken thread preempt the one running; a helper woken by a
reply would then take the CPU from the replica mid-step, and the replica would wait for the GIL
the helper holds.  So in a pinned process helpers are batch threads (``SCHED_BATCH``: no
preemption on wake-up; they run when the replica's time slice ends or it waits, or when it lets
them, once a step: :func:`let_helpers_run`), and while the process is not pinned they are
ordinary threads, able to run on another core at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

#: The names of the threads :func:`helper_thread` starts begin with this.
HELPER_PREFIX = "downpour-wire"

#: Whether this process is pinned, so that its helper threads run as batch threads.
_helpers_batch = False


def split_cpus(cpus: Iterable[int], n_workers: int) -> list[list[int]]:
    """``cpus`` split into ``n_workers`` disjoint runs of consecutive CPUs, as equal as they
    can be (the first ones get one more when they do not divide evenly).

    Raises ValueError when there are fewer CPUs than workers: two workers on one CPU would
    compete for it the whole fit, which is what pinning is meant to prevent.
    """
    pool = sorted(set(cpus))
    if n_workers < 1:
        raise ValueError(f"n_workers must be at least 1, got {n_workers}")
    if n_workers > len(pool):
        raise ValueError(
            f"cannot pin {n_workers} workers to CPUs of their own: only {len(pool)} CPU(s) "
            f"{pool} are available to them; use at most {len(pool)} workers per host, or "
            f"leave them unpinned"
        )
    size, extra = divmod(len(pool), n_workers)
    runs, start = [], 0
    for i in range(n_workers):
        stop = start + size + (1 if i < extra else 0)
        runs.append(pool[start:stop])
        start = stop
    return runs


def require_affinity() -> None:
    """Raise RuntimeError, saying why, where threads cannot be pinned (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(
            "pinning workers to CPUs needs os.sched_setaffinity, which this platform "
            "(Linux only) does not have"
        )


def pin_threads(cpus: Iterable[int]) -> int:
    """Let every thread of this process run on ``cpus`` only; return how many threads were set.

    Linux's affinity belongs to a thread, not to a process, so each one is set; threads started
    afterwards inherit the affinity of the thread that starts them.
    """
    require_affinity()
    allowed = set(cpus)
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), allowed)
        except ProcessLookupError:  # the thread ended since the listing
            continue
        pinned += 1
    return pinned


def thread_cpus() -> dict[int, list[int]]:
    """Each thread of this process (native id) and the CPUs it may run on."""
    require_affinity()
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            found[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            continue
    return found


def _set_policy(tid: int, batch: bool) -> None:
    """Thread ``tid`` (0: the calling one) as a batch or an ordinary thread, where Linux's
    scheduling policies exist; a thread that ended meanwhile is left alone."""
    if not hasattr(os, "sched_setscheduler"):
        return
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    with contextlib.suppress(OSError):  # ProcessLookupError: it ended
        os.sched_setscheduler(tid, policy, os.sched_param(0))


def helpers_as_batch(batch: bool) -> None:
    """Make this process's helper threads, those running and those started later, batch threads
    (``batch``: the process was pinned) or ordinary ones again (it was unpinned)."""
    global _helpers_batch
    _helpers_batch = batch
    for thread in threading.enumerate():
        if thread.name.startswith(HELPER_PREFIX) and thread.native_id is not None:
            _set_policy(thread.native_id, batch)


def let_helpers_run() -> None:
    """Give the CPU to this process's helper threads that are ready to run, if it is pinned.

    A replica calls it once a step.  Batch helpers never preempt it, so without it a reply
    that arrived, or a request handed to a sender thread, waits for the end of the replica's
    time slice (milliseconds, several steps), and the replica then waits for its
    acknowledgements while its CPU idles.  Yielding at a step's boundary runs them at a point
    where the replica holds nothing they need.
    """
    if _helpers_batch:
        os.sched_yield()


def helper_thread(target: Callable[..., Any], name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread (not started) named ``name`` -- which must begin with
    :data:`HELPER_PREFIX` -- that runs ``target(*args)``, as a batch thread if this process is
    pinned."""
    if not name.startswith(HELPER_PREFIX):
        raise ValueError(f"a helper thread's name must begin with {HELPER_PREFIX!r}, got {name!r}")

    def run() -> None:
        if _helpers_batch:
            _set_policy(0, True)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def thread_policies() -> dict[str, list[int]]:
    """Each thread name of this process and the scheduling policies its threads have (Linux's
    ``os.SCHED_*`` numbers): what tests and diagnostics look at."""
    found: dict[str, list[int]] = {}
    for thread in threading.enumerate():
        if thread.native_id is not None and hasattr(os, "sched_getscheduler"):
            with contextlib.suppress(OSError):
                found.setdefault(thread.name, []).append(os.sched_getscheduler(thread.native_id))
    return found
