"""The parameter server on a real local cluster: placement, pull/push semantics, refusals,
and what counts as a lost shard."""

import os
import signal
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.comm import CommClosedError

from downpour_dask import live, optim
from downpour_dask.core.averaging import Averaged
from downpour_dask.ps.protocol import FencedError, ShardLostError, is_shard_lost
from downpour_dask.ps.server import ParameterServer
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.ps.wire import WireError
from downpour_dask.runtime.cluster import cluster_workers

TIMEOUT = 30


@pytest.fixture
def server(client):
    initial = np.arange(10, dtype=np.float32)
    ps = ParameterServer.create(client, initial, 2, optim.sgd(0.5), timeout=TIMEOUT)
    yield ps
    ps.close()


def test_two_shards_live_on_different_workers_and_cover_the_vector_once(client, server):
    assert len(set(server.workers)) == 2
    assert set(server.workers) == set(cluster_workers(client))
    status = server.status(TIMEOUT)
    covered = np.concatenate([np.arange(lo, hi) for lo, hi in zip(status["start"], status["stop"])])
    assert np.array_equal(covered, np.arange(10))
    values, versions = server.pull(TIMEOUT)
    assert np.array_equal(values, np.arange(10, dtype=np.float32)) and versions == [0, 0]


def test_push_applies_the_rule_on_each_range_and_bumps_versions(server):
    grad = np.ones(10, dtype=np.float32)
    replies = server.push(grad, [0, 0], replica=3, timeout=TIMEOUT)
    assert [r.version for r in replies] == [1, 1] and all(r.accepted for r in replies)
    assert server.versions(TIMEOUT) == [1, 1]
    replies = server.push(2 * grad, [0, 0], replica=3, timeout=TIMEOUT)
    assert [r.staleness for r in replies] == [1, 1]  # one update landed since version 0
    values, versions = server.pull(TIMEOUT)
    np.testing.assert_array_equal(values, np.arange(10) - 0.5 * 1 - 0.5 * 2)
    assert versions == [2, 2]
    assert server.status(TIMEOUT)["accepted_by_replica"].tolist() == [{3: 2}, {3: 2}]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_refused_and_parameters_unchanged(server, bad):
    grad = np.ones(10, dtype=np.float32)
    grad[7] = bad  # lands in shard 1 only
    replies = server.push(grad, [0, 0], replica=0, timeout=TIMEOUT)
    assert [r.accepted for r in replies] == [True, False]
    values, versions = server.pull(TIMEOUT)
    np.testing.assert_array_equal(values[5:], np.arange(5, 10, dtype=np.float32))
    assert versions == [1, 0]
    status = server.status(TIMEOUT)
    assert status["refused"].tolist() == [0, 1]
    [(_, kind, _, data)] = server.events(TIMEOUT)
    assert kind == "gradient_refused" and data["replica"] == 0 and data["non_finite"] == 1


def test_a_gradient_that_would_overflow_adagrad_state_is_refused_and_nothing_changes(client):
    """N(0, 1e20) is finite, but its square overflows Adagrad's accumulators: those coordinates
    would never move again.  The push is refused, values and accumulators left as they were."""
    initial = np.zeros(1000, dtype=np.float32)
    ps = ParameterServer.create(client, initial, 1, optim.adagrad(0.1), timeout=TIMEOUT)
    try:
        ps.push(np.ones(1000, dtype=np.float32), [0], timeout=TIMEOUT)
        before = ps.export_state(TIMEOUT)[0]
        huge = np.random.default_rng(0).normal(0, 1e20, 1000).astype(np.float32)
        [reply] = ps.push(huge, [1], replica=2, timeout=TIMEOUT)
        assert not reply.accepted and reply.version == 1
        after = ps.export_state(TIMEOUT)[0]
        np.testing.assert_array_equal(after["values"], before["values"])
        np.testing.assert_array_equal(after["rule_state"]["sum_sq"], before["rule_state"]["sum_sq"])
        [(_, kind, _, data)] = ps.events(TIMEOUT)
        assert kind == "gradient_refused" and "sum_sq" in data["reason"] and data["replica"] == 2
        [reply] = ps.push(np.ones(1000, dtype=np.float32), [1], timeout=TIMEOUT)  # still learns
        assert reply.accepted and reply.version == 2
    finally:
        ps.close()


