"""The fencing look-ups on the watch thread (ps/replacement_watch.py), with a channel in-process.

A channel must refuse its replaced shard's reply as it did when it read the replacements
variable itself, with the reads made off the replica's thread; a look older than
``CHECK_EVERY`` (the process was stopped) or taken before the channel moved to a new actor must
not be trusted; and the thread must end when the channels close.  The driver's variables are
fakes here; the real ones are read on a cluster in test_failures.py's shard-recovery tests.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_channel import SIZE, ActorStub, Replacement, make_shard

from downpour_dask import optim
from downpour_dask.ps import channel as channel_module
from downpour_dask.ps import replacement_watch
from downpour_dask.ps.channel import DaskShardChannel
from downpour_dask.ps.protocol import FencedError, ShardLostError
from downpour_dask.ps.replacement_watch import Look, watch_thread
from downpour_dask.ps.shard import ParameterServerShard


class Driver:
    """The two variables a driver publishes a shard's current actor and generation in; records
    which threads read them."""

    def __init__(self, actor):
        self.actor, self.generation, self.readers = actor, 0, set()

    def published(self, name, timeout):
        self.readers.add(threading.current_thread().name)
        return Replacement(self.actor)

    def published_generation(self, name, timeout=1.0):
        self.readers.add(threading.current_thread().name)
        return self.generation


@pytest.fixture
def driver(monkeypatch):
    driver = Driver(ActorStub(make_shard(), "shard-a"))
    for module in (replacement_watch, channel_module):
        monkeypatch.setattr(module, "published", driver.published)
        monkeypatch.setattr(module, "published_generation", driver.published_generation)
    return driver


def successor():
    """Generation 1 of the shard, in this process."""
    shard = ParameterServerShard(
        0, 0, SIZE, np.zeros(SIZE, np.float32), optim.sgd(1.0), generation=1
    )
    return ActorStub(shard, "shard-b")


def until(condition, what):
    deadline = time.monotonic() + 30.0
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def watched_channel(actor, check_every=60.0):
    channel = DaskShardChannel(actor, 0, SIZE, 0, 5.0, replacements="run-shard-0", direct=False)
    channel.CHECK_EVERY = check_every  # any look since attaching is recent enough
    return channel


def no_watch_thread():
    return watch_thread() is None and not any(
        t.name == "downpour-replacement-watch" for t in threading.enumerate()
    )


def test_the_watch_thread_learns_of_a_replacement_and_the_old_shards_reply_is_refused(driver):
    channel = watched_channel(driver.actor)
    try:
        until(lambda: channel._watch.latest is not None, "the watch thread made no look")
        assert channel.wait(channel.pull(), "shard-a", 0.0).version == 0
        driver.generation, driver.actor = 1, successor()
        until(lambda: channel._watch.latest.key == "shard-b", "the replacement was not seen")
        with pytest.raises(FencedError, match="generation 1 replaced it"):
            channel.wait(channel.pull(), "shard-a", 0.0)
        assert channel.generation == 1
        assert driver.readers == {"downpour-replacement-watch"}  # never the replica's thread
    finally:
        channel.close()
    until(no_watch_thread, "the watch thread outlived the channel")


def test_a_look_older_than_check_every_is_not_trusted_the_channel_reads_itself(driver):
    # the replica's process was stopped: the thread's last look is as old as the stop
    channel = watched_channel(driver.actor, check_every=1.0)
    replacement_watch.unwatch(channel._watch)  # no new looks
    channel._watch.latest = Look(time.monotonic() - 5.0, "shard-a", 0)
    channel._checked -= 5.0
    driver.generation, driver.actor = 1, successor()
    try:
        with pytest.raises(FencedError, match="generation 1 replaced it"):
            channel.wait(channel.pull(), "shard-a", 0.0)
        assert threading.current_thread().name in driver.readers
    finally:
        channel.close()


def test_a_look_from_before_a_switch_does_not_fence_the_replacement(driver):
    channel = watched_channel(driver.actor)
    try:
        driver.generation, driver.actor = 1, successor()
        assert channel.switch("shard-a", ShardLostError("lost", 0))
        channel._watch.latest = Look(channel._attached - 0.1, "shard-a", 0)  # a look in flight
        assert channel.wait(channel.pull(), "shard-b", 0.0).version == 0
        until(lambda: channel._watch.latest.key == "shard-b", "no look after the switch")
        assert channel.wait(channel.pull(), "shard-b", 0.0).version == 0
    finally:
        channel.close()


def test_one_watch_thread_serves_all_channels_and_ends_with_the_last(driver):
    channels = [watched_channel(driver.actor) for _ in range(3)]
    until(lambda: all(c._watch.latest is not None for c in channels), "a channel not looked at")
    assert sum(t.name == "downpour-replacement-watch" for t in threading.enumerate()) == 1
    for channel in channels[:-1]:
        channel.close()
    assert watch_thread() is not None and watch_thread().is_alive()
    channels[-1].close()
    until(no_watch_thread, "the watch thread outlived the channels")
