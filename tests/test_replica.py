"""The replica loop, in-process: real shard objects behind fake channels, no cluster.

``FakeChannel`` satisfies :class:`~downpour_dask.ps.protocol.ShardChannel` with a real
:class:`~downpour_dask.ps.shard.ParameterServerShard` called in this thread.  Its calls are
either answered at once or *held* -- not delivered to the shard until the loop waits for them --
which is how a slow network reorders a replica's fetches and pushes.  The loop over real
channels and a real cluster is pinned in test_downpour.py, test_wire.py and test_failures.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from downpour_dask import models, optim
from downpour_dask.downpour.pushes import Push, PushLedger
from downpour_dask.downpour.replica import ReplicaConfig
from downpour_dask.downpour.replica_loop import ReplicaLoop
from downpour_dask.ps.channel import Done
from downpour_dask.ps.protocol import PullReply, ShardLostError
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.runtime import cpus

LR = 0.1


class Held:
    """A call the shard has not received yet: delivered when the loop waits for it."""

    def __init__(self, channel, deliver):
        self.channel, self.deliver = channel, deliver
        self.outcome = self.error = None
        self.delivered = False

    def done(self):
        return self.delivered

    def result(self, timeout=None):
        if not self.delivered:
            raise TimeoutError("held")
        if self.error is not None:
            raise self.error
        return self.outcome


class Half:
    def __init__(self, call, index):
        self.call, self.index = call, index

    def done(self):
        return self.call.done()

    def result(self, timeout=None):
        return self.call.result(timeout)[self.index]


class FakeChannel:
    """A ShardChannel over an in-process shard; ``hold_pushes`` delays pushes (and exchanges)
    until the loop waits for them, in the order they were sent."""

    transport = "fake"
    shared = False
    in_process = False

    def __init__(self, shard, replica=0, hold_pushes=False):
        self.shard_object, self.replica, self.hold_pushes = shard, replica, hold_pushes
        self.shard = shard.shard_id
        self.generation = 0
        self.key = "shard-0"
        self.session = "session-0"
        self.base = self.next_seq = 0
        self.queue: list[Held] = []  # held calls, oldest first
        self.polls = 0
        self.switches = 0
        self.most_held = 0  # the most pushes held at once
        self.replacement = None  # the shard switch() moves to
        self.dead = False  # lost, and not switched yet: calls fail
        self.on_push = None  # hook(channel, seq) called as each push is sent

    # -- the calls -------------------------------------------------------------------------------
    def pull(self, avoid=None):
        return Done(self.shard_object.snapshot(self.replica, self.session))

    def _apply(self, grad, version, seq, examples, loss):
        self.next_seq = seq + 1
        if self.on_push is not None:
            self.on_push(self, seq)
        kw = dict(seq=seq - self.base, session=self.session, examples=examples, loss=loss)
        grad = grad.copy()  # as a message would carry it
        return lambda: self.shard_object.apply_push(grad, version, self.replica, **kw)

    def _hold(self, deliver):
        call = Held(self, deliver)
        if self.dead:
            call.error, call.delivered = ShardLostError("a dead shard", self.shard), True
            return call
        self.queue.append(call)
        self.most_held = max(self.most_held, len(self.queue))
        return call

    def push(self, grad, fetched_version, seq, examples, loss):
        apply = self._apply(grad, fetched_version, seq, examples, loss)
        return self._hold(apply) if self.hold_pushes else Done(apply())

    def exchange(self, grad, fetched_version, seq, examples, loss, avoid=None, into=None):
        apply = self._apply(grad, fetched_version, seq, examples, loss)
        self.into = getattr(self, "into", []) + [into is not None]

        def both():
            if into is not None and self.in_process:  # as DaskShardChannel's local transport
                return apply(), self.shard_object.snapshot_into(into, self.replica, self.session)
            return apply(), self.shard_object.snapshot(self.replica, self.session)

        call = self._hold(both) if self.hold_pushes else Done(both())
        return Half(call, 0), Half(call, 1)

    def poll_warmstart(self):
        self.polls += 1
        return Done(self.shard_object.warmstart_state())

    def includes(self, reply, seq):
        seq -= self.base
        return seq <= reply.applied_through or seq in reply.applied_ahead

    # -- waiting and losing the shard ------------------------------------------------------------
    def replaced(self, key, sent):
        return key != self.key

    def wait(self, call, key, sent):
        if key != self.key:
            raise ShardLostError(f"shard {self.shard} was replaced", self.shard)
        if isinstance(call, Half):
            return self.wait(call.call, key, sent)[call.index]
        if isinstance(call, Held) and not call.delivered:
            while self.queue:  # the connection delivers in order
                first = self.queue.pop(0)
                first.outcome, first.delivered = first.deliver(), True
                if first is call:
                    break
        if isinstance(call, Held) and call.error is not None:
            raise call.error
        return call.result()

    def lose(self):
        """The shard's worker died: every call it has not answered fails."""
        error = ShardLostError(f"shard {self.shard} was lost", self.shard)
        for call in self.queue:
            call.error, call.delivered = error, True
        self.queue = []
        self.dead = True

    def switch(self, lost_key, error):
        if lost_key != self.key:
            return False
        self.switches += 1
        self.shard_object, self.dead = self.replacement, False
        self.generation += 1
        self.key, self.session = f"shard-{self.generation}", f"session-{self.generation}"
        self.base = self.next_seq
        return True

    def close(self):
        pass


