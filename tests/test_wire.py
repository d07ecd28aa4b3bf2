"""The direct replica-to-shard connection: the protocol in-process, then on the real cluster."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import threading
import time

import numpy as np
import pytest

from downpour_dask import DownpourSGD, datasets, models, optim
from downpour_dask.ps import dispatch, frames, service, shared_slots, wire
from downpour_dask.ps.protocol import PullReply, PushReply
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.ps.wire import WireClient, WireError

TIMEOUT = 10.0


def make_shard(size: int = 1000, rate: float = 0.5) -> ParameterServerShard:
    values = np.linspace(-1, 1, size, dtype=np.float32)
    return ParameterServerShard(0, 0, size, values, optim.make("sgd", rate))


@pytest.fixture(params=["shared slots", "inline"])
def shard_and_client(request, monkeypatch):
    """A shard served on this process's service and a replica's connection to it, whose arrays
    go through shared slots (the shard is on the same host) or, switched off, the socket."""
    if request.param == "inline":
        monkeypatch.setenv(shared_slots.ENV_SWITCH, "0")
    shard = make_shard()
    client = WireClient(wire.serve(shard, "127.0.0.1"), timeout=TIMEOUT)
    assert client.shared == (request.param == "shared slots")
    yield shard, client
    client.close()


def test_pull_push_and_exchange_match_the_shards_own_methods(shard_and_client):
    shard, client = shard_and_client
    twin = make_shard()  # the same calls made directly, for comparison
    pulled = client.pull(3, "s").result(TIMEOUT)
    assert isinstance(pulled, PullReply)
    np.testing.assert_array_equal(pulled.values, twin.snapshot(3, "s").values)
    assert (pulled.version, pulled.stop, pulled.applied_through) == (0, False, -1)

    grad = np.arange(1000, dtype=np.float32) / 1000
    kw = dict(seq=0, session="s", examples=32, loss=0.7)
    pushed = client.push(grad, 0, 3, **kw).result(TIMEOUT)
    assert pushed == twin.apply_push(grad, 0, 3, **kw)
    assert isinstance(pushed, PushReply) and pushed.accepted and pushed.version == 1

    kw = dict(seq=1, session="s", examples=32, loss=0.5)
    got_push, got_pull = client.exchange(grad, 0, 3, **kw).result(TIMEOUT)
    want_push = twin.apply_push(grad, 0, 3, **kw)
    assert got_push == want_push and got_push.staleness == 1
    np.testing.assert_array_equal(got_pull.values, twin.values)
    assert got_pull.applied_through == 1  # the replica learns its pushes 0 and 1 are in
    assert shard.examples == 64 and shard.recent_loss == twin.recent_loss


def test_a_pull_can_land_in_the_callers_buffer(shard_and_client):
    """Replicas pull big shards into buffers they reuse (a fresh array of tens of MB is
    page-faulted afresh on every pull)."""
    shard, client = shard_and_client
    buffer = np.zeros(1000, dtype=np.float32)
    reply = client.pull(0, "s", out=buffer).result(TIMEOUT)
    assert reply.values is buffer
    np.testing.assert_array_equal(buffer, shard.values)
    grad = np.ones(1000, dtype=np.float32)
    _, pulled = client.exchange(grad, 0, 0, seq=0, session="s", out=buffer).result(TIMEOUT)
    assert pulled.values is buffer and pulled.version == 1
    with pytest.raises(ValueError, match=r"out must be a float32 array of shape \(1000,\)"):
        client.pull(out=np.zeros(10, dtype=np.float32))


class _TakesSome:
    """A connection whose buffers take ``room`` bytes of a send that must not wait."""

    def __init__(self, room: int | None):
        self.room, self.taken = room, b""

    def sendmsg(self, parts, ancillary, flags):
        assert flags & socket.MSG_DONTWAIT  # the shard's lock is held: it must not block
        data = b"".join(bytes(part) for part in parts)
        if self.room is None:
            raise BlockingIOError
        self.taken = data[: self.room]
        return len(self.taken)


@pytest.mark.parametrize("room", [None, 0, 5, 40, 61, 1000, 4003, 10**6])
def test_an_answer_sent_straight_from_the_shard_arrives_whole_wherever_the_send_stops(room):
    """A pull's answer goes from the shard's own values as far as the connection takes it
    without waiting; the rest of the head and the values from that byte on (not always on an
    element's boundary) are sent after the lock: together the same stream as a copy gives."""
    shard, twin = make_shard(), make_shard()
    grad = np.linspace(0, 1, 1000, dtype=np.float32)
    head = bytearray(
        frames.request(frames.EXCHANGE, 2, 0, 1000, seq=0, session="s")[: frames.REQUEST.size]
    )
    conn, out = _TakesSome(room), np.full(1000, np.nan, dtype=np.float32)
    reply = dispatch.call_shard(conn, shard, frames.EXCHANGE, grad, out, 2, "s", head)
    stream = conn.taken + reply.head + out.tobytes()[reply.values_from :]
    pushed = twin.apply_push(grad, 0, 2, seq=0, session="s")
    pulled = twin.snapshot(2, "s")
    want = frames.OK + frames.pushed(pushed) + frames.pulled(pulled) + pulled.values.tobytes()
    assert stream == want


def test_where_a_send_cannot_be_kept_from_waiting_none_is_tried_under_the_lock(monkeypatch):
    """A platform without MSG_DONTWAIT or sendmsg: the whole answer is copied and sent after
    the lock, as before, rather than risking a send that waits while holding it."""
    monkeypatch.setattr(frames, "_DONTWAIT", 0)
    conn = _TakesSome(10**6)
    assert frames.send_now(conn, [b"head", np.ones(4, np.float32)]) == 0 and conn.taken == b""


def test_pushes_are_applied_in_the_order_sent_and_a_repeat_is_refused(shard_and_client):
    shard, client = shard_and_client
    grads = [np.full(1000, i, dtype=np.float32) for i in range(1, 41)]
    calls = [client.push(g, 0, 1, seq=i, session="s") for i, g in enumerate(grads)]
    replies = [c.result(TIMEOUT) for c in calls]
    assert [r.version for r in replies] == list(range(1, 41))  # one connection: in order
    repeat = client.push(grads[0], 0, 1, seq=5, session="s").result(TIMEOUT)
    assert not repeat.accepted and shard.duplicates == 1 and shard.version == 40


def test_a_non_finite_gradient_is_refused_and_the_connection_stays_usable(shard_and_client):
    shard, client = shard_and_client
    bad = np.zeros(1000, dtype=np.float32)
    bad[7] = np.nan
    assert not client.push(bad, 0, 0, seq=0, session="s").result(TIMEOUT).accepted
    assert client.pull(0, "s").result(TIMEOUT).version == 0
    assert shard.refused == 1


def test_a_gradient_of_the_wrong_shape_or_dtype_is_refused_before_sending(shard_and_client):
    _, client = shard_and_client
    with pytest.raises(ValueError, match=r"contiguous float32 array of shape \(1000,\)"):
        client.push(np.zeros(999, dtype=np.float32), 0, 0)
    with pytest.raises(ValueError, match="dtype float64"):
        client.push(np.zeros(1000), 0, 0)
    assert client.pull().result(TIMEOUT).version == 0  # nothing half-sent broke the stream


def test_an_unknown_or_ended_shard_is_refused_with_a_clear_error():
    shard = make_shard()
    host, port, shard_id = wire.serve(shard, "127.0.0.1")
    with pytest.raises(WireError, match="no such parameter-server shard"):
        WireClient((host, port, "0" * 32), timeout=TIMEOUT)
    del shard
    gc.collect()  # the service holds shards weakly: an ended fit's shard is not kept alive
    with pytest.raises(WireError, match="no such parameter-server shard"):
        WireClient((host, port, shard_id), timeout=TIMEOUT)


@pytest.mark.parametrize(
    "mapped",
    [False, pytest.param(True, marks=pytest.mark.skipif(
        not shared_slots.available(), reason="needs memfd_create (Linux)"
    ))],
    ids=["receiver thread", "calls read their replies"],
)  # fmt: skip
def test_a_lost_shard_fails_every_call_in_flight_with_connection_error(mapped):
    """What a replica sees when the shard's worker dies: the connection closes and the calls
    waiting for replies fail at once (``ConnectionError`` is an ``OSError``, which the replica
    treats as a lost shard), and later calls fail too instead of hanging -- whether a receiver
    thread reads the replies or (shared slots) the calls do."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def shard_side() -> None:  # accepts the shard id, then reads requests and never answers
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(1024)
        conn.sendall(frames.OK + frames.SIZE.pack(1000))
        if shared_slots.available():  # the offer of shared slots: "mapped" (it is not used)
            frames.recv(conn, frames.REQUEST.size + frames.SHARE_AREA.size)
            conn.sendall(frames.OK + frames.SHARED.pack(mapped))

    thread = threading.Thread(target=shard_side)
    thread.start()
    client = WireClient(("127.0.0.1", listener.getsockname()[1], "x"), timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert client.shared is mapped
    calls = [client.pull(), client.push(np.zeros(1000, dtype=np.float32), 0, 0)]
    time.sleep(0.1)
    assert not any(c.done() for c in calls)
    accepted[0].close()  # the worker died
    for call in calls:
        with pytest.raises(ConnectionError):
            call.result(TIMEOUT)
    with pytest.raises(ConnectionError):
        client.pull().result(TIMEOUT)
    client.close()
    listener.close()


def test_a_call_without_a_reply_times_out_instead_of_hanging(shard_and_client):
    _, client = shard_and_client
    call = wire.WireCall(frames.PULL)  # never answered
    with pytest.raises(TimeoutError, match="within 0.05 s"):
        call.result(0.05)


# -- on the real two-worker cluster ----------------------------------------------------------
def _served_shards(dask_worker) -> int:
    gc.collect()
    return 0 if service._SERVICE is None else service._SERVICE.served()


def _shard_files() -> int:
    """Shared shard bodies (ps/shard_body.py) this process holds open or mapped."""
    gc.collect()
    held = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            held += "downpour-dask-shard" in os.readlink(f"/proc/self/fd/{name}")
    with open("/proc/self/maps") as maps:
        return held + sum("downpour-dask-shard" in line for line in maps)


@pytest.mark.timeout(120)
def test_replicas_reach_remote_shards_directly_and_train_as_with_actor_messages(client):
    """One replica, plain SGD: Downpour equals serial SGD whatever the timing, so the direct
    path (through shared memory: the workers share this host) and Dask's actor messages must
    end with the same parameters (2 shards: one of them is
    on the other worker).  The run records how each replica reached each shard, and the
    shards are released afterwards, one-sided shards' shared memory too.  One-sided, the replica
    applies its pushes to the other worker's shard itself: the same parameters again."""
    train, _ = datasets.load("digits")
    fitted = {}
    for transport in ("auto", "one-sided", "dask"):
        est = DownpourSGD(
            models.MLP(64, (16,), 10),
            n_replicas=1,
            n_shards=2,
            optimizer="sgd",
            learning_rate=0.1,
            batch_size=32,
            max_epochs=2,
            random_state=5,
            transport=transport,
        ).fit(train, client=client)
        fitted[transport] = est
    routes = {t: e.experiment_.config["replica_transports"] for t, e in fitted.items()}
    assert sorted(routes["auto"]["0"]) == ["local", "wire"]
    assert sorted(routes["dask"]["0"]) == ["actor", "local"]
    assert sorted(routes["one-sided"]["0"]) == ["local", "one-sided"]
    # the other worker is on this host: the direct connection's arrays went through shared
    # memory (ps/shared_slots.py), and the result is the same as over actor messages
    shared = {t: e.experiment_.config["replica_shared_memory"]["0"] for t, e in fitted.items()}
    wire_at = routes["auto"]["0"].index("wire")
    assert shared["auto"][wire_at] is shared_slots.available() and not any(shared["dask"])
    np.testing.assert_allclose(fitted["auto"].params_, fitted["dask"].params_, rtol=0, atol=1e-5)
    np.testing.assert_allclose(fitted["one-sided"].params_, fitted["dask"].params_, atol=1e-5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        sum(client.run(_served_shards).values()) or sum(client.run(_shard_files).values())
    ):
        gc.collect()  # see test_finished_fits_release_their_shards_on_the_workers for why
        time.sleep(0.1)
    assert sum(client.run(_served_shards).values()) == 0
    assert sum(client.run(_shard_files).values()) == 0, "a shared shard body outlived its fit"


def test_transport_must_be_auto_one_sided_or_dask():
    est = DownpourSGD(models.SoftmaxRegression(4, 3), n_replicas=1, n_shards=1, transport="tcp")
    allowed = "'auto', 'one-sided', 'dask'"
    with pytest.raises(ValueError, match=f"transport must be one of {allowed}, got 'tcp'"):
        est.fit(np.zeros((10, 4), np.float32), np.zeros(10, int), client="never used")
