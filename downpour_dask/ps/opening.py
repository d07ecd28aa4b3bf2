"""Opening a replica's channels: one :class:`~downpour_dask.ps.channel.DaskShardChannel` per
shard of a server view, with the direct connections to shards on other workers asked for all at
once (so their round trips overlap) before any is waited for."""

from __future__ import annotations

import time

from .channel import DaskShardChannel
from .server import ParameterServer


def open_channels(
    server: ParameterServer,
    replica: int,
    timeout: float,
    replacements: list[str] | None = None,
    direct: bool = True,
    secret: bytes = b"",
    one_sided: bool = False,
) -> list[DaskShardChannel]:
    """One channel per shard of ``server`` (a view made by ``portable()`` or the driver's),
    with the direct connections to shards on other workers opened all at once.

    ``replacements`` names, per shard, the variable where the driver publishes replacements;
    ``secret`` is the run's wire secret; ``one_sided``: push to shards on other workers of this
    host one-sided where they can take it (:mod:`~downpour_dask.ps.one_sided`).
    """
    server = server.opened()
    channels = [
        DaskShardChannel(
            actor,
            server.ids[s],
            hi - lo,
            replica,
            timeout,
            None if replacements is None else replacements[s],
            direct,
            secret,
            server.generations[s],
            one_sided,
        )
        for s, (actor, (lo, hi)) in enumerate(zip(server.shards, server.ranges))
    ]
    sent = time.monotonic()
    asked = [channel.ask_endpoint() for channel in channels]
    for channel, call in zip(channels, asked):
        channel.connect(call, sent)
    return channels