def test_max_grad_norm_clips_each_push_over_the_shards_slice():
    shard = ParameterServerShard(
        0, 0, 4, np.zeros(4, np.float32), optim.sgd(1.0), max_grad_norm=1.0
    )
    shard.apply_push(np.array([3, 4, 0, 0], np.float32), 0, 0)
    np.testing.assert_allclose(shard.values, [-0.6, -0.8, 0, 0], rtol=1e-6)
    shard.apply_push(np.array([0, 0, 0.3, 0.4], np.float32), 1, 0)  # norm 0.5: untouched
    np.testing.assert_allclose(shard.values, [-0.6, -0.8, -0.3, -0.4], rtol=1e-6)
    assert shard.clipped == 1


def test_a_retired_incarnation_refuses_every_call_and_reports_what_it_acknowledged(client):
    """Fencing: once generation 1 retires generation 0, the old copy changes nothing, however
    it is reached (actor call, in-process call), and says why; stopping needs the secret."""
    ps = ParameterServer.create(
        client, np.zeros(4, np.float32), 1, optim.sgd(0.1), timeout=TIMEOUT, wire_secret=b"s" * 32
    )
    try:
        ps.push(np.ones(4, np.float32), [0], replica=1, timeout=TIMEOUT)
        with pytest.raises(PermissionError, match="without the run's token"):
            ps.shards[0].request_stop(b"guess", "intruder").result(timeout=TIMEOUT)
        with pytest.raises(PermissionError):
            ps.shards[0].retire(1, b"guess").result(timeout=TIMEOUT)
        final = ps.shards[0].retire(1, b"s" * 32).result(timeout=TIMEOUT)
        assert final["version"] == 1 and final["generation"] == 0
        assert final["accepted_by_replica"] == {1: 1} and final["state"]["version"] == 1
        for call in (ps.shards[0].pull(), ps.shards[0].push(np.ones(4, np.float32), 1, 0)):
            with pytest.raises(FencedError, match="retired: generation 1 replaced it") as err:
                call.result(timeout=TIMEOUT)
            assert is_shard_lost(err.value) and err.value.shard == 0
        status = ps.status(TIMEOUT).iloc[0]
        assert status["version"] == 1 and status["retired_by"] == 1
        assert status["fenced_calls"] == 2
        kinds = [e[1] for e in ps.events(TIMEOUT)]
        assert kinds == ["stop_refused", "retire_refused"]
    finally:
        ps.close()


def test_a_huge_but_finite_gradient_is_accepted(server):
    """The check sums the gradient in float32; a sum that overflows must not be mistaken for a
    NaN or inf in the gradient itself."""
    grad = np.full(10, 3e38, dtype=np.float32)  # each finite; their sum is not
    replies = server.push(grad, [0, 0], replica=0, timeout=TIMEOUT)
    assert [r.accepted for r in replies] == [True, True]
    assert server.status(TIMEOUT)["refused"].tolist() == [0, 0]


