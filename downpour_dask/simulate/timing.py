"""What the simulator needs to know about a run: its shape (:class:`Setup`) and its costs
(:class:`Timing`).

A :class:`Setup` is the part of a :class:`~downpour_dask.DownpourSGD` configuration that decides
*when* things happen: replicas, shards, the parameter count, ``n_fetch``, ``n_push``,
``max_inflight``, ``warmstart_steps`` and how many steps each replica takes.  A :class:`Timing`
holds the costs, in seconds: a replica's compute time per step (a mean, a coefficient of
variation and a floor every step takes, the rest gamma distributed) plus its CPU per request it
sends to a shard, a shard's service time per push and per pull (a fixed part plus a part per
parameter of its slice), the shard's CPU per request that crosses the wire (decoding it and
encoding the reply in its connection's thread: a fixed part plus a part per parameter
carried), and every link's latency and bandwidth.  When
replicas and shards share a machine's cores (``Timing.cores``), the shards' CPU counts against
the replicas' too (:meth:`Timing.step_scale`; with one shard on a local cluster, against the
replicas on the shard's own worker: :meth:`Timing.scales`).  Both are plain dataclasses that
round-trip through JSON (:meth:`Timing.to_dict`), so calibrated timings are saved next to the
run they came from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

#: Bytes per parameter on the wire (float32).
BYTES_PER_PARAM = 4


def _check(name: str, value: float, low: float = 0.0, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or value < low or (math.isinf(value) and not allow_inf):
        inf = " (inf allowed)" if allow_inf else ""
        raise ValueError(f"{name} must be a finite number >= {low:g}{inf}, got {value!r}")


@dataclass(frozen=True)
class Setup:
    """The shape of a simulated Downpour run (the same meanings as :class:`DownpourSGD`'s).

    Parameters
    ----------
    n_replicas, n_shards : int
    n_params : int
        Length of the flat parameter vector; each shard owns about ``n_params / n_shards``.
    batch_size : int
        Examples per step (only for examples/s).
    n_fetch, n_push, max_inflight : int
        As in the replica loop (:mod:`downpour_dask.downpour.replica_loop`).
    steps : int
        Steps each replica takes (``max_steps``).
    warmstart_steps : int
        Steps replica 0 takes alone before the others start.
    local_replicas : int
        How many replicas (the first ones) run on a worker holding every shard and so call the
        shards in-process (a local cluster with one shard); 0 on a real cluster.
    local_shards : int
        How many shards each of the other replicas reaches in-process (on a local cluster a
        replica's worker holds some of the shards).  Only counted when the replicas share one
        machine (``Timing.cores`` set): on machines of their own every link is a wire.
    """

    n_replicas: int = 1
    n_shards: int = 1
    n_params: int = 7850
    batch_size: int = 32
    n_fetch: int = 1
    n_push: int = 1
    max_inflight: int = 4
    steps: int = 100
    warmstart_steps: int = 0
    local_replicas: int = 0
    local_shards: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in ("warmstart_steps", "local_replicas", "local_shards") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Setup.{f.name} must be an int >= {low}, got {value!r}")

    @property
    def slice_params(self) -> float:
        """Parameters per shard (the mean slice: shards differ by at most one)."""
        return self.n_params / self.n_shards

    @property
    def requests_per_step(self) -> float:
        """Requests a replica sends each shard per step: a push every ``n_push`` steps, a fetch
        every ``n_fetch``, one ``exchange`` when both are due."""
        both = 1.0 / math.lcm(self.n_push, self.n_fetch)
        return 1.0 / self.n_push + 1.0 / self.n_fetch - both

    @property
    def wire_fraction(self) -> float:
        """The part of a (non-local) replica's messages that crosses the wire."""
        return max(0.0, 1.0 - self.local_shards / self.n_shards)

    def with_(self, **changes: Any) -> Setup:
        """A copy with some fields changed."""
        return replace(self, **changes)


@dataclass(frozen=True)
class Timing:
    """Costs of a run, in seconds (see the module docstring).

    Parameters
    ----------
    step_seconds : float
        Mean CPU time of one replica step (a minibatch's gradient, the local update and the
        loop around them).
    message_seconds : float
        A replica's CPU per request it sends to one shard over the wire (encoding it and
        decoding the reply; in-process calls do not pay it): a step costs :meth:`replica_step`.
    step_cv : float
        Coefficient of variation of a step's time (0: every step the same).
    step_floor : float
        The part of a step's mean time every step takes, in [0, 1): a step is
        ``mean * (step_floor + (1 - step_floor) * G)`` with ``G`` gamma distributed of mean 1,
        its spread set so the step's is ``step_cv``.  0 is a plain gamma, whose large ``step_cv``
        makes most steps far shorter than the mean; a real step never takes less than its
        gradient, and its spread is rare long pauses (another process on the core).
    push_fixed, push_per_param : float
        A shard's service time for one push: ``push_fixed + push_per_param * slice``.
    pull_fixed, pull_per_param : float
        The same for one pull (an ``exchange`` costs a push plus a pull).
    wire_fixed, wire_per_param : float
        A shard's CPU per request that crosses the wire, on top of its service: ``wire_fixed``
        per request plus ``wire_per_param`` per parameter it carries (a push's gradient in, a
        pull's values out; an exchange both).  In-process calls (``Setup.local_replicas``,
        ``Setup.local_shards``) do not pay it.  It is spent in the request's connection thread
        before the shard's lock: it delays the request and loads the cores, but does not hold
        the shard's queue (:mod:`.engine`).
    latency : float
        One-way latency of every replica-shard link (on one machine a request pays
        :meth:`request_share` of it).
    bandwidth : float
        Bytes per second of every replica's link (inf: no transfer time).
    cores : int or None
        None: every replica has its own processor (a real cluster).  An int: all replicas and
        shards share that many cores (one machine), so steps are stretched by the CPU demand of
        both (:meth:`step_scale`; used to compare with oversubscribed local runs).
    crowding : float
        With ``cores``: the extra slowdown per additional replica sharing a core (switching
        between the threads of more replicas than cores, their interpreter lock, caches):
        steps are stretched by ``1 + crowding * (replicas / cores - 1)`` on top of the CPU
        balance when there are more replicas than cores.
    """

    step_seconds: float = 1e-3
    step_cv: float = 0.0
    step_floor: float = 0.0
    message_seconds: float = 0.0
    push_fixed: float = 0.0
    push_per_param: float = 0.0
    pull_fixed: float = 0.0
    pull_per_param: float = 0.0
    wire_fixed: float = 0.0
    wire_per_param: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    cores: int | None = None
    crowding: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("cores", "crowding"):
                _check(f"Timing.{f.name}", getattr(self, f.name), allow_inf=f.name == "bandwidth")
        if self.step_seconds <= 0:
            raise ValueError(f"Timing.step_seconds must be > 0, got {self.step_seconds!r}")
        if self.bandwidth <= 0:
            raise ValueError(f"Timing.bandwidth must be > 0, got {self.bandwidth!r}")
        if self.cores is not None and (not isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"Timing.cores must be None or an int >= 1, got {self.cores!r}")
        _check("Timing.crowding", self.crowding)
        if self.step_floor >= 1:
            raise ValueError(f"Timing.step_floor must be in [0, 1), got {self.step_floor!r}")

    def push_service(self, setup: Setup) -> float:
        """A shard's seconds to apply one push to its slice."""
        return self.push_fixed + self.push_per_param * setup.slice_params

    def pull_service(self, setup: Setup) -> float:
        """A shard's seconds to copy its slice for one pull."""
        return self.pull_fixed + self.pull_per_param * setup.slice_params

    def replica_step(self, setup: Setup, local: bool = False) -> float:
        """A replica's CPU per step: the step and its side of its requests that cross the wire.

        A ``local`` replica (on the worker holding every shard) sends none: its in-process calls
        cost it the shards' service (:meth:`shard_step`), not ``message_seconds``.  On one
        machine (``cores``) a replica's ``Setup.local_shards`` are in-process calls too; on
        machines of their own every request crosses the wire.
        """
        if local:
            return self.step_seconds
        fraction = 1.0 if self.cores is None else setup.wire_fraction
        wire_requests = setup.requests_per_step * setup.n_shards * fraction
        return self.step_seconds + self.message_seconds * wire_requests

    def link_latency(self, setup: Setup) -> float:
        """One-way latency of a link; with ``cores`` stretched as the steps are
        (:meth:`step_scale`): on one machine a message waits for its threads to get a core."""
        return self.latency * self.step_scale(setup)

    def transfer(self, setup: Setup, request: bool = False) -> float:
        """Seconds for a replica's full gradient (or parameters) to cross its link; a
        ``request`` (towards the shards) pays :meth:`request_share` of the latency."""
        share = self.request_share(setup) if request else 1.0
        return self.link_latency(setup) * share + BYTES_PER_PARAM * setup.n_params / self.bandwidth

    def request_share(self, setup: Setup) -> float:
        """The part of the link's latency a request (towards the shards) pays.

        Without ``cores`` all of it.  On one machine the latency stands for a message's wait
        until its receiving thread gets its worker process's interpreter, which a replica's
        step holds: a reply always lands in a replica's process, a request only if the
        shard's worker runs a replica too.  With fewer replicas than ``cores`` workers the
        wire shards sit on the workers the other replicas leave idle: a request pays
        ``(min(replicas, cores) - 1) / (cores - 1)`` of the latency (none for a lone
        replica, all of it from ``cores`` replicas on).
        """
        if self.cores is None or self.cores < 2:
            return 1.0
        return (min(setup.n_replicas, self.cores) - 1) / (self.cores - 1)

    def wire_cost(self, setup: Setup, payloads: int = 1) -> float:
        """A shard's wire CPU for one request of a replica that is not local, carrying
        ``payloads`` slices (2 for an exchange), averaged over its local and wire shards (all
        wire without ``cores``: machines of their own)."""
        fraction = 1.0 if self.cores is None else setup.wire_fraction
        return (self.wire_fixed + self.wire_per_param * setup.slice_params * payloads) * fraction

    def shard_step(self, setup: Setup, local: bool) -> float:
        """The shards' CPU seconds (summed over shards) that one step of a replica causes."""
        service = self.push_service(setup) / setup.n_push + self.pull_service(setup) / setup.n_fetch
        wire = 0.0
        if not local:  # a request each, and a slice per push and per pull carried
            payloads = 1.0 / setup.n_push + 1.0 / setup.n_fetch
            wire = (
                self.wire_cost(setup, 0) * setup.requests_per_step
                + (self.wire_cost(setup, 1) - self.wire_cost(setup, 0)) * payloads
            )
        return (service + wire) * setup.n_shards

    def step_scale(self, setup: Setup) -> float:
        """How much slower a step is because replicas and shards share ``cores`` (1 without).

        Processor sharing by CPU balance: if every step is stretched by ``k``, the replicas and
        the shard CPU their steps cause use ``sum(1 + shards' / replica's) / k`` cores; ``k``
        is the smallest factor >= 1 that keeps that within ``cores``.
        """
        if self.cores is None:
            return 1.0
        local = min(setup.local_replicas, setup.n_replicas)
        demand = local * (1 + self.shard_step(setup, True) / self.replica_step(setup, True)) + (
            setup.n_replicas - local
        ) * (1 + self.shard_step(setup, False) / self.replica_step(setup, False))
        crowded = 1.0 + self.crowding * max(0.0, setup.n_replicas / self.cores - 1.0)
        return max(1.0, demand / self.cores) * crowded

    def scales(self, setup: Setup) -> tuple[float, float]:
        """How much slower a step is because of shared ``cores``, for a replica beside the
        shards (``Setup.local_replicas``) and for the others: ``(near, far)``.

        Both are :meth:`step_scale` unless some replicas, but not all, run on the worker
        holding every shard (one shard on a local cluster of ``cores`` single-threaded worker
        processes).  Then the workers are not alike, and each is one core (its interpreter
        lock): the shards' worker runs its replicas *and* the connection threads serving every
        other replica's requests (``shard_step``), the others only their replicas.  The wire
        replicas share the ``cores - 1`` other workers (``far``); the shards' worker is
        processor-shared between its replicas, each getting ``1 / near`` of the core, and the
        connection threads, which take what the wire replicas' steps ask for, each at most a
        replica's share: ``near`` is where that fills the core.  With the pooled balance
        instead, two replicas on two cores leave every step unstretched, though the replica
        beside the shard shares its core with the other's connection threads (measured: it
        runs at about half its lone speed).
        """
        pooled = self.step_scale(setup)
        local = min(setup.local_replicas, setup.n_replicas)
        if self.cores is None or self.cores < 2 or local in (0, setup.n_replicas):
            return pooled, pooled
        crowded = 1.0 + self.crowding * max(0.0, setup.n_replicas / self.cores - 1.0)
        wire = setup.n_replicas - local
        far = max(1.0, wire / (self.cores - 1)) * crowded
        near_demand = 1 + self.shard_step(setup, True) / self.replica_step(setup, True)
        far_step, served = self.replica_step(setup, False) * far, self.shard_step(setup, False)

        def usage(k: float) -> float:  # of the shards' worker's core, its threads k x slower
            return local * near_demand / k + wire * served * min(1 / far_step, 1 / (served * k))

        low, high = 1.0, 1.0 + local * near_demand + wire  # usage(high) < 1
        if usage(low) <= 1.0:
            return crowded, far
        for _ in range(60):  # usage falls as k grows: bisect for a full core
            mid = 0.5 * (low + high)
            low, high = (mid, high) if usage(mid) > 1.0 else (low, mid)
        return high * crowded, far

    def with_(self, **changes: Any) -> Timing:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (inf bandwidth as the string ``"inf"``)."""
        out = asdict(self)
        out["bandwidth"] = "inf" if math.isinf(self.bandwidth) else self.bandwidth
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timing:
        """The inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Timing fields {unknown}; allowed: {sorted(known)}")
        values = dict(data)
        if values.get("bandwidth") == "inf":
            values["bandwidth"] = math.inf
        return cls(**values)
