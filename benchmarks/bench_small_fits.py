"""The fixed cost of a fit: many small fits on one running cluster, as model selection makes them.

``GridSearchCV`` or ``cross_val_score`` over a ``DownpourSGD`` or ``SandblasterLBFGS`` runs one
fit per candidate and fold, and on small data each fit costs mostly what every fit costs whatever
its data: placing the rows, starting the shards and the replicas or portions, gathering the
result and building the experiment log.  This script times ``--fits`` fits of each estimator with
its defaults on 150 rows x 4 features (iris-sized, synthetic) on a 2-worker local cluster, the two
estimators in turns, after one untimed fit each, and prints medians with scikit-learn's
``LogisticRegression`` on the same rows in this process as the baseline.  Run it through
``bench_code_ab.py --script bench_small_fits.py`` to compare two versions of the code.

    python benchmarks/bench_small_fits.py [--fits 40]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

from downpour_dask import DownpourSGD, SandblasterLBFGS  # noqa: E402

ESTIMATORS = {
    "scikit-learn LogisticRegression (in process)": lambda: LogisticRegression(),
    "DownpourSGD() (4 replicas, 2 shards, 1 epoch)": lambda: DownpourSGD(),
    "SandblasterLBFGS(max_iter=3)": lambda: SandblasterLBFGS(max_iter=3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=40, help="timed fits per estimator")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    rng = np.random.default_rng(0)
    X = rng.standard_normal((150, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.3 * rng.standard_normal(150) > 0).astype(int)
    times: dict[str, list[float]] = {name: [] for name in ESTIMATORS}
    warnings.simplefilter("ignore", ConvergenceWarning)
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster),
    ):
        for make in ESTIMATORS.values():  # untimed: imports and first allocations on the workers
            make().fit(X, y)
        for _ in range(args.fits):
            for name, make in ESTIMATORS.items():
                start = time.perf_counter()
                make().fit(X, y)
                times[name].append(time.perf_counter() - start)
    print(f"\n{args.fits} fits each, in turns; load {os.getloadavg()[0]:.1f}")
    print(f"{'estimator':48} {'median':>9} {'p10':>9} {'p90':>9} {'vs scikit-learn':>16}")
    baseline = statistics.median(next(iter(times.values())))
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10)
        median = statistics.median(values)
        print(
            f"{name:48} {median * 1e3:>7.1f}ms {deciles[0] * 1e3:>7.1f}ms "
            f"{deciles[-1] * 1e3:>7.1f}ms {median / baseline:>15.0f}x"
        )


if __name__ == "__main__":
    main()