def test_a_retried_push_is_applied_once_and_pull_reports_which_pushes_it_holds(server):
    shard = server.shards[0]
    grad = np.ones(5, dtype=np.float32)
    first = shard.push(grad, 0, 1, seq=0, session="s").result(TIMEOUT)
    again = shard.push(grad, 0, 1, seq=0, session="s").result(TIMEOUT)
    assert first.accepted and not again.accepted and again.version == 1
    shard.push(grad, 1, 1, seq=2, session="s").result(TIMEOUT)  # seq 1 still in flight
    reply = shard.pull(1, "s").result(TIMEOUT)
    assert (reply.applied_through, reply.applied_ahead, reply.version) == (0, (2,), 2)
    shard.push(grad, 1, 1, seq=1, session="s").result(TIMEOUT)
    reply = shard.pull(1, "s").result(TIMEOUT)
    assert (reply.applied_through, reply.applied_ahead) == (2, ())
    assert shard.status().result(TIMEOUT)["duplicates"] == 1


def test_stop_flag_reaches_pulls_and_pushes(server):
    assert not server.shards[0].pull().result(TIMEOUT).stop
    server.request_stop(TIMEOUT)
    assert server.shards[0].pull().result(TIMEOUT).stop
    assert all(r.stop for r in server.push(np.zeros(10, np.float32), [0, 0], timeout=TIMEOUT))


def test_wrong_gradient_length_is_an_error(server):
    with pytest.raises(ValueError, match="owns 5 parameters"):
        server.shards[0].push(np.ones(4, np.float32), 0, 0).result(TIMEOUT)


def test_a_bug_in_a_shard_method_is_raised_as_it_is_not_taken_for_a_lost_shard(server):
    pieces = [(np.ones(5, np.float32), 0, 0), (np.ones(4, np.float32), 0, 0)]
    with pytest.raises(ValueError, match="owns 5 parameters") as caught:
        server.call_all(ParameterServerShard.push, timeout=TIMEOUT, per_shard=pieces)
    assert not isinstance(caught.value, ShardLostError)


def test_shard_methods_are_called_by_reference_and_must_belong_to_the_shards(server):
    class Other:
        def status(self) -> None: ...

    with pytest.raises(TypeError, match="Other.status is not a method of these shards' class"):
        server.call_all(Other.status, timeout=TIMEOUT)


def test_typed_calls_on_every_shard(server):
    assert server.lost_shards(TIMEOUT) == []
    row = server.shard_status(1, TIMEOUT)
    assert (row["shard"], row["start"], row["stop"], row["version"]) == (1, 5, 10, 0)
    server.push(np.ones(10, np.float32), [0, 0], timeout=TIMEOUT)
    states = server.export_state(TIMEOUT)
    assert [state["version"] for state in states] == [1, 1]
    np.testing.assert_array_equal(states[0]["values"], np.arange(5, dtype=np.float32) - 0.5)
    assert not server.shards[0].poll_warmstart().result(TIMEOUT)[2]
    server.release_warmstart(TIMEOUT)
    assert all(shard.poll_warmstart().result(TIMEOUT)[2] for shard in server.shards)


@pytest.mark.parametrize(
    "error, lost",
    [
        (RuntimeError("Worker holding Actor was lost.  Status: cancelled"), True),
        (RuntimeError("Worker holding Actor was lost"), True),
        (ShardLostError("parameter-server shard 1 was replaced", 1), True),
        (OSError("Unable to contact Actor's worker"), True),
        (CommClosedError("in <TCP (closed)>"), True),
        (ConnectionError("lost the connection to the shard"), True),
        (TimeoutError("no reply from the shard within 5 s"), True),
        (CancelledError(), True),
        (RuntimeError("a bug in a shard method"), False),
        (WireError("parameter-server shard: ValueError: shard 0 owns 5 parameters"), False),
        (ValueError("shard 0 owns 5 parameters, got a gradient of shape (4,)"), False),
        (KeyError("parameterservershard-0-abc"), False),
    ],
)
def test_only_what_a_lost_shard_raises_counts_as_a_lost_shard(error, lost):
    assert is_shard_lost(error) is lost


