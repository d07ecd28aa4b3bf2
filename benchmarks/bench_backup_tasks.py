"""Sandblaster L-BFGS with one straggling worker: batch time with backup tasks against without.

One worker of a 2-worker local cluster sleeps ``--delay`` seconds in every portion it runs
(``fit(..., portion_delay=)``, the estimator's fault injection).  Without backup tasks every
batch waits for the straggler's portions; with them, copies of its late portions run on the
healthy worker and the first copy to finish counts.  The table gives the median batch time
(``batch_start`` to ``batch_done`` events) of each setting over ``--repeats`` fits, run
alternately on the same cluster, and the ratio with/without (below 1: backups help).  The test
suite checks only what timing cannot break (which worker's portions were counted); the speed-up
is measured here.

    python benchmarks/bench_backup_tasks.py [--delay 0.5] [--repeats 5] [--portions 10]
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import numpy as np
from clusters import local_cluster
from distributed import Client

from downpour_dask import SandblasterLBFGS, datasets, models
from downpour_dask.runtime.cluster import cluster_workers


def batch_seconds(est: SandblasterLBFGS) -> np.ndarray:
    events = est.experiment_.events
    start = events.loc[events["kind"] == "batch_start", "time"].to_numpy()
    done = events.loc[events["kind"] == "batch_done", "time"].to_numpy()
    return done - start


def idle(client: Client, timeout: float = 60) -> None:
    """Wait until no task runs on any worker (a straggler's leftover copies drain)."""
    deadline = time.monotonic() + timeout
    while any(client.run(lambda dask_worker: list(dask_worker.active_threads)).values()):
        if time.monotonic() > deadline:
            raise TimeoutError("workers still busy")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--portions", type=int, default=10)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*did not converge")  # max_iter=2 on purpose
    train, _ = datasets.load("digits")
    y = (train.y >= 5).astype(np.float64)
    model = models.LogisticRegression(train.n_features, l2=1e-2)
    print(
        f"{platform.machine()}, Python {platform.python_version()}, delay {args.delay} s on "
        f"one of 2 workers, {args.portions} portions per batch, {args.repeats} repeats"
    )
    times: dict[bool, list[float]] = {False: [], True: []}
    with (
        local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        slow = sorted(cluster_workers(client))[1]
        for _ in range(args.repeats):
            for backup in (False, True):
                est = SandblasterLBFGS(
                    model, portions_per_batch=args.portions, max_iter=2, backup_tasks=backup,
                    random_state=0,
                ).fit(train.X, y, client=client, portion_delay={slow: args.delay})  # fmt: skip
                times[backup].append(float(np.median(batch_seconds(est))))
                idle(client)
    without, with_ = np.median(times[False]), np.median(times[True])
    print("| backup tasks | median batch (s) | runs (s) |")
    print("|---|---|---|")
    for backup, median in ((False, without), (True, with_)):
        runs = ", ".join(f"{t:.3f}" for t in times[backup])
        print(f"| {'on' if backup else 'off'} | {median:.3f} | {runs} |")
    print(f"with / without: {with_ / without:.2f}x")


if __name__ == "__main__":
    main()
