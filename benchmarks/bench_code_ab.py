"""A/B of two versions of the code: Downpour's share of the ceiling, old and new code alternating.

``bench_ab.py`` compares values of one ``DownpourSGD`` argument on one cluster; a change of the
code itself cannot be switched on a running cluster.  This script exports a git revision of the
project (``git archive``, default ``HEAD``: the last commit) into a temporary directory and runs
the same measurement alternately with that code and with the working tree, each run a fresh
process with its own 2-worker cluster (``PYTHONPATH`` points the process and its workers at one
version).  Every run measures, on its own cluster: the ceiling (the serial loop on both workers at
once, no communication, as in ``bench_downpour.py``) and Downpour (2 replicas, 2 shards unless
told) at n_fetch = n_push of 1 and 4.  Its "of ceiling" ratios are per run, so the machine's drift
between runs cancels; medians over the rounds.  On a machine shared with other jobs even that
moves with their load from second to second, so the script also reports the CPU time the two
worker processes used per example (``time.process_time`` in each, before and after the whole
fit, over all the examples it trained on, start-up included), against the ceiling's: CPU spent
by other processes does not count in it, CPU spent on anything but gradients does.

    python benchmarks/bench_code_ab.py [--base HEAD] [--new REV] [--rounds 4] [--seconds 4]
                                       [--replicas 2] [--shards 2] [--pinned]
                                       [--transport one-sided]
    python benchmarks/bench_code_ab.py --base REV --rounds 2 --script bench_sandblaster.py \
        -- --repeats 1 --skip-dask-ml

``--new`` compares against a second revision instead of the working tree (so the tree can be
edited while the script runs).  ``--script`` runs another benchmark script of this directory
(the working tree's copy, so both versions are measured the same way) alternately with the two
versions of the project, passing it the arguments after ``--``, and prints each run's output:
each output's own baseline rows (measured in that run) are what to compare.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _cpu(client) -> float:
    """CPU seconds the cluster's worker processes have used so far (all their threads)."""
    return sum(client.run(time.process_time).values())


def _switches() -> int:
    """Context switches of this process's threads so far, ended threads included (voluntary: a
    thread blocked or woke another; involuntary: preempted): thread hand-offs show up here."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def _cpu_and_switches(client) -> tuple[float, int]:
    """``_cpu`` and the worker processes' context switches so far."""
    return _cpu(client), sum(client.run(_switches).values())


def measure(
    seconds: float, replicas: int, shards: int, pinned: bool = False, transport: str = "auto"
) -> dict[str, float]:
    """One run on a fresh cluster with whatever ``downpour_dask`` this process imports: examples/s
    and the workers' CPU microseconds per example, of the ceiling and of Downpour at n = 1, 4;
    with ``pinned``, the workers pinned to a CPU each first (both versions need ``pin_workers``);
    ``transport`` is Downpour's (both versions need it)."""
    from bench_downpour import _serial_on_worker, downpour_fit
    from clusters import local_cluster
    from distributed import Client

    from downpour_dask import datasets, models

    train, _ = datasets.load("mnist5k")
    model = models.MLP(784, (256,), 10)
    rates: dict[str, float] = {}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        if pinned:
            from downpour_dask import pin_workers

            pin_workers(client)
        workers = sorted(client.scheduler_info()["workers"])
        data = client.scatter([train.X, train.y], broadcast=True, hash=False)
        chosen = {} if transport == "auto" else {"transport": transport}
        downpour_fit(client, model, train, replicas, 1, 2.0, shards, **chosen)  # first calls
        cpu = _cpu(client)
        futures = [
            client.submit(_serial_on_worker, model, *data, seconds, workers=[w], pure=False)
            for w in workers
        ]
        rates["ceiling"] = sum(client.gather(futures))
        cpu = _cpu(client) - cpu
        rates["ceiling cpu"] = cpu * 1e6 / (rates["ceiling"] * seconds)
        client.cancel(data)
        for every in (1, 4):
            cpu, switches = _cpu_and_switches(client)
            pushes = downpour_fit(client, model, train, replicas, every, seconds, shards, **chosen)
            cpu_after, switches_after = _cpu_and_switches(client)
            cpu = cpu_after - cpu
            rates[f"n={every} switches"] = (switches_after - switches) / pushes["examples"].sum()
            window = pushes[(pushes["time"] >= 1.0) & (pushes["time"] <= seconds)]
            rates[f"n={every}"] = window["examples"].sum() / (seconds - 1.0)
            rates[f"n={every} cpu"] = cpu * 1e6 / pushes["examples"].sum()
    return rates


