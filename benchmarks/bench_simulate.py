"""Validate the simulator against real Downpour runs on a local cluster.

Real runs with 1, 2, 4 and 8 replicas and 1 and 2 shards on a local cluster of single-threaded
worker processes; the simulator is calibrated on ONE of them (``--calibrate-on``, default 2
replicas and 2 shards, so replicas reach shards over the wire) and predicts all the others:
steady examples/s (``simulate.calibration.steady_throughput`` on the real log,
``simulate.summarise`` on the simulation) and mean staleness.  Prints the table of errors and
the machine's load.  See benchmarks/README.md.

    python benchmarks/bench_simulate.py --replicas 1,2,4,8 --shards 1,2 --epochs 10 --hidden 128
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as Dask's nanny pins BLAS in every worker

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

from downpour_dask import DownpourSGD  # noqa: E402
from downpour_dask.data.shipped import load  # noqa: E402
from downpour_dask.simulate import predict, sweep  # noqa: E402
from downpour_dask.simulate.calibration import calibrate, measured, setup_of  # noqa: E402


def real_run(client, train, n_replicas, n_shards, epochs, hidden, seed):
    est = DownpourSGD(
        model=f"mlp:{hidden}",
        n_replicas=n_replicas,
        n_shards=n_shards,
        optimizer="adagrad",
        learning_rate=0.05,
        batch_size=32,
        max_epochs=epochs,
        eval_every=3600.0,
        random_state=seed,
    )
    est.fit(train.X, train.y, client=client)
    return est.experiment_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2,4,8")
    parser.add_argument("--shards", default="1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--calibrate-on",
        default="2,2",
        help="REPLICAS,SHARDS of the run to calibrate on (default 2,2)",
    )
    args = parser.parse_args()
    replicas = [int(x) for x in args.replicas.split(",")]
    shards = [int(x) for x in args.shards.split(",")]
    train, _ = load("mnist5k")
    print(f"load before: {os.getloadavg()}  cpu_count: {os.cpu_count()}")
    runs = {}
    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        client.wait_for_workers(args.workers, timeout=60)
        for r in replicas:
            for s in shards:
                start = time.time()
                runs[r, s] = real_run(client, train, r, s, args.epochs, args.hidden, 0)
                print(f"real run R={r} S={s}: {time.time() - start:.1f} s wall", flush=True)
    base_key = tuple(int(x) for x in args.calibrate_on.split(","))
    cal = calibrate(runs[base_key], cores=args.workers)
    print(f"calibrated on R={base_key[0]} S={base_key[1]}: {cal.timing}")
    rows = []
    for (r, s), experiment in runs.items():
        seen = measured(experiment)
        setup = setup_of(experiment)
        sim = predict(setup, cal.timing, seed=0)
        rows.append(
            {
                "replicas": r,
                "shards": s,
                "real ex/s": seen["examples_per_s"],
                "sim ex/s": sim.examples_per_s,
                "ex/s error": sim.examples_per_s / seen["examples_per_s"] - 1,
                "real staleness": seen["staleness_mean"],
                "sim staleness": sim.staleness_mean,
                "staleness error": (sim.staleness_mean - seen["staleness_mean"])
                / seen["staleness_mean"]
                if seen["staleness_mean"] > 0
                else np.nan,  # a relative error to 0 means nothing
            }
        )
    table = pd.DataFrame(rows)
    fmt = {c: (lambda v: "-" if v != v else f"{v:+.0%}") for c in ("ex/s error", "staleness error")}
    fmt.update({c: "{:,.0f}".format for c in ("real ex/s", "sim ex/s")})
    fmt.update({c: "{:.2f}".format for c in ("real staleness", "sim staleness")})
    print(table.to_string(index=False, formatters=fmt))
    errs = table[(table.replicas != base_key[0]) | (table.shards != base_key[1])]
    print(
        "median |error| excluding the calibration run: examples/s "
        f"{np.median(np.abs(errs['ex/s error'])):.0%}, staleness "
        f"{np.nanmedian(np.abs(errs['staleness error'])):.0%}"
    )
    setup, timing = cal.setup.with_(local_replicas=0), cal.timing.with_(cores=None)
    grid = ([10, 100, 1000, 10000], [1, 4, 16, 64, 256])
    start = time.perf_counter()
    swept = sweep(setup, timing, *grid)
    print(
        f"sweep of {len(swept)} configurations (10..10,000 replicas x 1..256 shards): "
        f"{time.perf_counter() - start:.1f} s, {swept.events.sum():,} events"
    )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
