"""Bringing back a parameter-server shard whose worker died.

Dask never recreates an actor lost with its worker, so :class:`ShardRecovery` does: it starts a
new shard on the least-loaded surviving worker from the freshest state available -- the last
checkpoint the driver holds (values and update-rule state), or, when fresher, the newest copy of
the shard's values a replica fetched (with the checkpoint's update-rule state) -- and announces
it; running replicas switch to it without restarting.  Updates the shard had applied after that
state are lost, and the ``shard_restored`` event says how many.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..base import RunRecorder
from ..ps.protocol import ShardLostError
from .checkpoints import Checkpoints
from .protocols import Cluster, Server

#: Seconds a shard may take to answer the probe that tells whether it is lost.
PROBE_TIMEOUT = 10.0


class ShardRecovery:
    """Restores lost shards of ``server`` on ``cluster`` from ``checkpoints``' saved states or
    the replicas' fetched copies, recording ``shard_lost`` / ``shard_restored`` events.

    ``on_replaced`` is called after a shard was replaced (a published run re-publishes the
    server, so that attached views follow).
    """

    def __init__(
        self,
        cluster: Cluster,
        server: Server,
        checkpoints: Checkpoints,
        recorder: RunRecorder,
        timeout: float,
        on_replaced: Callable[[], None] | None = None,
    ):
        self.cluster, self.server, self.checkpoints = cluster, server, checkpoints
        self.recorder, self.timeout, self.on_replaced = recorder, timeout, on_replaced

    def recover_lost(self, error: BaseException) -> None:
        """After a failed shard call, find which shard(s) are lost and restore them; re-raise
        ``error`` if every shard answers (it was not a lost shard)."""
        alive = self.cluster.workers()
        if isinstance(error, ShardLostError):
            lost = [error.shard]
        else:
            lost = self.server.lost_shards(min(self.timeout, PROBE_TIMEOUT))
        if not lost:
            raise error
        for i in lost:
            self.recover(i, f"{error}", alive)

    def recover(self, shard: int, reason: str, alive: list[str]) -> None:
        """Recreate ``shard`` on a worker of ``alive`` other than its own, from the freshest
        state available.

        Events: ``shard_lost`` ``{shard, worker, reason}``, then ``shard_restored`` ``{shard,
        worker, source, version, lost_updates}``: ``worker`` the new one, ``source``
        ``"checkpoint"`` or ``"fetched_copy"``, ``version`` the state's version, and
        ``lost_updates`` how many updates the shard had applied beyond it, as far as known.
        """
        lost_worker, lost_key = self.server.workers[shard], self.server.shard_key(shard)
        self.recorder.event(
            "shard_lost",
            f"shard {shard} on {lost_worker}: {reason}",
            shard=shard,
            worker=lost_worker,
            reason=reason,
        )
        saved = self.checkpoints.saved[shard]
        version, values = int(saved["version"]), saved["values"]
        source, where = "checkpoint", "checkpoint"
        survivors = [w for w in alive if w != lost_worker]
        if not survivors:
            raise RuntimeError(f"shard {shard} was lost and no worker survives to hold it")
        copies = self.cluster.fetched_copies(shard, lost_key, survivors)
        for holder, copy in copies.items():
            if isinstance(copy, tuple) and copy[0] > version:
                version, values = int(copy[0]), copy[1]
                source, where = "fetched_copy", f"a replica's copy on {holder}"
        known = max(self.checkpoints.known_versions[shard], version)
        lost_updates = known - version
        state = {
            "rule_state": saved["rule_state"],
            "version": version,
            "counters": saved.get("counters", {}),
        }
        worker = self._least_loaded(shard, survivors)
        future = self.server.replace_shard(shard, values, worker, state, self.timeout)
        self.cluster.announce_shard(shard, future)
        if self.on_replaced is not None:
            self.on_replaced()
        self.checkpoints.replaced(shard, {**state, "values": np.array(values, copy=True)})
        self.recorder.event(
            "shard_restored",
            f"shard {shard} on {worker} from {where} at version {version}; "
            f"{lost_updates} updates lost",
            shard=shard,
            worker=worker,
            source=source,
            version=version,
            lost_updates=lost_updates,
        )

    def _least_loaded(self, shard: int, survivors: list[str]) -> str:
        """The survivor holding the fewest other shards (ties: the first by address)."""
        load = {w: 0 for w in survivors}
        for j, w in enumerate(self.server.workers):
            if j != shard and w in load:
                load[w] += 1
        return min(survivors, key=lambda w: (load[w], w))
