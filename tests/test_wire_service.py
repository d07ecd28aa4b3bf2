"""The shard's side of the direct connections under hostile input: floods, malformed heads,
wrong secrets, too many sessions, running out of files.  Loopback only, bounded in count."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import WIRE_SECRET, WIRE_SIZE, said_hello, wire_shard

from downpour_dask import optim
from downpour_dask.downpour.replica_loop import ReplicaConfig
from downpour_dask.ps import frames
from downpour_dask.ps.frames import EXCHANGE, PULL, PUSH
from downpour_dask.ps.server import ParameterServer
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.ps.wire import WireClient, WireError

TIMEOUT = 10.0
SIZE, SECRET, make_shard = WIRE_SIZE, WIRE_SECRET, wire_shard  # the served shard (conftest.py)


def raw(endpoint, secret: bytes = SECRET) -> socket.socket:
    """A connection that said hello and read the shard's size."""
    sock, size = said_hello(endpoint, secret, TIMEOUT)
    assert size == SIZE
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wire_threads() -> int:
    return sum(t.name == "downpour-wire-shard" for t in threading.enumerate())


def test_a_flood_of_idle_connections_costs_no_threads_and_the_shard_still_serves(served):
    """1,000 connections that never say hello: no thread each (they wait in one selector,
    the oldest closed beyond MAX_PENDING), and a replica of the run still pulls and pushes."""
    service, shard, endpoint = served
    before = threading.active_count()
    flood = []
    try:
        for _ in range(1000):
            flood.append(socket.create_connection(endpoint[:2], timeout=TIMEOUT))
        client = WireClient(endpoint, TIMEOUT, SECRET)
        assert client.pull(0, "a").result(TIMEOUT).version == 0
        grad = np.ones(SIZE, dtype=np.float32)
        assert client.push(grad, 0, 0, seq=0, session="a").result(TIMEOUT).accepted
        # the accept thread, the client's two and the one serving it: nothing per idle socket
        assert threading.active_count() <= before + 3
        assert wire_threads() == 1
        client.close()
    finally:
        for sock in flood:
            sock.close()
    assert shard.version == 1


def test_a_connection_that_never_says_hello_is_closed(served, monkeypatch):
    _, _, endpoint = served
    monkeypatch.setattr(ShardService, "HELLO_TIMEOUT", 0.2)
    sock = socket.create_connection(endpoint[:2], timeout=TIMEOUT)
    sock.sendall(b"\x20")  # half a hello, then silence
    assert closed_by_peer(sock)
    sock.close()


def test_a_request_that_stops_halfway_is_cut_off_and_applies_nothing(served, monkeypatch):
    """An authenticated connection may idle between requests, but a started request must keep
    arriving: half a head, or a head and part of its gradient, then silence, closes it."""
    _, shard, endpoint = served
    monkeypatch.setattr(ShardService, "IO_TIMEOUT", 0.3)
    head = frames.request(PUSH, 0, 0, SIZE, seq=0, session="a")
    for partial in (head[:10], head + bytes(40)):
        sock = raw(endpoint)
        sock.sendall(partial)
        assert closed_by_peer(sock)
        sock.close()
    assert shard.version == 0
    client = WireClient(endpoint, TIMEOUT, SECRET)
    time.sleep(0.6)  # idle for twice IO_TIMEOUT between requests: still served
    assert client.pull(0, "b").result(TIMEOUT).version == 0
    client.close()


def test_a_hello_without_the_runs_secret_is_refused(served):
    _, shard, endpoint = served
    for secret in (b"", b"x" * 32, SECRET[:-1]):
        with pytest.raises(WireError, match="wrong run secret"):
            WireClient(endpoint, TIMEOUT, secret)
    host, port, _ = endpoint
    sock = socket.create_connection((host, port), timeout=TIMEOUT)
    sock.sendall(frames.HELLO.pack(65535, 0))  # an oversized id is refused before it is read
    with pytest.raises(WireError, match="at most 64 bytes, got 65535"):
        frames.check_status(sock)
    sock.close()
    client = WireClient(endpoint, TIMEOUT, SECRET)
    assert client.pull().result(TIMEOUT).version == 0 and shard.version == 0
    client.close()


def test_a_zero_length_push_is_refused_and_does_not_reapply_the_last_gradient(served):
    """It used to re-apply the gradient left in the connection's buffer by the previous push."""
    _, shard, endpoint = served
    sock = raw(endpoint)
    sock.sendall(frames.request(PUSH, 0, 0, SIZE, seq=0, session="a"))
    sock.sendall(np.ones(SIZE, dtype=np.float32))
    frames.check_status(sock)
    assert frames.PUSHED.unpack(frames.recv(sock, frames.PUSHED.size))[:3] == (1, 0, True)
    after_one = shard.values.copy()
    sock.sendall(frames.request(PUSH, 0, 0, 0, seq=1, session="a"))
    with pytest.raises(WireError, match="push to this shard carries 100 values .* got 0"):
        frames.check_status(sock)
    assert closed_by_peer(sock)
    assert shard.version == 1
    np.testing.assert_array_equal(shard.values, after_one)
    sock.close()