def test_adagrad_accumulators_live_on_the_shard(client):
    ps = ParameterServer.create(
        client, np.zeros(4, np.float32), 2, optim.adagrad(0.1), timeout=TIMEOUT
    )
    try:
        ps.push(np.array([1, 2, 3, 4], np.float32), [0, 0], timeout=TIMEOUT)
        ps.push(np.array([1, 2, 3, 4], np.float32), [1, 1], timeout=TIMEOUT)
        values, _ = ps.pull(TIMEOUT)
        # step 1: g/sqrt(g^2) = 1 -> -0.1; step 2: g/sqrt(2 g^2) = 1/sqrt(2) -> -0.0707
        np.testing.assert_allclose(values, -0.1 - 0.1 / np.sqrt(2), rtol=1e-5)
    finally:
        ps.close()


def test_the_model_the_shards_publish_is_their_average_for_the_driver_and_watchers(client):
    """With an averaged rule (``ema_decay``) the driver's model pull and a watcher's read
    (``attach(...).params()``, ``watch``) give the average; a replica's pull the values."""
    rule = Averaged(optim.sgd(0.5), 0.5)
    ps = ParameterServer.create(client, np.zeros(4, np.float32), 2, rule, timeout=TIMEOUT)
    try:
        for version in range(2):  # values -0.5 then -1.0: the corrected average is -5/6
            ps.push(np.ones(4, np.float32), [version, version], timeout=TIMEOUT)
        values, _ = ps.pull(TIMEOUT)
        model, versions = ps.pull(TIMEOUT, model=True)
        np.testing.assert_allclose(values, -1.0)
        np.testing.assert_allclose(model, -5 / 6, rtol=1e-6)
        assert versions == [2, 2]
        for shard, (lo, hi) in enumerate(ps.ranges):
            watched = client.submit(live.read_shard, ps.shards[shard].key, True,
                                    workers=[ps.workers[shard]], pure=False)  # fmt: skip
            seen, version = watched.result(timeout=TIMEOUT)
            np.testing.assert_array_equal(seen, model[lo:hi])
            assert version == 2
    finally:
        ps.close()


@pytest.mark.slow  # its own cluster, a worker killed
def test_a_lost_shard_fails_fast_with_an_error_naming_it():
    """SIGKILL the worker holding shard 1: calls fail at once, naming the shard; nothing hangs."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        ps = ParameterServer.create(client, np.zeros(10, np.float32), 2, optim.sgd(0.1))
        pid = client.run(os.getpid, workers=[ps.workers[1]])[ps.workers[1]]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShardLostError, match=r"shard 1 on worker tcp://.* was lost") as caught:
            for _ in range(100):  # the loss is noticed within moments, never a hang
                ps.pull(timeout=5)
                time.sleep(0.05)
        assert caught.value.shard == 1
        assert ps.lost_shards(timeout=5) == [1]
        ps.close()


class QuickOrderShard(ParameterServerShard):
    ORDER_WAIT = 0.3


@pytest.mark.timeout(60)
def test_a_replicas_pushes_are_applied_in_the_order_it_made_them(client):
    shard = ParameterServer.create(
        client, np.zeros(4, np.float32), 1, optim.sgd(1.0), shard_class=QuickOrderShard
    )
    try:
        [actor] = shard.shards
        g = np.ones(4, np.float32)
        second = actor.push(2 * g, 0, 0, seq=1, session="s")  # overtook its predecessor
        time.sleep(0.1)
        assert not second.done()  # it waits for push 0 instead of being applied first
        first = actor.exchange(g, 0, 0, seq=0, session="s")
        reply, pulled = first.result(timeout=TIMEOUT)
        assert reply.version == 1 and pulled.applied_through == 0
        np.testing.assert_array_equal(pulled.values, -g)  # push 0 alone
        assert second.result(timeout=TIMEOUT).version == 2
        # a predecessor that never comes (its sender died) holds a push up only ORDER_WAIT,
        # then it is applied anyway
        assert actor.push(g, 0, 0, seq=5, session="s").result(timeout=TIMEOUT).version == 3
    finally:
        shard.close()
