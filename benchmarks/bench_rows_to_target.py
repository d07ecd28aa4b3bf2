"""Rows to 0.94 on ``bench_large.py``'s data: what Downpour's schedule and asynchrony cost in rows.

``bench_large.py`` times Downpour against scikit-learn on 10^7 streamed rows.  Downpour reads and
trains more rows per second there, but it needs about twice scikit-learn's rows to reach the MLP
target.  This script finds where the extra rows come from, apart from any speed: it runs the
project's simulator in its training mode (:func:`downpour_dask.simulate.train`: the real model and
gradients, Adam applied by the shards through the same guarded update, the replicas' local steps
and re-applied own pushes, in the order the simulator's timing gives) on the same data, model and
update rule as ``bench_large.py``'s Downpour MLP: MLP 64-64-2, Adam 0.01 on the shards, batch
256, local SGD at 0.2, 2 shards.  No clock is involved: only the order of the steps, pushes and
fetches changes from one schedule to the next.

The schedules, from serial to what the cluster does:

- ``serial``: one replica, ``n_fetch = n_push = 1``, no latency: Adam on every batch, each
  gradient taken at the parameters the previous one produced (scikit-learn's ``partial_fit``
  with Adam does the same, at batch 200).
- ``1 replica, n=4``: one replica, ``n_fetch = n_push = 4``: one Adam step per 4 batches' summed
  gradient, local SGD steps in between (``bench_large.py``'s schedule, without a second replica).
- ``1 replica, push 1, fetch 4``: every batch's gradient pushed on its own, fetched every 4.
- ``2 replicas, ...``: the same with two replicas stepping in turn, with no latency, or with
  every request and every reply taking ``--late`` step times on its way (the simulator's one-way
  ``latency``): pushes and fetches in flight while the replica goes on, as on a busy cluster.
- ``..., ema 0.98``: the shards publish the moving average of their parameters as the model
  (``DownpourSGD(ema_decay=0.98)``, :mod:`downpour_dask.core.averaging`); it is what is scored.
- ``..., beta2 0.95``: Adam's second-moment decay at 0.95 instead of 0.999, serial and
  asynchronous (``bench_large.py`` runs both sides with it: scikit-learn's ``beta_2=0.95``,
  Downpour's ``optim.adam(0.01, beta2=0.95)``).

The data is the first ``--rows`` training rows of ``bench_large.py``'s cached files (written by
it if missing), held in memory and split among the replicas as a fit splits it; the test set is
the same 20,000 held-out rows.  The shards' parameters are scored every ``--check`` rows applied
(scikit-learn's row group in ``bench_large.py``); a schedule's rows are those applied at its first
check at or above the target.  Each schedule runs with ``--seeds`` seeds (initial parameters and
data order); the table gives each seed's rows, the median, and the median against ``serial``'s.

    python benchmarks/bench_rows_to_target.py            # ~2.5 min on 2 cores
    python benchmarks/bench_rows_to_target.py --seeds 1 --rows 1000000 --target 0.93   # quick
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from large_data import CLASSES, COLUMNS, FEATURES, HIDDEN, TEST_ROWS, cached_data, read_test  # noqa: E402

from downpour_dask import models, optim  # noqa: E402
from downpour_dask.core.averaging import Averaged  # noqa: E402
from downpour_dask.data.arrays import Dataset  # noqa: E402
from downpour_dask.simulate import Setup, Timing, train  # noqa: E402

BATCH, LEARNING_RATE, LOCAL_RATE, SHARDS = 256, 0.01, 0.2, 2
STEP = 1e-3  # a step's virtual seconds; only ratios to it matter


@dataclass(frozen=True)
class Schedule:
    name: str
    replicas: int
    n_fetch: int
    n_push: int
    late: float = 0.0  # one-way latency of every reply, in step times
    ema: float | None = None  # ema_decay: the shards publish the average (core/averaging.py)
    beta2: float = 0.999  # Adam's second-moment decay (optim.adam's default; 0.95 in the tuned)


def schedules(late: float) -> list[Schedule]:
    return [
        Schedule("serial (1 replica, n=1)", 1, 1, 1),
        Schedule("1 replica, n=4", 1, 4, 4),
        Schedule("1 replica, push 1, fetch 4", 1, 4, 1),
        Schedule("2 replicas, n=4", 2, 4, 4),
        Schedule("2 replicas, push 1, fetch 4", 2, 4, 1),
        Schedule(f"2 replicas, n=4, replies {late:g} steps late", 2, 4, 4, late),
        Schedule(f"2 replicas, push 1, fetch 4, replies {late:g} steps late", 2, 4, 1, late),
        Schedule("2 replicas, n=4, ema 0.98", 2, 4, 4, ema=0.98),
        Schedule(f"2 replicas, n=4, replies {late:g} steps late, ema 0.98", 2, 4, 4, late, 0.98),
        Schedule("serial, beta2 0.95", 1, 1, 1, beta2=0.95),
        Schedule("2 replicas, n=4, ema 0.98, beta2 0.95", 2, 4, 4, ema=0.98, beta2=0.95),
        Schedule(f"2 replicas, n=4, replies {late:g} steps late, ema 0.98, beta2 0.95", 2, 4, 4,
                 late, 0.98, 0.95),
    ]


def read_rows(files: list[str], rows: int) -> Dataset:
    """The first ``rows`` rows of ``files`` (in file order), in memory."""
    Xs, ys, got = [], [], 0
    for path in files:
        table = pq.read_table(path, columns=[*COLUMNS, "label"])[: rows - got]
        Xs.append(np.column_stack([table.column(c).to_numpy() for c in COLUMNS]))
        ys.append(table.column("label").to_numpy())
        got += table.num_rows
        if got >= rows:
            break
    return Dataset(np.concatenate(Xs).astype(np.float32), np.concatenate(ys).astype(np.int64))


def rows_to(schedule: Schedule, data: Dataset, test: Dataset, target: float, check: int,
            seed: int) -> tuple[int | None, float]:
    """Rows applied at the first check at or above ``target`` (None: not within ``data``), and
    the best accuracy checked."""
    rows_per_push = schedule.n_push * BATCH
    steps = len(data.y) // (schedule.replicas * BATCH)  # one epoch of each replica's part
    setup = Setup(n_replicas=schedule.replicas, n_shards=SHARDS, batch_size=BATCH,
                  n_fetch=schedule.n_fetch, n_push=schedule.n_push, steps=steps)
    timing = Timing(step_seconds=STEP, latency=schedule.late * STEP)
    # a check every ``check`` rows: pushes arrive at ``replicas`` per step time and a push
    # carries n_push steps, so rows are applied at replicas * BATCH per step time
    every = check / (schedule.replicas * BATCH) * STEP
    model = models.MLP(FEATURES, (HIDDEN,), CLASSES)
    rule = optim.adam(LEARNING_RATE, beta2=schedule.beta2)
    rule = rule if schedule.ema is None else Averaged(rule, schedule.ema)
    result = train(setup, timing, model, rule, data, test,
                   local_learning_rate=LOCAL_RATE, seed=seed, eval_every=every)
    hit = result.curve[result.curve["score"] >= target]
    rows = None if hit.empty else int(hit["version"].iloc[0]) * rows_per_push
    return rows, float(result.curve["score"].max())


def median_rows(found: list[int | None]) -> float:
    """The median of a schedule's rows over its seeds, a seed that never got there counting as
    infinitely many."""
    return statistics.median(np.inf if rows is None else rows for rows in found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="training rows held")
    parser.add_argument("--path", default="/tmp/downpour-bench-large", help="bench_large's cache")
    parser.add_argument("--data-rows", type=int, default=10_000_000,
                        help="bench_large's --rows: which cached data set")
    parser.add_argument("--target", type=float, default=0.94)
    parser.add_argument("--check", type=int, default=65_536, help="rows between test checks")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--late", type=float, default=2.0, help="reply latency, in step times")
    args = parser.parse_args()
    start = time.perf_counter()
    files, test_file = cached_data(Path(args.path), args.data_rows)
    data, test = read_rows(files, args.rows), Dataset(*read_test(test_file, TEST_ROWS))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}")
    print(f"MLP {FEATURES}-{HIDDEN}-{CLASSES}, Adam {LEARNING_RATE} on {SHARDS} shards, batch "
          f"{BATCH}, local SGD {LOCAL_RATE}; rows applied to test accuracy {args.target} (checked "
          f"every {args.check:,} rows; '-': not within {args.rows:,} rows), simulated order")
    results, best = {}, {}
    for schedule in schedules(args.late):
        runs = [rows_to(schedule, data, test, args.target, args.check, seed)
                for seed in range(args.seeds)]
        results[schedule.name] = [rows for rows, _ in runs]
        best[schedule.name] = max(score for _, score in runs)
        print(f"  {schedule.name}: {runs}", flush=True)
    medians = {name: median_rows(found) for name, found in results.items()}
    serial = next(iter(medians.values()))  # the first schedule is the serial one
    print(f"\n{'schedule':58} {'rows per seed':>36} {'median':>11} {'vs serial':>10} "
          f"{'best acc':>9}")
    for name, found in results.items():
        median = medians[name]
        each = ", ".join("-" if r is None else f"{r:,}" for r in found)
        shown = "-" if not np.isfinite(median) else f"{median:,.0f}"
        ratio = f"{median / serial:.2f}x" if np.isfinite(median) else "-"
        print(f"{name:58} {each:>36} {shown:>11} {ratio:>10} {best[name]:9.4f}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