def _head(op=PUSH, replica=0, seq=0, fetched=0, examples=0, n_values=SIZE, n_session=1):
    return frames.REQUEST.pack(op, replica, seq, fetched, examples, 0.0, n_values, n_session)


BAD_HEADS = {
    "unknown op": (_head(op=99), "unknown op 99"),
    "exchange without values": (_head(op=EXCHANGE, n_values=0), "carries 100 values"),
    "push of another size": (_head(n_values=SIZE + 1), "carries 100 values .* got 101"),
    "pull with values": (_head(op=PULL), "pull to this shard carries 0 values"),
    "fetched -2**63": (_head(fetched=-(2**63)), r"fetched version must be in \[0, 2\*\*53\]"),
    "seq below -1": (_head(seq=-5), "push number must be in"),
    "negative examples": (_head(examples=-1), "examples must be in"),
    "replica below -1": (_head(replica=-7), "replica must be in"),
    "60 kB session": (_head(n_session=60_000), "a session is at most 64 bytes, got 60000"),
}


@pytest.mark.parametrize("name", sorted(BAD_HEADS))
def test_a_malformed_head_is_refused_before_anything_changes(served, name):
    """Each is answered with an error naming the field, the connection closed, nothing applied
    or recorded; the service serves the next connection."""
    _, shard, endpoint = served
    head, message = BAD_HEADS[name]
    before = shard.values.copy()
    sock = raw(endpoint)
    sock.sendall(head + b"a")
    with pytest.raises(WireError, match=message):
        frames.check_status(sock)
    assert closed_by_peer(sock)
    sock.close()
    assert shard.version == 0 and shard.refused == 0 and not shard._sessions
    np.testing.assert_array_equal(shard.values, before)
    client = WireClient(endpoint, TIMEOUT, SECRET)
    assert client.pull().result(TIMEOUT).version == 0
    client.close()


def test_sessions_are_bounded_in_length_and_number_and_one_per_connection(served, monkeypatch):
    _, shard, endpoint = served
    monkeypatch.setattr(ShardService, "MAX_SESSIONS", 3)
    with pytest.raises(ValueError, match="at most 64 bytes"):
        frames.request(PULL, 0, 0, 0, session="x" * 65)
    grad = np.zeros(SIZE, dtype=np.float32)
    clients = [WireClient(endpoint, TIMEOUT, SECRET) for _ in range(4)]
    for i, client in enumerate(clients[:3]):
        client.pull(0, f"s{i}").result(TIMEOUT)
    with pytest.raises(WireError, match="has had 3 sessions"):
        clients[3].pull(0, "s3").result(TIMEOUT)
    with pytest.raises(WireError, match="one connection carries one session"):
        clients[0].push(grad, 0, 0, seq=0, session="s1").result(TIMEOUT)
    sock = raw(endpoint)
    sock.sendall(frames.REQUEST.pack(PULL, 0, -1, 0, 0, 0.0, 0, 4) + b"s-1!")
    with pytest.raises(WireError, match="ASCII letters and digits"):
        frames.check_status(sock)
    sock.close()
    assert shard.version == 0 and shard._sessions == {"s0", "s1", "s2"}
    for client in clients:
        client.close()


def test_connections_beyond_the_cap_are_refused_until_one_closes(monkeypatch):
    monkeypatch.setattr(ShardService, "MAX_CONNECTIONS", 2)
    service = ShardService("127.0.0.1")
    shard = make_shard()
    endpoint = service.register(shard, SECRET)
    try:
        first, second = (WireClient(endpoint, TIMEOUT, SECRET) for _ in range(2))
        with pytest.raises(WireError, match=r"too many connections \(at most 2\)"):
            WireClient(endpoint, TIMEOUT, SECRET)
        first.close()
        deadline = time.monotonic() + TIMEOUT
        while True:  # the slot frees once the serving thread has seen the close
            try:
                third = WireClient(endpoint, TIMEOUT, SECRET)
                break
            except WireError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert third.pull().result(TIMEOUT).version == 0
        second.close()
        third.close()
    finally:
        service.close()


def test_a_replica_that_stops_reading_holds_up_no_other(served):
    """A replica stopped mid-run (SIGSTOP, a debugger) leaves its answers unread; the shard's
    thread for it blocks in its send, but never while holding the shard: other replicas'
    pulls and pushes, over the wire and in-process, go on."""
    service, _, _ = served
    size = 1 << 20  # 4 MB per answer: a few fill both sockets' buffers
    shard = ParameterServerShard(0, 0, size, np.zeros(size, np.float32), optim.make("sgd", 0.5))
    endpoint = service.register(shard, SECRET)
    host, port, shard_id = endpoint
    stalled = socket.create_connection((host, port), timeout=TIMEOUT)
    stalled.sendall(frames.hello(shard_id, SECRET))
    frames.check_status(stalled)
    pull = frames.request(PULL, 0, 0, 0, session="stalled")
    stalled.sendall(pull * 16)  # 64 MB of answers that are never read
    time.sleep(0.2)
    other = WireClient(endpoint, TIMEOUT, SECRET)
    grad = np.ones(size, dtype=np.float32)
    for seq in range(3):
        assert other.exchange(grad, 0, 1, seq=seq, session="other").result(TIMEOUT)[0].accepted
    assert shard.apply_push(grad, 0, 2).accepted  # a replica on the shard's own worker
    assert shard.snapshot(2).version == 4
    other.close()
    stalled.close()


