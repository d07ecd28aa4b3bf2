"""The discrete-event core: Downpour's replica loop and shard queues on a virtual clock.

:func:`run` plays a :class:`~.timing.Setup` under a :class:`~.timing.Timing` with a heap of
timed events and returns a :class:`Trace` of every push and shard message.  Each replica follows
:class:`~downpour_dask.downpour.replica_loop.ReplicaLoop` step for step: it waits for its first
fetch, looks for arrived replies only at the top of a step (installing a fetched slice with its
own pushes the slice lacks counted on top, as ``PushLedger.replay`` does), starts a fetch every
``n_fetch`` steps unless one is in flight, pushes every ``n_push`` steps (an ``exchange`` when
the next fetch is due), waits for its oldest push when ``max_inflight`` are unacknowledged, and
pushes what it accrued when its steps run out.  The first ``Setup.local_replicas`` replicas
share a worker with every shard and call them in-process, as the real loop does: no latency,
transfer or wire CPU (``Timing.wire_fixed``, ``Timing.wire_per_param``), and the replica waits
(in the shards' queue) until its call is served.  A request that crosses the wire is first
decoded by its connection's own thread (one per replica and shard, so a replica's requests are
decoded in order, concurrently with other replicas' and with the in-process calls) and only
then queues for the shard's lock: the queue holds the update and the pull's copy alone, as in
:class:`~downpour_dask.ps.shard.ParameterServerShard`, and the connection threads' CPU counts in
the cores' balance (:meth:`~.timing.Timing.step_scale`), not in the queue.  On one machine a
request pays only :meth:`~.timing.Timing.request_share` of the latency (none when its shards'
worker runs no replica), a reply all of it.  Replicas other than
0 start when the shards' version reaches replica 0's warmstart pushes.  A shard serves messages
first come, first served; its version counts applied pushes and a push's staleness is
``version - base version`` as in
:meth:`~downpour_dask.ps.shard.ParameterServerShard.apply_push`.

Shards are symmetric: equal slices, the same deterministic service times, and every message of a
replica goes to all of them over one FIFO link, so every shard sees the same arrivals at the same
times and one queue stands for all of them (which is what makes 10,000 replicas x 256 shards
cheap).  An :class:`Observer` is told of every step, push, apply, snapshot and install in
virtual-time order; the training mode (:mod:`.training`) uses it to run the real mathematics.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .timing import Setup, Timing

_START, _STEP, _RESUME, _ARRIVE, _END = 0, 1, 2, 3, 4
_PUSH, _PULL, _EXCHANGE = 0, 1, 2


class Observer(Protocol):
    """What the training mode is told, in virtual-time order (all methods may do nothing)."""

    def on_step(self, replica: int, step: int) -> None:
        """Replica computes step ``step``'s gradient and its local update."""

    def on_push(self, replica: int, seq: int) -> None:
        """Replica sends what it accrued as its push ``seq``."""

    def on_apply(self, time: float, replica: int, seq: int, staleness: int) -> None:
        """The shards apply that push (finishing at virtual ``time``)."""

    def on_snapshot(self, replica: int, pull: int) -> None:
        """The shards copy their values for the replica's fetch ``pull``."""

    def on_install(self, replica: int, pull: int, lacking: range) -> None:
        """Replica installs fetch ``pull``; ``lacking`` are its own pushes it does not contain."""


@dataclass
class Trace:
    """Everything that happened in one simulated run (times in virtual seconds).

    Push arrays are indexed in the order the shards applied the pushes.
    """

    setup: Setup
    timing: Timing
    push_replica: np.ndarray
    push_sent: np.ndarray  # when the replica sent it
    push_applied: np.ndarray  # when the shards finished applying it
    push_acked: np.ndarray  # when its acknowledgement reached the replica
    push_staleness: np.ndarray
    push_examples: np.ndarray
    msg_arrival: np.ndarray  # every message a shard served (each shard served the same)
    msg_start: np.ndarray
    msg_end: np.ndarray
    replica_start: np.ndarray
    replica_end: np.ndarray  # when its last push was acknowledged
    events: int  # events processed (a cost measure)


class _Replica:
    __slots__ = (
        "step",
        "accrual",
        "base",
        "version",
        "pull",
        "inflight",
        "fetched",
        "final",
        "blocked",
        "pending_fetch",
        "link_free",
        "local",
        "busy_until",
        "durations",
        "finished",
        "started",
    )

    def __init__(self, durations: np.ndarray, local: bool):
        self.step = self.accrual = self.base = self.version = 0
        self.pull: list | None = None  # [pull id, pushes sent before it, reply time, version]
        self.inflight: deque[int] = deque()  # global push ids not acknowledged yet
        self.fetched = self.final = self.finished = False
        self.blocked = -1  # push id whose acknowledgement the replica waits for
        self.pending_fetch = False  # whether that blocked push is to fetch too
        self.link_free = 0.0  # the link is FIFO: a message arrives after the one before it
        self.durations = durations
        self.started = 0.0
        self.local = local  # on the shards' own worker: calls them in-process
        self.busy_until = 0.0  # when its last in-process call returned


