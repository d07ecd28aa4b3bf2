"""Ad-hoc (not committed): steady rows/s of Downpour MLP fits on bench_large's data."""
import os
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
import sys
from pathlib import Path
sys.path.insert(0, os.path.dirname(__file__))
import bench_large as bl
from distributed import Client, LocalCluster
from downpour_dask import DownpourSGD, models

def main():
    files, test_file = bl.cached_data(Path("/tmp/downpour-bench-large"), 10_000_000)
    test = bl.read_test(test_file, bl.TEST_ROWS)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
        DownpourSGD("logistic", n_replicas=2, max_steps=5).fit(*test, client=client)
        for _ in range(3):
            tr = bl.run_downpour(client, models.MLP(64, (64,), 2), files, test, 2.0, 5.0, optimizer="adam", learning_rate=0.01,
                                 batch_size=256, n_fetch=4, n_push=4, local_learning_rate=0.2)
            ch = tr.checks
            a = next(c for c in ch if c[0] >= 1.5); b = ch[-1]
            print(f"RATE mlp steady {(b[1]-a[1])/(b[0]-a[0]):9,.0f} rows/s", flush=True)

if __name__ == "__main__":
    main()
