"""One-sided pushes (ps/one_sided.py, ps/one_sided_host.py, ps/shard_body.py), in process.

The replica's side maps the shard's body through ``/proc/self/fd`` here: its own open file, so
its ``flock`` excludes the shard's as another process's would.  The wire it falls back on is a
fake that calls the shard directly and records what went by it.  A child process holds the lock
where a stopped or killed holder matters.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import signal
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

from downpour_dask import optim
from downpour_dask.core.compensation import DelayCompensated
from downpour_dask.ps.calls import Done
from downpour_dask.ps.one_sided import OneSidedShard
from downpour_dask.ps.protocol import FencedError
from downpour_dask.ps.shard import ParameterServerShard
from downpour_dask.ps.shard_body import DIRTY, IN_PROGRESS, LEDGERS, REVOKED, ShardLock

SIZE = 1000


class FakeWire:
    """The shard over "the wire": its methods called directly, each call recorded."""

    _broken = None

    def __init__(self, shard: ParameterServerShard):
        self.shard, self.calls = shard, []

    def push(self, grad, fetched_version, replica, **kw):
        self.calls.append(("push", kw.get("seq")))
        return Done(self.shard.apply_push(grad, fetched_version, replica, **kw))

    def pull(self, replica, session, out):
        self.calls.append(("pull", None))
        return Done(self.shard.snapshot_into(out, replica, session))

    def poll_warmstart(self):
        self.calls.append(("poll", None))
        return Done(self.shard.warmstart_state())


def _shard(rule: str = "adagrad", **kw) -> ParameterServerShard:
    values = np.linspace(-1, 1, SIZE, dtype=np.float32)
    built = DelayCompensated(optim.make("sgd", 0.1)) if rule == "dc-sgd" else optim.make(rule, 0.1)
    return ParameterServerShard(0, 0, SIZE, values, built, **kw)


def _line(shard: ParameterServerShard, replica: int = 1) -> tuple[OneSidedShard, FakeWire, str]:
    session = uuid.uuid4().hex
    offer = asyncio.run(shard.open_one_sided(replica, session))
    wire = FakeWire(shard)
    line = OneSidedShard.open(offer, wire)
    assert line is not None
    return line, wire, session


def _grads(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(n)]


def _push(line, grad, seq, session, fetched=0, replica=1, examples=32, loss=1.0):
    call = line.push(grad, fetched, replica, seq=seq, session=session, examples=examples, loss=loss)
    return call.result(5)


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_one_sided_pushes_leave_the_shard_as_the_same_pushes_applied_by_the_shard(rule):
    reference, shard = _shard(rule), _shard(rule)
    line, wire, session = _line(shard)
    for seq, grad in enumerate(_grads(20)):
        reference.apply_push(grad, seq // 2, 1, seq=seq, session=session, examples=32, loss=1.0)
        reply = _push(line, grad, seq, session, fetched=seq // 2)
        assert reply.accepted and reply.version == seq + 1
    assert not wire.calls, "every push was one-sided"
    np.testing.assert_array_equal(shard.values, reference.values)
    for name in reference.state:
        np.testing.assert_array_equal(shard.state[name], reference.state[name])
    mine, theirs = shard.counters(), reference.counters()
    for key in ("version", "accepted", "examples", "staleness_mean", "staleness_max",
                "accepted_by_replica", "sessions", "recent_loss"):  # fmt: skip
        assert mine[key] == theirs[key], key


def test_the_shard_counts_one_sided_pushes_in_its_checkpoints_clocks_and_duplicates():
    shard = _shard()
    line, _, session = _line(shard, replica=3)
    for seq, grad in enumerate(_grads(5)):
        _push(line, grad, seq, session)
    saved = asyncio.run(shard.export_state())
    assert saved["version"] == 5
    assert saved["counters"]["accepted_by_replica"] == {"3": 5}
    assert saved["counters"]["clock_pushes"] == {"3": 5}
    assert shard.clock_state(3, 4)[0] == 5
    # the same push again over the wire (a retry) is a duplicate: the shard knows it was applied
    again = shard.apply_push(_grads(1)[0], 0, 3, seq=4, session=session)
    assert not again.accepted and shard.counters()["duplicates"] == 1
    pulled = shard.snapshot(3, session)
    assert pulled.applied_through == 4


def test_a_non_finite_push_goes_to_the_shard_which_refuses_it_and_later_pushes_keep_their_order():
    shard = _shard()
    line, wire, session = _line(shard)
    good = _grads(3)
    _push(line, good[0], 0, session)
    bad = good[1].copy()
    bad[7] = np.nan
    refused = _push(line, bad, 1, session)
    assert not refused.accepted
    assert wire.calls == [("push", 1)]
    assert _push(line, good[2], 2, session).accepted
    assert wire.calls == [("push", 1)], "back to one-sided once the wire's push was answered"
    counters = shard.counters()
    assert (counters["version"], counters["refused"]) == (2, 1)
    (event,) = asyncio.run(shard.events())
    assert event[1] == "gradient_refused"
    assert line.pull(1, session, np.empty(SIZE, np.float32)).result(5).applied_through == 2


def test_a_push_that_would_overflow_the_rule_state_is_refused_by_the_shard_with_shared_bounds():
    shard = _shard("adagrad")
    line, wire, session = _line(shard)
    _push(line, _grads(1)[0], 0, session)
    huge = np.full(SIZE, 3e19, np.float32)  # its square overflows Adagrad's sums of squares
    assert not _push(line, huge, 1, session).accepted
    assert wire.calls == [("push", 1)]
    assert np.isfinite(shard.state["sum_sq"]).all() and shard.version == 1


def test_a_retired_shard_fences_one_sided_calls_and_the_stop_flag_reaches_the_replica():
    shard = _shard()
    line, _, session = _line(shard)
    asyncio.run(shard.request_stop())
    assert _push(line, _grads(1)[0], 0, session).stop
    asyncio.run(shard.retire(1))
    with pytest.raises(FencedError):
        _push(line, _grads(1)[0], 1, session)
    with pytest.raises(FencedError):
        line.pull(1, session, np.empty(SIZE, np.float32)).result(5)
    assert shard.version == 1


def test_pushes_from_the_shard_and_a_one_sided_replica_at_once_are_each_applied_once():
    shard = _shard("sgd")
    line, wire, session = _line(shard)
    grads, start = _grads(400), shard.values.copy()

    def local() -> None:
        for seq, grad in enumerate(grads[:200]):
            shard.apply_push(grad, 0, 0, seq=seq, session="local")

    thread = threading.Thread(target=local)
    thread.start()
    for seq, grad in enumerate(grads[200:]):
        _push(line, grad, seq, session)
    thread.join(30)
    assert not wire.calls
    counters = shard.counters()
    assert counters["version"] == 400
    assert counters["accepted_by_replica"] == {0: 200, 1: 200}
    expected = start - np.float32(0.1) * np.sum(grads, axis=0, dtype=np.float64)
    np.testing.assert_allclose(shard.values, expected, atol=1e-3)


def test_a_push_cut_short_by_a_dead_process_counts_once_and_is_reported():
    shard = _shard()
    line, wire, session = _line(shard, replica=2)
    _push(line, _grads(1)[0], 0, session, replica=2)
    line.row[IN_PROGRESS], line.body.head[DIRTY] = 1, line.ledger  # as a killed process leaves it
    assert _push(line, _grads(1)[0], 2, session, replica=2).accepted  # the shard settles it first
    assert wire.calls == [("push", 2)]
    assert shard.version == 3 and shard.counters()["accepted_by_replica"] == {2: 3}
    kinds = [event[1] for event in asyncio.run(shard.events())]
    assert kinds == ["torn_push"]


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def _holder(line: OneSidedShard) -> subprocess.Popen:
    """A child process holding the shard's lock, as a replica's process in a push would."""
    path = f"/proc/{os.getpid()}/fd/{line.body.fd}"
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.mark.timeout(60)
def test_a_holder_stopped_with_the_lock_makes_the_shard_take_its_state_back(monkeypatch):
    monkeypatch.setattr(ShardLock, "lease", 0.3)
    shard = _shard()
    line, wire, session = _line(shard)
    _push(line, _grads(1)[0], 0, session)
    before = shard.values.copy()
    child = _holder(line)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        reply = _push(line, _grads(1)[0], 1, session)  # waits WAIT, then the wire: the lease
        assert reply.accepted and wire.calls == [("push", 1)]
        assert [event[1] for event in asyncio.run(shard.events())] == ["one_sided_revoked"]
        assert shard.version == 2 and not np.array_equal(shard.values, before)
        _push(line, _grads(1)[0], 2, session)
        assert wire.calls[-1] == ("push", 2) and not line.usable
        assert asyncio.run(shard.open_one_sided(1, uuid.uuid4().hex)) is None
    finally:
        child.kill()
        os.kill(child.pid, signal.SIGCONT)
        child.wait(10)
    assert line.body.head[REVOKED] == 1


@pytest.mark.timeout(60)
def test_a_holder_killed_with_the_lock_lets_go_of_it_at_once():
    shard = _shard()
    line, wire, session = _line(shard)
    child = _holder(line)
    child.kill()
    child.wait(10)
    assert _push(line, _grads(1)[0], 0, session).accepted
    assert not wire.calls and line.usable
    assert asyncio.run(shard.events()) == []


def test_a_shard_that_cannot_take_one_sided_pushes_offers_none(monkeypatch):
    assert asyncio.run(_shard("dc-sgd").open_one_sided(0, "s")) is None
    monkeypatch.setenv("DOWNPOUR_DASK_ONE_SIDED", "0")
    assert asyncio.run(_shard().open_one_sided(0, "s")) is None


def test_an_offer_that_does_not_hold_its_token_is_not_mapped():
    shard = _shard()
    offer = asyncio.run(shard.open_one_sided(0, "s"))
    assert OneSidedShard.open({**offer, "token": b"x" * 16}, None) is None
    assert OneSidedShard.open({**offer, "pid": 2**22 + 17}, None) is None


@pytest.mark.timeout(60)
def test_a_replica_that_held_the_lock_when_the_shard_took_its_state_back_does_not_apply_its_push(
    monkeypatch,
):
    """The replica took the lock, then (stopped) kept it past the lease: when it goes on, it
    sees the body revoked before it changes anything, and its push goes over the wire."""
    monkeypatch.setattr(ShardLock, "lease", 0.2)
    shard = _shard()
    line, wire, session = _line(shard)
    _push(line, _grads(1)[0], 0, session)
    assert line._enter()
    waiting = threading.Thread(target=shard.counters)  # waits out the lease, then takes back
    waiting.start()
    waiting.join(30)
    grad = _grads(1, seed=1)[0]
    assert line._apply(grad, None, 0, 1, False, {}) is None
    line._leave()
    assert shard.version == 1 and not line.usable
    assert [event[1] for event in asyncio.run(shard.events())] == ["one_sided_revoked"]
    assert _push(line, grad, 1, session).accepted and wire.calls == [("push", 1)]
    assert shard.version == 2


def test_an_exchange_pushes_then_pulls_the_result_in_one_call():
    shard = _shard("sgd")
    line, wire, session = _line(shard)
    out = np.empty(SIZE, np.float32)
    call = line.exchange(
        _grads(1)[0], 0, 1, seq=0, session=session, examples=1, loss=1.0, out=out
    )
    pushed, pulled = call.result(5)
    assert pushed.accepted and (pulled.version, pulled.applied_through) == (1, 0)
    np.testing.assert_array_equal(out, shard.values)
    assert not wire.calls


def test_a_closed_sessions_ledger_is_counted_in_full_then_given_to_a_new_session():
    shard = _shard()
    lines = [_line(shard, replica=r % 4) for r in range(LEDGERS)]  # every ledger taken
    for line, _, session in lines[:2]:
        for seq, grad in enumerate(_grads(3)):
            _push(line, grad, seq, session)
    closed = lines[0][0]
    ledger = closed.ledger
    closed.close()  # its pushes are not folded in yet: the shard has not taken its lock since
    offer = asyncio.run(shard.open_one_sided(7, uuid.uuid4().hex))
    assert offer is not None and offer["ledger"] == ledger  # the closed session's ledger
    counters = shard.counters()
    assert counters["accepted"] == 6 and shard.version == 6  # both sessions counted in full
    assert counters["accepted_by_replica"][0] == 3 and counters["accepted_by_replica"][1] == 3
    assert asyncio.run(shard.open_one_sided(8, uuid.uuid4().hex)) is None  # the open ones stay
    for line, _, _ in lines[1:]:
        line.close()


_PUSHER = """
import base64, pickle, sys, time
import numpy as np
from downpour_dask.ps.one_sided import OneSidedShard

