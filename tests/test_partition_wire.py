"""Direct sockets between model-parallel partitions: messages arrive whole and in order, and a
connection with a bad secret, a malformed head or an oversized message delivers nothing.
Loopback only, bounded in count."""

from __future__ import annotations

import contextlib
import re
import socket
import threading

import numpy as np
import pytest
from conftest import said_hello

from downpour_dask.downpour.model_parallel import (
    Mailbox,
    MailboxLink,
    PartitionLost,
    open_senders,
)
from downpour_dask.downpour.partition_wire import (
    HEAD,
    PartitionLinkError,
    PartitionSender,
    check_head,
    encode_message,
    receive_messages,
)
from downpour_dask.ps.frames import WireError
from downpour_dask.ps.service import ShardService

TIMEOUT = 10.0
SECRET = b"p" * 32
PARTITIONS, LIMIT = 2, 1000


class Inbox:
    """What a mailbox's direct connections delivered, with a wait for the n-th message."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, int, object]] = []
        self.ended: list[str | None] = []
        self._cond = threading.Condition()

    def deliver(self, sender: int, tag: int, payload: object) -> None:
        with self._cond:
            self.messages.append((sender, tag, payload))
            self._cond.notify_all()

    def serve(self, conn: socket.socket) -> None:
        try:
            why = receive_messages(conn, self.deliver, PARTITIONS, LIMIT)
        except ConnectionError as err:
            why = f"broken: {err}"
        self.ended.append(why)
        with self._cond:
            self._cond.notify_all()

    def wait(self, predicate) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, TIMEOUT)


@contextlib.contextmanager
def served(target, handler):
    """``target`` registered under SECRET with ``handler`` on a fresh loopback service (which
    holds it weakly: the caller keeps it); yields its endpoint."""
    service = ShardService("127.0.0.1")
    try:
        yield service.register(target, SECRET, handler=handler)
    finally:
        service.close()


@pytest.fixture
def inbox():
    """An inbox served on loopback, and its endpoint."""
    box = Inbox()
    with served(box, Inbox.serve) as endpoint:
        yield box, endpoint


def test_messages_arrive_whole_in_order_with_their_sender_and_tag(inbox):
    box, endpoint = inbox
    sender = PartitionSender(endpoint, 1, SECRET, TIMEOUT)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((8, 100), dtype=np.float32)
    vector = rng.standard_normal(30)  # float64, 1-D
    logits = rng.standard_normal((8, 10), dtype=np.float32)
    sender.send(1, block)
    sender.send(2, vector)
    sender.send(3, (logits, 0.25, True))
    sender.flush()
    assert box.wait(lambda: len(box.messages) == 3)
    (s1, t1, got_block), (s2, t2, got_vector), (s3, t3, got_output) = box.messages
    assert (s1, t1, s2, t2, s3, t3) == (1, 1, 1, 2, 1, 3)
    np.testing.assert_array_equal(got_block, block)
    assert got_block.dtype == np.float32 and got_vector.dtype == np.float64
    np.testing.assert_array_equal(got_vector, vector)
    np.testing.assert_array_equal(got_output[0], logits)
    assert got_output[1:] == (0.25, True)
    sender.close()
    assert box.wait(lambda: box.ended == [None])  # a clean end of the stream


def test_a_sender_without_the_runs_secret_is_refused(inbox):
    _, endpoint = inbox
    with pytest.raises(WireError, match="wrong run secret"):
        PartitionSender(endpoint, 1, b"x" * 32, TIMEOUT)


def _connect(endpoint) -> socket.socket:
    return said_hello(endpoint, SECRET, TIMEOUT)[0]


BAD_HEADS = {
    "kind": ((7, 0, 2, 1, 1, 2, 2), "unknown message kind 7"),
    "dtype": ((0, 5, 2, 1, 1, 2, 2), "unknown dtype code 5"),
    "ndim": ((0, 0, 3, 1, 1, 2, 2), "1-D or 2-D"),
    "sender": ((0, 0, 2, 2, 1, 2, 2), r"sender must be a partition in \[0, 2\)"),
    "tag": ((0, 0, 2, 1, 0, 2, 2), "tag must be in"),
    "size": ((0, 0, 2, 1, 1, 1000, 2), "at most 1000 values"),
    "negative": ((0, 0, 2, 1, 1, -1, -1), "at most 1000 values"),
}


@pytest.mark.parametrize("name", sorted(BAD_HEADS))
def test_a_malformed_head_closes_the_connection_and_delivers_nothing(inbox, name):
    head, why = BAD_HEADS[name]
    assert re.search(why, check_head(head, PARTITIONS, LIMIT))
    box, endpoint = inbox
    sock = _connect(endpoint)
    sock.sendall(HEAD.pack(*head))
    assert sock.recv(1) == b""  # closed by the mailbox's side
    assert box.wait(lambda: len(box.ended) == 1)
    assert re.search(why, box.ended[0]) and box.messages == []
    sock.close()


def test_a_message_cut_off_halfway_is_not_delivered(inbox):
    box, endpoint = inbox
    sock = _connect(endpoint)
    head, array, _ = encode_message(1, 1, np.ones((10, 10), np.float32))
    sock.sendall(head + array.tobytes()[:123])
    sock.close()
    assert box.wait(lambda: len(box.ended) == 1) and box.messages == []
    assert box.ended[0].startswith("broken")


def test_only_float_arrays_and_output_triples_can_be_sent():
    with pytest.raises(TypeError, match="float32/float64"):
        encode_message(0, 1, np.ones((2, 2), np.int64))
    with pytest.raises(TypeError, match="1-D or 2-D"):
        encode_message(0, 1, np.ones((2, 2, 2), np.float32))


def test_a_broken_connection_fails_the_partition_instead_of_losing_messages(inbox):
    box, endpoint = inbox
    sender = PartitionSender(endpoint, 1, SECRET, TIMEOUT)
    sender._sock.shutdown(socket.SHUT_RDWR)  # as when the peer's worker dies
    link = MailboxLink(0, [None, None], None, TIMEOUT, senders={1: sender})
    with pytest.raises(PartitionLost, match="partition 1"):
        for tag in range(1, 100):  # the writer notices on the first message it writes
            link.send(1, tag, np.ones(10, np.float32))
            link.flush()
    with pytest.raises(PartitionLinkError):
        sender.send(100, np.ones(10, np.float32))


class _Call:
    def __init__(self, value):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout=None):
        return self.value


class _Box:
    def __init__(self, endpoint):
        self._endpoint = endpoint

    def endpoint(self):
        return _Call(self._endpoint)


def test_peers_without_a_direct_endpoint_get_actor_calls(inbox):
    _, endpoint = inbox
    boxes = [_Box(None), _Box(None), _Box(endpoint)]  # partition 1 is this one
    senders = open_senders(1, boxes, SECRET, TIMEOUT)
    assert list(senders) == [2]
    link = MailboxLink(1, boxes, None, TIMEOUT, senders=senders)
    assert link.transports() == {"0": "actor", "2": "wire"}
    assert open_senders(1, boxes, b"", TIMEOUT) == {}  # no secret: no direct socket
    link.close()


@pytest.fixture
def mailbox():
    """A partition's mailbox (of 2) served on loopback, and its endpoint."""
    box = Mailbox(partitions=PARTITIONS, limit=LIMIT)
    with served(box, Mailbox._serve_connection) as endpoint:
        yield box, endpoint


