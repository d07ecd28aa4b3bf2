"""Pull + push of a 1M-parameter float32 model between a replica and shards on another worker.

Baseline (the "naive actor"): a sync Dask actor whose ``pull`` returns a copy of its vector and
whose ``push`` applies a gradient in place, both awaited one after the other, from a task on the
other worker of a default 2-worker local cluster.  Then downpour-dask's path: its parameter-server
shards (2 shards on the other worker, async methods), each sent one ``exchange`` (the push and
the pull of its result in one message) concurrently, from a task that starts the way a replica
starts: once over the direct connections replicas use by default (downpour_dask/ps/wire.py; the
workers share this host, so the arrays go through shared memory slots, ps/shared_slots.py), once
over the same connections with the arrays on the socket (``DOWNPOUR_DASK_SHARED_MEMORY=0``, as
between hosts), once as Dask actor messages (``transport="dask"``).  Finally the naive actor
again in those same, now tuned, processes, to show what part of the gain is the allocator
(downpour_dask/runtime/malloc.py).

The limit any transport could reach: the machine's raw loopback socket throughput, measured in the
same run between the same two worker processes -- a plain TCP connection from a task on the near
worker to a thread on the far one, sending the push's bytes (4 MB) and receiving as many back
(the pull's), with nothing else done on either side.  The loopback and downpour-dask's two paths
are measured in turns, one batch of ``--calls`` round trips each per round, so a change in the
machine's load between rounds reaches all of them; their "vs loopback" column is the median over
the rounds of each round's time over that round's loopback (the range in "rounds"), the naive
actor's rows are over the median loopback.

    python benchmarks/bench_transfer.py [--repeats 5] [--calls 30]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402

from downpour_dask import ParameterServer, optim  # noqa: E402
from downpour_dask.ps import shared_slots  # noqa: E402
from downpour_dask.ps.wire import WireClient  # noqa: E402
from downpour_dask.runtime.cluster import cluster_workers  # noqa: E402
from downpour_dask.runtime.malloc import tune_malloc  # noqa: E402

SIZE = 1_000_000
LOOPBACK = "raw TCP loopback, same bytes, nothing else done"
WIRED = "downpour-dask shards (2, far), direct connections"
ON_SOCKET = "downpour-dask shards (2, far), direct, arrays on socket"
MESSAGES = "downpour-dask shards (2, far), actor messages"


class NaiveParameterActor:
    """What a first Dask parameter server looks like: sync methods, a copy out, an update in."""

    def __init__(self, values: np.ndarray):
        self.values = values.copy()

    def pull(self) -> np.ndarray:
        return self.values.copy()

    def push(self, grad: np.ndarray) -> int:
        self.values -= np.float32(0.01) * grad
        return 0


def time_naive(actor, calls: int) -> float:
    """Median seconds of one awaited pull followed by one awaited push (runs on a worker)."""
    grad = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    times = []
    for i in range(calls + 3):
        start = time.perf_counter()
        actor.pull().result(timeout=60)
        actor.push(grad).result(timeout=60)
        if i >= 3:  # warm-up calls open connections
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_downpour(server: ParameterServer, path: str, calls: int) -> float:
    """Median seconds of a push and a pull of every shard, as a replica issues them when a fetch
    is due on the step it pushes (``exchange``: both in one message per shard), over direct
    connections (``path`` WIRED; ON_SOCKET: without shared memory) or as actor messages."""
    tune_malloc()  # what a replica does when it starts
    targets = list(server.opened().shards)
    wired = path in (WIRED, ON_SOCKET)
    if wired:
        before = os.environ.get(shared_slots.ENV_SWITCH)
        os.environ[shared_slots.ENV_SWITCH] = "1" if path == WIRED else "0"
        try:
            targets = [WireClient(shard.open_wire().result(timeout=60)) for shard in targets]
        finally:
            os.environ.pop(shared_slots.ENV_SWITCH)
            if before is not None:
                os.environ[shared_slots.ENV_SWITCH] = before
    grad = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    times = []
    for i in range(calls + 3):
        start = time.perf_counter()
        calls = [  # a push and the pull of its result in one message per shard
            shard.exchange(grad[lo:hi], 0, 0, session="bench")
            for shard, (lo, hi) in zip(targets, server.ranges)
        ]
        for call in calls:
            call.result(timeout=60)
        if i >= 3:
            times.append(time.perf_counter() - start)
    for target in targets if wired else ():
        target.close()
    return statistics.median(times)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (one MSG_WAITALL call, as the wire's reads, unless cut short)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("the other side closed")
        got += n


def start_loopback_echo(host: str, nbytes: int, connections: int) -> int:
    """On the far worker (``client.run``): a thread serving ``connections`` connections one
    after the other, each answering every ``nbytes`` it receives with ``nbytes`` back; its port."""
    listener = socket.create_server((host, 0))
    listener.settimeout(300)

    def serve() -> None:
        buffer = memoryview(bytearray(nbytes))
        with listener:
            for _ in range(connections):
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(300)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        while True:
                            _recv_exactly(conn, buffer)
                            conn.sendall(buffer)
                    except ConnectionError:
                        continue

    threading.Thread(target=serve, name="bench-loopback-echo", daemon=True).start()
    return listener.getsockname()[1]


def time_loopback(host: str, port: int, calls: int) -> float:
    """Median seconds of sending a push's bytes and receiving a pull's over a plain TCP
    connection, nothing else done on either side (runs on the near worker)."""
    grad = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    back = memoryview(np.empty(SIZE, dtype=np.float32)).cast("B")
    times = []
    with socket.create_connection((host, port), timeout=300) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(calls + 3):
            start = time.perf_counter()
            sock.sendall(grad)
            _recv_exactly(sock, back)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, numpy {np.__version__}"
    )
    initial = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
    with (
        local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as c,
        Client(c) as client,
    ):
        near, far = sorted(cluster_workers(client))
        naive = client.submit(
            NaiveParameterActor, initial, actor=True, workers=[far], pure=False
        ).result(timeout=60)

        def one(fn, *fargs) -> float:
            return client.submit(fn, *fargs, args.calls, workers=[near], pure=False).result(300)

        baseline = statistics.median(one(time_naive, naive) for _ in range(args.repeats))
        host = urlparse(far).hostname
        port = client.run(start_loopback_echo, host, SIZE * 4, args.repeats, workers=[far])[far]
        server = ParameterServer.create(client, initial, 2, optim.sgd(0.01), [far, far])
        portable = server.portable()
        rounds: dict[str, list[float]] = {LOOPBACK: [], WIRED: [], ON_SOCKET: [], MESSAGES: []}
        for _ in range(args.repeats):  # interleaved: the machine's drift hits every path alike
            rounds[LOOPBACK].append(one(time_loopback, host, port))
            for path in (WIRED, ON_SOCKET, MESSAGES):
                rounds[path].append(one(time_downpour, portable, path))
        naive_tuned = statistics.median(one(time_naive, naive) for _ in range(args.repeats))
        server.close()
    loopback = statistics.median(rounds[LOOPBACK])
    rows = [
        (LOOPBACK, loopback),
        ("naive sync actor, default worker processes", baseline),
        (WIRED, statistics.median(rounds[WIRED])),
        (ON_SOCKET, statistics.median(rounds[ON_SOCKET])),
        (MESSAGES, statistics.median(rounds[MESSAGES])),
        ("naive sync actor, after downpour-dask tuned them", naive_tuned),
    ]
    ratios = {  # each round's time over the loopback measured just before it
        name: [t / lb for t, lb in zip(rounds[name], rounds[LOOPBACK])] for name in rounds
    }
    print(
        f"\npull + push of {SIZE:,} float32 parameters from another worker, median of "
        f"{args.repeats} x {args.calls} round trips"
    )
    width = max(len(name) for name, _ in rows)
    print(f"{'path':{width}} {'ms':>8} {'vs naive':>9} {'vs loopback':>12} {'rounds':>12}")
    for name, seconds in rows:
        ratio, spread = seconds / loopback, ""
        if name in ratios:  # the median of the per-round ratios, and their range
            ratio = statistics.median(ratios[name])
            spread = f"{min(ratios[name]):.2f}-{max(ratios[name]):.2f}x"
        print(
            f"{name:{width}} {seconds * 1e3:8.2f} {seconds / baseline:8.2f}x {ratio:11.2f}x "
            f"{spread:>12}"
        )
    gbps = 2 * SIZE * 4 / loopback / 1e9
    print(f"raw loopback throughput: {gbps:.2f} GB/s (both directions, one connection)")


if __name__ == "__main__":
    main()
