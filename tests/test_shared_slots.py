"""Shared-memory slots of the direct connections (ps/shared_slots.py): what a shard maps, what
it refuses, that every request still gets the same answer, and what a killed peer leaves."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import numpy as np
import pytest
from conftest import WIRE_SECRET, WIRE_SIZE, said_hello, wire_shard

from downpour_dask.ps import frames, shared_slots
from downpour_dask.ps.frames import PULL_SLOT, PUSH, PUSH_SLOT, SHARE
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shared_slots import SlotArea
from downpour_dask.ps.wire import WireClient, WireError

pytestmark = pytest.mark.skipif(not shared_slots.available(), reason="needs memfd_create (Linux)")

TIMEOUT = 10.0
SIZE, SECRET, make_shard = WIRE_SIZE, WIRE_SECRET, wire_shard  # the served shard (conftest.py)


def open_connections(service: ShardService, endpoint) -> int:
    """How many connections the shard at ``endpoint`` is served on (the service's record)."""
    with service._lock:
        return len(service._shards[endpoint[2]].conns)


def raw(endpoint) -> socket.socket:
    """A connection that said hello and read the shard's size."""
    return said_hello(endpoint, SECRET, TIMEOUT)[0]


def offer(sock: socket.socket, pid: int, fd: int, n_slots: int, token: bytes) -> bool:
    """Send a SHARE request; whether the shard mapped the area."""
    sock.sendall(frames.request(SHARE, -1, 0, 0) + frames.SHARE_AREA.pack(pid, fd, n_slots, token))
    frames.check_status(sock)
    return frames.SHARED.unpack(frames.recv(sock, frames.SHARED.size))[0]


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_slots_per_connection_stay_within_the_budget():
    assert shared_slots.slots_for(SIZE) == shared_slots.MAX_SLOTS
    assert shared_slots.slots_for(10_500_000) == 1  # a 42 MB shard: one slot, not four
    assert shared_slots.slots_for(0) == shared_slots.MAX_SLOTS


def test_an_area_maps_only_what_it_was_announced_as():
    """The shard maps an area only if it is a regular file of the announced size holding the
    announced token: anything else (another host's /proc path, a pipe, a wrong size) is None."""
    area = SlotArea.create(SIZE, 2)
    try:
        twin = SlotArea.attach(os.getpid(), area.fd, area.token, SIZE, 2)
        assert twin is not None
        area.slot(1)[:] = 7.0  # one memory: what one side writes, the other reads
        np.testing.assert_array_equal(twin.slot(1), np.full(SIZE, 7.0, np.float32))
        twin.close()
        assert SlotArea.attach(os.getpid(), area.fd, b"x" * 16, SIZE, 2) is None  # token
        assert SlotArea.attach(os.getpid(), area.fd, area.token, SIZE, 3) is None  # size
        assert SlotArea.attach(os.getpid(), area.fd, area.token, SIZE + 1, 2) is None
        assert SlotArea.attach(os.getpid(), area.fd, area.token, SIZE, 99) is None  # > MAX
        assert SlotArea.attach(2**22 + 7, area.fd, area.token, SIZE, 2) is None  # no process
        read_end, write_end = os.pipe()
        try:  # a FIFO is never opened (an open could block or have side effects)
            assert SlotArea.attach(os.getpid(), read_end, area.token, SIZE, 2) is None
        finally:
            os.close(read_end)
            os.close(write_end)
    finally:
        area.close()


def test_slots_are_handed_out_once_until_given_back():
    area = SlotArea.create(SIZE, 2)
    taken = {area.take(), area.take()}
    assert taken == {0, 1} and area.take() is None
    area.give(1)
    assert area.take() == 1
    area.close()


def test_more_requests_in_flight_than_slots_go_inline_and_all_are_answered(served):
    """With the shard busy, 7 pushes and a pull wait at once: 4 in slots, the rest on the
    socket; each is answered in order and the shard applied all 7, as without slots."""
    service, shard, endpoint = served
    twin = make_shard()
    client = WireClient(endpoint, TIMEOUT, SECRET)
    assert client.shared
    grads = [np.full(SIZE, i + 1, np.float32) / 8 for i in range(7)]
    with shard._lock:  # the shard's thread waits at the first push meanwhile
        calls = [client.push(g, 0, 0, seq=i, session="a") for i, g in enumerate(grads)]
        slotted = [c.slot is not None for c in calls]
        pull = client.pull(0, "a")
    assert slotted == [True] * 4 + [False] * 3
    for i, (call, g) in enumerate(zip(calls, grads)):
        assert call.result(TIMEOUT) == twin.apply_push(g, 0, 0, seq=i, session="a")
    np.testing.assert_array_equal(pull.result(TIMEOUT).values, twin.values)
    assert sorted(client._area._free) == [0, 1, 2, 3]  # every slot given back
    client.close()


def test_a_replica_that_cannot_make_an_area_keeps_its_arrays_on_the_socket(served, monkeypatch):
    service, shard, endpoint = served

    def no_files(*args):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(SlotArea, "create", no_files)
    client = WireClient(endpoint, TIMEOUT, SECRET)
    assert not client.shared
    pushed, pulled = client.exchange(np.ones(SIZE, np.float32), 0, 0, seq=0, session="a").result(
        TIMEOUT
    )
    assert pushed.accepted and pulled.version == 1
    np.testing.assert_array_equal(pulled.values, shard.values)
    client.close()


class _HeldWrites:
    """A client's socket whose ``sendall`` (the sender thread's writes) waits for ``go``."""

    def __init__(self, sock: socket.socket):
        self._sock, self.go = sock, threading.Event()

    def sendall(self, data) -> None:
        self.go.wait(TIMEOUT)
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_slotted_request_never_overtakes_one_queued_for_the_sender_thread(served):
    """The replica's thread writes a slotted request itself only while the sender thread has
    nothing to send: a push that found every slot taken (so went inline, to the sender thread)
    reaches the shard before a later pull that found a slot free, and the pull sees it."""
    service, shard, endpoint = served
    client = WireClient(endpoint, TIMEOUT, SECRET)
    assert client.shared
    client._sock = held = _HeldWrites(client._sock)
    taken = [client._area.take() for _ in range(client._area.n_slots)]
    pushed = client.push(np.ones(SIZE, np.float32), 0, 0, seq=0, session="a")
    client._area.give(taken.pop())
    pulled = client.pull(0, "a")
    assert pulled.slot is not None and pushed.slot is None
    after_the_push = shard.values - 0.5  # plain SGD at rate 0.5
    held.go.set()
    assert pushed.result(TIMEOUT).version == 1
    reply = pulled.result(TIMEOUT)
    assert reply.version == 1 and reply.applied_through == 0
    np.testing.assert_array_equal(reply.values, after_the_push)
    client.close()


def _stalling_shard(listener: socket.socket, sent: list) -> None:
    """Says hello and maps the offered slots, then sends the first reply's first byte only."""
    conn, _ = listener.accept()
    sent.append(conn)
    frames.recv(conn, len(frames.hello("x", SECRET)))
    conn.sendall(frames.OK + frames.SIZE.pack(SIZE))
    frames.recv(conn, frames.REQUEST.size + frames.SHARE_AREA.size)
    conn.sendall(frames.OK + frames.SHARED.pack(True))
    frames.recv(conn, frames.REQUEST.size + frames.SLOT.size)  # a pull through a slot
    conn.sendall(frames.OK[:1])


def test_a_shard_stopped_mid_reply_fails_the_call_within_the_connection_timeout():
    """A call that reads its own replies does so on the replica's thread: a reply begun and
    not finished fails the connection once its timeout has passed, instead of hanging it."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: list[socket.socket] = []
    shard_side = threading.Thread(target=_stalling_shard, args=(listener, sent), daemon=True)
    shard_side.start()
    client = WireClient(("127.0.0.1", listener.getsockname()[1], "x"), 0.5, SECRET)
    assert client.shared
    outcome: list[BaseException] = []

    def wait_for_the_pull() -> None:
        try:
            client.pull().result(TIMEOUT)
        except BaseException as err:  # noqa: BLE001 - what the replica would see
            outcome.append(err)

    waiter = threading.Thread(target=wait_for_the_pull, daemon=True)
    waiter.start()
    waiter.join(TIMEOUT + 5)
    assert not waiter.is_alive() and isinstance(outcome[0], ConnectionError)
    with pytest.raises(ConnectionError):
        client.push(np.ones(SIZE, np.float32), 0, 0).result(TIMEOUT)
    client.close()
    shard_side.join(TIMEOUT)
    sent[0].close()
    listener.close()


def _slot_files() -> Counter[str]:
    """How many mappings of each slot area (by the memory file's inode) this process has."""
    with open("/proc/self/maps") as maps:
        return Counter(line.split()[4] for line in maps if "downpour-dask-slots" in line)


def _slot_descriptors() -> int:
    """How many of this process's open descriptors are slot areas' memory files."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            found += "downpour-dask-slots" in os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_no_descriptor_or_mapping_outlives_its_connections(served):
    """Twenty connections opened, used and closed: the memory files' descriptors are closed
    once the shard has mapped them, and both sides' mappings go with the connection.  (Counted
    by memory file: other threads of a test process may open files of their own meanwhile.)"""
    service, shard, endpoint = served
    gc.collect()
    descriptors, opened = _slot_descriptors(), set()
    for i in range(20):
        before = _slot_files()
        client = WireClient(endpoint, TIMEOUT, SECRET)
        new = _slot_files() - before
        assert client.shared and 2 in new.values()  # the replica's and the shard's mapping
        opened.update(new)
        client.push(np.ones(SIZE, np.float32), 0, 0, seq=i, session="a").result(TIMEOUT)
        client.close()
        del client
    done = threading.Event()
    for _ in range(200):  # the shard's threads end once they read the closes
        gc.collect()
        if open_connections(service, endpoint) == 0 and not opened & set(_slot_files()):
            done.set()
            break
        done.wait(0.05)
    assert done.is_set() and shard.version == 20
    assert _slot_descriptors() <= descriptors


def test_a_slot_request_without_a_mapped_area_is_refused_and_applies_nothing(served):
    service, shard, endpoint = served
    sock = raw(endpoint)
    sock.sendall(frames.request(PUSH_SLOT, 0, 0, SIZE, seq=0, session="a") + frames.SLOT.pack(0))
    with pytest.raises(WireError, match="shared area was not mapped"):
        frames.check_status(sock)
    assert closed_by_peer(sock) and shard.version == 0
    sock.close()


def test_a_bogus_offer_is_declined_and_the_connection_serves_on(served):
    service, shard, endpoint = served
    sock = raw(endpoint)
    read_end, write_end = os.pipe()
    try:
        assert not offer(sock, os.getpid(), read_end, 2, b"t" * 16)  # a pipe, not an area
    finally:
        os.close(read_end)
        os.close(write_end)
    sock.sendall(frames.request(PUSH, 0, 0, SIZE, seq=0, session="a"))
    sock.sendall(np.ones(SIZE, np.float32))  # inline, as before
    frames.check_status(sock)
    assert frames.PUSHED.unpack(frames.recv(sock, frames.PUSHED.size))[:3] == (1, 0, True)
    sock.close()


def test_a_slot_outside_the_area_or_a_second_offer_is_refused(served):
    service, shard, endpoint = served
    area = SlotArea.create(SIZE, 2)
    sock = raw(endpoint)
    assert offer(sock, os.getpid(), area.fd, 2, area.token)
    sock.sendall(frames.request(PULL_SLOT, 0, 0, 0) + frames.SLOT.pack(1))  # a good one
    frames.check_status(sock)
    frames.recv(sock, frames.PULLED.size)
    np.testing.assert_array_equal(area.slot(1), shard.values)
    sock.sendall(frames.request(PUSH_SLOT, 0, 0, SIZE, seq=0, session="a") + frames.SLOT.pack(2))
    with pytest.raises(WireError, match="slot 2 is outside the shared area's 2 slots"):
        frames.check_status(sock)
    assert closed_by_peer(sock) and shard.version == 0
    sock.close()
    sock = raw(endpoint)
    assert offer(sock, os.getpid(), area.fd, 2, area.token)
    sock.sendall(frames.request(SHARE, -1, 0, 0) + frames.SHARE_AREA.pack(0, 0, 2, area.token))
    with pytest.raises(WireError, match="already mapped"):
        frames.check_status(sock)
    sock.close()
    area.close()


_SHARD_PROCESS = """
import sys, numpy as np
from downpour_dask import optim
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shard import ParameterServerShard
shard = ParameterServerShard(0, 0, {size}, np.zeros({size}, np.float32), optim.make("sgd", 1.0))
service = ShardService("127.0.0.1")
host, port, key = service.register(shard, {secret!r})
print(port, key, flush=True)
sys.stdin.read()
"""


def _wait_until_stopped(pid: int) -> None:
    """Wait until every thread of process ``pid`` is stopped: ``kill(SIGSTOP)`` returns before
    they are, and a thread not stopped yet may still answer a request sent meanwhile."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                states.add(stat.read().rsplit(")", 1)[1].split()[0])
        if states <= {"T", "t"}:
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} was not stopped within {TIMEOUT} s")