class NoWire:
    _broken = False

offer, session = pickle.loads(base64.b64decode(sys.stdin.readline()))
line = OneSidedShard.open(offer, NoWire())
rng = np.random.default_rng(1)
for seq in range(3):
    grad = rng.standard_normal(line.body.values.size).astype(np.float32)
    call = line.push(grad, 0, 2, seq=seq, session=session, examples=32, loss=1.0)
    assert call.result(5).accepted
print("pushed", flush=True)
time.sleep(60)
"""


@pytest.mark.slow  # a child process, stopped and killed
@pytest.mark.timeout(60)
def test_the_ledger_of_a_killed_replica_process_is_counted_and_freed_when_ledgers_run_out():
    """A replica's process killed mid-session never closes its ledger.  Once every ledger is
    taken, the shard frees those whose process is gone (after counting their pushes in full);
    a stopped process keeps its ledger, as it may still write there."""
    shard = _shard()
    child = subprocess.Popen(
        [sys.executable, "-c", _PUSHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        session = uuid.uuid4().hex
        offer = asyncio.run(shard.open_one_sided(2, session, child.pid))
        child.stdin.write(base64.b64encode(pickle.dumps((offer, session))).decode() + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "pushed"
        mine = os.getpid()
        for _ in range(LEDGERS - 1):  # every ledger taken
            assert asyncio.run(shard.open_one_sided(0, uuid.uuid4().hex, mine)) is not None
        os.kill(child.pid, signal.SIGSTOP)
        assert asyncio.run(shard.open_one_sided(5, uuid.uuid4().hex, mine)) is None  # stopped
        child.kill()
        os.kill(child.pid, signal.SIGCONT)
        child.wait(10)
        new = asyncio.run(shard.open_one_sided(5, uuid.uuid4().hex, mine))
    finally:
        child.kill()
        child.wait(10)
    assert new is not None and new["ledger"] == offer["ledger"]  # the killed process's ledger
    counters = shard.counters()
    assert counters["accepted_by_replica"] == {2: 3} and shard.version == 3  # counted in full
    kinds = [event[1] for event in asyncio.run(shard.events())]
    assert kinds == ["one_sided_refused", "one_sided_freed"]
    assert asyncio.run(shard.open_one_sided(6, uuid.uuid4().hex, mine)) is None  # the live stay


def test_a_shard_whose_ledgers_are_all_taken_sends_a_new_session_over_the_wire_and_says_so():
    shard = _shard()
    offers = [asyncio.run(shard.open_one_sided(0, uuid.uuid4().hex)) for _ in range(LEDGERS)]
    assert all(offer is not None for offer in offers)
    assert len({offer["ledger"] for offer in offers}) == LEDGERS
    assert asyncio.run(shard.open_one_sided(5, uuid.uuid4().hex)) is None
    ((_, kind, _, data),) = asyncio.run(shard.events())
    assert kind == "one_sided_refused" and data == {"replica": 5}
