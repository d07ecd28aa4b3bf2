"""Training speed once a model is confident: a fitted model's steps against a fresh model's.

On data a model fits well, its wrong-class probabilities fall below float32's smallest normal
number (a logit 88 below the row's largest); so do the gradients back-propagated from them, and
arithmetic on such subnormal numbers is many times slower on common CPUs.  The output passes
flush those probabilities to 0 (``core/dense.exp_flushed``).  This script measures what that is
for, with whichever version of the code it runs on (``bench_code_ab.py --script`` alternates
two):

1. In this process: an MLP 64-64-2's ``loss_and_grad`` on batches of 256 rows of separable data
   (labels from a linear teacher, no noise), at its initial parameters (the baseline) and after
   ``--epochs`` epochs of plain SGD have made it confident; the two in turns, ``--rounds``
   times, medians.  Also a logistic regression's gradient over all 100,000 rows (Sandblaster's
   kind of step), with weights along the teacher scaled so that the logits spread by 1
   (baseline) or by 100 (as after a long fit on separable data, where most rows' logits lie
   beyond float32's subnormal edge).
2. On a local cluster of 2 single-threaded workers: ``DownpourSGD`` (2 replicas x 2 shards, Adam
   0.01, batch 256, n_fetch = n_push = 4) for ``--seconds`` on the separable data, and, as the
   baseline, on the same features with noisy labels (which no model fits with confidence);
   examples per second over the second half of each run, from the experiment's pushes.

    python benchmarks/bench_confident.py [--rounds 5] [--epochs 20] [--seconds 6]
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

from downpour_dask import DownpourSGD, models  # noqa: E402

ROWS, FEATURES, BATCH = 100_000, 64, 256


def features_and_teacher() -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """Standard normal float32 features, a fixed linear teacher, and the generator after both."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    return X, rng.standard_normal(FEATURES), rng


def data(noise: float) -> tuple[np.ndarray, np.ndarray]:
    """The features; labels from the teacher plus ``noise``."""
    X, teacher, rng = features_and_teacher()
    score = X @ teacher + noise * rng.standard_normal(ROWS)
    return X, (score > 0).astype(np.int64)


def gradient_us(model, params: np.ndarray, X: np.ndarray, y: np.ndarray, steps: int) -> float:
    """Median microseconds of ``loss_and_grad`` over ``steps`` consecutive batches."""
    out = np.empty_like(params)
    times = []
    for i in range(steps):
        lo = (i * BATCH) % (len(X) - BATCH)
        start = time.perf_counter()
        model.loss_and_grad(params, X[lo : lo + BATCH], y[lo : lo + BATCH], out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def fitted(model, X: np.ndarray, y: np.ndarray, epochs: int) -> tuple[np.ndarray, float]:
    """Parameters after ``epochs`` of plain SGD (rate 0.5) from the initial ones; final loss."""
    params = model.init(np.random.default_rng(0))
    grad = np.empty_like(params)
    for _ in range(epochs):
        for lo in range(0, len(X) - BATCH + 1, BATCH):
            model.loss_and_grad(params, X[lo : lo + BATCH], y[lo : lo + BATCH], out=grad)
            params -= 0.5 * grad
    return params, model.loss(params, X[:10_000], y[:10_000])


def full_batch_ms(
    X: np.ndarray, y: np.ndarray, teacher: np.ndarray, margin: float, rounds: int
) -> float:
    """Median milliseconds of a logistic regression's gradient over all of ``X`` (Sandblaster's
    kind of step) with weights along the labels' ``teacher``, scaled so the logits' spread is
    ``margin``: at 100, as after a long fit on separable data, most rows' logits lie beyond
    float32's subnormal edge; at 1, none do."""
    model = models.LogisticRegression(FEATURES)
    params = model.layout.zeros()
    model.layout.views(params)["W"][:, 0] = margin * teacher / np.linalg.norm(teacher)
    out = np.empty_like(params)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.loss_and_grad(params, X, y, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def downpour_rate(client: Client, X: np.ndarray, y: np.ndarray, seconds: float) -> float:
    """Examples per second over the second half of a ``seconds``-long Downpour fit."""
    est = DownpourSGD(
        models.MLP(FEATURES, (64,), 2),
        n_replicas=2,
        n_shards=2,
        optimizer="adam",
        learning_rate=0.01,
        batch_size=BATCH,
        n_fetch=4,
        n_push=4,
        max_seconds=seconds,
        max_epochs=1000,
        random_state=0,
    )
    est.fit(X, y, client=client)
    pushes = est.experiment_.pushes
    late = pushes[pushes["time"] >= seconds / 2]
    return float(late["examples"].sum() / (late["time"].max() - late["time"].min()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20, help="SGD epochs of the fitted model")
    parser.add_argument("--steps", type=int, default=400, help="gradients timed per round")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of a Downpour fit")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*stopped by max_seconds")  # each fit is, by design
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}; load average at start "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    separable, noisy = data(noise=0.0), data(noise=3.0)
    model = models.MLP(FEATURES, (64,), 2)
    fresh = model.init(np.random.default_rng(0))
    trained, loss = fitted(model, *separable, args.epochs)
    times: dict[str, list[float]] = {"fresh": [], "fitted": []}
    for _ in range(args.rounds):
        times["fresh"].append(gradient_us(model, fresh, *separable, args.steps))
        times["fitted"].append(gradient_us(model, trained, *separable, args.steps))
    teacher = features_and_teacher()[1]
    wide_ms = full_batch_ms(*separable, teacher, margin=1.0, rounds=5 * args.rounds)
    sure_ms = full_batch_ms(*separable, teacher, margin=100.0, rounds=5 * args.rounds)
    with (
        local_cluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
        as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        rates: dict[str, list[float]] = {"noisy": [], "separable": []}
        for _ in range(max(1, args.rounds // 2)):
            rates["noisy"].append(downpour_rate(client, *noisy, args.seconds))
            rates["separable"].append(downpour_rate(client, *separable, args.seconds))
    fresh_us, fitted_us = (statistics.median(times[k]) for k in ("fresh", "fitted"))
    noisy_rate, separable_rate = (statistics.median(rates[k]) for k in ("noisy", "separable"))
    rows = [
        ("gradient of a batch, fresh parameters (baseline)", f"{fresh_us:.0f} us", 1.0),
        ("gradient of a batch, fitted parameters", f"{fitted_us:.0f} us", fitted_us / fresh_us),
        (f"logistic, {ROWS:,}-row gradient, logits' spread 1 (baseline)", f"{wide_ms:.2f} ms",
         1.0),
        (f"logistic, {ROWS:,}-row gradient, logits' spread 100", f"{sure_ms:.2f} ms",
         sure_ms / wide_ms),
        ("Downpour, noisy labels (baseline), examples/s", f"{noisy_rate:,.0f}", 1.0),
        ("Downpour, separable labels, examples/s", f"{separable_rate:,.0f}",
         separable_rate / noisy_rate),
    ]  # fmt: skip
    print(f"\nMLP {FEATURES}-64-2, batch {BATCH}; fitted: {args.epochs} SGD epochs, "
          f"training loss {loss:.2e}")  # fmt: skip
    print(f"{'measurement':60} {'value':>12} {'vs baseline':>12}")
    for name, value, ratio in rows:
        print(f"{name:60} {value:>12} {ratio:>11.2f}x")
    print("load average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
