"""The consistency spectrum and the paper's follow-ups, side by side on mnist5k.

Every method trains MLP 784-128-10 with batch 32, 4 replicas and 2 shards on a 2-worker
``LocalCluster`` (1 thread each, started once, before any timing), for the same wall-clock
budget, evaluating on the test split every 0.25 s.  The same rates for every SGD-based method
(plain SGD at 0.1, as in notebooks/02; Adagrad at 0.05 for the paper's recipe) -- none is tuned
for one method only:

- Downpour: asynchronous, plain SGD on the shards.
- Downpour + Adagrad + warmstart: the paper's recipe (Adagrad 0.05, 100 warmstart steps).
- Downpour + averaged model: Downpour whose shards publish the moving average of their
  parameters as the model (``ema_decay=0.98``); it is what gets evaluated.
- SSP s=1, SSP s=4: stale synchronous parallel (Ho et al. 2013), ``consistency="ssp"``.
- BSP: ``consistency="bsp"``, synchronous SGD on the 4 replicas' combined batch.
- EASGD: asynchronous elastic averaging (Zhang et al. 2015), tau = 4 steps, alpha = 0.9 / 4
  (the paper's beta = 0.9), local SGD at 0.1.
- DC-ASGD: ``optimizer="dc_sgd"`` (Zheng et al. 2017), lambda 0.04.
- top-k 1%: ``top_k=0.01`` with error feedback (Lin et al. 2018).

Columns: final test accuracy (median over repeats), seconds to the target accuracy (first
evaluation at or above it; "-" if never), pushes, MB of gradient sent (the push log's
``bytes_sent``; its ratio to Downpour's), mean and max staleness of the pushes.  Runs are
interleaved (every method once, then the next repeat) so that load on the machine spreads over
all methods.

    python benchmarks/bench_algorithms.py [--budget 8] [--repeats 3] [--target 0.9]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models  # noqa: E402

REPLICAS, SHARDS = 4, 2
SGD = {"optimizer": "sgd", "learning_rate": 0.1}

#: The methods compared: DownpourSGD arguments on top of the common ones (see the docstring).
METHODS: dict[str, dict[str, Any]] = {
    "Downpour": SGD,
    "Downpour + Adagrad + warmstart": {"optimizer": "adagrad", "learning_rate": 0.05,
                                       "warmstart_steps": 100},
    "Downpour + averaged model": {**SGD, "ema_decay": 0.98},
    "SSP s=1": {**SGD, "consistency": "ssp", "staleness_bound": 1},
    "SSP s=4": {**SGD, "consistency": "ssp", "staleness_bound": 4},
    "BSP": {**SGD, "consistency": "bsp"},
    "EASGD": {**SGD, "elastic_alpha": 0.9 / REPLICAS, "n_push": 4, "n_fetch": 4},
    "DC-ASGD": {"optimizer": "dc_sgd", "learning_rate": 0.1},
    "top-k 1%": {**SGD, "top_k": 0.01},
}  # fmt: skip


def run_method(
    client: Client, name: str, train, test, budget: float, seed: int = 0, steps: int | None = None
):
    """Fit method ``name`` for ``budget`` seconds -- or, given ``steps``, for that many steps per
    replica whatever the machine's load -- and return its experiment log."""
    length = {"max_seconds": budget} if steps is None else {"max_steps": steps}
    est = DownpourSGD(
        models.MLP(784, (128,), 10), n_replicas=REPLICAS, n_shards=SHARDS, batch_size=32,
        max_epochs=None, eval_every=0.25, random_state=seed, timeout=60,
        **length, **METHODS[name],
    )  # fmt: skip
    est.fit(train, eval_data=test, client=client)
    return est.experiment_


def summarise(name: str, runs: list, target: float) -> dict[str, Any]:
    """One row of the table from the experiment logs of ``runs`` (medians over them)."""

    def median(values):
        return statistics.median(values)

    hits = [run.time_to(target) for run in runs]
    reached = [t for t in hits if t == t]
    return {
        "method": name,
        "accuracy": median(float(run.evals["accuracy"].iloc[-1]) for run in runs),
        "to_target": median(reached) if len(reached) * 2 > len(runs) else float("nan"),
        "pushes": median(len(run.pushes) for run in runs),
        "mb_sent": median(run.pushes["bytes_sent"].sum() / 1e6 for run in runs),
        "staleness_mean": median(float(run.pushes["staleness"].mean()) for run in runs),
        "staleness_max": max(int(run.pushes["staleness"].max()) for run in runs),
    }


def table(rows: list[dict[str, Any]], target: float) -> str:
    """The rows as the printed table (MB sent also as a ratio to the first row's)."""
    base = rows[0]["mb_sent"] or float("nan")
    lines = [
        f"{'method':32s} {'accuracy':>8s} {f's to {target:.2f}':>9s} {'pushes':>7s} "
        f"{'MB sent':>8s} {'vs first':>8s} {'stale mean':>10s} {'stale max':>9s}"
    ]
    for r in rows:
        to = f"{r['to_target']:.1f}" if r["to_target"] == r["to_target"] else "-"
        lines.append(
            f"{r['method']:32s} {r['accuracy']:8.3f} {to:>9s} {r['pushes']:7.0f} "
            f"{r['mb_sent']:8.1f} {r['mb_sent'] / base:7.3f}x {r['staleness_mean']:10.2f} "
            f"{r['staleness_max']:9d}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=8.0, help="seconds of training per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.90)
    args = parser.parse_args()
    train, test = datasets.load("mnist5k")
    runs: dict[str, list] = {name: [] for name in METHODS}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        for seed in range(args.repeats):
            for name in METHODS:
                runs[name].append(run_method(client, name, train, test, args.budget, seed))
    rows = [summarise(name, found, args.target) for name, found in runs.items()]
    print(
        f"MLP 784-128-10 on mnist5k, batch 32, {REPLICAS} replicas, {SHARDS} shards, "
        f"{args.budget:g} s per run, median of {args.repeats}"
    )
    print(table(rows, args.target))


if __name__ == "__main__":
    main()
