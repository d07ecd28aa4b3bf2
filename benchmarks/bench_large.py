"""Time to a target test accuracy on 10^7 rows x 64 features streamed from parquet files.

The data is the project's own learnable synthetic set (``datasets.synthetic``: standard normal
float32 features, binary labels from a fixed random tanh teacher network), 10^7 training rows in
10 parquet files (~256 MB each) plus an 11th file from which the first 20,000 rows are the test
set.  It is written once (``large_data.py``) and cached under ``--path`` (default
``/tmp/downpour-bench-large``, one folder per row count; ``--clean`` or
``rm -rf /tmp/downpour-bench-large`` removes it).

Every method streams the same 10 files and pays its own reading; each is timed from its first
call (building its dataset or collection included) to the first test-accuracy check at or above
its target, and stops there (or after ``--budget`` seconds); its rows/s are the rows it had
trained on by then over that time, which separates how fast a method reads and trains from how
many rows it needs.  Two targets: ``--linear-target`` (0.90; a linear model's accuracy on this
data tops out near 0.91) for the logistic regressions, and ``--target`` (0.94) for the MLPs: it
needs about 2-3 million rows, so it is where data too large for one process's patience shows.
Each model class is compared with its own baselines.

- scikit-learn, one process (BLAS pinned to 1 thread, as Dask's nanny pins every worker):
  ``partial_fit`` on one parquet row group (65,536 rows) at a time, files and row groups in a
  fresh random order each epoch, the test set scored after each call (off the clock).
  ``SGDClassifier(loss="log_loss")`` (logistic regression; ``alpha=1e-4``) with its default
  ``learning_rate="optimal"`` and with ``learning_rate="adaptive", eta0=0.01``;
  ``MLPClassifier(hidden_layer_sizes=(64,))`` (relu, adam, ``batch_size=200``,
  ``alpha=1e-4``) with its default ``learning_rate_init=1e-3``, with 1e-2, and with 1e-2 and
  ``beta_2=0.95`` (Adam's second-moment average over ~20 steps instead of ~1000: fewer rows
  to the target, here and for Downpour).
- dask-ml ``Incremental`` wrapping the best of them (SGD adaptive, MLP adam 1e-2 with
  ``beta_2=0.95``), on the same
  2-worker cluster, over ``dask.dataframe.read_parquet`` (one partition per row group):
  ``partial_fit`` on ``--dask-ml-blocks`` blocks at a time (Incremental visits them in turn,
  moving the model to the worker holding each block), the test set scored between calls (off
  the clock).
- Downpour (``DownpourSGD`` on the same cluster: 2 single-threaded worker processes, 2 replicas,
  2 shards unless said; ``datasets.from_parquet`` of the files, each replica streaming its 5
  files on its worker): ``models.LogisticRegression(64)`` and ``models.MLP(64, (64,), 2)``
  (relu, softmax over 2 outputs: the same function class as sklearn's one logistic output; no
  L2), adam 0.01, batch 256, ``n_fetch = n_push = 4``; the MLP's replicas step locally with SGD
  at 0.2 between fetches (``local_learning_rate``).  The MLP runs as it is; with
  ``ema_decay=0.98`` (the shards publish the moving average of their parameters as the model);
  and with the average and ``optimizer="adam:beta2=0.95"`` at 0.01 and 0.015, as
  scikit-learn's, on 2 shards and on 1 (this model's 4,290 parameters make a second shard all
  overhead).  It evaluates every 0.1 s on the driver; its time is taken when the callback first
  sees a score at or above the target (the evaluation's own time is on the clock: this errs
  against Downpour), and the callback then stops the fit; its "rows" are the examples applied.

Hyperparameters: the library defaults, plus the winners of the small grid that ``--grid`` runs
too (sklearn: MLP adam 3e-3, sgd 0.1, and with ``beta_2`` 0.99 and 0.9, or 0.95 at rates 5e-3
and 2e-2; Downpour: adam 0.003 at batch 128 and 256, batch 512, adam 0.006 with n=2,
staleness-aware and delay-compensated adam, adagrad 0.05, the local SGD rate left at its
default, and ``beta2`` 0.99 with the average, 0.95 without);
benchmarks/README.md has a grid run.

    python benchmarks/bench_large.py                   # 10^7 rows; ~2 min to write the data once
    python benchmarks/bench_large.py --rounds 3        # every method 3 times in turns: medians
    python benchmarks/bench_large.py --pinned          # and each Downpour method with the
                                                       # workers pinned (downpour_dask.pin_workers)
    python benchmarks/bench_large.py --rows 100000 --target 0.91 --linear-target 0.88  # quick
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker: the in-process baselines use one core.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import dask.dataframe as dd  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from clusters import local_cluster  # noqa: E402
from dask_ml.wrappers import Incremental  # noqa: E402
from distributed import Client  # noqa: E402
from large_data import (  # noqa: E402
    CLASSES,
    COLUMNS,
    FEATURES,
    HIDDEN,
    SEED,
    TEST_ROWS,
    cached_data,
    read_test,
    row_groups,
)
from sklearn.linear_model import SGDClassifier  # noqa: E402
from sklearn.neural_network import MLPClassifier  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models, pin_workers, unpin_workers  # noqa: E402

# -- one method's run ------------------------------------------------------------------------


@dataclass
class Trace:
    """A run's test-accuracy checks: (seconds on its clock, rows seen, accuracy)."""

    checks: list[tuple[float, int, float]] = field(default_factory=list)

    def add(self, seconds: float, rows: int, accuracy: float) -> None:
        self.checks.append((seconds, rows, accuracy))

    def time_to(self, target: float) -> tuple[float, int]:
        """(seconds, rows) at the first check at or above ``target``; (nan, 0) if none."""
        for seconds, rows, acc in self.checks:
            if acc >= target:
                return seconds, rows
        return math.nan, 0

    @property
    def best(self) -> float:
        return max((a for *_, a in self.checks), default=math.nan)


