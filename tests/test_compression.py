"""Top-k compressed pushes with error feedback (core/compression.py): k = all is a dense push,
nothing is lost to the residual, sparse pushes travel on every transport (in-process, the
direct wire, actor messages) and malformed ones are refused."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from test_replica import INITIAL, MODEL, config, data, run, server_values, shards_for

from downpour_dask import DownpourSGD, optim
from downpour_dask.core.compression import SparseGradient, TopK, check_fraction
from downpour_dask.ps import frames
from downpour_dask.ps.frames import PUSH_SPARSE
from downpour_dask.ps.service import ShardService
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.ps.wire import WireClient, WireError

TIMEOUT = 10.0


@pytest.mark.parametrize("n_shards", [1, 2])
def test_top_k_of_every_coordinate_equals_the_uncompressed_push(n_shards):
    batches = data()
    dense = shards_for(INITIAL, n_shards)
    _, _, dense_sink = run(MODEL, dense, batches, config(max_epochs=2))
    sparse = shards_for(INITIAL, n_shards)
    _, _, sparse_sink = run(MODEL, sparse, batches, config(max_epochs=2, top_k=1.0))
    assert np.abs(server_values(dense) - INITIAL).max() > 0.05  # it trained
    np.testing.assert_array_equal(server_values(sparse), server_values(dense))
    assert {row.bytes_sent for row in dense_sink.rows} == {4 * INITIAL.size}
    assert {row.bytes_sent for row in sparse_sink.rows} == {8 * INITIAL.size}  # index + value


def test_a_sparse_push_sends_the_largest_and_keeps_the_rest_for_later():
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(5, 40)).astype(np.float32)
    topk, sent_total = TopK(0.1, 40), np.zeros(40, np.float32)
    for g in grads:
        acc = topk.residual + g
        sent = g.copy()
        parts = topk.compress(sent, [(0, 20), (20, 40)])
        assert [len(p.indices) for p in parts] == [2, 2]  # ceil(0.1 * 20) per shard
        for (lo, hi), part in zip([(0, 20), (20, 40)], parts):
            biggest = np.sort(np.argsort(-np.abs(acc[lo:hi]))[:2])
            np.testing.assert_array_equal(part.indices, biggest)
            np.testing.assert_array_equal(sent[lo:hi], part.dense())  # what the ledger replays
        np.testing.assert_allclose(sent + topk.residual, acc, rtol=1e-6)  # nothing lost
        sent_total += sent
    np.testing.assert_allclose(sent_total + topk.residual, grads.sum(0), rtol=1e-5, atol=1e-6)


def test_bad_top_k_and_bad_sparse_pushes_are_refused():
    with pytest.raises(ValueError, match=r"top_k must be a fraction in \(0, 1\]"):
        check_fraction(0.0)
    with pytest.raises(TypeError, match="top_k must be a fraction"):
        check_fraction("1%")
    with pytest.raises(ValueError, match="top_k takes no model parallelism"):
        check_fraction(0.1, partitions=2)
    with pytest.raises(ValueError, match="top_k"):
        DownpourSGD(top_k=2).fit(np.zeros((8, 3), np.float32), np.arange(8) % 2)
    shard = ParameterServerShard(0, 0, 10, np.zeros(10, np.float32), optim.sgd(0.1))
    bad = SparseGradient(np.array([3, 10], np.int32), np.ones(2, np.float32), 10)
    with pytest.raises(ValueError, match=r"indices must be in \[0, 10\), got \[3, 10\]"):
        shard.apply_push(bad, 0, 0)
    assert shard.version == 0


@pytest.fixture
def served():
    service = ShardService("127.0.0.1")
    shard = ParameterServerShard(0, 0, 100, np.linspace(-1, 1, 100, dtype=np.float32),
                                 optim.sgd(0.5))  # fmt: skip
    yield shard, service.register(shard, b"s" * 32)
    service.close()


def test_a_sparse_push_over_the_wire_is_applied_as_its_dense_form(served):
    shard, endpoint = served
    twin = ParameterServerShard(0, 0, 100, shard.values.copy(), optim.sgd(0.5))
    client = WireClient(endpoint, TIMEOUT, b"s" * 32)
    push = SparseGradient(np.array([1, 50, 99], np.int32), np.array([1, -2, 3], np.float32), 100)
    reply = client.push(push, 0, 0, seq=0, session="s").result(TIMEOUT)
    assert reply == twin.apply_push(push.dense(), 0, 0, seq=0, session="s")
    got_push, got_pull = client.exchange(push, 1, 0, seq=1, session="s").result(TIMEOUT)
    assert got_push.accepted and got_push.version == 2
    twin.apply_push(push.dense(), 1, 0, seq=1, session="s")
    np.testing.assert_array_equal(got_pull.values, twin.values)
    out_of_range = SparseGradient(np.array([100], np.int32), np.ones(1, np.float32), 100)
    with pytest.raises(WireError, match=r"indices must be in \[0, 100\)"):
        client.push(out_of_range, 2, 0, seq=2, session="s").result(TIMEOUT)
    assert client.pull(0, "s").result(TIMEOUT).version == 2  # the connection still serves
    client.close()


def test_a_sparse_push_head_with_too_many_values_is_refused_and_closed(served):
    shard, (host, port, shard_id) = served
    sock = socket.create_connection((host, port), timeout=TIMEOUT)
    sock.sendall(frames.hello(shard_id, b"s" * 32))
    frames.check_status(sock)
    frames.recv(sock, frames.SIZE.size)
    sock.sendall(frames.REQUEST.pack(PUSH_SPARSE, 0, 0, 0, 0, 0.0, 101, 1) + b"s")
    with pytest.raises(WireError, match="sparse push to this shard carries 1 to 100 values"):
        frames.check_status(sock)
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread
        closed = True
    assert closed
    sock.close()
    assert shard.version == 0


@pytest.mark.parametrize("transport", ["auto", "dask"])
def test_top_k_fits_on_a_real_cluster_over_each_transport(client, transport):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 20)).astype(np.float32)
    y = (X[:, 0] - X[:, 2] > 0).astype(int)
    est = DownpourSGD(
        "softmax", n_replicas=2, n_shards=2, optimizer="sgd", learning_rate=0.1, batch_size=20,
        max_epochs=3, random_state=0, timeout=30, top_k=0.1, transport=transport,
    ).fit(X, y, client=client)  # fmt: skip
    n_params = est.params_.size
    sent = est.experiment_.pushes["bytes_sent"]
    assert set(sent) == {8 * 2 * int(np.ceil(0.1 * n_params / 2))}  # k per shard, 8 B each
    assert sent.max() < 4 * n_params  # less than a dense push
    assert est.experiment_.config["top_k"] == 0.1
    assert est.score(X, y) > 0.8


def test_compressed_dc_asgd_resumes_from_its_checkpoint(client, tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 20)).astype(np.float32)
    y = (X[:, 1] > 0).astype(int)
    kw = dict(model="softmax", n_replicas=2, n_shards=2, optimizer="dc_adagrad", batch_size=20,
              top_k=0.05, random_state=0, timeout=30)  # fmt: skip
    DownpourSGD(max_steps=5, checkpoint_dir=tmp_path, **kw).fit(X, y, client=client)
    est = DownpourSGD(max_steps=10, **kw).fit(X, y, client=client, resume_from=tmp_path)
    pushes = est.experiment_.pushes
    assert sorted(pushes.groupby("replica")["step"].max()) == [9, 9]  # it went on from step 5
    assert (pushes["bytes_sent"] > 0).all()  # the resumed log has every push's size
    assert est.experiment_.config["optimizer"] == "dc_adagrad"
    assert est.server_status_["accepted"].sum() == 2 * 2 * 10
