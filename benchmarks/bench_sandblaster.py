"""Time to reach the same objective on L2-regularised logistic regression (synthetic, 10^6 x 100):
Sandblaster L-BFGS vs dask-ml's ``LogisticRegression(solver="lbfgs")`` vs serial scipy L-BFGS-B.

The objective is downpour-dask's ``models.LogisticRegression(100, l2=L2)``: mean log-loss over the
N rows plus ``0.5 * L2 * ||w||^2`` on the weights, the intercept unpenalised.  dask-ml minimises
``sum log-loss + (1/C) * 0.5 * ||beta||^2`` with the intercept inside ``beta``; the script gives it
``C = 1 / (L2 * N)`` and an L2 regulariser that skips the intercept (the last coordinate dask-ml
appends), so its objective is exactly N times ours; its values are divided by N.

Each method's objective is recorded at every evaluation (scipy, dask-ml) or iteration (Sandblaster)
against wall time since the method was handed the numpy arrays (data placement on the cluster is
included). The target is the best final objective of all runs, re-evaluated in float64 on the
driver, times ``1 + --rel``; the table reports when each run first reached it, and the ratios to
scipy's best time and to dask-ml's (below 1: faster). ``evals`` counts full gradient evaluations
(distributed passes for Sandblaster, line-search trials included); ``1st eval`` is when the first
objective value was known: mostly data placement (scatter to the workers) for the cluster runs;
``passes`` is the time from then to the target, and ``backups`` the number of backup copies
Sandblaster launched. Sandblaster runs with its default portions (1 per worker thread, 2 here) and
with 20 (10 per thread, the default before 2026-11-23), interleaved with scipy ``--repeats`` times;
the "relayed" row runs the default through a client made with ``direct_to_workers=False``, so its
data blocks and the driver's calls to the shards travel through the scheduler (Dask's default, and
the path before) instead of straight to the workers. The "Dask Array on cluster" row starts with
the data already in the workers' memory, as a user who loaded it with Dask has it: 2 row blocks
scattered round-robin before the clock starts, passed to ``fit`` as Dask Arrays (each block is then
read into a portion on its own worker); it is the cluster's counterpart of scipy's data in memory.
Dask receives a scattered block at an arbitrary byte offset, so that row's fit copies each block
aligned first; the "Dask Array computed on cluster" row has each block made by a task on its worker
(as data Dask read or generated there is), aligned already and read without a copy.
With ``--eval-rows N``, every Sandblaster fit also scores N held-out rows (drawn from the same
model) after every iteration (``eval_data``, scored on a worker while the fit goes on), as a
user watching a fit's accuracy has it; scipy is not scored.
A small Sandblaster fit runs first, untimed: the first fit on a new cluster pays one-off costs
(imports and allocations on the workers) that would otherwise land on one row.  The Sandblaster
rows take turns in their order, one repeat to the next: the first fit after scipy's run places
its data later (0.5-1 s against 0.25-0.4 s, in every run; the cause is not known), so with
``--repeats`` a multiple of 5 each row kind takes that place equally often.

    python benchmarks/bench_sandblaster.py [--rows 1000000] [--features 100] [--rel 1e-5]
                                           [--repeats 1] [--skip-dask-ml] [--eval-rows 0]
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker: the serial baseline is a single-thread run.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import dask_glm.algorithms  # noqa: E402
import numpy as np  # noqa: E402
import scipy.optimize  # noqa: E402
from clusters import local_cluster  # noqa: E402
from dask_glm.regularizers import L2  # noqa: E402
from dask_ml.linear_model import LogisticRegression as DaskLogisticRegression  # noqa: E402
from distributed import Client, wait  # noqa: E402

from downpour_dask import models  # noqa: E402
from downpour_dask.sandblaster.blocks import default_portions  # noqa: E402
from downpour_dask.sandblaster.coordinator import Coordinator  # noqa: E402
from downpour_dask.sandblaster.estimator import SandblasterLBFGS  # noqa: E402

L2_WEIGHT = 1e-4


class L2ExceptIntercept(L2):
    """dask-glm's L2 penalty on every coordinate but the last (dask-ml's appended intercept)."""

    name = "l2_except_intercept"

    def f(self, beta):
        return (beta[:-1] ** 2).sum() / 2

    def gradient(self, beta):
        g = beta.copy()
        g[-1] = 0
        return g


SCIPY = "serial scipy L-BFGS-B (1 thread)"
DASK_ML = "dask-ml LogisticRegression(lbfgs)"
RELAYED = "relayed"
ON_CLUSTER = "Dask Array on cluster"
COMPUTED = "Dask Array computed on cluster"
VARIANTS = (  # (portions, variant)
    (None, ""), (None, RELAYED), (20, ""), (None, ON_CLUSTER), (None, COMPUTED),
)  # fmt: skip


def make_data(
    rows: int, features: int, seed: int = 0, held_out: int = 0
) -> tuple[np.ndarray, np.ndarray] | tuple[tuple, tuple]:
    """Seeded synthetic logistic data: Gaussian features, labels drawn from a true model.

    With ``held_out``, also that many more rows of the same model, drawn after the training
    rows (which stay the same): ``(X, y), (X_held, y_held)``."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, features), dtype=np.float32)
    w = rng.standard_normal(features).astype(np.float32) * np.float32(2.0 / np.sqrt(features))

    def labels(X: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-(X @ w + np.float32(0.5))))
        return (rng.random(len(X), dtype=np.float32) < p).astype(np.int64)

    y = labels(X)
    if not held_out:
        return X, y
    X_held = rng.standard_normal((held_out, features), dtype=np.float32)
    return (X, y), (X_held, labels(X_held))


