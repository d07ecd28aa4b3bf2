"""The least a parameter server adds to the serial loop: minimal parameter servers, no library.

``bench_downpour.py`` runs them beside Downpour.  Each runs the serial loop on both workers at
once, each worker also holding half the parameters as a shard.  Every n steps a replica applies
its own half in place and hands the other half's gradient to the other worker's shard, which
applies it (one subtraction, plain SGD) and hands back its values.  How the far half travels:

- ``"shared"`` (*two-sided*, as Downpour's shards on the replica's host): the arrays go through
  memory the two processes share (an anonymous ``memfd`` each, mapped by the other through
  ``/proc``), a 1-byte token on a raw TCP connection says a push or a reply is there, and a
  thread of the other worker wakes to apply the push; the replica takes the reply between two
  steps once it has arrived (one push in flight).
- ``"socket"``: the same, with the arrays on that TCP connection, as between hosts.
- ``"tokens"``: only the tokens (the shard applies a gradient it holds, the replica installs
  nothing): what is left of the two-sided design without moving the arrays at all.
- ``"one-sided"``: no thread and no message.  Each shard lives in shared memory, and the
  replica applies its push to the far shard itself, under a lock the two processes share (an
  ``flock`` on the shard's ``memfd``), and copies the result back, as it does with its own
  shard: what a design without a wake-up on the other worker could reach on one host.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import socket
import threading
import time
import uuid

import numpy as np
from distributed import Variable

from downpour_dask.data.datasets import minibatches
from downpour_dask.ps import frames
from downpour_dask.runtime.malloc import tune_malloc

#: How the far half of the parameters travels (see the module docstring).
CARRIES = ("shared", "socket", "tokens", "one-sided")


def set_up_as_a_replica(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a replica does first on its worker: the allocator tuned, and the received arrays
    copied into aligned memory (see ``stream.ArraySource``)."""
    tune_malloc()
    return np.require(X, requirements=["C", "A"]), np.require(y, requirements=["C", "A"])


def _step(model, params, Xb, yb, first, accrued, scratch, learning_rate) -> None:
    """A replica's step: the gradient times the rate (into the accrual on an accrual's
    ``first`` step, as Downpour's replicas do), the local step, and the accrual."""
    g = accrued if first else scratch
    model.loss_and_grad(params, Xb, yb, out=g, scale=learning_rate)
    params -= g
    if not first:
        accrued += g


def _shared_pair(n_own: int, n_far: int, publish, peer) -> tuple[np.ndarray, np.ndarray]:
    """This worker's shared buffer for the far replica's pushes and replies (``n_own`` values:
    gradient in, values out, one after the other) and the other worker's (``n_far``), mapped
    here: an anonymous memory file each, announced as ``(pid, fd)`` through ``publish`` and
    opened through ``/proc`` from what ``peer()`` returns."""
    fd = os.memfd_create("bench-minimal-ps")
    os.ftruncate(fd, 8 * n_own)
    mine = np.frombuffer(mmap.mmap(fd, 8 * n_own), np.float32)
    publish((os.getpid(), fd))
    pid, far_fd = peer()
    opened = os.open(f"/proc/{pid}/fd/{far_fd}", os.O_RDWR)
    theirs = np.frombuffer(mmap.mmap(opened, 8 * n_far), np.float32)
    os.close(opened)
    return mine, theirs


