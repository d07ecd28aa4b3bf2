"""Model-parallel replicas on Dask: the P partitions of one replica as P tasks on P workers.

Each partition of a replica (see :mod:`downpour_dask.core.partition` for the neuron split) runs
the ordinary Downpour replica loop (:class:`~.replica_loop.ReplicaLoop`: fetch every n_fetch
steps, local alpha updates, push every n_push steps, all asynchronous) over *its own* parameter
range, talking only to the parameter-server shards that hold that range.  What it cannot compute
alone -- the activations and gradients that cross partition boundaries -- travels through
**mailboxes**: one small actor per partition, on the partition's worker.  A partition sends a
message straight into the receiver's mailbox over a direct socket
(:mod:`.partition_wire`: raw array bytes, no event loop on either side) and reads its own
mailbox in-process, without any message.  Where the direct socket cannot be used (a TLS
cluster, or a connection that fails), messages are actor calls into the mailbox instead,
served on the receiving worker's event loop.

Partitions step in lockstep (each step's collectives wait for the peers), so they must agree on
when to stop: a shard's stop flag reaches the partitions at different steps, so each partition's
wish to stop rides with the step's logits and all of them stop after the same step.

When a partition's worker dies, its peers would wait forever; the driver closes their mailboxes
(:meth:`Mailbox.close`), which makes them fail with :class:`PartitionAborted`, and restarts the
whole replica.  A peer that stops answering for ``timeout`` seconds, or a
message that cannot be delivered, fails the partition with :class:`PartitionLost`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
from distributed import secede

from ..core.models import Model
from ..core.partition import PartitionPlan
from ..core.partition_part import MLPPart
from ..data.stream import StreamSpec, make_source
from ..ps.frames import WireError
from ..ps.protocol import ShardChannel
from ..ps.refs import ActorRef
from ..ps.server import ParameterServer
from ..ps.service import serve, unregister
from ..runtime.cluster import worker_tcp_host
from ..runtime.dask_internals import actor_result, local_actor
from ..runtime.malloc import tune_malloc
from ..runtime.xla_threads import size_xla_pools
from .config import ReplicaSink
from .partition_wire import PartitionLinkError, PartitionSender, receive_messages
from .replica import run_loop
from .replica_loop import ReplicaConfig, ReplicaLoop


class PartitionLost(RuntimeError):
    """A peer partition of the same replica stopped answering (its worker probably died)."""


class PartitionAborted(RuntimeError):
    """The driver closed this partition's mailbox: its replica is being restarted."""


