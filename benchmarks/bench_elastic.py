"""A Downpour fit that follows its cluster: 2 -> 4 -> 2 workers.

One fit on a local cluster of 2 worker processes (2 replicas, 2 shards, ``max_replicas=4``),
timed by ``max_seconds``.  At ``--grow-at`` seconds the cluster is scaled to 4 workers; the
fit starts a replica on each worker that joins (a new worker process takes from 1 s on an idle
machine to 20 s on a loaded one to join).  ``--hold`` seconds after the fourth worker joined,
two workers are retired with ``client.retire_workers``: the one holding shard 1 (and replica
1), and one of the workers that joined.  The shard migrates (fenced, its exact final state
continues on a staying worker), replica 1 moves on after the steps it made, the added replica
ends.

Prints the replicas training in each second, examples/s per phase (the 2-worker phase is the
baseline: ratios are against it, measured in the same run) and the updates lost at each event.

    python benchmarks/bench_elastic.py [--seconds 40] [--grow-at 1] [--hold 8]
"""

from __future__ import annotations

import argparse
import threading

import numpy as np
from clusters import local_cluster
from distributed import Client

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.runtime.cluster import cluster_workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--grow-at", type=float, default=1.0)
    parser.add_argument("--hold", type=float, default=8.0)
    args = parser.parse_args()
    train, test = datasets.load("mnist5k")
    with (
        local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        first = sorted(cluster_workers(client))
        asked: dict[str, float] = {}

        def follow(progress) -> None:
            if "grow" not in asked and progress.time >= args.grow_at:
                asked["grow"] = progress.time
                cluster.scale(4)  # returns at once; the workers join seconds later
            if "grow" in asked and "joined" not in asked and len(cluster_workers(client)) == 4:
                asked["joined"] = progress.time
            if "shrink" not in asked and progress.time >= asked.get("joined", 1e9) + args.hold:
                asked["shrink"] = progress.time
                joined = sorted(set(cluster_workers(client)) - set(first))
                leaving = [first[1], *joined[:1]]  # shard 1's worker, and one that joined
                threading.Thread(target=client.retire_workers, args=(leaving,)).start()

        est = DownpourSGD(
            models.MLP(784, (128,), 10), n_replicas=2, n_shards=2, batch_size=64,
            max_replicas=4, max_epochs=None, max_seconds=args.seconds, random_state=0,
            eval_every=1.0, warmstart_steps=20,
        )  # fmt: skip
        est.fit(train, eval_data=test, client=client, callback=follow)
    report(est, asked)


def report(est: DownpourSGD, asked: dict[str, float]) -> None:
    """Print replicas over time, examples/s per phase and the events with their losses."""
    run = est.experiment_
    pushes, events = run.pushes, run.events
    end = float(pushes["time"].max())
    print("replicas pushing in each second:")
    seconds = np.floor(pushes["time"]).astype(int)
    counts = pushes.groupby(seconds)["replica"].nunique()
    print("  " + " ".join(f"{t}s:{n}" for t, n in counts.items()))
    added = events.loc[events["kind"] == "replica_added", "time"]
    left = events.loc[events["kind"].isin(["shard_migrated", "replica_retired"]), "time"]
    grown = float(added.max()) if len(added) else end
    shrunk = float(left.max()) if len(left) else end
    phases = [
        ("2 workers (before the first join)", 1.0, float(added.min()) if len(added) else end),
        ("4 workers (after the last join)", grown, asked.get("shrink", end)),
        ("2 workers (after the departures)", shrunk, end),
    ]
    phases = [p for p in phases if p[2] > p[1]]
    print(f"\n{'phase':40} {'seconds':>8} {'examples/s':>11} {'vs 2 workers':>13}")
    base = None
    for name, lo, hi in phases:
        part = pushes[(pushes["time"] >= lo) & (pushes["time"] < hi)]
        rate = part["examples"].sum() / (hi - lo) if hi > lo else float("nan")
        base = rate if base is None else base
        print(f"{name:40} {hi - lo:8.1f} {rate:11,.0f} {rate / base:12.2f}x")
    print(f"\n{'time':>6}  {'event':16} {'lost updates':>12}  detail")
    shown = ("replica_added", "replica_retired", "shard_migrated", "shard_lost", "shard_restored")
    for _, event in events[events["kind"].isin(shown)].iterrows():
        lost = event["data"].get("lost_updates", "")
        print(f"{event['time']:6.2f}  {event['kind']:16} {lost!s:>12}  {event['detail']}")
    status = est.server_status_
    accuracy = est.score(datasets.load("mnist5k")[1])
    print(f"\nlost updates per shard over the run: {list(status['lost_updates'])}; pushes "
          f"acknowledged {run.config['acknowledged_pushes']}, final versions "
          f"{list(status['version'])}; test accuracy {accuracy:.3f}; asked {asked}")  # fmt: skip


if __name__ == "__main__":
    main()