class Sink:
    def __init__(self):
        self.rows, self.fetched = [], []

    def keep_row(self, row):
        self.rows.append(row)

    def keep_fetched(self, shard, key, version, values):
        self.fetched.append((shard, key, version))
        return True

    def keep_acked(self, shard, key, version):
        pass

    def abandoned(self):
        return False


class Batches:
    """A data source: the same fixed minibatches every epoch."""

    def __init__(self, batches):
        self.batches = batches

    def epoch(self, rng):
        yield from self.batches


def data(n_batches=12, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(batch, 5)).astype(np.float32), rng.integers(0, 3, batch))
        for _ in range(n_batches)
    ]


def shards_for(initial, n_shards, rule=None):
    bounds = np.linspace(0, initial.size, n_shards + 1).astype(int)
    return [
        ParameterServerShard(i, lo, hi, initial[lo:hi], rule or optim.sgd(LR))
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]


def config(**kw):
    settings = dict(
        replica=0, batch_size=8, n_fetch=1, n_push=1, local_learning_rate=LR, seed=0, t0=0.0
    )
    return ReplicaConfig(**{**settings, **kw})


def run(model, shards, batches, cfg, **channel_kw):
    channels = [FakeChannel(shard, **channel_kw) for shard in shards]
    ranges = [(shard.start, shard.stop) for shard in shards]
    sink = Sink()
    result = ReplicaLoop(channels, ranges, model, cfg, sink).run(Batches(batches))
    return result, channels, sink


def serial_sgd(model, params, batches, epochs=1):
    params = params.copy()
    for _ in range(epochs):
        for Xb, yb in batches:
            params -= np.float32(LR) * model.loss_and_grad(params, Xb, yb)[1]
    return params


def server_values(shards):
    return np.concatenate([shard.values for shard in shards])


MODEL = models.SoftmaxRegression(5, 3)
INITIAL = MODEL.init(np.random.default_rng(1))


@pytest.mark.parametrize("n_shards", [1, 2])
def test_one_replica_with_plain_sgd_equals_serial_sgd(n_shards):
    batches = data()
    shards = shards_for(INITIAL, n_shards)
    result, _, sink = run(MODEL, shards, batches, config(max_epochs=2))
    expected = serial_sgd(MODEL, INITIAL, batches, epochs=2)
    assert result["steps"] == 2 * len(batches) and len(sink.rows) == 2 * len(batches)
    assert np.abs(expected - INITIAL).max() > 0.05  # it did train
    np.testing.assert_allclose(server_values(shards), expected, rtol=0, atol=2e-6)


class CountingLoop(ReplicaLoop):
    """Counts the parameters each local step updates (not the installs' re-application of
    the accrued gradient)."""

    descended, stepping = 0, False

    def _step_locally(self, g, exchanging):
        self.stepping = True
        super()._step_locally(g, exchanging)
        self.stepping = False

    def _descend(self, target, grad):
        self.descended += target.size if self.stepping else 0
        super()._descend(target, grad)


@pytest.mark.parametrize(
    ("n_fetch", "n_push", "local"), [(1, 1, 1), (2, 2, 1), (2, 1, 1), (1, 3, 1), (1, 1, 2)]
)
def test_in_process_shards_skip_the_local_step_their_exchange_overwrites(n_fetch, n_push, local):
    """A step whose push exchanges with a shard in the replica's process leaves that shard's
    slice alone (the fetch, copied straight into the slice, overwrites it before the next
    step): one pass over the vector less, and the same training as serial SGD."""
    batches = data()
    shards = shards_for(INITIAL, 2)
    channels = [FakeChannel(shard) for shard in shards]
    for channel in channels[:local]:  # shard 0 (or both) in the replica's process, others remote
        channel.in_process = True
    ranges = [(shard.start, shard.stop) for shard in shards]
    cfg = config(max_steps=len(batches), n_fetch=n_fetch, n_push=n_push)
    loop = CountingLoop(channels, ranges, MODEL, cfg, Sink())
    loop.run(Batches(batches))
    expected = serial_sgd(MODEL, INITIAL, batches)
    np.testing.assert_allclose(server_values(shards), expected, rtol=0, atol=2e-6)
    exchanges = sum(
        1 for step in range(1, len(batches) + 1) if step % n_push == step % n_fetch == 0
    )
    skipped = exchanges * sum(shard.stop - shard.start for shard in shards[:local])
    assert loop.descended == len(batches) * INITIAL.size - skipped
    # and their fetches are copied straight into the slices (a remote shard's into a buffer)
    assert all(channel.into == [True] * exchanges for channel in channels[:local])
    assert not any(getattr(channels[-1], "into", [])) or local == 2


