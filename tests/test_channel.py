"""DaskShardChannel in-process: a real shard behind a stand-in actor handle, reached through
the handle's calls (the "actor" transport) or a real direct connection (the "wire" one).

Both transports must give the replica the same answers; a lost shard must be recognised (and
a bug must not be); the replacement must be talked to under a new session numbering pushes
from 0.  The "local" transport and the replacements variable need a worker: they are pinned
on a cluster in test_downpour.py, test_wire.py and test_failures.py.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from downpour_dask import optim
from downpour_dask.ps import wire
from downpour_dask.ps.channel import DaskShardChannel, Done
from downpour_dask.ps.clock import finish_clock, poll_clock
from downpour_dask.ps.protocol import LOST_ACTOR, FencedError, PushReply, ShardLostError
from downpour_dask.ps.shard import ParameterServerShard

SIZE = 6


class Unanswered:
    def done(self):
        return False

    def result(self, timeout=None):
        raise TimeoutError("no answer")


class ActorStub:
    """What the channel uses of a shard actor handle, answered by a shard in this process."""

    def __init__(self, shard, key, lost=False):
        self.shard, self.key, self.lost = shard, key, lost

    def _answer(self, compute):
        if self.lost:  # what Dask's handle raises once the actor's task is gone
            raise RuntimeError(f"{LOST_ACTOR}.  Status: cancelled")
        return Done(compute())

    def open_wire(self):
        return self._answer(lambda: wire.serve(self.shard, "127.0.0.1"))

    def pull(self, replica, session):
        return self._answer(lambda: self.shard.snapshot(replica, session))

    def push(self, grad, version, replica, **kw):
        return self._answer(lambda: self.shard.apply_push(grad.copy(), version, replica, **kw))

    def exchange(self, grad, version, replica, **kw):
        def both():
            pushed = self.shard.apply_push(grad.copy(), version, replica, **kw)
            return pushed, self.shard.snapshot(replica, kw["session"])

        return self._answer(both)

    def poll_warmstart(self):
        return self._answer(self.shard.warmstart_state)


class Replacement:
    """The future the driver publishes for a replaced shard."""

    def __init__(self, actor):
        self.key, self.actor = actor.key, actor

    def result(self, timeout=None):
        return self.actor


def make_shard():
    return ParameterServerShard(0, 0, SIZE, np.zeros(SIZE, np.float32), optim.sgd(1.0))


def open_channel(actor, direct):
    channel = DaskShardChannel(actor, 0, SIZE, 0, timeout=5.0, replacements=None, direct=direct)
    channel.connect(channel.ask_endpoint(), 0.0)
    return channel


def drive(channel):
    """A replica's calls: two pushes, an exchange, a pull, a warmstart poll."""
    key, g = channel.key, np.ones(SIZE, np.float32)
    pushed = [channel.wait(channel.push(g, 0, seq, 8, 0.5), key, 0.0) for seq in (0, 1)]
    halves = channel.exchange(2 * g, 2, 2, 8, 0.5)
    exchanged, after = (channel.wait(half, key, 0.0) for half in halves)
    pulled = channel.wait(channel.pull(), key, 0.0)
    polled = channel.wait(channel.poll_warmstart(), key, 0.0)
    return pushed, exchanged, after, pulled, polled


@pytest.mark.parametrize("direct, transport", [(False, "actor"), (True, "wire")])
def test_both_transports_give_the_replica_the_same_answers(direct, transport):
    shard = make_shard()
    channel = open_channel(ActorStub(shard, "shard-a"), direct)
    try:
        assert channel.transport == transport and not channel.in_process
        pushed, exchanged, after, pulled, polled = drive(channel)
        assert [(r.version, r.staleness) for r in pushed] == [(1, 0), (2, 1)]
        assert (exchanged.version, exchanged.staleness) == (3, 0)  # fetched at version 2
        assert all(r.accepted for r in (*pushed, exchanged))
        np.testing.assert_array_equal(after.values, np.full(SIZE, -4.0, np.float32))
        assert pulled.version == 3 and pulled.applied_through == 2
        assert all(channel.includes(pulled, seq) for seq in (0, 1, 2))
        assert not channel.includes(pulled, 3)
        assert polled == (3, False, False)
    finally:
        channel.close()


