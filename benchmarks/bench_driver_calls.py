"""Round trip of the driver's calls to parameter-server shards: relayed by the scheduler or direct.

A Dask client made without ``direct_to_workers=True`` (Dask's default) relays every actor call
through the scheduler.  The driver's calls to the shards -- Sandblaster's vector programs (about
three per L-BFGS iteration) and Downpour's status and evaluation pulls -- go straight to the
shard's worker instead (``runtime/dask_internals.direct_actor``).  This script times both paths
on the same 2 shards of a 2-worker local cluster, in turns (one batch of ``--calls`` per path per
round), for a call with a few scalars back (``current_version``) and one bringing back a 101-value
slice (``pull``), and prints the medians and the ratio of each relayed call to the direct one of
the same round.  The workers are idle: inside a fit, where the workers compute, every call costs
more (``benchmarks/README.md`` has both).

    python benchmarks/bench_driver_calls.py [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
from clusters import local_cluster
from distributed import Actor, Client

from downpour_dask import ParameterServer, optim
from downpour_dask.ps.shard import ParameterServerShard


def timed(server: ParameterServer, method, calls: int) -> float:
    """Median seconds of one ``call_all`` of ``method`` (both shards at once)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        server.call_all(method, timeout=30)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )
    methods = {
        "version (scalars back)": ParameterServerShard.current_version,
        "pull (101 float32 back)": ParameterServerShard.pull,
    }
    rows: dict[tuple[str, str], list[float]] = {}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        server = ParameterServer.create(client, np.zeros(202, np.float32), 2, optim.sgd(0.1))
        plain = [  # handles as Dask makes them: its default path, through the scheduler
            Actor(ParameterServerShard, address, shard.key)
            for shard, address in zip(server.shards, server.workers)
        ]
        relayed = ParameterServer(plain, server.ranges, server.workers)
        try:
            for _ in range(args.rounds):
                for name, method in methods.items():
                    direct = timed(server, method, args.calls)
                    relay = timed(relayed, method, args.calls)
                    rows.setdefault((name, "direct"), []).append(direct)
                    rows.setdefault((name, "relayed"), []).append(relay)
                    rows.setdefault((name, "ratio"), []).append(relay / direct)
        finally:
            server.close()
    print(
        f"\ndriver -> 2 shards (both at once), idle 2-worker LocalCluster; median of "
        f"{args.rounds} rounds of {args.calls} calls"
    )
    print(f"{'call':28} {'direct':>10} {'relayed':>10} {'relayed/direct':>15} {'rounds':>12}")
    for name in methods:
        ratios = rows[(name, "ratio")]
        print(
            f"{name:28} {statistics.median(rows[(name, 'direct')]) * 1e3:>8.2f}ms "
            f"{statistics.median(rows[(name, 'relayed')]) * 1e3:>8.2f}ms "
            f"{statistics.median(ratios):>14.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
