"""Model parallelism: examples/s of one replica split over P = 2 workers against P = 1.

Model: MLP 1024-4096-4096-10 (relu, softmax; 21M parameters, 84 MB), too wide to be fast on one
single-threaded worker.  Data: 8,192 synthetic rows of 1,024 features labelled by a random
teacher.  One Downpour replica with Adagrad, batch 128, 2 shards, on a local cluster of 2
single-threaded worker processes; P = 1 runs the replica on one worker (its shards on both),
P = 2 splits it by neurons over both (each partition with the shard of its own parameters).
Each configuration is repeated and the median reported, and the best run (the one least
disturbed on a shared machine); ratios are against P = 1 measured in this same run, with the
same n_fetch = n_push.  A single-threaded in-process numpy loop of the same model shows what one
core does with no communication at all.

The bytes crossing partition boundaries are counted by the partitions themselves (every message
payload) and compared with the plan's count of values per example; each partition also reports
its thread's CPU time and the time it waited for the other's messages, shown per step (mean of
the partitions, median of the runs): the CPU time does not grow when other processes take the
cores, so it shows a change in work even on a busy machine.

With ``--ab [NAME ...]`` each configuration also runs with the speed-ups listed in ``BEFORE``
(those named, or all) switched off on the workers ("no ..." rows), interleaved with the current
code's runs in every repeat, so a change is measured against what it replaced on the same
machine at the same moment.

With ``--pinned yes`` the workers run pinned to a CPU each (:func:`downpour_dask.pin_workers`),
with ``--pinned both`` both ways in every repeat (ratios against P = 1 of the same kind).

    python benchmarks/bench_model_parallel.py [--seconds 10] [--repeats 3] [--pinned both]
    python benchmarks/bench_model_parallel.py --ab [NAME ...] [--every 1 4]
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker: the serial baseline is a single-thread loop.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
from bench_downpour import (  # noqa: E402  (the same baseline loop and pinned runs)
    BATCH,
    PIN_STATES,
    PINNED,
    serial_examples_per_s,
)
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD, models, pin_workers, unpin_workers  # noqa: E402
from downpour_dask.core.partition import PartitionPlan  # noqa: E402
from downpour_dask.core.partition_part import MLPPart  # noqa: E402
from downpour_dask.downpour.model_parallel import MailboxLink  # noqa: E402
from downpour_dask.downpour.replica_loop import ReplicaLoop  # noqa: E402

FEATURES, HIDDEN, CLASSES = 1024, (4096, 4096), 10

#: The speed-ups ``--ab`` switches off for its "before" rows: (class, attribute, before, now).
BEFORE = [
    (MLPPart, "overlap", False, True),
    (ReplicaLoop, "skip_refetched", False, True),
    (ReplicaLoop, "pull_into", False, True),
    (MailboxLink, "direct", False, True),
]


def switch(before: bool, names: list[str]) -> None:
    """Set the speed-ups ``names`` of this process (a worker's, through ``Client.run``) off or
    on (every other one on)."""
    for cls, name, old, new in BEFORE:
        setattr(cls, name, old if before and name in names else new)


def synthetic(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian features labelled by a random linear teacher (float32, int64)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)
    return X, np.argmax(X @ teacher, axis=1).astype(np.int64)


def replica_run(client, model, X, y, partitions: int, every: int, seconds: float):
    """Examples/s of one replica in the window after the first 2 s, and boundary bytes/example."""
    est = DownpourSGD(
        model,
        n_replicas=1,
        n_shards=2,
        optimizer="adagrad",
        learning_rate=0.01,
        batch_size=BATCH,
        n_fetch=every,
        n_push=every,
        max_seconds=seconds,
        max_epochs=10_000,
        eval_every=seconds,
        random_state=0,
        timeout=300,
        partitions=partitions,
    ).fit((X, y), client=client)
    run = est.experiment_
    pushes = run.pushes[run.pushes["partition"] == 0]
    window = pushes[(pushes["time"] >= 2.0) & (pushes["time"] <= seconds)]
    span = window["time"].max() - 2.0 if len(window) else float("nan")
    rate = window["examples"].sum() / span if span > 0 else float("nan")
    sent = run.config.get("partition_bytes_sent", 0) / max(1.0, run.summary()["examples"])
    slots = run.config.get("partition_slots", [])
    per_step = [  # ms of its thread's CPU and of waiting for the peer, per step, per partition
        (1e3 * s["cpu_seconds"] / s["steps"], 1e3 * s["waited_seconds"] / s["steps"])
        for s in slots
        if s.get("steps")
    ]
    return rate, sent, per_step


def _median(values: list[float]) -> float:
    """The median of the runs that measured something (a run too slow to push in its window
    measures nan)."""
    finite = [v for v in values if np.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def _best(values: list[float]) -> float:
    """The fastest of the runs that measured something."""
    return max((v for v in values if np.isfinite(v)), default=float("nan"))


def _ms(value: float | None) -> str:
    """A partition's milliseconds per step for the table ("-": not split, or not measured)."""
    return "-" if value is None or not np.isfinite(value) else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ab",
        nargs="*",
        metavar="NAME",
        help="also run with these of BEFORE's speed-ups off (none named: all of them)",
    )
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4], help="n_fetch = n_push")
    parser.add_argument(
        "--pinned", choices=["no", "yes", "both"], default="no",
        help="run with each worker pinned to a CPU of its own (downpour_dask.pin_workers), or "
        "both ways in every repeat",
    )  # fmt: skip
    args = parser.parse_args()
    model = models.MLP(FEATURES, HIDDEN, CLASSES)
    X, y = synthetic(8192)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    serial = statistics.median(
        serial_examples_per_s(model, X, y, args.seconds / 2, learning_rate=0.001)
        for _ in range(args.repeats)
    )
    rows = [("serial numpy loop (1 thread, in process)", "-", serial, *[None] * 6)]
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        off = [name for _, name, _, _ in BEFORE] if args.ab == [] else args.ab or []
        # interleaved: every repeat runs each configuration once
        configs = [
            (partitions, before, pinned)
            for pinned in PIN_STATES[args.pinned]
            for partitions in (1, 2)
            for before in ([True, False] if off else [False])
        ]
        for every in args.every:
            runs: dict[tuple[int, bool, bool], list] = {config: [] for config in configs}
            for _ in range(args.repeats):
                for partitions, before, pinned in configs:
                    client.run(switch, before, off)
                    if pinned:
                        pin_workers(client)
                    run = replica_run(client, model, X, y, partitions, every, args.seconds)
                    unpin_workers(client)
                    runs[(partitions, before, pinned)].append(run)
                    label = f"P = {partitions}" + (" (no ...)" if before else "")
                    label += PINNED if pinned else ""
                    steps = ", ".join(f"CPU {c:.0f} ms + wait {w:.0f} ms" for c, w in run[2])
                    print(
                        f"  run: n = {every}, {label}: {run[0]:,.1f} examples/s"
                        + (f"; per step and partition: {steps}" if steps else ""),
                        flush=True,
                    )
            client.run(switch, False, off)
            for (partitions, before, pinned), measured in runs.items():
                base = _median([r for r, *_ in runs[(1, False, pinned)]])
                best_base = _best([r for r, *_ in runs[(1, False, pinned)]])
                rate, best = _median([r for r, *_ in measured]), _best([r for r, *_ in measured])
                sent = _median([s for _, s, _ in measured])
                cpu = _median([float(np.mean([c for c, _ in p])) for *_, p in measured if p])
                wait = _median([float(np.mean([w for _, w in p])) for *_, p in measured if p])
                name = f"1 replica, P = {partitions}" + (f" (no {'+'.join(off)})" if before else "")
                name += PINNED if pinned else ""
                ratios = (rate / base, best, best / best_base)
                rows.append((name, str(every), rate, *ratios, sent, cpu, wait))
    plan = PartitionPlan(model, 2)
    print(
        f"\nMLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES} ({model.layout.size:,} "
        f"parameters), batch {BATCH}, Adagrad, 2 workers; median of {args.repeats} runs of "
        f"{args.seconds:.0f} s"
    )
    header = f"{'configuration':48} {'n_fetch=n_push':>14} {'examples/s':>11} {'vs P = 1':>9}"
    print(
        f"{header} {'best':>8} {'vs P = 1':>9} {'bytes/example across partitions':>32} "
        f"{'CPU ms/step':>11} {'wait ms/step':>12}"
    )
    for name, every, rate, ratio, best, best_ratio, sent, cpu, wait in rows:
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        best_text = "-" if best is None else f"{best:,.1f}"
        best_ratio_text = "-" if best_ratio is None else f"{best_ratio:.2f}x"
        sent_text = "-" if sent is None else f"{sent:,.0f}"
        print(
            f"{name:48} {every:>14} {rate:>11,.1f} {ratio_text:>9} {best_text:>8} "
            f"{best_ratio_text:>9} {sent_text:>32} {_ms(cpu):>11} {_ms(wait):>12}"
        )
    print(
        f"\nplan for P = 2: {plan.boundary_values_per_example():,} float32 values cross "
        f"partitions per example ({4 * plan.boundary_values_per_example():,} bytes): the "
        f"all-gather and reduce-scatter of hidden layer 0 ({HIDDEN[0]} units) and the "
        f"all-reduce of the {CLASSES} logits; hidden layer 1 never travels"
    )


if __name__ == "__main__":
    main()
