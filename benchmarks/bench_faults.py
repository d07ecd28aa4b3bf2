"""Fault injection: SIGKILL replica and shard workers on a schedule during a Downpour run.

Model: MLP 784-64-10, Adagrad, batch 32, 3 replicas, 2 shards, on the shipped mnist5k, on a
local cluster of 3 single-threaded worker processes (nannies start a fresh worker after each
kill).  Shard i starts on worker i, replica r on worker r, so killing worker 2 costs a replica
only and killing worker 1 costs shard 1 and replica 1.  Each scenario is run ``--repeats`` times
on a fresh cluster; the table shows failures injected, updates lost (the shard's known version
minus the version it was restored at, plus pushes replicas never saw answered), time to
recover (from the kill until the ``shard_restored`` / ``replica_restarted`` event) and the final
test accuracy against a clean run of the same settings.

    python benchmarks/bench_faults.py [--epochs 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

from clusters import local_cluster
from distributed import Client

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.runtime.cluster import cluster_workers

#: scenario name -> list of (pushes applied when to kill, worker index to kill)
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "clean": [],
    "replica worker x1": [(250, 2)],
    "shard worker x1": [(250, 1)],
    "replica + shard workers": [(150, 2), (450, 1)],
}


class Injector:
    """A fit callback that SIGKILLs workers when the server has applied given push counts."""

    def __init__(self, client: Client, schedule: list[tuple[int, int]]):
        workers = sorted(cluster_workers(client))
        pids = client.run(os.getpid)
        self.plan = [(pushes, pids[workers[w]]) for pushes, w in schedule]
        self.kill_times: list[float] = []

    def __call__(self, progress) -> None:
        while self.plan and progress.pushes >= self.plan[0][0]:
            _, pid = self.plan.pop(0)
            os.kill(pid, signal.SIGKILL)
            self.kill_times.append(progress.time)


def run(schedule: list[tuple[int, int]], epochs: int, seed: int) -> dict[str, float]:
    train, test = datasets.load("mnist5k")
    with (
        local_cluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(3, timeout=60)
        injector = Injector(client, schedule)
        est = DownpourSGD(
            models.MLP(784, (64,), 10),
            n_replicas=3,
            n_shards=2,
            optimizer="adagrad",
            learning_rate=0.05,
            batch_size=32,
            warmstart_steps=50,
            max_epochs=epochs,
            random_state=seed,
            eval_every=0.25,
            checkpoint_every=1.0,
            timeout=60,
        )
        est.fit(train, eval_data=test, client=client, callback=injector)
    events = est.experiment_.events
    lost = est.experiment_.config.get("lost_pushes", 0)
    recover = []
    for kill_time in injector.kill_times:
        done = events[
            events["kind"].isin(["shard_restored", "replica_restarted"])
            & (events["time"] >= kill_time)
        ]
        if len(done):
            recover.append(float(done["time"].iloc[0]) - kill_time)
    for data in events.loc[events["kind"] == "shard_restored", "data"]:
        lost += data["lost_updates"]
    return {
        "failures": len(injector.kill_times),
        "events": int(events["kind"].isin(["shard_lost", "replica_failed"]).sum()),
        "lost": lost,
        "recover": max(recover) if recover else float("nan"),
        "accuracy": est.score(test),
        "seconds": float(events.loc[events["kind"] == "stop", "time"].iloc[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'scenario':<26}{'failures':>9}{'detected':>9}{'updates lost':>13}"
        f"{'recover s':>10}{'accuracy':>9}{'vs clean':>9}{'run s':>7}"
    )
    clean = None
    for name, schedule in SCENARIOS.items():
        rows = [run(schedule, args.epochs, seed) for seed in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        if clean is None:
            clean = med["accuracy"]
        print(
            f"{name:<26}{med['failures']:>9.0f}{med['events']:>9.0f}{med['lost']:>13.0f}"
            f"{med['recover']:>10.2f}{med['accuracy']:>9.4f}{med['accuracy'] - clean:>+9.4f}"
            f"{med['seconds']:>7.1f}"
        )
        time.sleep(1)


if __name__ == "__main__":
    main()
