"""Validate the simulator against real Downpour runs on a local cluster.

Real runs with 1, 2, 4 and 8 replicas and 1, 2 and 4 shards on a local cluster of
single-threaded worker processes, each configuration ``--repeats`` times (in rounds: every
round runs every configuration once, so a change in the machine's load hits them all alike).
The simulator is calibrated on a few of them (``--calibrate-on``, default 1x1, 1x4, 2x2, 8x2
and 4x1: replicas x shards, the corners of the range and one shard with replicas on both
workers, which no corner has; each its median repeat by examples/s) and
predicts all of them: steady examples/s (``simulate.calibration.steady_throughput`` on the
real log, ``simulate.summarise`` on the simulation) and mean staleness, against the median of
the repeats.  Prints the table, the
median |error| over the runs it was not calibrated on, the same against each round's runs alone
(its spread), a single-run calibration (``--single``, default 2x2) on the same runs for
comparison, and the machine's load.  ``--save DIR`` keeps the real runs, ``--load DIR`` reuses
them (to compare models on the same runs).  See benchmarks/README.md.

    python benchmarks/bench_simulate.py --replicas 1,2,4,8 --shards 1,2,4 --epochs 40 \
        --hidden 128 --repeats 3 --save DIR
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as Dask's nanny pins BLAS in every worker

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import DownpourSGD  # noqa: E402
from downpour_dask.data.shipped import load  # noqa: E402
from downpour_dask.log import Experiment  # noqa: E402
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


def pairs(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x2"`` -> ``[(1, 1), (2, 2)]`` (replicas x shards)."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def collect(args, configs) -> dict:
    """Every configuration ``args.repeats`` times, in rounds; saved under ``args.save``."""
    train, _ = load("mnist5k")
    runs = {}
    with (
        local_cluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        client.wait_for_workers(args.workers, timeout=60)
        for k in range(args.repeats):
            start = time.time()
            for r, s in configs:
                runs[k, r, s] = real_run(client, train, r, s, args.epochs, args.hidden, k)
                if args.save:
                    runs[k, r, s].save(Path(args.save) / f"k{k}" / f"r{r}s{s}", overwrite=True)
            print(f"round {k}: {time.time() - start:.0f} s, load {os.getloadavg()}", flush=True)
    return runs


def errors(timing, runs, configs, repeats) -> pd.DataFrame:
    """One row per configuration: the median real figures, their spread and the prediction."""
    rows = []
    for r, s in configs:
        seen = [measured(runs[k, r, s]) for k in range(repeats)]
        ex = np.array([m["examples_per_s"] for m in seen])
        st = np.array([m["staleness_mean"] for m in seen])
        sim = predict(setup_of(runs[0, r, s]), timing, seed=0)
        rows.append(
            {
                "replicas": r,
                "shards": s,
                "real ex/s": np.median(ex),
                "spread": (ex.max() - ex.min()) / np.median(ex),
                "sim ex/s": sim.examples_per_s,
                "ex/s error": sim.examples_per_s / np.median(ex) - 1,
                "real staleness": np.median(st),
                "st spread": (st.max() - st.min()) / np.median(st) if np.median(st) else np.nan,
                "sim staleness": sim.staleness_mean,
                "staleness error": sim.staleness_mean / np.median(st) - 1
                if np.median(st) > 0
                else np.nan,  # a relative error to 0 means nothing
                # against each round's run alone, for the spread of the median error
                "round ex/s errors": sim.examples_per_s / ex - 1,
                "round staleness errors": np.where(
                    st > 0, sim.staleness_mean / np.where(st > 0, st, 1) - 1, np.nan
                ),
            }
        )
    return pd.DataFrame(rows)


def median_run(runs, r, s, repeats) -> Experiment:
    """The repeat of a configuration with the median examples/s."""
    ex = [measured(runs[k, r, s])["examples_per_s"] for k in range(repeats)]
    return runs[int(np.argsort(ex)[len(ex) // 2]), r, s]


def report(title, cal, runs, configs, used, repeats) -> None:
    print(f"\n{title}\n{cal.timing}")
    table = errors(cal.timing, runs, configs, repeats)
    table["calibrated on"] = [(r, s) in used for r, s in configs]
    fmt = {c: (lambda v: "-" if v != v else f"{v:+.0%}") for c in ("ex/s error", "staleness error")}
    fmt.update({c: "{:.0%}".format for c in ("spread", "st spread")})
    fmt.update({c: "{:,.0f}".format for c in ("real ex/s", "sim ex/s")})
    fmt.update({c: "{:.2f}".format for c in ("real staleness", "sim staleness")})
    shown = table.drop(columns=["round ex/s errors", "round staleness errors"])
    print(shown.to_string(index=False, formatters=fmt))
    held = table[~table["calibrated on"]]
    ex_rounds = np.median(np.abs(np.stack(held["round ex/s errors"].to_list())), axis=0)
    st_rounds = np.nanmedian(np.abs(np.stack(held["round staleness errors"].to_list())), axis=0)
    print(
        f"median |error| over the {len(held)} runs not calibrated on: examples/s "
        f"{np.median(np.abs(held['ex/s error'])):.0%}, staleness "
        f"{np.nanmedian(np.abs(held['staleness error'])):.0%} (against the median of "
        f"{repeats} repeats); against each round alone: examples/s "
        f"{', '.join(f'{v:.0%}' for v in ex_rounds)}; staleness "
        f"{', '.join(f'{v:.0%}' for v in st_rounds)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2,4,8")
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calibrate-on", default="1x1,1x4,2x2,8x2,4x1")
    parser.add_argument("--single", default="2x2", help="the one run of the comparison")
    parser.add_argument("--save", help="directory to keep the real runs in")
    parser.add_argument("--load", help="directory of saved runs (--save) instead of running")
    args = parser.parse_args()
    configs = [(int(r), int(s)) for r in args.replicas.split(",") for s in args.shards.split(",")]
    print(f"load before: {os.getloadavg()}  cpu_count: {os.cpu_count()}")
    if args.load:
        runs = {}
        for k in range(args.repeats):
            for r, s in configs:
                runs[k, r, s] = Experiment.load(Path(args.load) / f"k{k}" / f"r{r}s{s}")
    else:
        runs = collect(args, configs)
    used = pairs(args.calibrate_on)
    first, *rest = [median_run(runs, r, s, args.repeats) for r, s in used]
    cal = calibrate(first, also=rest, cores=args.workers)
    report(f"calibrated on {args.calibrate_on}", cal, runs, configs, used, args.repeats)
    single = pairs(args.single)
    one = calibrate(median_run(runs, *single[0], args.repeats), cores=args.workers)
    report(f"calibrated on {args.single} alone", one, runs, configs, single, args.repeats)
    setup, timing = cal.setup.with_(local_replicas=0), cal.timing.with_(cores=None)
    grid = ([10, 100, 1000, 10000], [1, 4, 16, 64, 256])
    start = time.perf_counter()
    swept = sweep(setup, timing, *grid)
    print(
        f"\nsweep of {len(swept)} configurations (10..10,000 replicas x 1..256 shards): "
        f"{time.perf_counter() - start:.1f} s, {swept.events.sum():,} events"
    )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