def _two_sided_on_worker(
    model, X, y, seconds, every, me, names, carry="shared", batch=128, learning_rate=0.01
) -> float:
    """One worker's half of the minimal parameter server (see the module docstring): a replica
    loop and a thread serving this worker's shard to the other worker's replica.  ``carry``:
    how the arrays travel, ``"shared"`` (shared memory, a 1-byte token on the socket),
    ``"socket"`` (the arrays on the socket) or ``"tokens"`` (only the token: the shard applies a
    gradient it already holds and the replica installs nothing)."""
    X, y = set_up_as_a_replica(X, y)
    params = model.init(np.random.default_rng(0))
    cut = params.size // 2
    own, far = (slice(0, cut), slice(cut, None)) if me == 0 else (slice(cut, None), slice(0, cut))
    shard = params[own].copy()
    server = socket.create_server(("127.0.0.1", 0))
    Variable(names[me]).set(server.getsockname()[1])
    out = socket.create_connection(("127.0.0.1", Variable(names[1 - me]).get(timeout=60)))
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    served, _ = server.accept()
    served.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if carry == "shared":  # [gradient | values] of my shard, and of the far one
        mine, theirs = _shared_pair(
            shard.size, params[far].size, Variable(names[me] + "-shm").set,
            lambda: Variable(names[1 - me] + "-shm").get(timeout=60),
        )  # fmt: skip
        grad_in, values_out = mine[: shard.size], mine[shard.size :]
        far_grad, far_values = theirs[: params[far].size], theirs[params[far].size :]

    lock = threading.Lock()  # a shard applies one push at a time, as Downpour's does

    def receive(sock: socket.socket, into: np.ndarray, shared: np.ndarray | None) -> None:
        if carry == "socket":
            frames.recv_into(sock, into)
            return
        if not sock.recv(1):
            raise ConnectionError("closed")
        if shared is not None and carry == "shared":
            np.copyto(into, shared)

    def send(sock: socket.socket, values: np.ndarray, shared: np.ndarray | None) -> None:
        if carry == "socket":
            sock.sendall(memoryview(values).cast("B"))
            return
        if shared is not None and carry == "shared":
            np.copyto(shared, values)
        sock.sendall(b"x")

    def serve() -> None:  # the shard: a gradient in, one axpy, its values back
        grad = np.zeros_like(shard)
        with contextlib.suppress(ConnectionError):  # the replica's end closed: the run is over
            while True:
                receive(served, grad, None)
                applied = grad_in if carry == "shared" else grad  # (shared: applied in place)
                with lock:
                    np.subtract(shard, applied, out=shard)
                    send(served, shard, values_out if carry == "shared" else None)
        served.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    step, accrued = np.empty_like(params), np.empty_like(params)
    rng = np.random.default_rng(me)
    examples, steps, start, pending = 0, 0, time.perf_counter(), False
    while time.perf_counter() - start < seconds:
        for Xb, yb in minibatches(X, y, batch, rng):
            if pending and select.select([out], [], [], 0)[0]:  # the far half's values arrived
                receive(out, params[far], far_values if carry == "shared" else None)
                pending = False
            _step(model, params, Xb, yb, steps % every == 0, accrued, step, learning_rate)
            examples, steps = examples + len(yb), steps + 1
            if steps % every == 0:  # push both halves, fetch both back
                with lock:  # the own half first: no lock is wanted while a reply is due
                    shard -= accrued[own]
                    params[own] = shard
                if pending:  # one push in flight at a time
                    receive(out, params[far], far_values if carry == "shared" else None)
                send(out, accrued[far], far_grad if carry == "shared" else None)
                pending = True
            if time.perf_counter() - start >= seconds:
                break
    rate = examples / (time.perf_counter() - start)
    if pending:
        receive(out, params[far], None)
    out.shutdown(socket.SHUT_WR)  # the peer's shard thread ends; then wait for ours
    thread.join(timeout=60)
    out.close()
    server.close()
    return rate


def _one_sided_on_worker(
    model, X, y, seconds, every, me, names, batch=128, learning_rate=0.01
) -> float:
    """One worker's replica of the one-sided minimal server (see the module docstring): its own
    shard and the far one both in shared memory, each push applied to both by this thread."""
    X, y = set_up_as_a_replica(X, y)
    params = model.init(np.random.default_rng(0))
    cut = params.size // 2
    own, far = (slice(0, cut), slice(cut, None)) if me == 0 else (slice(cut, None), slice(0, cut))
    fd = os.memfd_create("bench-one-sided-ps")
    os.ftruncate(fd, 4 * params[own].size)
    shard = np.frombuffer(mmap.mmap(fd, 4 * params[own].size), np.float32)
    shard[:] = params[own]  # before it is announced: the peer may update it at once
    Variable(names[me]).set((os.getpid(), fd))
    pid, far_fd = Variable(names[1 - me]).get(timeout=60)
    far_lock = os.open(f"/proc/{pid}/fd/{far_fd}", os.O_RDWR)  # a lock of its own on that file
    far_shard = np.frombuffer(mmap.mmap(far_lock, 4 * params[far].size), np.float32)
    Variable(names[me] + "-opened").set(True)
    halves = ((own, shard, fd), (far, far_shard, far_lock))
    step, accrued = np.empty_like(params), np.empty_like(params)
    rng = np.random.default_rng(me)
    examples, steps, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for Xb, yb in minibatches(X, y, batch, rng):
            _step(model, params, Xb, yb, steps % every == 0, accrued, step, learning_rate)
            examples, steps = examples + len(yb), steps + 1
            if steps % every == 0:  # push both halves, fetch both back
                for half, values, lock in halves:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    np.subtract(values, accrued[half], out=values)
                    params[half] = values
                    fcntl.flock(lock, fcntl.LOCK_UN)
            if time.perf_counter() - start >= seconds:
                break
    rate = examples / (time.perf_counter() - start)
    Variable(names[1 - me] + "-opened").get(timeout=60)  # the peer has its own way in to mine
    os.close(far_lock)
    os.close(fd)
    return rate


def minimal_ps_examples_per_s(
    client, model, X, y, seconds: float, every: int, carry: str = "shared", batch: int = 128
) -> float:
    """A minimal parameter server on both workers at once: the sum of their examples/s
    (``carry``: one of :data:`CARRIES`, see the module docstring)."""
    if carry not in CARRIES:
        raise ValueError(f"carry must be one of {CARRIES}, got {carry!r}")
    workers = sorted(client.scheduler_info()["workers"])
    data = client.scatter([X, y], broadcast=True, hash=False)
    names = [f"bench-minimal-ps-{uuid.uuid4().hex}" for _ in workers]
    one_sided = carry == "one-sided"
    task = _one_sided_on_worker if one_sided else _two_sided_on_worker
    kw = {} if one_sided else {"carry": carry}
    futures = [
        client.submit(
            task, model, *data, seconds, every, me, names, batch=batch, workers=[w], pure=False,
            **kw,
        )  # fmt: skip
        for me, w in enumerate(workers)
    ]
    rate = sum(client.gather(futures))
    client.cancel(data)
    for name in names:
        for variable in (name, name + "-shm", name + "-opened"):
            Variable(variable, client=client).delete()
    return rate