def run(setup: Setup, timing: Timing, seed: int = 0, observer: Observer | None = None) -> Trace:
    """Simulate ``setup`` under ``timing``; deterministic for a given ``seed``.

    Parameters
    ----------
    setup : Setup
    timing : Timing
    seed : int
        Seeds the step-time draws.
    observer : Observer, optional
        Told of every step, push, apply, snapshot and install (the training mode).
    """
    R, steps = setup.n_replicas, setup.steps
    rng = np.random.default_rng(seed)
    local = np.arange(R) < setup.local_replicas
    own = np.where(local, timing.replica_step(setup, True), timing.replica_step(setup, False))
    near, far = timing.scales(setup)
    mean = (own * np.where(local, near, far))[:, None]
    if timing.step_cv > 0:  # a floor every step takes, and a gamma part carrying the spread
        floor = timing.step_floor
        k = ((1.0 - floor) / timing.step_cv) ** 2
        durations = mean * floor + rng.gamma(k, mean * (1.0 - floor) / k, size=(R, steps))
    else:
        durations = np.broadcast_to(mean, (R, steps))
    reps = [_Replica(durations[r], r < setup.local_replicas) for r in range(R)]
    push_s, pull_s = timing.push_service(setup), timing.pull_service(setup)
    service = (push_s, pull_s, push_s + pull_s)  # under the shard's lock, whoever calls
    one, two = timing.wire_cost(setup, 1), timing.wire_cost(setup, 2)
    decode = (one, one, two)  # a wire request's connection thread, before it takes the lock
    transfer, latency = timing.transfer(setup), timing.link_latency(setup)
    request = timing.transfer(setup, request=True)
    gate = -(-setup.warmstart_steps // setup.n_push) if R > 1 and setup.warmstart_steps else 0
    n_fetch, n_push, max_inflight = setup.n_fetch, setup.n_push, setup.max_inflight
    obs = observer

    heap: list = []
    counter = 0
    p_rep: list[int] = []  # per global push id (in sending order)
    p_seq: list[int] = []
    p_base: list[int] = []
    p_sent: list[float] = []
    p_ack: list[float] = []  # reply arrival at the replica; -1 until served
    p_examples: list[int] = []
    applied: list[tuple[int, float, int]] = []  # (push id, end, staleness) in service order
    m_arr: list[float] = []
    m_start: list[float] = []
    m_end: list[float] = []
    next_seq = [0] * R
    shard = {"free": 0.0, "version": 0, "pulls": 0, "released": 0}
    events = 0

    def schedule(t: float, kind: int, r: int, payload: tuple = ()) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (t, counter, kind, r, payload))

    def send(t: float, r: int, kind: int, pid: int, pull: int) -> None:
        rep = reps[r]
        if rep.local:  # an in-process call: served now (after the queue), the replica waits
            rep.busy_until = arrive(t, r, kind, pid, pull)
            return
        # the link and its connection thread are FIFO: a request is decoded after the one
        # before it, then waits for the shard's lock
        arrival = max(t + request, rep.link_free) + decode[kind]
        rep.link_free = arrival
        schedule(arrival, _ARRIVE, r, (kind, pid, pull))

    def start_fetch(t: float, r: int, rep: _Replica) -> None:
        pull = shard["pulls"]
        shard["pulls"] += 1
        rep.pull = [pull, next_seq[r], -1.0, 0]
        send(t, r, _PULL, -1, pull)

    def poll(t: float, r: int, rep: _Replica) -> None:
        pull = rep.pull
        if pull is not None and 0 <= pull[2] <= t:
            lacking = range(pull[1], next_seq[r])
            rep.version = pull[3] + len(lacking)
            if obs is not None:
                obs.on_install(r, pull[0], lacking)
            rep.pull = None
        inflight = rep.inflight
        while inflight and 0 <= p_ack[inflight[0]] <= t:
            inflight.popleft()

    def push(t: float, r: int, rep: _Replica, fetch: bool) -> bool:
        """Send the accrual (False: blocked on the oldest push's acknowledgement)."""
        inflight = rep.inflight
        while len(inflight) >= max_inflight:
            ack = p_ack[inflight[0]]
            if ack < 0 or ack > t:
                rep.blocked, rep.pending_fetch = inflight[0], fetch
                if ack > t:
                    schedule(ack, _RESUME, r)
                return False
            inflight.popleft()
        rep.blocked = -1
        pid, seq = len(p_rep), next_seq[r]
        next_seq[r] += 1
        p_rep.append(r)
        p_seq.append(seq)
        p_base.append(rep.base)
        p_sent.append(t)
        p_ack.append(-1.0)
        p_examples.append(rep.accrual * setup.batch_size)
        if obs is not None:
            obs.on_push(r, seq)
        inflight.append(pid)
        rep.accrual = 0
        if fetch and rep.pull is None:
            pull = shard["pulls"]
            shard["pulls"] += 1
            rep.pull = [pull, seq + 1, -1.0, 0]  # the exchange's pull contains this push
            send(t, r, _EXCHANGE, pid, pull)
        else:
            send(t, r, _PUSH, pid, -1)
        return True

    def after_push(t: float, r: int, rep: _Replica) -> None:
        if rep.final:
            rep.finished = True
        else:
            rep.step += 1
            step(t, r, rep, False)

    def end(t: float, r: int, rep: _Replica) -> bool:
        """A step's gradient is complete: push if due (False: blocked, or done)."""
        s = rep.step
        if (s + 1) % n_push == 0:
            fetch = (s + 1) % n_fetch == 0
            rep.fetched = fetch
            if not push(t, r, rep, fetch):
                return False
        rep.step += 1
        return True

    def step(t: float, r: int, rep: _Replica, popped: bool) -> None:
        """Top of the loop at ``t``: stop, or poll, fetch if due, compute, and push if due.

        Steps run inline while no other event comes first; otherwise the replica goes back on
        the heap, so everything before ``t`` (an arriving reply) has happened when it polls."""
        nonlocal events
        while True:
            if not popped and heap and heap[0][0] <= t:
                schedule(t, _STEP, r)
                return
            popped = False
            events += 1
            if rep.step >= steps:
                if rep.accrual and not rep.final:
                    rep.final = True
                    if push(t, r, rep, False):
                        rep.finished = True
                else:
                    rep.finished = True
                return
            poll(t, r, rep)
            s = rep.step
            if s % n_fetch == 0 and s > 0 and not rep.fetched and rep.pull is None:
                start_fetch(t, r, rep)
                t = max(t, rep.busy_until)
            rep.fetched = False
            if rep.accrual == 0:
                rep.base = rep.version
            if obs is not None:
                obs.on_step(r, s)
            t += rep.durations[s]
            rep.accrual += 1
            if heap and heap[0][0] <= t:
                schedule(t, _END, r)
                return
            if not end(t, r, rep):
                return
            t = max(t, rep.busy_until)

    def release(t: float) -> None:
        """Let the replicas waiting for the warmstart go (once)."""
        if shard["released"]:
            return
        shard["released"] = 1
        for other in range(1, R):
            schedule(t, _START, other)

    def arrive(t: float, r: int, kind: int, pid: int, pull: int) -> float:
        """Serve a message arriving at ``t``; return when the shards are done with it."""
        rep = reps[r]
        begin = max(t, shard["free"])
        end = begin + service[kind]
        shard["free"] = end
        m_arr.append(t)
        m_start.append(begin)
        m_end.append(end)
        back, fetched = (0.0, 0.0) if rep.local else (latency, transfer)
        if kind != _PULL:
            staleness = max(0, shard["version"] - p_base[pid])
            shard["version"] += 1
            applied.append((pid, end, staleness))
            if obs is not None:
                obs.on_apply(end, r, p_seq[pid], staleness)
            p_ack[pid] = end + back
            if rep.blocked == pid:
                schedule(end + back, _RESUME, r)
            if gate and shard["version"] == gate:
                release(end + back)
        if kind != _PUSH:
            if obs is not None:
                obs.on_snapshot(r, pull)
            rep.pull[2] = end + fetched
            rep.pull[3] = shard["version"]
            if rep.step == 0 and rep.accrual == 0 and kind == _PULL and not rep.finished:
                schedule(end + fetched, _STEP, r)  # the first fetch: step 0 may begin
        return end

    schedule(0.0, _START, 0)
    if not gate:
        for r in range(1, R):
            schedule(0.0, _START, r)
    while heap:
        t, _, kind, r, payload = heapq.heappop(heap)
        events += 1
        rep = reps[r]
        if kind == _ARRIVE:
            arrive(t, r, *payload)
        elif kind == _STEP:
            step(t, r, rep, True)
        elif kind == _END:
            if end(t, r, rep):
                step(max(t, rep.busy_until), r, rep, False)
        elif kind == _RESUME:
            if push(t, r, rep, rep.pending_fetch):
                after_push(max(t, rep.busy_until), r, rep)
        else:  # _START
            rep.started = t
            start_fetch(t, r, rep)
        if gate and reps[0].finished and not shard["released"]:
            release(t)  # replica 0 ran out of steps before the warmstart's end (as the driver)

    order = [a[0] for a in applied]
    ack = np.asarray(p_ack)
    ends = np.zeros(R)
    if p_rep:
        np.maximum.at(ends, np.asarray(p_rep, dtype=np.int64), ack)
    return Trace(
        setup=setup,
        timing=timing,
        push_replica=np.asarray(p_rep, dtype=np.int64)[order],
        push_sent=np.asarray(p_sent)[order],
        push_applied=np.asarray([a[1] for a in applied]),
        push_acked=ack[order],
        push_staleness=np.asarray([a[2] for a in applied], dtype=np.int64),
        push_examples=np.asarray(p_examples, dtype=np.int64)[order],
        msg_arrival=np.asarray(m_arr),
        msg_start=np.asarray(m_start),
        msg_end=np.asarray(m_end),
        replica_start=np.asarray([rep.started for rep in reps]),
        replica_end=ends,
        events=events,
    )
