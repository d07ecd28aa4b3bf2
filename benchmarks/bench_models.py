"""Examples/s of the numpy MLP, the JAX MLP and the JAX CNN: serial, and per replica under Downpour;
and the test accuracy Downpour reaches with each on mnist5k.

Part 1 (speed): each model's serial loop in this process (gradient + SGD update, in one thread:
BLAS, and JAX with ``PJRT_NPROC=1``; first compilation excluded), and Downpour with 2 replicas
and 2 shards on a local cluster of 2 single-threaded worker processes (n_fetch = n_push = 1).
A replica's rate is its examples between its 5th push (fewer if it made fewer than 8) and its
last one, over that time, so JAX's compilation on the worker does not count; the table gives
the mean over replicas and the ratio to the serial loop of the same model.

Part 2 (accuracy): Downpour + Adagrad (2 replicas, 2 shards, rate 0.05, batch 32, 50 warmstart
steps) for ``--epochs`` epochs, per seed: test accuracy and training time of each model.

    python benchmarks/bench_models.py [--seconds 6] [--epochs 8] [--seeds 0 1 2]

``--epochs 0`` runs part 1 only.
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker (as in bench_downpour.py).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models  # noqa: E402
from downpour_dask.data.datasets import minibatches  # noqa: E402

BATCH = 32


def build() -> dict:
    return {
        "numpy MLP 784-128-10": models.MLP(784, (128,), 10),
        "JAX MLP 784-128-10": models.jax_mlp(784, (128,), 10),
        "JAX CNN conv5x5x8-pool-conv5x5x16-pool-64-10": models.cnn(),
    }


def serial_examples_per_s(model, X, y, seconds: float, learning_rate: float = 0.01) -> float:
    """SGD in this process: the gradient (times the rate) into a reused buffer, then the update."""
    params = model.init(np.random.default_rng(0))
    step = np.empty_like(params)
    model.loss_and_grad(params, X[:BATCH], y[:BATCH], out=step)  # JAX compiles here, not timed
    rng = np.random.default_rng(0)
    examples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for Xb, yb in minibatches(X, y, BATCH, rng):
            if len(yb) < BATCH:
                continue  # a last, smaller batch would be one more compilation for JAX
            model.loss_and_grad(params, Xb, yb, out=step, scale=learning_rate)
            params -= step
            examples += len(yb)
            if time.perf_counter() - start >= seconds:
                break
    return examples / (time.perf_counter() - start)


def downpour_per_replica(client, model, train, seconds: float) -> float:
    """Mean examples/s of a replica of a 2-replica fit, after each replica's 5th push."""
    est = DownpourSGD(
        model, n_replicas=2, n_shards=2, optimizer="sgd", learning_rate=0.01, batch_size=BATCH,
        max_seconds=seconds, max_epochs=10_000, eval_every=1.0, random_state=0,
    ).fit(train, client=client)  # fmt: skip
    rates = []
    for _, rows in est.experiment_.pushes.groupby("replica"):
        rows = rows.sort_values("time")
        rows = rows.iloc[min(5, len(rows) - 3) :]  # past the compilation, if it pushed enough
        elapsed = rows["time"].iloc[-1] - rows["time"].iloc[0]
        rates.append(rows["examples"].iloc[1:].sum() / elapsed)
    return float(np.mean(rates))


def accuracy_run(client, model, train, test, epochs: int, seed: int) -> tuple[float, float]:
    est = DownpourSGD(
        model, n_replicas=2, n_shards=2, optimizer="adagrad", learning_rate=0.05,
        batch_size=BATCH, warmstart_steps=50, max_epochs=epochs, eval_every=2.0,
        random_state=seed,
    )  # fmt: skip
    start = time.perf_counter()
    est.fit(train, eval_data=test, client=client)
    return est.score(test), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--xla-one-thread",
        action="store_true",
        help="XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 here "
        "and in the workers (set before JAX starts; the workers inherit it)",
    )
    args = parser.parse_args()
    if args.xla_one_thread:
        os.environ["XLA_FLAGS"] = (
            "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    train, test = datasets.load("mnist5k")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}; load average {os.getloadavg()[0]:.2f} at start; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    with (
        local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        # The serial loops' JAX in one thread too, as BLAS (XLA sizes its pools by the cores
        # otherwise).  Set once the workers run, which must not inherit it: what their JAX
        # uses is the library's business (runtime/xla_threads.py), and an A/B of the library
        # through bench_code_ab.py measures that.
        os.environ.setdefault("PJRT_NPROC", "1")
        print(
            f"\nexamples/s, batch {BATCH}, plain SGD; Downpour: 2 replicas, 2 shards, per replica"
        )
        print(f"{'model':48} {'params':>8} {'serial':>9} {'Downpour':>9} {'vs serial':>9}")
        for name, model in build().items():
            serial = serial_examples_per_s(model, train.X, train.y, args.seconds)
            replica = downpour_per_replica(client, model, train, args.seconds)
            print(
                f"{name:48} {model.n_params:>8,} {serial:>9,.0f} {replica:>9,.0f} "
                f"{replica / serial:>8.2f}x"
            )
        if not args.epochs:  # --epochs 0: the speed table only
            return
        print(f"\ntest accuracy on mnist5k after {args.epochs} epochs (Downpour + Adagrad)")
        print(f"{'model':48} {'seed':>4} {'accuracy':>8} {'time':>7}")
        for seed in args.seeds:
            for name, model in build().items():
                accuracy, seconds = accuracy_run(client, model, train, test, args.epochs, seed)
                print(f"{name:48} {seed:>4} {accuracy:>8.3f} {seconds:>6.1f}s")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
