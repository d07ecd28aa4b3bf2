"""Where a Downpour fit's CPU goes, with no profiler attached: threads' CPU and shard locks.

``profile_downpour.py`` samples the replica threads with py-spy, which stops a worker process
for every sample.  A process stopped while it holds a one-sided shard's file lock makes the
other replica wait for it, so py-spy's samples overstate the lock waits of a one-sided fit.
This script measures without stopping anything:

- **CPU per thread** (``/proc/<pid>/task/<tid>/stat``) of both worker processes and of this
  process (the scheduler and the fit's driver), over a window while the replicas run, as a
  share of one core: how much of each worker's core its replica thread gets, and what else
  (the workers' event loops, the driver) takes;
- **shard locks** (with ``--transport one-sided``): every ``flock`` taken on a shard's shared
  body in the workers, how long its taker waited for it and how long it held it (percentiles
  and totals per worker, as a share of the fit).  The library's lock functions are wrapped in
  the workers for this, before the fit starts; a wrapper costs two clock reads per lock.

Workload: ``bench_downpour.py``'s (MLP 784-256-10, batch 128, plain SGD, 2 replicas x 2 shards,
n_fetch = n_push = ``--every``) on a fresh 2-worker cluster.

    python benchmarks/profile_fit_cpu.py [--every 1] [--seconds 8] [--transport one-sided]
                                         [--repeats 2]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False")

import argparse  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
from bench_downpour import downpour_fit  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import datasets, models  # noqa: E402
from downpour_dask.ps import one_sided, shard_body  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pids: list[int]) -> dict[tuple[int, int, str], float]:
    """CPU seconds (user + system) each thread of ``pids`` has used so far, by (pid, tid,
    name)."""
    seconds = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    text = stat.read()
            except OSError:  # the thread ended meanwhile
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            seconds[(pid, int(tid), name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def sample(into: dict, name: str, at: float, pids: list[int]) -> None:
    """At ``time.monotonic()`` ``at``, put the time and :func:`thread_cpu` in ``into[name]``."""
    time.sleep(max(0.0, at - time.monotonic()))
    into[name] = (time.monotonic(), thread_cpu(pids))


# -- run in the workers (sent by value: what they keep hangs on the wrapped lock function) --------
def wrap_locks() -> bool:
    """Time every shard ``flock`` this worker takes (``shard_body``'s and ``one_sided``'s
    references to the lock functions are both replaced)."""
    take, drop = shard_body.take_file_lock, shard_body.drop_file_lock
    taken: dict[tuple[int, int], float] = {}
    times: dict[str, list[float]] = {"wait": [], "hold": []}

    def timed_take(fd: int, within: float) -> bool:
        start = time.perf_counter()
        had = take(fd, within)
        now = time.perf_counter()
        times["wait"].append(now - start)
        taken[(fd, threading.get_ident())] = now
        return had

    def timed_drop(fd: int) -> None:
        since = taken.pop((fd, threading.get_ident()), None)
        drop(fd)
        if since is not None:
            times["hold"].append(time.perf_counter() - since)

    timed_take.times = times  # type: ignore[attr-defined]
    shard_body.take_file_lock = one_sided.take_file_lock = timed_take
    shard_body.drop_file_lock = one_sided.drop_file_lock = timed_drop
    return True


def lock_times() -> dict[str, list[float]]:
    """The waits and holds timed since the last call (and forget them)."""
    kept = shard_body.take_file_lock.times  # type: ignore[attr-defined]
    times = {name: list(values) for name, values in kept.items()}
    for values in kept.values():
        values.clear()
    return times


# -- the report -----------------------------------------------------------------------------------
def cpu_shares(before: dict, after: dict, wall: float, driver: int) -> list[str]:
    """Lines of each process's CPU as a share of one core, its busiest threads below it."""
    used = Counter({key: after[key] - before.get(key, 0.0) for key in after})
    by_pid = Counter()
    for (pid, _, _), seconds in used.items():
        by_pid[pid] += seconds
    lines = []
    for pid, seconds in by_pid.most_common():
        what = "driver and scheduler (this process)" if pid == driver else f"worker {pid}"
        lines.append(f"  {what}: {seconds / wall:.1%} of a core")
        threads = [(key, s) for key, s in used.most_common() if key[0] == pid and s / wall > 0.005]
        for (_, tid, name), s in threads[:4]:
            lines.append(f"      thread {tid} ({name}){'':4s}{s / wall:6.1%}")
    return lines


def lock_lines(times: dict[str, list[float]], fit_seconds: float) -> list[str]:
    lines = []
    for name in ("wait", "hold"):
        values = np.array(times[name]) * 1e6
        if not values.size:
            continue
        p50, p90, p99, p999 = np.percentile(values, [50, 90, 99, 99.9])
        lines.append(
            f"      {name}s: {values.size:,} locks, p50 {p50:,.0f} us, p90 {p90:,.0f}, "
            f"p99 {p99:,.0f}, p99.9 {p999:,.0f}, max {values.max():,.0f}; "
            f"total {values.sum() / 1e6:.2f} s ({values.sum() / 1e6 / fit_seconds:.1%} of the fit)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="n_fetch = n_push")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each fit")
    parser.add_argument("--transport", choices=["auto", "one-sided"], default="one-sided")
    parser.add_argument("--repeats", type=int, default=2, help="fits, one after the other")
    args = parser.parse_args()
    train, _ = datasets.load("mnist5k")
    model = models.MLP(784, (256,), 10)
    window = (2.0, args.seconds - 1.0)  # CPU measured in here: the replicas run throughout
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
        with Client(cluster) as client:
            workers = list(client.run(os.getpid).values())
            pids = [os.getpid(), *workers]
            client.run(wrap_locks)
            print(
                f"MLP 784-256-10, batch 128, 2 replicas x 2 shards, n_fetch = n_push = "
                f"{args.every}, transport {args.transport}, fits of {args.seconds:g} s; CPU "
                f"measured from {window[0]:g} to {window[1]:g} s; load {os.getloadavg()[0]:.1f}"
            )
            for repeat in range(args.repeats):
                client.run(lock_times)  # forget the last fit's
                samples: dict[str, tuple[float, dict]] = {}
                start = time.monotonic()
                samplers = [
                    threading.Thread(target=sample, args=(samples, name, start + at, pids))
                    for name, at in zip(("from", "to"), window)
                ]
                for sampler in samplers:
                    sampler.start()
                pushes = downpour_fit(
                    client, model, train, 2, args.every, args.seconds, transport=args.transport
                )
                for sampler in samplers:
                    sampler.join(timeout=60)
                shown = pushes[(pushes["time"] >= 1.0) & (pushes["time"] <= args.seconds)]
                rate = shown["examples"].sum() / (args.seconds - 1.0)
                print(f"fit {repeat + 1}: {rate:,.0f} examples/s")
                (t0, before), (t1, after) = samples["from"], samples["to"]
                print("\n".join(cpu_shares(before, after, t1 - t0, os.getpid())))
                for address, times in client.run(lock_times).items():
                    if times["wait"]:
                        print(f"  shard locks taken in worker {address}:")
                        print("\n".join(lock_lines(times, args.seconds)))


if __name__ == "__main__":
    main()
