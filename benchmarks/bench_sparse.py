"""Sparse tables: traffic and speed of the sparse path, time to a target log-loss, and scale.

Three parts, on the Criteo-shaped synthetic click log (downpour_dask/data/criteo.py):

1. **Sparse vs dense path.**  An embedding + MLP model (26 hashed fields into a table of
   2**18 rows x 8, 13 numeric features, hidden 32) trained by 2 replicas against 2 shards on a
   2-worker local cluster, once pulling and pushing only the rows each batch touches, once
   through the same model's dense path (every step moves every row: the table as one dense
   vector would).  Bytes moved per step (ids, rows and dense slices, both directions, all
   shards) and examples/s, from the runs' push logs.
2. **Time to a target.**  Logistic regression on hashed features, one epoch over the training
   files: scikit-learn's ``SGDClassifier(loss="log_loss")`` with ``partial_fit`` on
   ``FeatureHasher`` features in one process (hashing included), against ``fit_sparse`` (2
   replicas streaming and hashing the parquet files, 2 shards, Adagrad).  Both are scored the
   same way while they train: the progressive log-loss (each batch's loss before the model
   trains on it), averaged over the last 20 % of the examples seen; the target is what
   scikit-learn reaches at the end of its epoch.  Held-out log-loss and AUC at the end.
3. ``--scale``: a table of 10**8 rows x 16 (6.4 GB) on 4 shards of a 4-worker local cluster
   trains a few hundred steps; each worker's resident memory against the bytes of its shard's
   rows, and the bytes per step.

    python benchmarks/bench_sparse.py [--rows 10000000] [--scale]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402
from scipy.sparse import csr_matrix, hstack  # noqa: E402
from sklearn.feature_extraction import FeatureHasher  # noqa: E402
from sklearn.linear_model import SGDClassifier  # noqa: E402
from sklearn.metrics import log_loss, roc_auc_score  # noqa: E402

from downpour_dask.core.sparse_models import EmbeddingMLP, SparseLogisticRegression  # noqa: E402
from downpour_dask.data.criteo import CATEGORICAL, INTEGER, LABEL, criteo_spec, write_criteo  # noqa: E402,E501
from downpour_dask.data.hashing import load_hashed  # noqa: E402
from downpour_dask.downpour.sparse_fit import fit_sparse  # noqa: E402

BATCH = 512


class DensePath:
    """The same model through its dense path: every step pulls and pushes every table row."""

    def __init__(self, model):
        self.model = model
        for name in ("n_dense", "tables", "n_numeric", "n_fields", "is_classifier",
                     "init_dense", "loss_and_grad", "predict_proba"):
            setattr(self, name, getattr(model, name))

    def touched(self, batch):
        return [np.arange(spec.n_rows) for spec in self.model.tables]


def rss_mib() -> float:
    """Resident set size of this process in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def throughput(pushes: pd.DataFrame) -> tuple[float, float, float]:
    """(examples/s after the first 20 % of the run, mean bytes per step, mean rows per step)."""
    first = pushes[pushes["shard"] == 0]
    late = first[first["time"] >= first["time"].quantile(0.2)]
    rate = late["examples"].sum() / max(1e-9, late["time"].max() - late["time"].min())
    steps = pushes.groupby(["replica", "step"])[["bytes", "rows"]].sum()
    return rate, steps["bytes"].mean(), steps["rows"].mean()


def part_paths(paths, test_rows):
    return paths[:-1], pq.read_table(paths[-1]).slice(0, test_rows)


