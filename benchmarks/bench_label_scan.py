"""The label scan at the start of a fit on a Dask collection: sorting each block or hashing it.

A classifier fitted on Dask data learns its classes from the labels first: every block's distinct
values are found on the worker holding it, and the driver merges the small results
(``data/dask_collections.distinct_labels``).  Nothing else of the fit can start before it.  This
script times that scan on a 2-worker local cluster for 10^6 labels (``--rows``) in 2 blocks
already in the workers' memory (as data Dask loaded there is), with each block's values found by
``np.unique`` (a sort: the project's scan before 2026-11-26, the baseline) and by
``pandas.unique`` (a hash table: the scan now), in turns, ``--rounds`` times each, and prints the
medians and the ratio to the baseline.  Also timed: the same two functions alone on one block in
this process, with no Dask around them.

    python benchmarks/bench_label_scan.py [--rows 1000000] [--classes 2] [--rounds 15]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client, wait  # noqa: E402

from downpour_dask.data.dask_collections import distinct_labels  # noqa: E402


def sorted_scan(labels: da.Array) -> da.Array:
    """The baseline: each block's distinct values by ``np.unique`` (it sorts the block)."""
    blocks = ((np.nan,) * len(labels.chunks[0]),)
    return labels.map_blocks(np.unique, chunks=blocks, dtype=labels.dtype)


def on_workers(client: Client, y: np.ndarray, parts: int) -> da.Array:
    """``y`` as a Dask Array of ``parts`` blocks, each made by a task on its own worker."""
    workers = sorted(client.scheduler_info()["workers"])
    cuts = np.linspace(0, len(y), parts + 1).astype(int).tolist()
    blocks = []
    for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        where = [workers[i % len(workers)]]
        scattered = client.scatter(y[lo:hi], workers=where, hash=False)
        blocks.append(client.submit(np.array, scattered, workers=where, pure=False))
    wait(blocks)
    return da.concatenate(
        [da.from_delayed(b, (hi - lo,), y.dtype) for b, lo, hi in zip(blocks, cuts, cuts[1:])]
    )


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, pandas {pd.__version__}, "
        f"dask {dask.__version__}"
    )
    y = np.random.default_rng(0).integers(0, args.classes, args.rows)
    block = y[: args.rows // 2]
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        times.setdefault("np.unique, one block, no Dask", []).append(
            seconds(lambda: np.unique(block))
        )
        times.setdefault("pandas.unique, one block, no Dask", []).append(
            seconds(lambda: pd.unique(block))
        )
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        labels = on_workers(client, y, 2)
        expected = np.unique(y)
        for scan in (sorted_scan, distinct_labels):  # once each, untimed: imports on the workers
            assert np.array_equal(np.unique(client.compute(scan(labels)).result()), expected)
        for _ in range(args.rounds):
            for name, scan in (("np.unique (before)", sorted_scan),
                               ("pandas.unique (now)", distinct_labels)):  # fmt: skip
                times.setdefault(f"{name}, 2 blocks on the cluster", []).append(
                    seconds(lambda scan=scan: client.compute(scan(labels)).result(timeout=60))
                )
    print(
        f"\n{args.rows:,} int64 labels, {args.classes} classes; {args.rounds} rounds in turns; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'scan':52} {'median':>9} {'min':>9} {'max':>9} {'vs np.unique':>13}")
    baseline = {}
    for name, values in times.items():
        kind = name.split(", ", 1)[1]
        median = statistics.median(values)
        baseline.setdefault(kind, median)
        print(
            f"{name:52} {median * 1e3:>7.1f}ms {min(values) * 1e3:>7.1f}ms "
            f"{max(values) * 1e3:>7.1f}ms {median / baseline[kind]:>12.2f}x"
        )


if __name__ == "__main__":
    main()
