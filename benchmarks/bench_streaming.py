"""Streaming a large parquet dataset from disk against training on the same data in memory.

Writes a synthetic classification dataset of ``--gib`` GiB of float32 features as parquet shards
(``datasets.synthetic``), then on a local cluster of 2 single-threaded worker processes:

1. **read only**: each worker streams its half of the shards through the real reader (row groups,
   shuffle buffer, prefetch thread) without training: the reader's capacity, rows/s per worker;
2. **streaming epoch**: ``DownpourSGD.fit`` for one epoch over the files (2 replicas, one per
   worker): rows/s per worker and each worker process's peak resident memory (VmHWM, reset just
   before the epoch);
3. **in-memory epoch**: the same estimator for one epoch over in-memory arrays of the same shape
   (the first ``--memory-fraction`` of the rows, so that the client's copy, the scattered copies
   and the 2 workers fit in RAM next to other jobs); compared per row, i.e. rows/s per worker.

Reading cost = 1 - (streaming rows/s) / (in-memory rows/s): the share of the epoch's time that
streaming adds.  Targets: peak RSS < 1.5 GiB per worker, reading cost < 10%.

    python benchmarks/bench_streaming.py [--gib 4] [--path /tmp/downpour-bench] [--keep]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
from clusters import local_cluster
from distributed import Client

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.data.assignment import assign_shards
from downpour_dask.data.stream import ShardStream, StreamSpec, default_buffer
from downpour_dask.runtime.cluster import cluster_workers

FEATURES, CLASSES, HIDDEN, BATCH = 256, 10, 64, 512


def reset_peak_rss() -> None:
    """Start a new VmHWM measurement in this process (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kib = line.split()[:2]
                values[key] = int(kib) / 1024
    return values["VmRSS:"], values["VmHWM:"]


def read_only(spec: StreamSpec) -> tuple[int, float]:
    """Stream one epoch of ``spec`` on this worker without training: (rows, seconds)."""
    start, rows = time.perf_counter(), 0
    for _, yb in ShardStream(spec).epoch(np.random.default_rng(0)):
        rows += len(yb)
    return rows, time.perf_counter() - start


def estimator() -> DownpourSGD:
    return DownpourSGD(
        models.MLP(FEATURES, (HIDDEN,), CLASSES),
        n_replicas=2,
        n_shards=2,
        optimizer="adagrad",
        learning_rate=0.02,
        batch_size=BATCH,
        n_fetch=4,
        n_push=4,
        max_epochs=1,
        eval_every=5.0,
        random_state=0,
        timeout=600,
    )


def epoch(client: Client, data, workers: list[str]) -> dict:
    """One epoch; per worker: rows, rows/s over the epoch, peak RSS during it."""
    client.run(reset_peak_rss)
    est = estimator().fit(data, client=client)
    peaks = client.run(rss_mib)
    pushes = est.experiment_.pushes
    out = {}
    for r, rows in pushes.groupby("replica"):
        worker = workers[r % len(workers)]
        span = rows["time"].max()  # seconds from the start of fit to the replica's last push
        out[worker] = (int(rows["examples"].sum()), rows["examples"].sum() / span, peaks[worker][1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="feature bytes to write (GiB)")
    parser.add_argument("--path", default="/tmp/downpour-bench-streaming")
    parser.add_argument("--memory-fraction", type=float, default=0.25)
    parser.add_argument("--keep", action="store_true", help="keep the parquet files")
    args = parser.parse_args()
    rows = int(args.gib * 2**30 / (4 * FEATURES))
    path = Path(args.path)
    if path.exists():
        shutil.rmtree(path)
    start = time.perf_counter()
    ds = datasets.synthetic(path, rows, FEATURES, CLASSES, seed=0)
    written = sum(os.path.getsize(s.path) for s in ds.shards)
    print(
        f"wrote {rows:,} rows x {FEATURES} float32 features ({written / 2**30:.2f} GiB on disk, "
        f"{len(ds.shards)} files) in {time.perf_counter() - start:.0f} s"
    )
    try:
        with (
            local_cluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
            ) as cluster,
            Client(cluster) as client,
        ):
            workers = sorted(cluster_workers(client))
            results = {}
            client.run(reset_peak_rss)
            specs = [
                StreamSpec(ds.schema, tuple(s), BATCH, default_buffer(FEATURES, BATCH), CLASSES)
                for s in assign_shards(ds.shards, 2)
            ]
            futures = [
                client.submit(read_only, spec, workers=[w], pure=False)
                for spec, w in zip(specs, workers)
            ]
            reads = [f.result() for f in futures]
            peaks = client.run(rss_mib)
            results["read only (no training)"] = {
                w: (n, n / s, peaks[w][1]) for w, (n, s) in zip(workers, reads)
            }
            results["streaming epoch (parquet)"] = epoch(client, ds, workers)
            n_mem = int(rows * args.memory_fraction)
            memory = datasets.from_parquet(
                [s.path for s in ds.shards[: max(1, int(len(ds.shards) * args.memory_fraction))]]
            ).to_dataset()
            memory = datasets.from_arrays(memory.X[:n_mem], memory.y[:n_mem])
            results["in-memory epoch"] = epoch(client, memory, workers)
            del memory
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    print(
        f"\nMLP {FEATURES}-{HIDDEN}-{CLASSES}, batch {BATCH}, n_fetch=n_push=4, 2 replicas, "
        f"2 shards, 2 single-thread workers; {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print(f"{'run':<28}{'worker':>8}{'rows':>12}{'rows/s':>11}{'peak RSS':>11}")
    for name, per_worker in results.items():
        for i, w in enumerate(workers):
            n, rate, peak = per_worker[w]
            print(f"{name if i == 0 else '':<28}{i:>8}{n:>12,}{rate:>11,.0f}{peak:>8,.0f} MiB")
    stream = np.mean([v[1] for v in results["streaming epoch (parquet)"].values()])
    mem = np.mean([v[1] for v in results["in-memory epoch"].values()])
    worst = max(v[2] for v in results["streaming epoch (parquet)"].values())
    print(
        f"\nreading cost: {max(0.0, 1 - stream / mem):.1%} of the epoch time "
        f"(streaming {stream:,.0f} vs in-memory {mem:,.0f} rows/s per worker); "
        f"worst streaming peak RSS {worst:,.0f} MiB (target < 1,536 MiB)"
    )


if __name__ == "__main__":
    main()