def sparse_vs_dense(client, data) -> None:
    model = EmbeddingMLP(1 << 18, 26, n_numeric=13, dim=8, hidden=(32,))
    print("\n1. sparse vs dense path: embedding MLP, table 2**18 x 8, 2 replicas, 2 shards")
    print(f"{'path':<8}{'batch':>7}{'steps':>7}{'examples/s':>12}{'rows/step':>11}"
          f"{'bytes/step':>13}{'bytes/row':>11}  vs sparse at batch {BATCH}")
    base = None
    runs = [("sparse", model, b, 400) for b in (128, BATCH, 4 * BATCH)]
    runs.append(("dense", DensePath(model), BATCH, 40))
    for name, m, batch, steps in runs:
        fit = fit_sparse(m, data, client=client, n_replicas=2, n_shards=2, batch_size=batch,
                         max_steps=steps, optimizer="adagrad", learning_rate=0.05, timeout=300)
        fit.close()
        rate, moved, rows = throughput(fit.pushes)
        if name == "sparse" and batch == BATCH:
            base = (rate, moved)
        ratio = f"{rate / base[0]:.2f}x, {moved / base[1]:.0f}x bytes" if name != "sparse" else ""
        print(f"{name:<8}{batch:>7}{steps:>7}{rate:>12,.0f}{rows:>11,.0f}{moved:>13,.0f}"
              f"{moved / rows:>11,.1f}  {ratio}")
    transports = sorted(set(fit.pushes["transport"]))
    print(f"(transports: {', '.join(transports)}; bytes count ids, rows and dense slices, both "
          "directions, all shards)")


def progressive_target(losses: np.ndarray, weights: np.ndarray) -> float:
    tail = int(len(losses) * 0.8)
    return float(np.average(losses[tail:], weights=weights[tail:]))


def first_time_below(times, losses, weights, target) -> float:
    """The first time the running progressive loss over the last 20 % of examples <= target."""
    for i in range(1, len(losses)):
        lo = int(i * 0.8)
        if np.average(losses[lo : i + 1], weights=weights[lo : i + 1]) <= target:
            return float(times[i])
    return float("nan")


def sklearn_epoch(train_paths, test, n_features):
    hasher = FeatureHasher(n_features, input_type="string", alternate_sign=False)
    # the best of a few settings tried on 400k rows (default "optimal" rates diverged on the
    # unscaled log1p counts): see benchmarks/README.md
    clf = SGDClassifier(loss="log_loss", alpha=1e-6, learning_rate="invscaling", eta0=0.1,
                        power_t=0.25, random_state=0)

    def features(frame):
        tokens = [[f"{c}={v}" for c, v in zip(CATEGORICAL, row)]
                  for row in zip(*(frame[c].to_numpy() for c in CATEGORICAL))]
        ints = np.log1p(np.nan_to_num(frame[list(INTEGER)].to_numpy(np.float64), nan=0.0).clip(0))
        return hstack([hasher.transform(tokens), csr_matrix(ints)]).tocsr()

    times, losses, weights = [], [], []
    start = time.perf_counter()
    for path in train_paths:
        for record in pq.ParquetFile(path).iter_batches(BATCH * 20):
            frame = record.to_pandas()
            X, y = features(frame), frame[LABEL].to_numpy()
            for lo in range(0, len(y), BATCH):
                xb, yb = X[lo : lo + BATCH], y[lo : lo + BATCH]
                if times:  # progressive: the loss before training on the batch
                    p = clf.predict_proba(xb)[:, 1]
                    losses.append(log_loss(yb, p, labels=[0, 1]))
                    weights.append(len(yb))
                    times.append(time.perf_counter() - start)
                else:
                    times.append(0.0)
                clf.partial_fit(xb, yb, classes=[0, 1])
    elapsed = time.perf_counter() - start
    frame = test.to_pandas()
    p = clf.predict_proba(features(frame))[:, 1]
    y = frame[LABEL].to_numpy()
    return (np.array(times[1:]), np.array(losses), np.array(weights), elapsed,
            log_loss(y, p), roc_auc_score(y, p))