def objective64(model, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    """The objective in float64 on the driver, in row blocks (the common yardstick)."""
    w, b = params[:-1].astype(np.float64), float(params[-1])
    total = 0.0
    for lo in range(0, len(X), 100_000):
        z = X[lo : lo + 100_000].astype(np.float64) @ w + b
        total += float(np.logaddexp(0, z).sum() - z @ y[lo : lo + 100_000])
    return total / len(X) + 0.5 * model.l2 * float(w @ w)


def run_scipy(model, X, y, x0):
    """Serial scipy L-BFGS-B on the model's float32 objective, one thread, in this process."""
    trace, grad, start = [], np.empty(model.layout.size, np.float32), time.time()

    def fun(w):
        loss, g = model.loss_and_grad(w.astype(np.float32), X, y, out=grad)
        trace.append((time.time() - start, loss))
        return loss, g.astype(np.float64)

    result = scipy.optimize.minimize(
        fun, x0.astype(np.float64), jac=True, method="L-BFGS-B",
        options={"maxiter": 200, "ftol": 1e-12, "gtol": 1e-9},
    )  # fmt: skip
    return result.x.astype(np.float32), trace, len(trace)


def run_dask_ml(client, X, y, chunk_rows):
    """dask-ml's lbfgs with the identical objective, on dask arrays chunked over the workers."""
    trace, start = [], time.time()
    original = dask_glm.algorithms.fmin_l_bfgs_b

    def traced(func, x0, **kwargs):
        def wrapped(beta, *args):
            loss, grad = func(beta, *args)
            trace.append((time.time() - start, float(loss) / len(X)))
            return loss, grad

        return original(wrapped, x0, **kwargs)

    dask_glm.algorithms.fmin_l_bfgs_b = traced
    try:
        # scattered chunks (as Sandblaster scatters its blocks), not data embedded in the graph
        bounds = [(lo, min(lo + chunk_rows, len(X))) for lo in range(0, len(X), chunk_rows)]
        xf = client.scatter([X[lo:hi] for lo, hi in bounds], hash=False)
        yf = client.scatter([y[lo:hi].astype(np.float64) for lo, hi in bounds], hash=False)
        Xd = da.concatenate(
            [da.from_delayed(f, (hi - lo, X.shape[1]), X.dtype) for f, (lo, hi) in zip(xf, bounds)]
        )
        yd = da.concatenate(
            [da.from_delayed(f, (hi - lo,), np.float64) for f, (lo, hi) in zip(yf, bounds)]
        )
        est = DaskLogisticRegression(
            solver="lbfgs", C=1.0 / (L2_WEIGHT * len(X)), fit_intercept=True, max_iter=200,
            tol=1e-9, solver_kwargs={"regularizer": L2ExceptIntercept()},
        ).fit(Xd, yd)  # fmt: skip
    finally:
        dask_glm.algorithms.fmin_l_bfgs_b = original
    del Xd, yd
    params = np.append(est.coef_, est.intercept_).astype(np.float32)
    return params, trace, len(trace)


def on_cluster(client, X, y, parts: int, computed: bool = False) -> tuple:
    """``(X, y)`` as Dask Arrays of ``parts`` row blocks already in the workers' memory, spread
    evenly (scattered round-robin), before any clock.  With ``computed``, each block is then the
    result of a task on its worker (a copy of the scattered one), as data that Dask loaded or
    generated there is: Dask receives a scattered array into a buffer at any byte offset, while
    a task's result is an aligned array of its own."""
    workers = sorted(client.scheduler_info()["workers"])
    cuts = np.linspace(0, len(X), parts + 1).astype(int).tolist()
    bounds = list(zip(cuts[:-1], cuts[1:]))
    xs, ys = [], []
    for i, (lo, hi) in enumerate(bounds):
        where = [workers[i % len(workers)]]
        xs.append(client.scatter(X[lo:hi], workers=where, hash=False))
        ys.append(client.scatter(y[lo:hi], workers=where, hash=False))
        if computed:
            xs[-1], ys[-1] = (
                client.submit(np.array, f, workers=where, pure=False) for f in (xs[-1], ys[-1])
            )
    wait(xs + ys)
    Xd = da.concatenate(
        [da.from_delayed(f, (hi - lo, X.shape[1]), X.dtype) for f, (lo, hi) in zip(xs, bounds)]
    )
    yd = da.concatenate(
        [da.from_delayed(f, (hi - lo,), y.dtype) for f, (lo, hi) in zip(ys, bounds)]
    )
    return Xd, yd


def run_sandblaster(client, model, X, y, portions, scored=None):
    runs = []
    original = Coordinator.execute

    def execute(self):
        runs.append(self)
        return original(self)

    Coordinator.execute = execute
    try:
        start = time.time()
        est = SandblasterLBFGS(
            model, portions_per_batch=portions, max_iter=200, tol=1e-10, random_state=0
        ).fit(X, y, eval_data=scored, client=client)
    finally:
        Coordinator.execute = original
    evals = est.experiment_.evals
    offset = runs[-1].recorder.t0 - start  # checks (and persisting) before the run's clock
    trace = list(zip(evals["time"] + offset, evals["objective"]))
    kinds = est.experiment_.events["kind"]
    passes = int((kinds == "batch_start").sum())
    return est.params_, trace, (passes, int((kinds == "backup_launched").sum()))


def time_to(trace, target: float) -> float:
    hit = [t for t, f in trace if f <= target]
    return hit[0] if hit else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--rel", type=float, default=1e-5, help="target: best * (1 + rel)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="interleaved runs of scipy and Sandblaster"
    )
    parser.add_argument("--skip-dask-ml", action="store_true", help="leave dask-ml out")
    parser.add_argument(
        "--eval-rows", type=int, default=0, help="held-out rows each Sandblaster fit scores"
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, dask {dask.__version__}"
    )
    if args.eval_rows:
        (X, y), scored = make_data(args.rows, args.features, held_out=args.eval_rows)
    else:
        (X, y), scored = make_data(args.rows, args.features), None
    model = models.LogisticRegression(args.features, l2=L2_WEIGHT)
    x0 = np.zeros(model.layout.size, np.float32)  # dask-ml starts from zeros: so do all
    results: dict[str, list] = {}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
        Client(cluster, direct_to_workers=False) as relaying,  # Dask's default path for scatter
    ):
        if not args.skip_dask_ml:
            chunk = -(-args.rows // 20)
            results[DASK_ML] = [run_dask_ml(client, X, y, chunk)]
        client.run(lambda: None)
        warm = min(args.rows, 2000)  # the cluster's first fit pays one-off costs: not in a row
        SandblasterLBFGS(model, max_iter=2).fit(X[:warm], y[:warm], client=client)
        original_init = models.LogisticRegression.init
        models.LogisticRegression.init = lambda self, rng: x0.copy()  # same start as the others
        try:
            for repeat in range(args.repeats):  # interleaved: each repeat runs every method once
                results.setdefault(SCIPY, []).append(run_scipy(model, X, y, x0))
                turn = repeat % len(VARIANTS)  # rotated: the fit right after scipy's is slower
                for portions, variant in VARIANTS[turn:] + VARIANTS[:turn]:
                    label = "SandblasterLBFGS" + (
                        f" (default {default_portions(2)} portions)"
                        if portions is None
                        else f" ({portions} portions)"
                    )
                    label += f" {variant}" if variant else ""
                    data = (
                        on_cluster(client, X, y, default_portions(2), variant == COMPUTED)
                        if variant in (ON_CLUSTER, COMPUTED)
                        else (X, y)
                    )
                    results.setdefault(label, []).append(
                        run_sandblaster(
                            relaying if variant == RELAYED else client, model, *data, portions,
                            scored,
                        )
                    )
                    del data
        finally:
            models.LogisticRegression.init = original_init
    finals = {
        name: min(objective64(model, r[0], X, y) for r in runs) for name, runs in results.items()
    }
    target = min(finals.values()) * (1 + args.rel)
    scipy_time = min(time_to(trace, target) for _, trace, _ in results[SCIPY])
    dask_ml = time_to(results[DASK_ML][0][1], target) if DASK_ML in results else float("nan")
    print(
        f"\nlogistic regression, {args.rows:,} x {args.features} float32, l2={L2_WEIGHT}; "
        f"2-worker LocalCluster (1 thread each); target objective {target:.8f} "
        f"(best final * (1 + {args.rel:g})); {args.repeats} interleaved repeat(s)"
        + (f", Sandblaster scoring {args.eval_rows:,} rows every iteration" if scored else "")
        + ", load "
        f"{os.getloadavg()[0]:.1f}"
    )
    header = f"{'method':62} {'final objective':>16} {'evals':>6} {'1st eval':>9} {'to target':>10}"
    print(f"{header} {'passes':>7} {'vs scipy':>9} {'vs dask-ml':>11} {'backups':>8}")
    for name, runs in results.items():
        for _, trace, evals in runs:
            evals, backups = evals if isinstance(evals, tuple) else (evals, "-")
            hit = time_to(trace, target)
            first = trace[0][0]
            print(
                f"{name:62} {finals[name]:>16.8f} {evals:>6} {first:>8.2f}s {hit:>9.2f}s "
                f"{hit - first:>6.2f}s {hit / scipy_time:>8.2f}x {hit / dask_ml:>10.2f}x "
                f"{backups:>8}"
            )


if __name__ == "__main__":
    main()