def run_one(code: Path, args: argparse.Namespace) -> dict[str, float]:
    """``measure`` in a new process importing the project from ``code``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)])}
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--seconds", str(args.seconds),
        "--replicas", str(args.replicas), "--shards", str(args.shards),
        *(["--pinned"] if args.pinned else []), "--transport", args.transport,
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=code, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_script(code: Path, script: str, script_args: list[str]) -> str:
    """Benchmark ``script`` (of this directory) in a new process importing the project from
    ``code``; its standard output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)])}
    command = [sys.executable, str(HERE / script), *script_args]
    done = subprocess.run(command, env=env, cwd=code, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed with {code}:\n{done.stdout}\n{done.stderr[-3000:]}")
    return done.stdout


def export(revision: str, into: Path) -> Path:
    """A copy of the project at git ``revision`` in the new directory ``into``."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "archive", revision], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=60)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--new", default=None, help="a git revision instead of the working tree")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--script", default=None, help="another benchmark script to alternate")
    parser.add_argument("--pinned", action="store_true", help="pin the workers to a CPU each")
    parser.add_argument("--transport", default="auto", help="Downpour's transport")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, script_args = parser.parse_known_args()
    script_args = [a for a in script_args if a != "--"]
    if script_args and not args.script:
        parser.error(f"unrecognized arguments: {' '.join(script_args)} (only with --script)")
    if args.child:
        rates = measure(args.seconds, args.replicas, args.shards, args.pinned, args.transport)
        print(json.dumps(rates))
        return
    with tempfile.TemporaryDirectory(prefix="bench-code-ab-") as tmp:
        versions = {f"base {args.base}": export(args.base, Path(tmp, "base"))}
        versions.update({f"new {args.new}": export(args.new, Path(tmp, "new"))} if args.new
                        else {"working tree": ROOT})  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        for i in range(args.rounds):
            for name, code in versions.items() if i % 2 == 0 else reversed(versions.items()):
                if args.script:
                    output = run_script(code, args.script, script_args)
                    print(f"\n=== round {i + 1}, {name} ===\n{output}", flush=True)
                    continue
                runs[name].append(run_one(code, args))
                print(f"round {i + 1} {name}: {runs[name][-1]}", flush=True)
    if args.script:
        return
    print(
        f"\n{args.replicas} replicas, {args.shards} shards, MLP 784-256-10, batch 128"
        + ("; workers pinned to a CPU each" if args.pinned else "")
        + "; "
        f"{args.rounds} rounds of {args.seconds:.0f} s runs, old and new code alternating; "
        "medians (range): examples/s and its share of the ceiling measured in the same run; "
        "the workers' CPU per example against the ceiling's (CPU share: ceiling's / row's); "
        "the workers' context switches per 128 examples (one step)"
    )
    print(
        f"{'code':24} {'n':>3} {'examples/s':>11} {'of ceiling':>10} {'range':>9} "
        f"{'cpu us/ex':>10} {'CPU share':>10} {'range':>9} {'switches/step':>14}"
    )
    for name, rows in runs.items():
        for every in (1, 4):
            shares = [row[f"n={every}"] / row["ceiling"] for row in rows]
            cpu_shares = [row["ceiling cpu"] / row[f"n={every} cpu"] for row in rows]
            rate = statistics.median(row[f"n={every}"] for row in rows)
            cpu = statistics.median(row[f"n={every} cpu"] for row in rows)
            switches = [128 * row.get(f"n={every} switches", float("nan")) for row in rows]
            print(
                f"{name:24} {every:>3} {rate:>11,.0f} {statistics.median(shares):>9.0%} "
                f"{min(shares):>4.0%}-{max(shares):.0%} {cpu:>10.1f} "
                f"{statistics.median(cpu_shares):>9.0%} {min(cpu_shares):>4.0%}-"
                f"{max(cpu_shares):.0%} {statistics.median(switches):>14.1f}"
            )


if __name__ == "__main__":
    main()
