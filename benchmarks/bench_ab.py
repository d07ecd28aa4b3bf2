"""A/B of one DownpourSGD setting: the values interleaved on one cluster, so that drift and noise
of the machine fall on every value alike.

Same workload as ``bench_downpour.py`` (MLP 784-256-10, batch 128, plain SGD, mnist5k, 2
single-threaded workers, 2 replicas, 2 shards unless told), at n_fetch = n_push of 1 and 4.  Each
round runs every value once, in order, and the serial numpy loop once; medians over the rounds,
ratios against the first value and against the serial loop.

    python benchmarks/bench_ab.py max_inflight 2 4 [--rounds 5] [--seconds 4] [--shards 2]
    python benchmarks/bench_ab.py n_shards 2 1
    python benchmarks/bench_ab.py transport '"dask"' '"auto"' --shards 1
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

from bench_downpour import downpour_examples_per_s, serial_examples_per_s  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", help="a DownpourSGD argument, e.g. max_inflight")
    parser.add_argument("values", nargs="+", help="values to compare (JSON: 4, 0.5, true, ...)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2, help="n_shards, unless it is the setting")
    args = parser.parse_args()
    if args.setting not in inspect.signature(DownpourSGD).parameters:
        parser.error(f"{args.setting!r} is not a DownpourSGD argument")
    values = [json.loads(v) for v in args.values]
    train, _ = datasets.load("mnist5k")
    model = models.MLP(784, (256,), 10)
    rates: dict[tuple[int, int], list[float]] = {}
    serial: list[float] = []
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        for _ in range(args.rounds):
            serial.append(serial_examples_per_s(model, train.X, train.y, args.seconds))
            for every in (1, 4):
                for i, value in enumerate(values):
                    rate = downpour_examples_per_s(
                        client, model, train, args.replicas, every, args.seconds,
                        **{"shards": args.shards, args.setting: value},
                    )  # fmt: skip
                    rates.setdefault((every, i), []).append(rate)
    shards = "" if args.setting == "n_shards" else f", {args.shards} shard(s)"
    base_serial = statistics.median(serial)
    print(
        f"\n{args.replicas} replicas{shards}, MLP 784-256-10, batch 128; {args.rounds} interleaved "
        f"rounds of {args.seconds:.0f} s; examples/s; serial numpy loop {base_serial:,.0f} "
        f"({', '.join(f'{r:,.0f}' for r in serial)})"
    )
    print(
        f"{'n_fetch=n_push':>14} {args.setting:>14} {'median':>9} {'vs first':>9} "
        f"{'vs serial':>9}  runs"
    )
    for every in (1, 4):
        base = statistics.median(rates[(every, 0)])
        for i, value in enumerate(values):
            runs = rates[(every, i)]
            median = statistics.median(runs)
            listed = ", ".join(f"{r:,.0f}" for r in runs)
            print(
                f"{every:>14} {value!s:>14} {median:>9,.0f} {median / base:>8.2f}x "
                f"{median / base_serial:>8.2f}x  {listed}"
            )


if __name__ == "__main__":
    main()
