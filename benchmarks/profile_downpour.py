"""Where a Downpour replica thread's time goes: py-spy on both workers during one fit.

Runs ``bench_downpour.py``'s workload (MLP 784-256-10, batch 128, 2 replicas x 2 shards,
n_fetch = n_push = ``--every``) on a fresh 2-worker cluster and, once the replicas run, records
both worker processes with ``py-spy record --native --format raw`` for ``--duration`` seconds.
Then it sorts the samples of the replica threads (those inside ``ReplicaLoop.run``) into the
items issue 23 names -- the gradient, ``_push`` and within it the hand-off to the wire's sender
thread, the waits for acknowledgements, the in-process shard's apply, and the fencing
look-ups (``Variable.get`` on the replica thread) -- and prints each one's share per worker.
py-spy needs ptrace rights (root, or ``kernel.yama.ptrace_scope = 0``).  It stops a process for
every sample: with ``--transport one-sided`` a worker stopped while it holds a shard's lock
makes the other replica wait, so the lock waits here are overstated; ``profile_fit_cpu.py``
measures them (and the threads' CPU) without stopping anything.

    python benchmarks/profile_downpour.py [--every 1] [--duration 10] [--out DIR] [--pinned]
                                          [--transport {auto,one-sided}]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

#: (item, substring of a frame that puts a sample in it); a sample counts once per item
ITEMS = [
    ("gradient (loss_and_grad)", "loss_and_grad"),
    ("_push", "_push (downpour_dask"),
    ("  thread hand-off (SimpleQueue.put)", "put (_queuemodule"),
    ("  send from the replica thread (sendmsg)", "sendmsg"),
    ("  waits for acknowledgements (_ack)", "_ack (downpour_dask"),
    ("  in-process apply_push", "apply_push"),
    ("_poll", "_poll (downpour_dask"),
    ("fencing look-ups (Variable.get)", "get (distributed/variable.py"),
    ("install of fetched values (_install)", "_install (downpour_dask"),
    ("one-sided calls (ps/one_sided.py)", "(downpour_dask/ps/one_sided.py"),
    ("  waits for a shard's file lock", "take_file_lock"),
    ("  the update rule, one-sided", "_apply (downpour_dask/ps/one_sided.py"),
    ("  pulls' copies, one-sided", "_pull (downpour_dask/ps/one_sided.py"),
    ("the shard folding ledgers in (_fold)", "_fold (downpour_dask"),
]


def shares(raw: str) -> tuple[int, Counter[str]]:
    """Samples of the replica thread in a py-spy raw profile, and how many fall in each item."""
    total, counts = 0, Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if "run (downpour_dask/downpour/replica_loop.py" not in stack or not n.isdigit():
            continue
        total += int(n)
        for name, needle in ITEMS:
            if needle in stack:
                counts[name] += int(n)
    return total, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="n_fetch = n_push")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds recorded")
    parser.add_argument("--out", default=None, help="directory for the raw profiles")
    parser.add_argument(
        "--pinned", action="store_true", help="pin each worker to a CPU of its own first"
    )
    parser.add_argument("--transport", choices=["auto", "one-sided"], default="auto")
    args = parser.parse_args()
    from bench_downpour import downpour_fit
    from clusters import local_cluster
    from distributed import Client

    from downpour_dask import datasets, models, pin_workers

    out = Path(args.out or tempfile.mkdtemp(prefix="downpour-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    train, _ = datasets.load("mnist5k")
    model = models.MLP(784, (256,), 10)
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        if args.pinned:
            pin_workers(client)
        chosen = {"transport": args.transport}
        downpour_fit(client, model, train, 2, args.every, 2.0, 2, **chosen)  # imports, first calls
        pids = sorted(client.run(os.getpid).values())
        seconds = args.duration + 6.0
        fit = threading.Thread(
            target=downpour_fit, args=(client, model, train, 2, args.every, seconds, 2),
            kwargs=chosen,
        )
        fit.start()
        time.sleep(3.0)
        spies = [
            subprocess.Popen(
                ["py-spy", "record", "--native", "--format", "raw", "--rate", "200",
                 "-d", str(int(args.duration)), "-p", str(pid), "-o", str(out / f"{pid}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for pid in pids
        ]  # fmt: skip
        for spy in spies:
            spy.wait(timeout=args.duration + 60)
        fit.join(timeout=seconds + 60)
    pinned = (", pinned" if args.pinned else "") + f", transport {args.transport}"
    print(f"replica threads, n_fetch = n_push = {args.every}{pinned}, {args.duration:.0f} s at "
          f"200 Hz "
          f"(raw profiles in {out}); load: {os.getloadavg()}")  # fmt: skip
    for pid in pids:
        path = out / f"{pid}.txt"
        if not path.exists():
            print(f"worker {pid}: no profile (py-spy failed)")
            continue
        total, counts = shares(path.read_text())
        print(f"worker {pid}: {total} samples")
        for name, _ in ITEMS:
            print(f"  {name:40s} {counts[name]:6d}  {100 * counts[name] / max(total, 1):5.1f}%")


if __name__ == "__main__":
    main()