def test_unregister_fences_the_shard_off(served):
    """What a replacement's driver does to the old incarnation: open connections fail, new
    ones are refused, and nothing more is applied."""
    service, shard, endpoint = served
    client = WireClient(endpoint, TIMEOUT, SECRET)
    grad = np.ones(SIZE, dtype=np.float32)
    assert client.push(grad, 0, 0, seq=0, session="a").result(TIMEOUT).accepted
    assert service.unregister(endpoint[2]) == 1
    with pytest.raises(ConnectionError):
        client.push(grad, 1, 0, seq=1, session="a").result(TIMEOUT)
    with pytest.raises(WireError, match="no such parameter-server shard"):
        WireClient(endpoint, TIMEOUT, SECRET)
    assert shard.version == 1 and service.unregister(endpoint[2]) == 0
    client.close()


_OUT_OF_FILES = """
import resource, sys, threading
import numpy as np
from downpour_dask import optim
from downpour_dask.downpour.replica_loop import ReplicaConfig
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shard import ParameterServerShard
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
service = ShardService("127.0.0.1")
shard = ParameterServerShard(0, 0, 100, np.zeros(100, np.float32), optim.make("sgd", 0.5))
host, port, shard_id = service.register(shard, b"%s")
print(port, shard_id, flush=True)
sys.stdin.readline()
names = [t.name for t in threading.enumerate()]
print(service.out_of_files, names.count("downpour-wire-shard"), len(names), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_accept_loop_survives_running_out_of_file_descriptors():
    """A process at its file limit: accept() fails with EMFILE; the service drops the oldest
    waiting hello, backs off and keeps accepting, and serves the run once the flood ends."""
    script = textwrap.dedent(_OUT_OF_FILES % SECRET.decode())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    flood: list[socket.socket] = []
    try:
        port, shard_id = proc.stdout.readline().split()
        endpoint = ("127.0.0.1", int(port), shard_id)
        for _ in range(200):  # the process has about 40 descriptors left
            try:
                flood.append(socket.create_connection(endpoint[:2], timeout=0.5))
            except OSError:
                break  # the listener's backlog is full: enough
        for sock in flood:
            sock.close()
        flood.clear()
        deadline = time.monotonic() + 60
        while True:
            try:
                client = WireClient(endpoint, TIMEOUT, SECRET)
                break
            except (OSError, WireError, struct.error):
                assert time.monotonic() < deadline, "the service did not recover"
                time.sleep(0.1)
        assert client.pull().result(TIMEOUT).version == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        out_of_files, serving, threads = map(int, proc.stdout.readline().split())
        client.close()
        assert out_of_files > 0  # it did run out, and kept going
        assert serving == 1 and threads <= 4
    finally:
        for sock in flood:
            sock.close()
        proc.kill()
        proc.wait(TIMEOUT)


def test_the_run_secret_stays_with_the_driver_and_the_replicas_config():
    """The view of the server sent to tasks (and published) does not carry the secret; the
    replicas get it in their config, whose repr (logs, errors) does not show it."""
    server = ParameterServer([None], [(0, 10)], ["tcp://w:1"])
    server.wire_secret = SECRET
    assert pickle.loads(pickle.dumps(server)).wire_secret == b""
    config = ReplicaConfig(0, 32, 1, 1, 0.1, 0, 0.0, wire_secret=SECRET)
    assert SECRET.decode() not in repr(config) and config.wire_secret == SECRET


@pytest.mark.timeout(60)
def test_a_shard_on_a_worker_serves_only_connections_with_its_runs_secret(client):
    """On the real cluster: a process that learns a shard's endpoint (its actor answers
    open_wire to anyone holding a handle) still cannot push without the run's secret."""
    server = ParameterServer.create(
        client, np.zeros(SIZE, np.float32), 1, optim.make("sgd", 0.5), wire_secret=SECRET
    )
    try:
        endpoint = server.shards[0].open_wire().result(TIMEOUT)
        with pytest.raises(WireError, match="wrong run secret"):
            WireClient(endpoint, TIMEOUT)
        member = WireClient(endpoint, TIMEOUT, SECRET)
        grad = np.ones(SIZE, dtype=np.float32)
        assert member.push(grad, 0, 0, seq=0, session="a").result(TIMEOUT).version == 1
        member.close()
        assert server.versions(TIMEOUT) == [1]
    finally:
        server.close()
