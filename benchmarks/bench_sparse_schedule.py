"""Sparse replicas with n_fetch = n_push = k: traffic, speed and held-out log-loss against k = 1.

An embedding + MLP model (26 hashed fields into a table of 2**18 rows x 8, 13 numeric
features, hidden 32) on the Criteo-shaped synthetic click log (downpour_dask/data/criteo.py),
trained for one epoch by 2 replicas against 2 shards on a 2-worker local cluster, for
k = 1, 2, 4, 8 (a fetch pulls the union of the rows of the next k batches, a push carries each
row touched since the last push once).  The runs of the different k are interleaved and
repeated (``--repeats``); the table shows the median of each k and its ratio to k = 1:
examples/s over the run, bytes moved per example (ids, rows and dense slices, both
directions, all shards, from the push log), pushes per replica, and the held-out log-loss of
the final parameters.

    python benchmarks/bench_sparse_schedule.py [--rows 400000] [--repeats 3]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402
from sklearn.metrics import log_loss  # noqa: E402

from downpour_dask.core.sparse_models import EmbeddingMLP  # noqa: E402
from downpour_dask.data.criteo import criteo_spec, write_criteo  # noqa: E402
from downpour_dask.data.hashing import load_hashed  # noqa: E402
from downpour_dask.downpour.sparse_fit import fit_sparse  # noqa: E402

KS = (1, 2, 4, 8)
BATCH = 256


def held_out_loss(model, dense, tables, test) -> float:
    touched = model.touched(test)
    rows = [(ids, tables[t][ids]) for t, ids in enumerate(touched)]
    p = np.clip(np.asarray(model.predict_proba(dense, rows, test), np.float64), 1e-7, 1 - 1e-7)
    return float(log_loss(test.y, p, labels=[0, 1]))


def one_run(client, model, train, test, k) -> dict[str, float]:
    start = time.perf_counter()
    fit = fit_sparse(model, train, client=client, n_replicas=2, n_shards=2, batch_size=BATCH,
                     max_epochs=1, optimizer="adagrad", learning_rate=0.05, n_fetch=k,
                     n_push=k, timeout=300)
    seconds = time.perf_counter() - start
    try:
        dense, tables = fit.state()
    finally:
        fit.close()
    pushes = fit.pushes
    examples = pushes[pushes["shard"] == 0]["examples"].sum()
    return {"examples/s": examples / seconds, "bytes/example": pushes["bytes"].sum() / examples,
            "pushes/replica": len(pushes[pushes["shard"] == 0]) / 2,
            "log-loss": held_out_loss(model, dense, tables, test)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="/tmp/downpour-bench-schedule")
    args = parser.parse_args()
    paths = write_criteo(args.data, args.rows, rows_per_file=args.rows // 4)
    spec = criteo_spec(n_rows=1 << 18)
    train, test = load_hashed(paths[:-1], spec), load_hashed(paths[-1:], spec)
    model = EmbeddingMLP(1 << 18, 26, n_numeric=13, dim=8, hidden=(32,))
    print(f"{platform.node()}: {os.cpu_count()} cores, load {os.getloadavg()}; "
          f"{len(train.y):,} training rows, {len(test.y):,} held out, batch {BATCH}")
    results: dict[int, list[dict[str, float]]] = {k: [] for k in KS}
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        one_run(client, model, train, test, 1)  # warm the workers up
        for _ in range(args.repeats):
            for k in KS:  # interleaved: a change of load hits every k alike
                results[k].append(one_run(client, model, train, test, k))
    columns = list(results[1][0])
    median = {k: {c: float(np.median([r[c] for r in results[k]])) for c in columns} for k in KS}
    print(f"\n{'k':>3}" + "".join(f"{c:>16}" for c in columns) + "   vs k = 1")
    for k in KS:
        row = median[k]
        ratio = (f"{row['examples/s'] / median[1]['examples/s']:.2f}x examples/s, "
                 f"{row['bytes/example'] / median[1]['bytes/example']:.2f}x bytes")
        print(f"{k:>3}" + "".join(f"{row[c]:>16,.3f}" for c in columns) + f"   {ratio}")
    print(f"(medians of {args.repeats} interleaved runs; load at the end {os.getloadavg()})")


if __name__ == "__main__":
    main()
