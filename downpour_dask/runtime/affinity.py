"""Each worker process on CPUs of its own: :func:`pin_workers` and :func:`unpin_workers`.

A Downpour worker runs a replica thread beside helper threads -- the wire's sender and receiver,
the shard service's connection threads, the event loop -- that hand each other the same
buffers: the gradient a push sends, the values a fetch installs, the shard slice both the local
replica and a far push update.  Left to the kernel's scheduler, on a machine with as many cores
as workers these threads spread over every core: a helper reads a buffer out of the other
core's cache, and two workers' busy threads meet on one core while the other core runs helpers.
Pinned, each worker's threads and their data stay together.  On the 2-core development machine
that raised Downpour's share of the no-communication ceiling and brought 4 replicas to within a
few points of 2 (``benchmarks/README.md``, ``bench_downpour.py --pinned both``).

It takes CPUs away: a pinned worker can no longer borrow an idle core (a fit with fewer replicas
than workers, a worker that also serves other work), and a cluster sharing its host with other
jobs may have better uses for the cores.  So a cluster the user brings is pinned only when asked;
an embedded cluster pins itself when its fit has a replica for every worker
(:func:`~downpour_dask.runtime.cluster.cluster_client`).  Pinning is a Dask worker plugin, so a
worker its nanny restarts is pinned again; :func:`unpin_workers` gives every worker back the CPUs
it had.  Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

from .cpus import helpers_as_batch, pin_threads, require_affinity, split_cpus
from .dask_client_calls import (
    register_worker_plugin,
    run_within,
    scheduler_workers,
    unregister_worker_plugin,
)

#: The plugin's name on the cluster (one pinning at a time: a new one replaces it).
PLUGIN_NAME = "downpour-dask-pinned-cpus"


class PinnedCPUs(WorkerPlugin):
    """Pins its worker's process to the CPUs listed for the worker's name when it is set up
    (also in a worker that a nanny restarted: the scheduler hands it its plugins), and gives
    back the CPUs the process had when it is torn down.

    Parameters
    ----------
    by_name : dict
        ``str(worker.name)``: the CPUs that worker may use.  A worker not listed (one that
        joined later) is left as it is.
    """

    name = PLUGIN_NAME

    def __init__(self, by_name: dict[str, list[int]]):
        self.by_name = by_name
        self.before: list[int] | None = None  # the CPUs this worker had, while pinned

    def setup(self, worker: Any) -> None:
        cpus = self.by_name.get(str(worker.name))
        if cpus is None:
            return
        before = sorted(os.sched_getaffinity(0))
        pin_threads(cpus)
        helpers_as_batch(True)
        self.before = before

    def teardown(self, worker: Any) -> None:
        if self.before is not None:
            pin_threads(self.before)
            helpers_as_batch(False)
            self.before = None


def _cpus_before_pinning(dask_worker: Any) -> list[int]:
    """The CPUs this worker may use apart from a pinning of ours (run on each worker)."""
    require_affinity()
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    before = getattr(plugin, "before", None)
    return list(before) if before is not None else sorted(os.sched_getaffinity(0))


def _name_order(info: dict[str, Any]) -> tuple[int, Any]:
    """Workers in name order: numbers (a LocalCluster's 0, 1, ...) by value, then the rest."""
    name = info.get("name")
    return (0, name) if isinstance(name, int) else (1, str(name))


def pin_workers(
    client: Client, cpus: Sequence[int] | None = None, timeout: float = 60.0
) -> dict[str, list[int]]:
    """Pin each worker process of ``client``'s cluster to CPUs of its own, for good.

    On every host, the CPUs its workers may use (or those of them in ``cpus``) are split into
    disjoint runs of consecutive CPUs, one per worker in name order (:func:`split_cpus`).  It
    stays in force until :func:`unpin_workers`, also for a worker its nanny restarts (it keeps
    its name); a worker that joins later is not pinned.  Calling it again re-pins.

    Parameters
    ----------
    client : distributed.Client
    cpus : sequence of int, optional
        Only these CPUs (on every host); by default every CPU the workers may use now.
    timeout : float
        Seconds to wait for the cluster's answers.

    Returns
    -------
    dict
        Each worker's address and the CPUs it is pinned to.

    Raises
    ------
    ValueError
        A host has more workers than CPUs to give them, or ``cpus`` names none the workers may
        use; nothing is changed.
    RuntimeError
        A worker's platform cannot pin threads (not Linux).
    """
    workers = scheduler_workers(client)
    if not workers:
        raise ValueError("the cluster has no workers to pin")
    allowed = run_within(client, _cpus_before_pinning, list(workers), timeout)
    by_host: dict[str, list[str]] = {}
    for address, info in workers.items():
        by_host.setdefault(info["host"], []).append(address)
    pinned = {}
    for host, addresses in by_host.items():
        pool = set().union(*(allowed[a] for a in addresses if a in allowed))
        if cpus is not None:
            chosen = pool & set(cpus)
            if not chosen:
                raise ValueError(
                    f"cpus={sorted(set(cpus))} names no CPU the workers on {host} may use "
                    f"({sorted(pool)})"
                )
            pool = chosen
        addresses.sort(key=lambda a: _name_order(workers[a]))
        pinned.update(zip(addresses, split_cpus(pool, len(addresses))))
    by_name = {str(workers[address].get("name")): run for address, run in pinned.items()}
    register_worker_plugin(client, PinnedCPUs(by_name), PLUGIN_NAME, timeout)
    return pinned


def unpin_workers(client: Client, timeout: float = 60.0) -> bool:
    """Give every worker pinned by :func:`pin_workers` back the CPUs it had; return whether
    there was a pinning to undo."""
    return unregister_worker_plugin(client, PLUGIN_NAME, timeout)