def time_to_target(client, paths, n_rows_table) -> None:
    train, test = part_paths(paths, 200_000)
    n_train = sum(pq.ParquetFile(p).metadata.num_rows for p in train)
    bits = n_rows_table.bit_length() - 1
    print(f"\n2. time to a target: logistic regression on hashed features (2**{bits} rows), "
          f"one epoch over {n_train:,} rows, batch {BATCH}")
    s_times, s_losses, s_w, s_elapsed, s_ll, s_auc = sklearn_epoch(train, test, n_rows_table)
    target = progressive_target(s_losses, s_w)
    spec = criteo_spec(n_rows_table)
    model = SparseLogisticRegression(n_rows_table, 26, n_numeric=13)
    start = time.perf_counter()
    fit = fit_sparse(model, (train, spec), client=client, n_replicas=2, n_shards=2,
                     batch_size=BATCH, max_epochs=1, optimizer="adagrad", learning_rate=0.05,
                     timeout=600)
    elapsed = time.perf_counter() - start
    dense, tables = fit.state()
    fit.close()
    first = fit.pushes[fit.pushes["shard"] == 0].sort_values("time")
    d_times = first["time"].to_numpy()
    d_losses, d_w = first["loss"].to_numpy(), first["examples"].to_numpy()
    held = load_hashed([paths[-1]], spec)
    held = held.take(slice(0, 200_000))
    (ids,) = model.touched(held)
    p = model.predict_proba(dense, [(ids, tables[0][ids])], held)
    d_ll, d_auc = log_loss(held.y, p), roc_auc_score(held.y, p)
    print(f"target: progressive log-loss {target:.4f} (scikit-learn's over the last 20 % of its"
          " epoch)")
    print(f"{'trainer':<44}{'epoch s':>9}{'examples/s':>12}{'to target s':>13}"
          f"{'held-out log-loss':>19}{'AUC':>8}")
    for name, times, losses, w, total, ll, auc in (
        ("scikit-learn SGDClassifier + FeatureHasher", s_times, s_losses, s_w, s_elapsed, s_ll,
         s_auc),
        ("fit_sparse, 2 replicas, 2 shards, Adagrad", d_times, d_losses, d_w, elapsed, d_ll,
         d_auc),
    ):
        reach = first_time_below(times, losses, w, target)
        print(f"{name:<44}{total:>9.1f}{n_train / total:>12,.0f}{reach:>13.1f}{ll:>19.4f}"
              f"{auc:>8.4f}")


def scale(paths) -> None:
    n_rows, width, n_shards = 10**8, 16, 4
    print(f"\n3. scale: a table of {n_rows:,} rows x {width} ({n_rows * width * 4 / 1e9:.1f} GB)"
          f" on {n_shards} shards, 4-worker local cluster, SGD")
    with local_cluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit="5.5GiB") as cluster, Client(cluster) as client:
        before = client.run(rss_mib)
        model = EmbeddingMLP(n_rows, 26, n_numeric=13, dim=width, hidden=(32,))
        spec = criteo_spec(n_rows)
        start = time.perf_counter()
        fit = fit_sparse(model, (paths[:2], spec), client=client, n_replicas=2,
                         n_shards=n_shards, batch_size=BATCH, max_steps=300, optimizer="sgd",
                         learning_rate=0.05, timeout=900)
        elapsed = time.perf_counter() - start
        after = client.run(rss_mib)
        counters = fit.counters()
        fit.close()
        rate, moved, rows = throughput(fit.pushes)
        print(f"fit (shard start-up + 2 x 300 steps): {elapsed:.0f} s; {rate:,.0f} examples/s; "
              f"{rows:,.0f} rows and {moved / 1e6:.2f} MB moved per step "
              f"(the table: {n_rows * width * 4 / 1e9:.1f} GB)")
        print(f"{'worker':<28}{'RSS before MiB':>15}{'RSS after MiB':>15}{'shard rows MiB':>16}")
        owned = {fit.workers[c['shard']]: c for c in counters}
        for w in sorted(after):
            c = owned.get(w)
            rows_mib = 0 if c is None else sum(hi - lo for lo, hi in c["row_ranges"]) * (
                width * 4 + 8 + 1) / 2**20
            print(f"{w:<28}{before[w]:>15,.0f}{after[w]:>15,.0f}{rows_mib:>16,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--data", default="/tmp/downpour-bench-criteo")
    parser.add_argument("--scale", action="store_true")
    parser.add_argument("--parts", default="12", help="which of parts 1 and 2 to run")
    args = parser.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}; load: {os.getloadavg()}")
    root = Path(args.data) / str(args.rows)
    start = time.perf_counter()
    paths = sorted(root.glob("part-*.parquet")) or write_criteo(
        root, args.rows, rows_per_file=min(1_000_000, args.rows // 4))
    print(f"data: {args.rows:,} rows in {len(paths)} files ({time.perf_counter() - start:.0f} s)")
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        if "1" in args.parts:
            sparse_vs_dense(client, load_hashed(paths[:1], criteo_spec(1 << 18)))
        if "2" in args.parts:
            time_to_target(client, paths, 1 << 20)
    if args.scale:
        scale(paths)


if __name__ == "__main__":
    main()