def test_a_direct_pull_never_lands_in_the_buffer_the_caller_still_holds():
    channel = open_channel(ActorStub(make_shard(), "shard-a"), direct=True)
    try:
        held = channel.wait(channel.pull(), channel.key, 0.0).values
        fresh = channel.wait(channel.pull(avoid=held), channel.key, 0.0).values
        again = channel.wait(channel.pull(avoid=fresh), channel.key, 0.0).values
        assert fresh is not held and again is held  # two buffers, reused in turn
    finally:
        channel.close()


def test_a_lost_actor_fails_its_calls_as_a_lost_shard_and_a_bug_as_itself():
    channel = open_channel(ActorStub(make_shard(), "shard-a"), direct=False)
    with pytest.raises(ValueError, match="owns 6 parameters"):  # a bug: raised as it is
        channel.wait(channel.push(np.ones(SIZE - 1, np.float32), 0, 0, 1, 0.0), "shard-a", 0.0)
    channel.actor.lost = True
    call = channel.pull()  # the handle refuses at once; the call fails when waited for
    with pytest.raises(ShardLostError, match="shard 0 was lost: Worker holding Actor") as caught:
        channel.wait(call, "shard-a", 0.0)
    assert caught.value.shard == 0


class LostActorHandle:
    """Dask's handle of an actor whose worker was lost: it refuses even a method's lookup."""

    key = "shard-a"

    def __getattr__(self, name):
        raise RuntimeError(f"{LOST_ACTOR}.  Status: error")


def test_a_handle_that_refuses_the_lookup_fails_a_clock_call_as_a_lost_shard():
    """SSP's and BSP's clock calls (``ps/clock``) once failed the replica with Dask's
    RuntimeError, raised by the lookup before the call could be made."""
    channel = open_channel(ActorStub(make_shard(), "shard-a"), direct=False)
    channel.actor = LostActorHandle()
    for call in (poll_clock(channel, 2), finish_clock(channel, "run")):
        with pytest.raises(ShardLostError, match="shard 0 was lost: Worker holding Actor"):
            channel.wait(call, "shard-a", 0.0)


def test_a_call_to_a_shard_replaced_meanwhile_fails_as_lost():
    channel = open_channel(ActorStub(make_shard(), "shard-a"), direct=False)
    with pytest.raises(ShardLostError, match="was replaced"):
        channel.wait(Unanswered(), "shard-before", 0.0)


def test_switching_talks_to_the_replacement_under_a_new_session_numbering_pushes_from_0():
    old, new = make_shard(), make_shard()
    channel = open_channel(ActorStub(old, "shard-a"), direct=True)
    try:
        g = np.ones(SIZE, np.float32)
        for seq in range(3):
            channel.wait(channel.push(g, 0, seq, 1, 0.0), "shard-a", 0.0)
        session = channel.session
        replacement = ActorStub(new, "shard-b")
        channel._published = lambda timeout: Replacement(replacement)  # the driver's variable
        channel.replacements = "downpour-run-shard-0"
        assert channel.switch("shard-a", ShardLostError("lost", 0))
        assert not channel.switch("shard-a", ShardLostError("lost", 0))  # already moved
        assert channel.key == "shard-b" and channel.session != session
        assert channel.transport == "wire"  # a new direct connection, to the new shard
        reply = channel.wait(channel.exchange(g, 0, 3, 1, 0.0)[1], "shard-b", 0.0)
        assert reply.applied_through == 0  # the replica's push 3 is the new session's push 0
        assert channel.includes(reply, 3) and not channel.includes(reply, 4)
    finally:
        channel.close()


