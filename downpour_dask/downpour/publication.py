"""A Downpour fit published by name, for other processes to follow (:mod:`downpour_dask.live`).

With ``fit(..., publish=NAME)`` the running parameter server is published on the scheduler and
a JSON description of the run goes to the run's event topic (what attached views read: they
never unpickle the publication), with progress snapshots; the description is logged again every
:attr:`Publication.DESCRIBE_EVERY` seconds (the topic keeps only its last 1000 events) and when
a shard is replaced after its worker died (attached views then follow it); the name is released
when the fit ends, however it ends.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from distributed import Client

from .. import live
from ..log import Progress
from ..ps.server import ParameterServer


class Publication:
    """The published name ``name`` of one fit on ``client``'s scheduler; ``info`` is what
    attached processes read about the run (JSON-able)."""

    #: Seconds between two descriptions of the run on its topic.
    DESCRIBE_EVERY = 5.0

    def __init__(self, client: Client, name: str, info: dict[str, Any]):
        self.client, self.name, self.info = client, name, info
        self.published = False
        self.server: ParameterServer | None = None
        self.described = -math.inf

    @staticmethod
    def check_free(client: Client, name: str) -> None:
        """Raise ValueError if ``name`` is taken on the scheduler (before any cluster work)."""
        if live.is_published(client, name):
            raise ValueError(
                f"publish={name!r}: a run or dataset of that name is already published on the "
                f"scheduler; choose another name"
            )

    def publish(self, server: ParameterServer) -> None:
        """Publish the running ``server``."""
        live.publish(self.client, self.name, server, self.info)
        self.published, self.server, self.described = True, server, time.monotonic()

    def republish(self, server: ParameterServer) -> None:
        """After a shard was replaced: attached views must see the new shard, not the lost one
        (best effort: never fails the recovery)."""
        if not self.published:
            return
        with contextlib.suppress(Exception):
            live.publish(self.client, self.name, server, self.info, override=True)

    def report(self, progress: Progress) -> None:
        """Log a progress snapshot on the run's event topic."""
        live.log_progress(self.client, self.name, progress)
        if self.server is not None and time.monotonic() - self.described >= self.DESCRIBE_EVERY:
            self.described = time.monotonic()
            with contextlib.suppress(Exception):  # best effort, like progress
                live.describe(self.client, self.name, self.server, self.info)

    def unpublish(self) -> None:
        """Release the name (if it was published)."""
        if self.published:
            live.unpublish(self.client, self.name)
            self.published = False