def fastest(times: list[float]) -> float:
    """The least of ``times`` that reached the target (not nan); nan if none did."""
    return min((t for t in times if not math.isnan(t)), default=math.nan)


def median_to(runs: list[Trace], target: float) -> tuple[float, float]:
    """Median (seconds, rows) to ``target`` over a method's rounds; nan if a round missed it."""
    reached = [tr.time_to(target) for tr in runs]
    if any(math.isnan(t) for t, _ in reached):
        return math.nan, 0.0
    return statistics.median(t for t, _ in reached), statistics.median(r for _, r in reached)


def run_sklearn(make: Callable, files, test, stop_at: float, budget: float) -> Trace:
    """``partial_fit`` one row group at a time in this process; scoring is off the clock."""
    clf, trace = make(), Trace()
    clock, rows = 0.0, 0
    start = time.perf_counter()
    for X, y in row_groups(files, np.random.default_rng(SEED)):
        clf.partial_fit(X, y, classes=np.arange(CLASSES))
        clock += time.perf_counter() - start
        rows += len(y)
        trace.add(clock, rows, clf.score(*test))
        if trace.checks[-1][2] >= stop_at or clock >= budget:
            return trace
        start = time.perf_counter()
    return trace


def run_incremental(client, make, files, test, stop_at, budget, blocks_per_call) -> Trace:
    """dask-ml ``Incremental`` over ``read_parquet``'s row-group partitions, on the cluster."""
    trace, clock, rows = Trace(), 0.0, 0
    start = time.perf_counter()
    ddf = dd.read_parquet(files, columns=[*COLUMNS, "label"], split_row_groups=True)
    lengths = [
        pq.ParquetFile(f).metadata.row_group(g).num_rows
        for f in files
        for g in range(pq.ParquetFile(f).metadata.num_row_groups)
    ]
    # one array, so that X and y come from the same read of each partition (projecting the
    # columns separately lets dask-expr partition the two differently)
    table = ddf.to_dask_array(lengths=lengths)
    X, y = table[:, :FEATURES].astype(np.float32), table[:, FEATURES].astype(np.int64)
    inc = Incremental(make(), shuffle_blocks=True, random_state=SEED)
    rng = np.random.default_rng(SEED)
    while True:
        order = rng.permutation(X.numblocks[0])
        for lo in range(0, len(order), blocks_per_call):
            idx = sorted(int(i) for i in order[lo : lo + blocks_per_call])
            inc.partial_fit(X.blocks[idx], y.blocks[idx], classes=np.arange(CLASSES))
            clock += time.perf_counter() - start
            rows += sum(lengths[i] for i in idx)
            trace.add(clock, rows, inc.estimator_.score(*test))
            if trace.checks[-1][2] >= stop_at or clock >= budget:
                return trace
            start = time.perf_counter()