def test_a_fetch_lacking_the_replicas_own_pushes_gets_each_replayed_exactly_once():
    """Pushes held back while fetches arrive: every fetch lacks the replica's latest pushes.
    Re-applying each missing push once (not zero times, not twice) keeps the replica's copy,
    and so its gradients, exactly those of serial SGD."""
    batches = data()
    shards = shards_for(INITIAL, 2)
    result, channels, _ = run(
        MODEL, shards, batches, config(max_steps=len(batches), max_inflight=3), hold_pushes=True
    )
    assert all(channel.most_held == 3 for channel in channels)  # fetches did overtake pushes
    assert result["lost_pushes"] == 0
    expected = serial_sgd(MODEL, INITIAL, batches)
    np.testing.assert_allclose(server_values(shards), expected, rtol=0, atol=2e-6)


def test_replay_applies_only_the_pushes_a_fetch_lacks():
    ledger = PushLedger(2)
    shard = ParameterServerShard(0, 0, 2, np.zeros(2, np.float32), optim.sgd(LR))
    channel = FakeChannel(shard)
    for seq in range(4):
        ledger.add(Push(seq, seq, np.full(2, 10.0**seq, np.float32), [], 0.0, 1, False, {0}))
    # the shard's values contain pushes 0 and 2 (2 overtook 1 on the network), not 1 and 3
    reply = PullReply(np.zeros(2, np.float32), 2, False, 0, (2,))
    local = np.zeros(2, np.float32)
    replayed = ledger.replay(0, channel, reply, local, (0, 2), 1.0)
    assert replayed == 2
    np.testing.assert_array_equal(local, -(10.0 + 1000.0))
    assert [p.needed_by for p in ledger.pending] == [set(), {0}, set(), {0}]


def test_max_inflight_bounds_the_pushes_not_yet_acknowledged():
    batches = data(n_batches=10)
    for max_inflight in (1, 2, 5):
        shards = shards_for(INITIAL, 1)
        result, [channel], sink = run(
            MODEL, shards, batches, config(max_steps=10, max_inflight=max_inflight),
            hold_pushes=True,
        )  # fmt: skip
        assert channel.most_held == max_inflight
        assert len(sink.rows) == 10 and shards[0].version == 10


def test_a_pinned_replica_lets_its_helper_threads_run_once_a_step(monkeypatch):
    """Batch helper threads never preempt a pinned replica: it yields at the top of every
    step, so replies and sends they hold wait a step at most, not a time slice."""
    yields = []
    monkeypatch.setattr(cpus.os, "sched_yield", lambda: yields.append(1))
    try:
        cpus.helpers_as_batch(True)  # what pinning the worker does
        result, _, _ = run(MODEL, shards_for(INITIAL, 2), data(n_batches=7), config(max_steps=7))
    finally:
        cpus.helpers_as_batch(False)
    assert result["steps"] == 7 and len(yields) == 7


def test_switching_to_a_replacement_shard_counts_the_pushes_the_lost_one_took():
    """The shard is lost with 3 unacknowledged pushes; the replica moves to the replacement,
    under a new session numbering its pushes from 0, and goes on."""
    batches = data(n_batches=10)
    [shard] = shards_for(INITIAL, 1)
    replacement = ParameterServerShard(0, 0, INITIAL.size, INITIAL, optim.sgd(LR))
    channel = FakeChannel(shard, hold_pushes=True)
    channel.replacement = replacement

    def lose_at_push_3(ch, seq):
        if seq == 3:
            ch.lose()  # takes pushes 1 and 2 along; push 3 is sent to the dead shard

    channel.on_push = lose_at_push_3
    sink = Sink()
    cfg = config(max_steps=10, max_inflight=3)
    result = ReplicaLoop([channel], [(0, INITIAL.size)], MODEL, cfg, sink).run(Batches(batches))
    assert channel.switches == 1
    assert result["lost_pushes"] == 3
    assert [row.accepted for row in sink.rows] == [True, False, False, False] + [True] * 6
    assert replacement.version == 6  # pushes 4..9
    pulled = replacement.snapshot(0, "session-1")
    assert pulled.applied_through == 5 and pulled.applied_ahead == ()


