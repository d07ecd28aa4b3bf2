"""Sandblaster L-BFGS against serial scipy L-BFGS-B on data in parquet files (10^7 x 100).

The data is the project's synthetic generator (``datasets.synthetic``: standard normal float32
features, labels of a fixed random teacher network, 2 classes), written as parquet files (~256
MiB each) into a temporary folder that the script deletes at the end.  The objective is
``models.LogisticRegression(features, l2=L2)`` as in ``bench_sandblaster.py``.  All start from
zeros.  Three ways to get from the files to the optimum, timed from the moment each is handed
the files (the target is the best final objective, re-evaluated in float64, times ``1 + rel``):

* **serial scipy L-BFGS-B**: one process reads every file into memory (the read counts: a user
  pays it), then minimises with the same float32 model code, one BLAS thread.
* **SandblasterLBFGS, files**: ``fit(datasets.from_parquet(...))``; each worker reads its share
  of the files itself, once, and keeps it for every pass.
* **SandblasterLBFGS, arrays from the driver** (what the library offered before files): the
  driver reads the files as scipy does (scipy's read, reused and its time counted again), and
  ``fit(X, y)`` scatters the rows to the workers.

The cluster (2 single-threaded worker processes, as Dask's nanny gives each one BLAS thread) is
started before any timing: a user who brings a cluster has it already.  ``moved`` is the bytes
the workers received from each other during the fit (a portion run away from its block); the
"any-worker" row lets an idle worker take a portion whose block is on another live worker
(``Portions.LOCAL_ONLY = False``, the dispatch before), the other waits for that worker.

    python benchmarks/bench_sandblaster_files.py [--rows 10000000] [--features 100] [--rel 1e-5]

Memory: the driver holds the data once (4 GB at the default size), the workers another copy;
disk: the files (4 GB), in ``--dir`` (default: a new temporary folder).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import dask  # noqa: E402
import numpy as np  # noqa: E402
from bench_sandblaster import (  # noqa: E402
    L2_WEIGHT,
    objective64,
    run_sandblaster,
    run_scipy,
    time_to,
)
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import datasets, models  # noqa: E402
from downpour_dask.sandblaster.blocks import read_block  # noqa: E402
from downpour_dask.sandblaster.portions import Portions  # noqa: E402


def read_all(files) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``files`` into one process's memory (one copy, file by file)."""
    X = np.empty((files.n_rows, files.n_features), np.float32)
    y = np.empty(files.n_rows, np.int64)
    row = 0
    for shard in files.shards:
        Xb, yb = read_block(shard, files.schema, 2)
        X[row : row + len(Xb)], y[row : row + len(Xb)] = Xb, yb
        row += len(Xb)
    return X, y


def transferred(client: Client) -> int:
    """Bytes the workers have received from each other so far."""

    def received(dask_worker) -> int:
        return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)

    return int(sum(client.run(received).values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--rel", type=float, default=1e-5, help="target: best * (1 + rel)")
    parser.add_argument("--dir", default=None, help="folder for the files (default: temporary)")
    parser.add_argument(
        "--skip-arrays", action="store_true", help="leave out the arrays-from-the-driver run"
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, dask {dask.__version__}"
    )
    folder = tempfile.mkdtemp(prefix="bench_sandblaster_files_", dir=args.dir)
    try:
        t = time.time()
        files = datasets.synthetic(folder, args.rows, args.features, classes=2, seed=0)
        print(
            f"wrote {len(files.shards)} parquet files, {files.n_rows:,} x {files.n_features} "
            f"in {time.time() - t:.1f}s; load: {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        run(files, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(files, args) -> None:
    model = models.LogisticRegression(args.features, l2=L2_WEIGHT)
    x0 = np.zeros(model.layout.size, np.float32)
    results, moved = {}, {}
    start = time.time()
    X, y = read_all(files)  # scipy's own read, timed as part of its run
    read = time.time() - start
    params, trace, evals = run_scipy(model, X, y, x0)
    results["serial scipy L-BFGS-B (reads the files)"] = (
        params, [(t + read, f) for t, f in trace], evals,
    )  # fmt: skip
    print(f"scipy done; load: {os.getloadavg()[0]:.1f}", flush=True)
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.run(lambda: None)
        original_init = models.LogisticRegression.init
        models.LogisticRegression.init = lambda self, rng: x0.copy()  # same start as scipy
        try:
            for local_only in (False, True):  # A/B: portions may run away from their block
                Portions.LOCAL_ONLY = local_only
                label = "SandblasterLBFGS (workers read the files)" + (
                    "" if local_only else " any-worker"
                )
                before = transferred(client)
                params, trace, evals = run_sandblaster(client, model, files, None, None)
                results[label] = (params, trace, evals)
                moved[label] = transferred(client) - before
            print(f"files done; load: {os.getloadavg()[0]:.1f}", flush=True)
            if not args.skip_arrays:
                label = "SandblasterLBFGS (driver reads, scatters)"
                before = transferred(client)
                params, trace, evals = run_sandblaster(client, model, X, y, None)
                results[label] = (params, [(t + read, f) for t, f in trace], evals)
                moved[label] = transferred(client) - before
        finally:
            models.LogisticRegression.init = original_init
    finals = {name: objective64(model, r[0], X, y) for name, r in results.items()}
    target = min(finals.values()) * (1 + args.rel)
    base = time_to(results["serial scipy L-BFGS-B (reads the files)"][1], target)
    print(
        f"\nlogistic regression, {files.n_rows:,} x {files.n_features} float32 in "
        f"{len(files.shards)} parquet files, l2={L2_WEIGHT}; 2-worker LocalCluster (1 thread "
        f"each); target objective {target:.8f} (best final * (1 + {args.rel:g})); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    header = f"{'method':42} {'final objective':>16} {'evals':>6} {'1st eval':>9} {'to target':>10}"
    print(f"{header} {'vs scipy':>9} {'moved':>9} {'backups':>8}")
    print(f"(scipy's read of the files into memory: {read:.2f}s, counted for both driver reads)")
    for name, (_, trace, evals) in results.items():
        evals, backups = evals if isinstance(evals, tuple) else (evals, "-")
        hit, first = time_to(trace, target), trace[0][0]
        mb = f"{moved[name] / 2**20:.0f} MiB" if name in moved else "-"
        print(
            f"{name:42} {finals[name]:>16.8f} {evals:>6} {first:>8.2f}s {hit:>9.2f}s "
            f"{hit / base:>8.2f}x {mb:>9} {backups:>8}"
        )


if __name__ == "__main__":
    main()
