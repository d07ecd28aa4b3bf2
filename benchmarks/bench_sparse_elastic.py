"""A sparse fit through a cluster that shrinks (3 -> 2 workers) or grows (2 -> 3, ``--join``).

One ``fit_sparse`` on a local cluster of 3 worker processes: a logistic model on hashed
click-like data (an in-memory ``SparseBatch``), 3 replicas and 3 table shards, one of each per
worker.  At ``--leave-at`` seconds the worker holding shard 1 and replica 1 leaves, by
``client.retire_workers`` (default) or ``cluster.scale(2)`` (``--scale``).  The shard migrates
to a staying worker from its exact final state (rows, Adagrad state, push counters); replica 1
pauses and, once its worker is gone, is restarted on a staying worker after the steps it pushed.

With ``--join`` the fit starts on 2 workers with 2 replicas, 2 shards and ``max_replicas=3``,
and ``cluster.scale(3)`` at ``--leave-at`` seconds adds a worker, which gets replica 2 with a
third of each of the others' rows (:mod:`downpour_dask.downpour.sparse_growth`).

Prints the events with their times, the updates lost per shard, whether every shard's final
version equals the pushes it accepted, and examples/s before the change (the baseline,
measured in the same run) and after it.

    python benchmarks/bench_sparse_elastic.py [--steps 6000] [--leave-at 4] [--scale | --join]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask.core.sparse import SparseBatch  # noqa: E402
from downpour_dask.core.sparse_models import SparseLogisticRegression  # noqa: E402
from downpour_dask.downpour.sparse_fit import fit_sparse  # noqa: E402
from downpour_dask.runtime.cluster import cluster_workers  # noqa: E402

N_ROWS, FIELDS, EXAMPLES = 1 << 16, 8, 200_000


def clicks(seed: int = 0) -> SparseBatch:
    """Click-like data a logistic model can learn: each example's ids drawn from the table,
    its label from the sum of the ids' hidden effects."""
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1.0, N_ROWS)
    ids = rng.integers(0, N_ROWS, (EXAMPLES, FIELDS))
    clicked = rng.random(EXAMPLES) < 1 / (1 + np.exp(-effect[ids].sum(axis=1) / 2))
    x = rng.normal(size=(EXAMPLES, 2)).astype(np.float32)
    return SparseBatch(x, ids, clicked.astype(np.int64))


def rate(pushes: pd.DataFrame, start: float, stop: float) -> float:
    """Examples/s trained between ``start`` and ``stop`` (shard 0's records: one per step)."""
    window = pushes[(pushes["shard"] == 0) & (pushes["time"] >= start) & (pushes["time"] < stop)]
    return window["examples"].sum() / max(1e-9, stop - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000, help="steps per replica")
    parser.add_argument("--leave-at", type=float, default=4.0, help="seconds into the fit")
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--scale", action="store_true", help="cluster.scale(2), not retire")
    way.add_argument("--join", action="store_true", help="2 -> 3 workers, max_replicas=3")
    args = parser.parse_args()
    data = clicks()
    n = 2 if args.join else 3
    with (
        local_cluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(n, timeout=60)
        workers = sorted(cluster_workers(client))
        asked: list[float] = []

        def change(progress) -> None:
            if not asked and progress.time >= args.leave_at:
                asked.append(progress.time)
                if args.scale or args.join:
                    cluster.scale(3 if args.join else 2)  # returns at once
                else:  # not from the driver's thread, which supervises the fit meanwhile
                    threading.Thread(target=client.retire_workers, args=([workers[1]],)).start()

        started = time.perf_counter()
        fit = fit_sparse(SparseLogisticRegression(N_ROWS, FIELDS, n_numeric=2), data,
                         client=client, n_replicas=n, n_shards=n, batch_size=64,
                         max_epochs=10_000, max_steps=args.steps, timeout=60, callback=change,
                         max_replicas=3 if args.join else None)
        elapsed = time.perf_counter() - started
        how = "cluster.scale(3)" if args.join else "cluster.scale(2)" if args.scale else (
            "retire_workers")
        try:
            report(fit, asked, elapsed, how, len(cluster_workers(client)), args.join)
        finally:
            fit.close()


def report(fit, asked: list[float], elapsed: float, how: str, left: int, join: bool) -> None:
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.1f}; fit {elapsed:.1f} s; {how} at {asked[0]:.1f} s; "
          f"{left} workers at the end")
    events = fit.events
    print("\n  time  event               detail")
    for _, event in events.iterrows():
        print(f"{event['time']:6.2f}  {event['kind']:<19} {event['detail']}")
    pushes = fit.pushes
    print(f"\nupdates lost per shard: {fit.lost_updates}")
    for shard, counters in enumerate(fit.counters()):
        accepted = counters["accepted_by_replica"]
        print(f"shard {shard}: version {counters['version']:,}, pushes accepted "
              f"{sum(accepted.values()):,} ({dict(sorted(accepted.items()))})")
    moved = events.loc[events["kind"].isin(["shard_migrated", "replica_added"]), "time"]
    restarted = events.loc[events["kind"] == "replica_restarted", "time"]
    start, end = pushes["time"].min() + 0.5, pushes["time"].max()
    leave = asked[0] if moved.empty else float(moved.iloc[0])
    after = max(leave, float(restarted.iloc[0]) if len(restarted) else leave) + 0.5
    before = rate(pushes, start, asked[0])
    if join:
        added = pushes[(pushes["shard"] == 0) & (pushes["replica"] == 2)]
        print(f"replica 2 (added): {len(added):,} steps, {added['examples'].sum():,} examples")
        end = min(end, float(pushes.loc[pushes["replica"] < 2, "time"].max()))  # 3 training
    phases = ("2 workers (before the join)", "3 workers (3 replicas, after the join)")
    if not join:
        phases = ("3 workers (before the departure)", "2 workers (3 replicas, after the restart)")
    print(f"\n{'phase':<44}{'seconds':>8}{'examples/s':>12}{'vs before':>11}")
    print(f"{phases[0]:<44}{asked[0] - start:>8.1f}{before:>12,.0f}{1:>10.2f}x")
    rest = rate(pushes, after, end)
    print(f"{phases[1]:<44}{end - after:>8.1f}{rest:>12,.0f}{rest / before:>10.2f}x")


if __name__ == "__main__":
    main()
