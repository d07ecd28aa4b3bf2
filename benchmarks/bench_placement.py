"""Placing a fit's in-memory data on the workers: straight to them, or relayed by the scheduler.

Sandblaster (and Downpour, for in-memory data) scatters the driver's arrays to the workers
before the first pass: 10^6 x 100 float32 rows and their labels, cut into portions, are ~400 MB.
Dask's ``Client.scatter`` from a client outside the cluster sends them through the scheduler
unless told ``direct=True``; ``runtime.cluster.send_to_workers`` sends them straight to the
workers (a client made with ``direct_to_workers=False`` keeps the relay).  This script places
the same blocks (``sandblaster.blocks.ArrayBlocks.place``, what a fit calls) both ways,
alternating, on one 2-worker cluster with two clients, and prints the medians and the ratio.

    python benchmarks/bench_placement.py [--rows 1000000] [--features 100] [--portions 20]
                                         [--rounds 8]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from bench_sandblaster import make_data  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask.sandblaster.blocks import ArrayBlocks  # noqa: E402


def place_seconds(client: Client, blocks: ArrayBlocks, rows: list) -> float:
    """Seconds to place every portion's block; the blocks are released again afterwards."""
    start = time.perf_counter()
    futures = blocks.place(client, rows, None, timeout=120)
    seconds = time.perf_counter() - start
    client.cancel(futures)
    time.sleep(0.3)  # let the workers free the memory before the next placement
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--portions", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    X, y = make_data(args.rows, args.features)
    blocks = ArrayBlocks(X, y)
    rows = blocks.portions(len(X), args.portions, None)[0]
    megabytes = (X.nbytes + y.nbytes) / 2**20
    times: dict[str, list[float]] = {"straight to the workers": [], "relayed by the scheduler": []}
    with (
        local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as direct,
        Client(cluster, direct_to_workers=False) as relaying,
    ):
        place_seconds(direct, blocks, rows)  # warm-up: connections, first allocations
        for i in range(args.rounds):  # alternating, each first in every other round
            order = [("straight to the workers", direct), ("relayed by the scheduler", relaying)]
            for name, client in order if i % 2 == 0 else order[::-1]:
                times[name].append(place_seconds(client, blocks, rows))
    base = statistics.median(times["relayed by the scheduler"])
    print(
        f"\nplacing {args.rows:,} x {args.features} float32 rows and labels ({megabytes:,.0f} MiB) "
        f"in {args.portions} blocks on a 2-worker LocalCluster; {args.rounds} alternating rounds, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'path':28} {'median s':>9} {'range':>13} {'vs relayed':>11} {'MiB/s':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:28} {median:>9.3f} {min(values):>6.2f}-{max(values):<6.2f} "
            f"{median / base:>10.2f}x {megabytes / median:>7,.0f}"
        )


if __name__ == "__main__":
    main()
