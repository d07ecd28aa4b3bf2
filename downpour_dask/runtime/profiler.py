"""Dask's worker profiler and a CPython deadlock it can set off, and what the library does about
it.

Dask's worker profiler samples every thread's stack with ``sys._current_frames()`` every 10 ms
(``distributed.worker.profile``).  On CPython before 3.11.9 that call can deadlock the whole
worker process (CPython gh-106883): it holds the interpreter's lock on its list of threads while
it builds frame objects; an allocation there can start the garbage collector, and a finalizer the
collector runs (a Dask ``Future.__del__``, say) lets another thread take the GIL.  If that thread
is starting or ending a thread, it waits for the list's lock while holding the GIL, and neither
moves again.  A Downpour worker starts and ends threads all the time (the helper threads of its
direct connections, the threads Dask adds for seceded replica tasks), and a run of this
project's CI script saw it happen: a worker's event loop stuck in ``trigger_profile`` ->
``Future.__del__``, a replica stuck in ``Thread.start``, until the scheduler gave up on the
silent worker 5 minutes later.  CPython 3.12 runs the collector only at safe points, and 3.11.9
turns it off during the call.

So, on an interpreter that has the bug, the clusters the library starts itself run their workers
without the profiler (the dashboard's profile page stays empty), restarted workers included, and
a fit on a cluster whose workers have both the bug and the profiler -- now, or once their nanny
restarts them after a crash -- warns, once per cluster, saying how to turn it off.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import dask

from .dask_client_calls import ask_each_within

#: Dask's setting that starts the worker profiler.
PROFILE_SETTING = "distributed.worker.profile.enabled"

#: Schedulers whose workers were already looked at by :func:`warn_if_profiler_can_deadlock`.
_checked: set[str] = set()


def profiler_can_deadlock(
    version: tuple[int, ...] | None = None, implementation: str | None = None
) -> bool:
    """Whether ``sys._current_frames()``, which Dask's worker profiler calls, can deadlock a
    process on this interpreter (default: the running one): CPython before 3.11.9 (gh-106883)."""
    version = tuple(sys.version_info[:3]) if version is None else tuple(version[:3])
    implementation = sys.implementation.name if implementation is None else implementation
    return implementation == "cpython" and version < (3, 11, 9)


def without_unsafe_profiler() -> dict[str, Any]:
    """Keyword arguments for a :class:`distributed.LocalCluster` (or a ``Nanny``) whose workers
    go without the profiler where :func:`profiler_can_deadlock`: ``{"config": ...}``, a copy of
    Dask's settings with the profiler off, there; ``{}`` elsewhere.

    Each nanny starts its worker with those settings, and every worker it restarts after a
    crash.  A ``dask.config.set`` block around the cluster's creation would not do: a nanny keeps
    a shallow merge of Dask's settings (``toolz.merge``), which shares their nested sections, so
    once the block has ended a restarted worker would run the profiler again.
    """
    if not profiler_can_deadlock():
        return {}
    settings = dask.config.merge(dask.config.config)  # a copy of every section
    dask.config.set({PROFILE_SETTING: False}, config=settings)
    return {"config": settings}


def _profile_risk(dask_worker: Any = None) -> tuple[tuple[int, ...], str, bool]:
    """This worker's interpreter (version, implementation) and whether its profiler runs."""
    running = "profile" in getattr(dask_worker, "periodic_callbacks", {})
    return tuple(sys.version_info[:3]), sys.implementation.name, running


def _restart_risk(dask_worker: Any = None) -> tuple[tuple[int, ...], str, bool]:
    """This nanny's interpreter and whether a worker it restarted now would run the profiler.
    A nanny hands its worker its own settings, a shallow merge that shares their sections with
    its process's: made inside a ``dask.config.set`` block, it restarts workers with whatever
    the block's end put back."""
    settings = getattr(dask_worker, "config", None) or {}
    enabled = dask.config.get(PROFILE_SETTING, False, config=settings)
    return tuple(sys.version_info[:3]), sys.implementation.name, bool(enabled)


def _at_risk(answers: dict[str, tuple[tuple[int, ...], str, bool]]) -> list[str]:
    """The addresses whose answer says the profiler is on where it can deadlock."""
    return sorted(
        address
        for address, (version, implementation, profiling) in answers.items()
        if profiling and profiler_can_deadlock(version, implementation)
    )


def warn_if_profiler_can_deadlock(client: Any, timeout: float = 10.0) -> bool:
    """Warn (``RuntimeWarning``, once per scheduler) if a worker of ``client``'s cluster runs
    Dask's profiler on an interpreter where it can deadlock (:func:`profiler_can_deadlock`), or
    its nanny would restart it with the profiler after a crash; return whether it warned.
    Workers and nannies are asked at once; those that do not answer within ``timeout``
    seconds in all are left out (a stopped worker, say): this is advice, not a precondition of
    the fit, and the others' answers still count."""
    address = getattr(getattr(client, "scheduler", None), "address", None) or str(id(client))
    if address in _checked:
        return False
    _checked.add(address)
    try:
        workers, nannies = ask_each_within(
            client, [(_profile_risk, False), (_restart_risk, True)], timeout
        )
    except Exception:  # noqa: BLE001 - a client that cannot ask: nothing to advise on
        return False
    running, restarting = _at_risk(workers), _at_risk(nannies)
    if not running and not restarting:
        return False
    first = workers[running[0]] if running else nannies[restarting[0]]
    version = ".".join(map(str, first[0]))
    what = [f"{len(running)} of the {len(workers)} workers that answered run Dask's profiler"]
    if restarting:
        what.append(
            f"{len(restarting)} of the {len(nannies)} nannies that answered would restart a "
            f"crashed worker with it (a nanny made inside a dask.config.set block takes the "
            f"settings current at the restart)"
        )
    warnings.warn(
        f"{'; '.join(what)}, on Python {version}, where it can deadlock a worker that starts "
        f"threads, as a fit's workers do (CPython gh-106883, fixed in 3.11.9 and 3.12). Start "
        f"the workers with the setting {PROFILE_SETTING}=False (environment: "
        f"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False; for a LocalCluster, "
        f"dask.config.set before making it, not as a with block around it), or on Python "
        f"3.11.9 or later.",
        RuntimeWarning,
        stacklevel=2,
    )
    return True