class _Reached(Exception):
    """Raised by the callback to stop a Downpour fit at its target."""


def run_downpour(client, model, files, test, stop_at, budget, **settings) -> Trace:
    """``DownpourSGD`` on the cluster, streaming the files; stopped by its callback at target."""
    trace = Trace()
    start = time.perf_counter()

    def callback(progress) -> None:
        if not math.isnan(progress.score):
            trace.add(time.perf_counter() - start, progress.examples, progress.score)
            if progress.score >= stop_at:
                raise _Reached

    est = DownpourSGD(model, **{"n_shards": 2, **settings}, n_replicas=2, max_seconds=budget,
                      max_epochs=100, eval_every=0.1, random_state=SEED, timeout=60)  # fmt: skip
    try:
        est.fit(datasets.from_parquet(files), eval_data=test, client=client, callback=callback)
    except _Reached:
        pass
    return trace


# -- the methods -----------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    kind: str  # "sklearn", "dask-ml", "downpour"
    linear: bool
    make: Callable  # sklearn: estimator factory; downpour: model factory
    settings: dict = field(default_factory=dict)
    pinned: bool = False  # the workers pinned to a CPU each for the run (downpour_dask.pin_workers)


def methods(grid: bool) -> list[Method]:
    sgd = lambda **kw: lambda: SGDClassifier(loss="log_loss", random_state=SEED, **kw)  # noqa: E731
    mlp = lambda **kw: lambda: MLPClassifier((HIDDEN,), random_state=SEED, **kw)  # noqa: E731
    logistic = lambda: models.LogisticRegression(FEATURES)  # noqa: E731
    net = lambda: models.MLP(FEATURES, (HIDDEN,), CLASSES)  # noqa: E731
    dp = dict(optimizer="adam", learning_rate=0.01, batch_size=256, n_fetch=4, n_push=4)
    averaged = {**dp, "local_learning_rate": 0.2, "ema_decay": 0.98}
    one_shard = {"n_shards": 1}
    adam = lambda rate, beta2: {"optimizer": f"adam:beta2={beta2}", "learning_rate": rate}  # noqa: E731
    out = [
        Method("sklearn SGDClassifier(log_loss), defaults", "sklearn", True, sgd()),
        Method("sklearn SGDClassifier(log_loss), adaptive eta0=0.01", "sklearn", True,
               sgd(learning_rate="adaptive", eta0=0.01)),
        Method("dask-ml Incremental(SGDClassifier(log_loss)), adaptive eta0=0.01", "dask-ml",
               True, sgd(learning_rate="adaptive", eta0=0.01)),
        Method("Downpour LogisticRegression, adam 0.01, batch 256, n=4", "downpour", True,
               logistic, dp),
        Method("sklearn MLPClassifier(64), defaults (adam 1e-3)", "sklearn", False, mlp()),
        Method("sklearn MLPClassifier(64), adam 1e-2", "sklearn", False,
               mlp(learning_rate_init=1e-2)),
        Method("sklearn MLPClassifier(64), adam 1e-2, beta_2 0.95", "sklearn", False,
               mlp(learning_rate_init=1e-2, beta_2=0.95)),
        Method("dask-ml Incremental(MLPClassifier(64), adam 1e-2, beta_2 0.95)", "dask-ml",
               False, mlp(learning_rate_init=1e-2, beta_2=0.95)),
        Method("Downpour MLP 64-64-2, adam 0.01, local SGD 0.2, batch 256, n=4", "downpour",
               False, net, {**dp, "local_learning_rate": 0.2}),
        Method("Downpour MLP 64-64-2, adam 0.01, local SGD 0.2, batch 256, n=4, ema 0.98",
               "downpour", False, net, averaged),
        Method("Downpour MLP 64-64-2, adam 0.01 beta2 0.95, local SGD 0.2, batch 256, n=4, "
               "ema 0.98", "downpour", False, net, {**averaged, **adam(0.01, 0.95)}),
        Method("Downpour MLP 64-64-2, adam 0.015 beta2 0.95, local SGD 0.2, batch 256, n=4, "
               "ema 0.98", "downpour", False, net, {**averaged, **adam(0.015, 0.95)}),
        Method("Downpour MLP 64-64-2, adam 0.01 beta2 0.95, local SGD 0.2, n=4, ema 0.98, 1 shard",
               "downpour", False, net, {**averaged, **adam(0.01, 0.95), **one_shard}),
        Method("Downpour MLP 64-64-2, adam 0.015 beta2 0.95, local SGD 0.2, n=4, ema 0.98, 1 "
               "shard", "downpour", False, net, {**averaged, **adam(0.015, 0.95), **one_shard}),
    ]  # fmt: skip
    if grid:
        out += [
            Method("sklearn MLPClassifier(64), sgd 0.1 (momentum 0.9)", "sklearn", False,
                   mlp(solver="sgd", learning_rate_init=0.1)),
            Method("sklearn MLPClassifier(64), adam 3e-3", "sklearn", False,
                   mlp(learning_rate_init=3e-3)),
            Method("sklearn MLPClassifier(64), adam 1e-2, beta_2 0.99", "sklearn", False,
                   mlp(learning_rate_init=1e-2, beta_2=0.99)),
            Method("sklearn MLPClassifier(64), adam 1e-2, beta_2 0.9", "sklearn", False,
                   mlp(learning_rate_init=1e-2, beta_2=0.9)),
            Method("sklearn MLPClassifier(64), adam 5e-3, beta_2 0.95", "sklearn", False,
                   mlp(learning_rate_init=5e-3, beta_2=0.95)),
            Method("sklearn MLPClassifier(64), adam 2e-2, beta_2 0.95", "sklearn", False,
                   mlp(learning_rate_init=2e-2, beta_2=0.95)),
            Method("Downpour MLP 64-64-2, adam 0.01 beta2 0.99, local SGD 0.2, n=4, ema 0.98",
                   "downpour", False, net, {**averaged, **adam(0.01, 0.99)}),
            Method("Downpour MLP 64-64-2, adam 0.01 beta2 0.95, local SGD 0.2, n=4", "downpour",
                   False, net, {**dp, "local_learning_rate": 0.2, **adam(0.01, 0.95)}),
            Method("Downpour MLP 64-64-2, adam 0.003, batch 128, n=4", "downpour", False, net,
                   {**dp, "batch_size": 128, "learning_rate": 0.003}),
            Method("Downpour MLP 64-64-2, adam 0.003, batch 256, n=4", "downpour", False, net,
                   {**dp, "learning_rate": 0.003}),
            Method("Downpour MLP 64-64-2, adam 0.01, batch 512, n=4", "downpour", False, net,
                   {**dp, "batch_size": 512}),
            Method("Downpour MLP 64-64-2, adam 0.006, batch 256, n=2", "downpour", False, net,
                   {**dp, "learning_rate": 0.006, "n_fetch": 2, "n_push": 2}),
            Method("Downpour MLP 64-64-2, staleness_aware_adam 0.01, batch 256, n=4", "downpour",
                   False, net, {**dp, "optimizer": "staleness_aware_adam"}),
            Method("Downpour MLP 64-64-2, dc_adam 0.01, batch 256, n=4", "downpour", False, net,
                   {**dp, "optimizer": "dc_adam"}),
            Method("Downpour MLP 64-64-2, adagrad 0.05, batch 128, n=4", "downpour", False, net,
                   {**dp, "batch_size": 128, "optimizer": "adagrad", "learning_rate": 0.05}),
            Method("Downpour MLP 64-64-2, adam 0.01 (local SGD 0.01), batch 256, n=4",
                   "downpour", False, net, dp),
        ]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="training rows")
    parser.add_argument("--path", default="/tmp/downpour-bench-large", help="data cache")
    parser.add_argument("--clean", action="store_true", help="remove the data cache and exit")
    parser.add_argument("--target", type=float, default=0.94, help="MLP target accuracy")
    parser.add_argument("--linear-target", type=float, default=0.90)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per method, at most")
    parser.add_argument("--dask-ml-blocks", type=int, default=4, help="blocks per partial_fit")
    parser.add_argument("--grid", action="store_true", help="also run the tuning grid")
    parser.add_argument("--pinned", action="store_true",
                        help="also run each Downpour method with the workers pinned to a CPU each")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times, in turns (medians reported)")
    args = parser.parse_args()
    root = Path(args.path)
    if args.clean:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}")
        return
    warnings.filterwarnings("ignore", module="sklearn")
    files, test_file = cached_data(root, args.rows)
    test = read_test(test_file, TEST_ROWS)
    print(f"data cached in {root} (remove with: python {__file__} --clean, or rm -rf {root})")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average at start "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    todo = methods(args.grid)
    if args.pinned:
        ours = [m for m in todo if m.kind == "downpour"]
        todo += [replace(m, name=f"{m.name}, pinned", pinned=True) for m in ours]
    traces: dict[str, list[Trace]] = {m.name: [] for m in todo}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        # warm up: every worker imports what the runs use before any clock starts
        DownpourSGD("logistic", n_replicas=2, max_steps=5).fit(*test, client=client)
        # every round runs every method once; every other round in reverse order, so that no
        # method always follows the same one
        turns = [m for r in range(args.rounds) for m in (todo if r % 2 == 0 else todo[::-1])]
        for m in turns:
            stop_at = args.linear_target if m.linear else args.target
            load = os.getloadavg()[0]
            if m.kind == "sklearn":
                trace = run_sklearn(m.make, files, test, stop_at, args.budget)
            elif m.kind == "dask-ml":
                trace = run_incremental(
                    client, m.make, files, test, stop_at, args.budget, args.dask_ml_blocks
                )
            else:
                if m.pinned:
                    pin_workers(client)
                trace = run_downpour(client, m.make(), files, test, stop_at, args.budget,
                                     **m.settings)  # fmt: skip
                unpin_workers(client)
            traces[m.name].append(trace)
            t, rows = trace.time_to(stop_at)
            print(
                f"  {m.name}: {t:.2f} s to {stop_at} ({rows:,} rows), best {trace.best:.4f}; "
                f"load {load:.2f}",
                flush=True,
            )
    print(
        f"\n{args.rows:,} rows x {FEATURES} features, {CLASSES} classes, streamed from 10 "
        f"parquet files; test {TEST_ROWS:,} held-out rows; budget {args.budget:g} s per method; "
        "times from each method's first call, reading included"
        + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else "")
    )
    print(
        f"{'method':75} {'target':>6} {'time (s)':>9} {'rows':>11} {'rows/s':>9} {'vs best':>8} "
        f"{'best acc':>9}"
    )
    ratios, per_round = {}, []
    for linear, target in ((True, args.linear_target), (False, args.target)):
        group = [m for m in todo if m.linear == linear]
        times = {m.name: [tr.time_to(target)[0] for tr in traces[m.name]] for m in group}
        baselines = [m.name for m in group if m.kind != "downpour"]
        best = fastest([median_to(traces[n], target)[0] for n in baselines])
        print(f"-- {'logistic regression' if linear else f'MLP {FEATURES}-{HIDDEN}-out'}: "
              f"best baseline (sklearn, dask-ml) {best:.2f} s to {target}")  # fmt: skip
        for m in group:
            t, rows = median_to(traces[m.name], target)
            ratios[m.name] = t / best
            shown = ("-",) * 4 if math.isnan(t) else (
                f"{t:.2f}", f"{rows:,.0f}", f"{rows / t:,.0f}", f"{t / best:.2f}x"
            )
            top = max(tr.best for tr in traces[m.name])
            print(f"{m.name:75} {target:>6} {shown[0]:>9} {shown[1]:>11} {shown[2]:>9} "
                  f"{shown[3]:>8} {top:9.4f}")  # fmt: skip
        if not linear:  # each round's fastest Downpour MLP against its fastest baseline
            ours = [m.name for m in group if m.kind == "downpour"]
            for r in range(args.rounds):
                per_round.append(fastest([times[n][r] for n in ours])
                                 / fastest([times[n][r] for n in baselines]))  # fmt: skip
    downpour = [ratios[m.name] for m in todo if m.kind == "downpour" and not m.linear]
    print(
        f"Downpour MLP's best against the best baseline to {args.target}: "
        f"{min(downpour, default=math.nan):.2f}x (goal <= 0.6x)"
    )
    if args.rounds > 1:
        print("the same in each round: " + ", ".join(f"{x:.2f}x" for x in per_round)
              + f"; median {statistics.median(per_round):.2f}x")  # fmt: skip
    print("load average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
