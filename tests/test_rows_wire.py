"""The rows frame kind of the direct connections, in-process against a real SparseShard."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from downpour_dask.core import optim
from downpour_dask.core.sparse import TableSpec
from downpour_dask.ps import frames, wire
from downpour_dask.ps.rows import RowsLink
from downpour_dask.ps.rows_frames import PUSH_ROWS, push_payload
from downpour_dask.ps.rows_wire import RowsWireClient
from downpour_dask.ps.table import SparseShard
from downpour_dask.ps.wire import WireError

TIMEOUT = 10.0


@pytest.fixture
def shard_and_client():
    shard = SparseShard(0, 0, 3, np.zeros(3, np.float32), optim.adagrad(0.1),
                        tables=[(TableSpec(100, 4, 0.1), 20, 60)], seed=2)
    client = RowsWireClient(wire.serve(shard, "127.0.0.1", b"s3cret"), 1, TIMEOUT, b"s3cret")
    yield shard, client
    client.close()


def test_rows_pulls_and_pushes_over_the_wire_match_the_shards_own_methods(shard_and_client):
    shard, client = shard_and_client
    ids = np.array([20, 33, 59])
    reply = client.pull_rows([ids], 0, "abc").result(TIMEOUT)
    here = shard.rows_into([ids])
    assert np.array_equal(reply.rows[0], here.rows[0]) and reply.pull.version == 0
    grads = np.arange(12, dtype=np.float32).reshape(3, 4)
    pushed = client.push_rows(np.ones(3, np.float32), [(ids, grads)], 0, 0, seq=0,
                              session="abc", examples=5).result(TIMEOUT)
    assert pushed.accepted and pushed.version == 1
    after = client.pull_rows([ids], 0, "abc").result(TIMEOUT)
    assert np.array_equal(after.rows[0], shard.blocks[0].values[ids - 20])
    assert after.row_versions[0].tolist() == [1, 1, 1] and after.pull.applied_through == 0
    assert not np.array_equal(after.rows[0], reply.rows[0])


def test_an_out_of_range_row_over_the_wire_is_refused_and_changes_nothing(shard_and_client):
    shard, client = shard_and_client
    before = shard.blocks[0].values.copy()
    call = client.push_rows(np.zeros(3, np.float32), [(np.array([21, 60]), np.ones((2, 4)))],
                            0, 0, seq=0, session="abc")
    with pytest.raises(WireError, match=r"out of this block's range \[20, 60\): \[60\]"):
        call.result(TIMEOUT)
    assert np.array_equal(shard.blocks[0].values, before) and shard.version == 0
    # the connection stays usable
    assert client.pull_rows([np.array([21])], 0, "abc").result(TIMEOUT).pull.version == 0
    link = RowsLink(shard, 0, 0, TIMEOUT)  # the same refusal in-process
    with pytest.raises(ValueError, match=r"out of this block's range"):
        link.wait(link.push(np.zeros(3, np.float32), [(np.array([60]), np.ones((1, 4)))],
                            0, 0, 0, 0.0))


def test_a_malformed_rows_payload_is_refused_with_a_clear_error(shard_and_client):
    shard, _ = shard_and_client
    host, port, shard_id = wire.serve(shard, "127.0.0.1", b"s3cret")
    with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
        sock.sendall(frames.hello(shard_id, b"s3cret"))
        frames.check_status(sock)
        frames.recv(sock, frames.SIZE.size)
        payload = push_payload(np.zeros(3, np.float32), [(np.array([21]), np.ones((1, 4)))])
        cut = payload[:-4]  # the last gradient value is missing
        sock.sendall(frames.request(PUSH_ROWS, 0, 0, len(cut), session="abc") + cut)
        with pytest.raises(WireError, match="ends before its declared contents"):
            frames.check_status(sock)
        too_big = frames.request(PUSH_ROWS, 0, 0, 2**31, session="abc")
        sock.sendall(too_big)
        with pytest.raises(WireError, match="carries 1 to 1073741824 payload bytes"):
            frames.check_status(sock)
    assert shard.version == 0 and not shard.blocks[0].versions.any()
