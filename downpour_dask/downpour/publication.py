"""A Downpour fit published by name, for other processes to follow (:mod:`downpour_dask.live`).

With ``fit(..., publish=NAME)`` the running parameter server is published on the scheduler with
a short description of the run, progress snapshots go to the run's event topic, a shard
replaced after its worker died is published again (attached views then follow it), and the name
is released when the fit ends, however it ends.
"""

from __future__ import annotations

import contextlib
from typing import Any

from distributed import Client

from .. import live
from ..log import Progress
from ..ps.server import ParameterServer


class Publication:
    """The published name ``name`` of one fit on ``client``'s scheduler; ``info`` is what
    attached processes read about the run (msgpack/JSON-able)."""

    def __init__(self, client: Client, name: str, info: dict[str, Any]):
        self.client, self.name, self.info = client, name, info
        self.published = False

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
        self.published = True

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

    def unpublish(self) -> None:
        """Release the name (if it was published)."""
        if self.published:
            live.unpublish(self.client, self.name)
            self.published = False