def test_the_stop_flag_ends_the_loop():
    batches = data(n_batches=50)
    [shard] = shards_for(INITIAL, 1)
    channel = FakeChannel(shard)

    def stop_at_push_4(ch, seq):
        if seq == 4:
            ch.shard_object.stopped = True

    channel.on_push = stop_at_push_4
    sink = Sink()
    result = ReplicaLoop([channel], [(0, INITIAL.size)], MODEL, config(max_epochs=1), sink).run(
        Batches(batches)
    )
    # push 4's reply carries the flag; the replica finishes the step during which it reads it
    assert result["steps"] == 6
    assert len(sink.rows) == 6


def test_push_rows_report_staleness_version_and_a_refused_non_finite_gradient():
    """With n_fetch=3 a replica pushes three times from one fetch: the shard has applied 0, 1,
    then 2 updates since that fetch.  A minibatch of NaN gives a non-finite gradient, which
    the shard refuses, leaving its version; its row says so."""
    batches = data(n_batches=9)
    batches[7] = (np.full_like(batches[7][0], np.nan), batches[7][1])
    [shard] = shards_for(INITIAL, 1)
    result, _, sink = run(MODEL, [shard], batches, config(max_epochs=1, n_fetch=3))
    rows = sink.rows
    assert [row.step for row in rows] == list(range(9))
    # the refused push 7 is not an update: push 8 is one update behind its fetch, not two
    assert [row.staleness for row in rows] == [0, 1, 2, 0, 1, 2, 0, 1, 1]
    assert [row.version for row in rows] == [1, 2, 3, 4, 5, 6, 7, 7, 8]
    assert [row.accepted for row in rows] == [True] * 7 + [False, True]
    assert all(row.examples == 8 and row.replica == 0 and row.partition == 0 for row in rows)
    assert np.isnan(rows[7].loss) and np.isfinite(rows[8].loss)
    assert shard.refused == 1
    assert result["pushes"] == rows


def test_a_replica_waits_at_the_warmstart_gate_until_released():
    [shard] = shards_for(INITIAL, 1)
    channel = FakeChannel(shard)
    real_poll = channel.poll_warmstart

    def poll():
        if channel.polls == 3:
            shard.released = True  # the driver's call
        return real_poll()

    channel.poll_warmstart = poll
    loop = ReplicaLoop([channel], [(0, INITIAL.size)], MODEL, config(max_steps=2,
                       start_after_version=5), Sink())  # fmt: skip
    loop.WARMSTART_POLL = 0.0
    result = loop.run(Batches(data(n_batches=2)))
    assert channel.polls == 4 and result["steps"] == 2


def test_a_replica_passes_the_warmstart_gate_once_every_shard_reached_the_version():
    shards = shards_for(INITIAL, 2)
    for shard in shards:
        shard.version = 5
    result, channels, _ = run(MODEL, shards, data(n_batches=2), config(
        max_steps=2, start_after_version=5))  # fmt: skip
    assert [channel.polls for channel in channels] == [1, 1] and result["steps"] == 2


def test_a_stopped_run_ends_a_replica_waiting_at_the_warmstart_gate_without_a_step():
    [shard] = shards_for(INITIAL, 1)
    shard.stopped = True
    result, _, sink = run(MODEL, [shard], data(), config(max_steps=5, start_after_version=5))
    assert result["steps"] == 0 and sink.rows == [] and shard.version == 0


def test_a_replica_its_driver_let_go_stops_waiting_at_the_warmstart_gate():
    """The shards never reach the version and never say stop (the driver's stop did not
    arrive): the replica stops once its task is cancelled, without a step or a push."""
    [shard] = shards_for(INITIAL, 1)
    channel = FakeChannel(shard)

    class LetGo(Sink):
        def abandoned(self):
            return channel.polls >= 3  # the driver cancels the task while it waits

    loop = ReplicaLoop([channel], [(0, INITIAL.size)], MODEL, config(max_steps=5,
                       start_after_version=5), LetGo())  # fmt: skip
    loop.WARMSTART_POLL = 0.0
    result = loop.run(Batches(data(n_batches=2)))
    assert channel.polls == 3 and result["steps"] == 0 and shard.version == 0


class NoScaleMLP(models.MLP):
    """A user's model whose loss_and_grad takes no ``scale=``: the replicas never ask for it."""

    def loss_and_grad(self, params, X, y, out=None):
        return super().loss_and_grad(params, X, y, out)


def test_a_model_without_scale_trains_like_serial_sgd():
    model = NoScaleMLP(5, (4,), 3)
    initial = model.init(np.random.default_rng(2))
    batches = data()
    shards = shards_for(initial, 2)
    run(model, shards, batches, config(max_epochs=1))
    expected = serial_sgd(model, initial, batches)
    np.testing.assert_allclose(server_values(shards), expected, rtol=0, atol=2e-6)