class Mailbox:
    """A Dask actor receiving the messages sent to one partition of one replica.

    Peers send over a direct socket to :meth:`endpoint` (see :mod:`.partition_wire`), or call
    :meth:`put` (async: served on the worker's event loop as soon as the message arrives, not
    queued behind other actors' work); the partition on the same worker calls :meth:`take`
    directly on the object, blocking its own thread only.

    Parameters
    ----------
    secret : bytes
        The run's wire secret: a direct connection must carry it.  Empty: no direct socket.
    partitions : int
        How many partitions the replica has (a message's sender is checked against it).
    limit : int
        The most values one message may carry (checked before it is read).
    """

    def __init__(self, secret: bytes = b"", partitions: int = 0, limit: int = 0) -> None:
        self._box: dict[tuple[int, int], Any] = {}
        self._cond = threading.Condition()
        self._closed: str | None = None
        self._partitions, self._limit = partitions, limit
        self._dropped: str | None = None  # why a direct connection was given up
        host = worker_tcp_host()
        self._endpoint = None
        if secret and host is not None and partitions > 1 and limit > 0:
            with contextlib.suppress(OSError):  # no socket to be had: peers use put()
                self._endpoint = serve(self, host, secret, handler=Mailbox._serve_connection)

    async def endpoint(self) -> tuple[str, int, str] | None:
        """Where peers reach this mailbox directly, ``(host, port, id)``, or None (no direct
        socket: TLS or another comm, or no secret), in which case they call :meth:`put`."""
        return self._endpoint

    async def put(self, sender: int, tag: int, payload: Any) -> None:
        """Deliver ``payload`` from partition ``sender`` under ``tag``."""
        self._deliver(sender, tag, payload)

    async def close(self, reason: str) -> None:
        """Make every present and future :meth:`take` fail with :class:`PartitionAborted`, and
        close the direct connections."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()
        if self._endpoint is not None:
            unregister(self._endpoint[2])

    def _deliver(self, sender: int, tag: int, payload: Any) -> None:
        with self._cond:
            self._box[(sender, tag)] = payload
            self._cond.notify_all()

    def _serve_connection(self, conn: Any) -> None:
        """Serve one peer's direct connection (on the service's thread for it).  A stream given
        up (a bad head, a message cut off) lost messages: a :meth:`take` that finds its message
        missing then fails at once, naming why."""
        try:
            problem = receive_messages(conn, self._deliver, self._partitions, self._limit)
        except Exception as err:  # the connection broke (its peer died or closed mid-message)
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            with self._cond:
                self._dropped = self._dropped or problem
                self._cond.notify_all()

    def take(self, sender: int, tag: int, timeout: float) -> Any:
        """Wait (at most ``timeout`` seconds) for the message from ``sender`` under ``tag``.

        Raises
        ------
        PartitionAborted
            If the mailbox was closed.
        PartitionLost
            If nothing arrived in time, or a direct connection lost messages.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed is not None:
                    raise PartitionAborted(self._closed)
                if (sender, tag) in self._box:
                    return self._box.pop((sender, tag))
                if self._dropped:
                    raise PartitionLost(
                        f"message {tag} from partition {sender} will not come: a direct "
                        f"connection into this mailbox was dropped ({self._dropped})"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PartitionLost(
                        f"partition {sender} sent nothing for {timeout} s (message {tag}); "
                        f"its worker probably died"
                    )
                self._cond.wait(min(remaining, 1.0))


class MailboxLink:
    """A :class:`~downpour_dask.core.partition.Link` into the peers' mailboxes.

    A message to a peer in ``senders`` goes over that direct connection (a broken one fails the
    partition with :class:`PartitionLost`).  To any other peer it is an asynchronous actor call;
    the replies are checked later (every call, without blocking) so that an undeliverable
    message fails the partition instead of vanishing, and at most ``max_inflight`` sends may be
    unanswered, which bounds the memory held by messages.
    """

    #: Send over direct sockets where the peers' mailboxes offer one (False: actor calls only,
    #: kept for benchmarks/bench_model_parallel.py's A/B).
    direct: bool = True

    def __init__(
        self,
        partition: int,
        mailboxes: list,
        own: Mailbox,
        timeout: float,
        max_inflight: int = 16,
        senders: dict[int, PartitionSender] | None = None,
    ):
        self.partition, self.mailboxes, self.own = partition, mailboxes, own
        self.timeout, self.max_inflight = timeout, max_inflight
        self.senders = senders or {}
        self.bytes_sent = 0
        self.waited = 0.0  # seconds receive() was blocked waiting for a peer's message
        self._inflight: list[tuple[int, Any]] = []

    def transports(self) -> dict[str, str]:
        """How this partition reaches each peer: ``"wire"`` (direct socket) or ``"actor"``."""
        return {
            str(q): "wire" if q in self.senders else "actor"
            for q in range(len(self.mailboxes))
            if q != self.partition
        }

    def send(self, to: int, tag: int, payload: Any) -> None:
        self.bytes_sent += _nbytes(payload)
        sender = self.senders.get(to)
        if sender is not None:
            try:
                sender.send(tag, payload)
            except PartitionLinkError as err:
                raise PartitionLost(f"cannot send to partition {to}: {err}") from err
            return
        self._settle(wait=len(self._inflight) >= self.max_inflight)
        try:
            call = self.mailboxes[to].put(self.partition, tag, payload)
        except (RuntimeError, OSError) as err:
            raise PartitionLost(f"cannot send to partition {to}: {err}") from err
        self._inflight.append((to, call))

    def receive(self, sender: int, tag: int) -> Any:
        self._settle(wait=False)
        started = time.perf_counter()
        try:
            return self.own.take(sender, tag, self.timeout)
        finally:
            self.waited += time.perf_counter() - started

    def _settle(self, wait: bool) -> None:
        """Drop answered sends (raising if one failed); with ``wait``, wait for the oldest."""
        keep = []
        for i, (to, call) in enumerate(self._inflight):
            if call.done() or (wait and i == 0):
                try:
                    actor_result(call, self.timeout)
                except Exception as err:  # the receiver's worker is gone or did not answer
                    raise PartitionLost(f"a message to partition {to} was lost: {err!r}") from err
            else:
                keep.append((to, call))
        self._inflight = keep

    def flush(self) -> None:
        """Wait until every message sent was delivered (over a direct socket: written)."""
        while self._inflight:
            self._settle(wait=True)
        for to, sender in self.senders.items():
            try:
                sender.flush()
            except PartitionLinkError as err:
                raise PartitionLost(f"a message to partition {to} was lost: {err}") from err

    def close(self) -> None:
        """Close the direct connections (the peers' readers end)."""
        for sender in self.senders.values():
            sender.close()


def open_senders(
    partition: int, mailboxes: list, secret: bytes, timeout: float
) -> dict[int, PartitionSender]:
    """Direct connections to the peers' mailboxes that offer one (the others get actor calls).

    A peer whose mailbox has no endpoint, or whose connection fails, is left out: its messages
    then travel as actor calls, which work wherever the actor does.
    """
    senders: dict[int, PartitionSender] = {}
    if not secret or not MailboxLink.direct:
        return senders
    for q, mailbox in enumerate(mailboxes):
        if q == partition:
            continue
        endpoint = actor_result(mailbox.endpoint(), timeout)
        if endpoint is None:
            continue
        with contextlib.suppress(OSError, WireError):
            senders[q] = PartitionSender(endpoint, partition, secret, timeout, min(10.0, timeout))
    return senders


def _nbytes(payload: Any) -> int:
    if isinstance(payload, np.ndarray):
        return payload.nbytes
    if isinstance(payload, tuple):
        return sum(_nbytes(p) for p in payload)
    return 8


class PartitionLoop(ReplicaLoop):
    """The replica loop of one partition: stops only when all partitions agree to."""

    def __init__(
        self,
        channels: list[ShardChannel],
        ranges: list[tuple[int, int]],
        part: MLPPart,
        config: ReplicaConfig,
        sink: ReplicaSink,
    ):
        super().__init__(channels, ranges, part, config, sink)
        part.vote = lambda: self.stop

    def _done(self, step: int, epochs: int) -> bool:
        return self.model.agreed_stop or self._limit_reached(step, epochs)


class Peers:
    """The mailboxes of one replica's partitions, as one opaque task argument of (key, worker
    address) pairs.

    Not actor handles: Dask treats handles found in a task's list arguments as the task's
    dependencies and fails the task ("Worker holding Actor was lost") as soon as any of them is
    lost, and a handle made in the driver keeps its actor alive (see
    :class:`~downpour_dask.ps.refs.ActorRef`).  A partition whose peer died learns it from its
    own calls and reports :class:`PartitionLost`.
    """

    def __init__(self, mailboxes: list[tuple[str, str]]):
        self.mailboxes = [ActorRef(Mailbox, address, key) for key, address in mailboxes]

    def open(self) -> list:
        """Actor handles of the mailboxes (call it in the partition's task)."""
        return [ref.open() for ref in self.mailboxes]


def local_mailbox(mailbox: Any) -> Mailbox:
    """The mailbox object of actor handle ``mailbox``, which must live in this worker."""
    found = local_actor(mailbox.key)
    if not isinstance(found, Mailbox):
        raise RuntimeError(
            f"the mailbox {mailbox.key} of this partition is not on this worker; "
            f"a partition task must run where its mailbox was created"
        )
    return found


def run_partition(
    server: ParameterServer,
    model: Model,
    partitions: int,
    peers: Peers,
    data: tuple[np.ndarray, np.ndarray] | StreamSpec,
    config: ReplicaConfig,
    parts: list | tuple = (),
) -> dict[str, Any]:
    """Dask task entry point: run partition ``config.partition`` of replica ``config.replica``.

    ``server`` is the view over this partition's own shards only
    (:meth:`~downpour_dask.ps.server.ParameterServer.subset`); ``peers`` holds the mailboxes of
    every partition of the replica, this one's on this worker; ``data`` is the replica's
    data, which every partition reads in the same order.
    """
    secede()  # a partition runs for the whole fit; it must not hold a task slot
    tune_malloc()
    size_xla_pools()
    cpu = time.thread_time()
    plan = PartitionPlan(model, partitions)
    p = config.partition
    mailboxes = peers.open()
    own = local_mailbox(mailboxes[p])
    senders = open_senders(p, mailboxes, config.wire_secret, config.timeout)
    link = MailboxLink(p, mailboxes, own, config.timeout, senders=senders)
    try:
        part = MLPPart(plan, p, link)
        source = make_source(data, config.batch_size, parts)
        result = run_loop(server, part, config, source, loop_class=PartitionLoop)
        with contextlib.suppress(PartitionLost):  # the peers got what they needed; may be done
            link.flush()
    finally:
        link.close()
    result["partition_transports"] = link.transports()
    result["bytes_sent"] = link.bytes_sent
    result["values_sent"] = part.values_sent
    result["waited_seconds"] = link.waited  # for benchmarks: where a partition's time goes
    result["cpu_seconds"] = time.thread_time() - cpu
    return result


def partition_workers(first: str, partitions: int, workers: list[str]) -> list[str]:
    """Workers for the ``partitions`` partitions of a replica whose partition 0 (the one next
    to its data) runs on ``first``: the next workers in ``workers``' order, so the partitions
    of a replica are on distinct workers whenever there are enough."""
    start = workers.index(first) if first in workers else 0
    return [workers[(start + p) % len(workers)] for p in range(partitions)]