def test_a_mailbox_hands_direct_messages_to_its_partition(mailbox):
    box, endpoint = mailbox
    sender = PartitionSender(endpoint, 1, SECRET, TIMEOUT)
    block = np.arange(12, dtype=np.float32).reshape(3, 4)
    sender.send(5, block)
    np.testing.assert_array_equal(box.take(1, 5, TIMEOUT), block)
    sender.close()


def test_a_partition_waiting_on_a_dropped_connection_fails_at_once_naming_why(mailbox):
    """A bad head loses the stream's messages: the partition learns it now, not after its
    timeout (30 s here, after which the message would say nothing of the connection)."""
    box, endpoint = mailbox
    sock = _connect(endpoint)
    sock.sendall(HEAD.pack(0, 0, 2, 1, 1, 1000, 2))  # 2,000 values: over the limit
    with pytest.raises(PartitionLost, match="dropped .*at most 1000 values"):
        box.take(1, 1, timeout=30)
    sock.close()


def test_a_write_to_a_peer_that_stopped_reading_fails_instead_of_hanging():
    """As when the peer's worker is stopped (SIGSTOP): the socket's buffers fill, and the write
    gives up after the sender's timeout with an error the partition turns into PartitionLost."""
    released = threading.Event()
    box = Inbox()
    with served(box, lambda box, conn: released.wait(TIMEOUT)) as endpoint:
        try:
            sender = PartitionSender(endpoint, 1, SECRET, timeout=0.5)
            big = np.zeros((64, 1 << 17), np.float32)  # 32 MB, more than the socket buffers hold
            with pytest.raises(PartitionLinkError, match="read nothing for 0.5 s"):
                sender.send(1, big)
            with pytest.raises(PartitionLinkError):  # and it stays broken
                sender.flush()
            sender.close()
        finally:
            released.set()