def test_without_a_replacement_to_wait_for_a_lost_shard_is_final():
    channel = open_channel(ActorStub(make_shard(), "shard-a"), direct=False)
    with pytest.raises(ShardLostError, match="no replacement appeared"):
        channel.switch("shard-a", ShardLostError("lost", 0))


@pytest.mark.parametrize("direct", [False, True])
def test_a_retired_shard_changes_nothing_whatever_carries_the_call(direct):
    """Fencing: once a newer generation retired the shard, a push over the actor transport or
    a direct connection fails as a lost shard would (the replica switches) and is not applied."""
    shard = make_shard()
    channel = open_channel(ActorStub(shard, "shard-a"), direct)
    try:
        assert channel.transport == ("wire" if direct else "actor")
        g = np.ones(SIZE, np.float32)
        assert channel.wait(channel.push(g, 0, 0, 1, 0.0), "shard-a", 0.0).accepted
        asyncio.run(shard.retire(1))
        with pytest.raises(ShardLostError):
            channel.wait(channel.push(g, 1, 1, 1, 0.0), "shard-a", 0.0)
        assert shard.version == 1 and shard.fenced_calls <= 1
    finally:
        channel.close()


def test_a_reply_from_an_older_generation_is_refused():
    """A channel that knows of generation 1 refuses what generation 0 answers (the old copy
    could not be retired: its worker was stopped when the replacement started)."""
    channel = DaskShardChannel(
        ActorStub(make_shard(), "shard-a"), 0, SIZE, 0, timeout=5.0, direct=False, generation=1
    )
    with pytest.raises(FencedError, match="generation 0 was refused"):
        channel.wait(channel.pull(), "shard-a", 0.0)


class FrozenThenAnswered:
    """A call waited on by a process that is stopped (SIGSTOP) for 1.5 s, then answered."""

    def __init__(self):
        self.looks = 0

    def done(self):
        return self.looks >= 2

    def result(self, timeout=None):
        self.looks += 1
        if self.looks == 1:
            time.sleep(1.5)  # the whole process stands still: the shard is not to blame
            raise TimeoutError("no answer")
        return PushReply(1, 0, True, False)


def test_time_the_replicas_own_process_was_stopped_does_not_count_against_the_shard():
    channel = DaskShardChannel(ActorStub(make_shard(), "shard-a"), 0, SIZE, 0, 1.0, direct=False)
    channel.FROZEN = 0.2
    assert channel.wait(FrozenThenAnswered(), "shard-a", 0.0).version == 1


class EndedFitChannel(DaskShardChannel):
    """A channel whose fit has ended: the replacements variable is gone, and a read of it blocks
    for its whole timeout (what ``distributed.Variable.get`` does for a missing variable)."""

    looks = 0

    def _published(self, timeout):
        self.looks += 1
        # a look and a wait for the call take >= 1.2 s: a 3 s deadline sees at most 3 looks
        assert self.looks <= 3, "the blocked looks were taken for a stopped process"
        time.sleep(timeout)
        return None


class WaitedUnanswered(Unanswered):
    """A call nobody answers, waited for as long as asked each time."""

    def result(self, timeout=None):
        time.sleep(timeout)
        raise TimeoutError("no answer")


def test_a_slow_look_for_a_replacement_is_not_taken_for_a_stopped_process():
    # an interrupted fit left a replica waiting on a call its deleted shard never answers: the
    # wait must end at its timeout, not extend it by every blocked look as if it were a freeze
    channel = EndedFitChannel(
        ActorStub(make_shard(), "shard-a"), 0, SIZE, 0, 3.0, replacements="gone", direct=False
    )
    channel.FROZEN, channel.CHECK_EVERY = 0.7, 0.0  # longer than one 0.5 s wait for the call
    with pytest.raises(ShardLostError, match="did not answer within 3.0 s"):
        channel.wait(WaitedUnanswered(), "shard-a", 0.0)
    assert channel.looks >= 1
