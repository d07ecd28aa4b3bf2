"""Sustained accepted pushes/s of 32 concurrent replicas against 4 parameter-server shards, with
an exact accounting check: no push lost, none applied twice.

A local cluster of 2 single-threaded worker processes holds the 4 shards (2 per worker) and the
replicas.  Each replica is a seceded long-running task (it leaves the worker's thread pool), so
32 replicas share the 2 one-thread workers; the script verifies that all of them were running at
the same time (every replica's first push precedes every replica's last push).  Baseline: 4
replicas -> 4 shards, measured in the same run.  Two models:

- SoftmaxRegression 64 -> 10 on the shipped digits (650 parameters), batch 8, plain SGD: the
  gradient is tiny, so the push path is the bottleneck;
- MLP 784-128-10 on the shipped mnist5k (101,770 parameters), batch 32, Adagrad.

Throughput counts the pushes acknowledged (accepted by every shard) between ``--warmup`` seconds
and ``--seconds`` (when the stop is requested), divided by the window's length.  The check, per
run: every shard's ``version`` and ``accepted`` equal the number of accepted pushes in
``experiment_.pushes``; every shard's ``accepted_by_replica`` equals each replica's count of
accepted pushes; every shard's ``examples`` equals the examples in those pushes; and no shard
counted a duplicate or refused a push.

    python benchmarks/bench_shard_scale.py [--seconds 10] [--repeats 3]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402

import distributed  # noqa: E402
import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models  # noqa: E402

N_SHARDS = 4


def accounting(est, n_replicas: int) -> list[str]:
    """Problems found comparing the shards' counters with the replicas' push log (empty: PASS)."""
    pushes, status = est.experiment_.pushes, est.server_status_
    accepted = pushes[pushes["accepted"]]
    per_replica = accepted.groupby("replica").size().to_dict()
    problems = []
    if len(accepted) != len(pushes):
        problems.append(f"{len(pushes) - len(accepted)} pushes not accepted by every shard")
    if set(pushes["replica"]) != set(range(n_replicas)):
        problems.append(f"only replicas {sorted(set(pushes['replica']))} pushed")
    for _, shard in status.iterrows():
        name = f"shard {shard['shard']}"
        if shard["version"] != len(accepted):
            problems.append(f"{name}: version {shard['version']} != {len(accepted)} pushes")
        if shard["accepted"] != len(accepted):
            problems.append(f"{name}: accepted {shard['accepted']} != {len(accepted)} pushes")
        by_replica = {int(k): int(v) for k, v in shard["accepted_by_replica"].items()}
        if by_replica != per_replica:
            diff = {
                r: (by_replica.get(r, 0), per_replica.get(r, 0))
                for r in set(by_replica) | set(per_replica)
                if by_replica.get(r, 0) != per_replica.get(r, 0)
            }
            problems.append(f"{name}: accepted_by_replica != log, (shard, log) by replica {diff}")
        if shard["examples"] != accepted["examples"].sum():
            problems.append(
                f"{name}: examples {shard['examples']} != {accepted['examples'].sum()} in the log"
            )
        if shard["duplicates"] or shard["refused"]:
            problems.append(f"{name}: {shard['duplicates']} duplicates, {shard['refused']} refused")
    return problems


def one_run(client, case, replicas: int, seconds: float, warmup: float, seed: int) -> dict:
    model, train, optimizer, lr, batch = case
    est = DownpourSGD(
        model,
        n_replicas=replicas,
        n_shards=N_SHARDS,
        optimizer=optimizer,
        learning_rate=lr,
        batch_size=batch,
        max_seconds=seconds,
        max_epochs=1_000_000,
        eval_every=0.5,
        random_state=seed,
    ).fit(train, client=client)
    pushes = est.experiment_.pushes
    ok = pushes[pushes["accepted"]]
    window = ok[(ok["time"] >= warmup) & (ok["time"] <= seconds)]
    span = ok.groupby("replica")["time"].agg(["min", "max"])
    return {
        "rate": len(window) / (seconds - warmup),
        "examples_rate": window["examples"].sum() / (seconds - warmup),
        "versions": est.server_status_["version"].tolist(),
        "workers": est.server_status_["worker"].tolist(),
        "concurrent": bool(len(span) == replicas and span["min"].max() < span["max"].min()),
        "last_start": float(span["min"].max()),
        "staleness": float(pushes["staleness"].mean()),
        "problems": accounting(est, replicas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=32)
    args = parser.parse_args()
    load = os.getloadavg()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, distributed "
        f"{distributed.__version__}; load average at start {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}"
    )
    digits, _ = datasets.load("digits")
    mnist, _ = datasets.load("mnist5k")
    cases = {
        "softmax 64-10, digits, batch 8, sgd": (
            models.SoftmaxRegression(64, 10),
            digits,
            "sgd",
            0.05,
            8,
        ),
        "MLP 784-128-10, mnist5k, batch 32, adagrad": (
            models.MLP(784, (128,), 10),
            mnist,
            "adagrad",
            0.05,
            32,
        ),
    }
    rows = []
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        nthreads = sum(client.nthreads().values())
        print(f"cluster: {len(client.nthreads())} workers, {nthreads} threads in total")
        # untimed warm-up fit: workers import everything before the first measured run
        DownpourSGD(models.SoftmaxRegression(64, 10), n_replicas=2, max_steps=20).fit(
            digits, client=client
        )
        for name, case in cases.items():
            runs = {4: [], args.replicas: []}
            for seed in range(args.repeats):  # interleaved: baseline and target alternate
                for replicas in runs:
                    runs[replicas].append(
                        one_run(client, case, replicas, args.seconds, args.warmup, seed)
                    )
            for replicas, found in runs.items():
                rows.append((name, replicas, found))
    load = os.getloadavg()
    print(
        f"\n{N_SHARDS} shards on 2 single-threaded workers; accepted pushes/s between "
        f"{args.warmup:g} s and {args.seconds:g} s, median of {args.repeats} runs; baseline = 4 "
        f"replicas of the same model"
    )
    header = (
        f"{'model':44} {'replicas':>8} {'pushes/s':>9} {'vs 4 rep.':>9} {'examples/s':>10} "
        f"{'staleness':>9} {'concurrent':>10}  {'shard versions (last run)':28} {'check':>5}"
    )
    print(header)
    baseline = {}
    for name, replicas, found in rows:
        rate = statistics.median(r["rate"] for r in found)
        baseline.setdefault(name, rate)
        examples = statistics.median(r["examples_rate"] for r in found)
        stale = statistics.median(r["staleness"] for r in found)
        concurrent = sum(r["concurrent"] for r in found)
        versions = ",".join(str(v) for v in found[-1]["versions"])
        verdict = "PASS" if not any(r["problems"] for r in found) else "FAIL"
        print(
            f"{name:44} {replicas:8d} {rate:9,.0f} {rate / baseline[name]:8.2f}x "
            f"{examples:10,.0f} {stale:9.1f} {f'{concurrent}/{len(found)}':>10}  "
            f"{versions:28} {verdict:>5}"
        )
    for name, replicas, found in rows:
        for i, r in enumerate(found):
            for problem in r["problems"]:
                print(f"  FAIL {name}, {replicas} replicas, run {i}: {problem}")
    last = [max(r["last_start"] for r in found) for _, _, found in rows]
    print(
        f"(concurrent: runs in which every replica's first push came before every replica's last "
        f"push; the latest first push of any replica came {max(last):.2f} s after fit started)"
    )
    print(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