@pytest.mark.slow
def test_a_shard_in_another_process_shares_slots_and_its_sigkill_fails_the_calls():
    """The real case: the shard's process maps the replica's area (through /proc), pushes and
    pulls go through it, and when that process is SIGKILLed every call in flight fails with
    ConnectionError instead of hanging, and the replica's memory stays its own."""
    script = textwrap.dedent(_SHARD_PROCESS.format(size=SIZE, secret=SECRET))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        port, key = proc.stdout.readline().split()
        client = WireClient(("127.0.0.1", int(port), key), TIMEOUT, SECRET)
        assert client.shared
        grad = np.arange(SIZE, dtype=np.float32)
        pushed, pulled = client.exchange(grad, 0, 0, seq=0, session="a").result(TIMEOUT)
        assert pushed.accepted and pulled.version == 1
        np.testing.assert_array_equal(pulled.values, -grad)
        buffer = np.zeros(SIZE, np.float32)
        os.kill(proc.pid, signal.SIGSTOP)  # a pull in flight, unanswered, when it dies
        _wait_until_stopped(proc.pid)
        call = client.pull(0, "a", out=buffer)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(TIMEOUT)
        with pytest.raises(ConnectionError):
            call.result(TIMEOUT)
        with pytest.raises(ConnectionError):
            client.pull().result(TIMEOUT)
        assert not buffer.any()  # nothing landed in it
        client.close()
    finally:
        proc.kill()
        proc.wait(TIMEOUT)


_REPLICA_PROCESS = """
import os, sys, numpy as np
from downpour_dask.ps.wire import WireClient
client = WireClient(("127.0.0.1", {port}, {key!r}), 10.0, {secret!r})
assert client.shared
print(client.push(np.ones({size}, np.float32), 0, 0, seq=0, session="b").result(10).version,
      flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_sigkilled_replica_process_leaves_the_shard_serving(served):
    """The shard maps the memory of a replica that is SIGKILLed: its connection ends, the shard
    keeps its values and serves the next replica."""
    service, shard, endpoint = served
    _, port, key = endpoint
    script = textwrap.dedent(_REPLICA_PROCESS.format(port=port, key=key, secret=SECRET,
                                                     size=SIZE))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout.readline().split() == ["1"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
    ended = threading.Event()
    for _ in range(200):  # its connection ends once the shard's thread reads the close
        if open_connections(service, endpoint) == 0:
            ended.set()
            break
        ended.wait(0.05)
    assert ended.is_set()
    after = shard.values.copy()
    client = WireClient(endpoint, TIMEOUT, SECRET)
    pulled = client.pull(0, "c").result(TIMEOUT)
    assert client.shared and pulled.version == 1
    np.testing.assert_array_equal(pulled.values, after)
    client.close()
