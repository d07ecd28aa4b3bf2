"""Elastic averaging SGD, the asynchronous variant (Zhang, Choromanska, LeCun, NIPS 2015).

Each replica keeps its own variable ``x_i`` and trains it with plain local SGD (the replica's
``local_learning_rate``, the paper's eta); the shards hold the *centre* variable ``x~``.  Every
``tau`` steps (``n_push``) replica i exchanges an elastic difference with the centre
(Algorithm 1 of the paper)::

    x~ = fetch the centre
    d = alpha * (x_i - x~)          # alpha = eta * rho, the moving rate
    x_i -= d                        # the replica is pulled towards the centre ...
    x~  += d                        # ... and the centre towards the replica (a push)

:class:`ElasticReplicaLoop` is :class:`~.replica_loop.ReplicaLoop` with that exchange in place
of the gradient push: fetches install the centre into its own buffer instead of over the
replica's variable (only the first fetch starts ``x_i`` at the centre), and a push carries
``-d / learning_rate`` so that the shard's plain SGD rule adds exactly ``d`` to the centre (so
EASGD needs ``optimizer="sgd"``).  The replica waits for its previous exchange to be
acknowledged before fetching the centre, so no own exchange is ever missing from a fetch.  The
trained model (``params_``) is the centre.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.optim import SGD, UpdateRule
from ..core.params import DTYPE
from ..ps.protocol import PullReply
from .replica_loop import ReplicaLoop


class ElasticReplicaLoop(ReplicaLoop):
    """A replica of asynchronous EASGD (module docstring): ``config.elastic_alpha`` is alpha,
    ``config.centre_rate`` the shards' SGD learning rate."""

    skip_refetched = False  # (see ReplicaLoop)

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.centre = np.empty_like(self.params)
        self.started = [False] * len(self.channels)

    def _install(self, s: int, reply: PullReply) -> None:
        """Keep the fetched centre (slice ``s``); the first fetch also starts ``x_i`` there."""
        self.pulls[s] = None
        channel = self.channels[s]
        if not channel.in_process and self.sink.keep_fetched(
            channel.shard, channel.key, reply.version, reply.values
        ):  # a copy the driver may restore a lost shard from, as the base loop keeps
            self.held[s] = reply.values
        lo, hi = self.ranges[s]
        self.centre[lo:hi] = reply.values
        if not self.started[s]:
            self.params[lo:hi] = reply.values
            self.started[s] = True
        self.versions[s] = reply.version
        self.stop = self.stop or reply.stop
        self.ledger.release()

    def _push(self, step: int, fetch: bool = False) -> None:
        """The elastic exchange with the centre, in place of a gradient push."""
        for p in self.ledger.unacknowledged():  # the centre must contain every own exchange
            self._ack(p, wait=True)
        for s in range(len(self.channels)):
            while self.pulls[s] is not None:  # a fetch sent before the acknowledgement
                self._take_pull(s, wait=True)
        self._start_fetches()
        for s in range(len(self.channels)):
            while self.pulls[s] is not None:
                self._take_pull(s, wait=True)
        cfg = self.cfg
        diff = np.subtract(self.params, self.centre, dtype=DTYPE)
        diff *= DTYPE(cfg.elastic_alpha)
        self.params -= diff
        # the push: the gradient whose step at the centre's rate moves the centre by d
        diff *= DTYPE(-1.0 / cfg.centre_rate)
        self.accrued[...] = diff
        self.base_versions = list(self.versions)
        super()._push(step, fetch=False)


def check_elastic(
    alpha: float | None,
    rule: UpdateRule,
    consistency: str,
    top_k: float | None,
    partitions: int,
    ema_decay: float | None = None,
) -> None:
    """Raise if ``DownpourSGD(elastic_alpha=alpha)`` cannot run with the other arguments: alpha
    must be in (0, 1), the shards' rule plain SGD, and it takes no SSP/BSP, top_k, model
    parallelism or ``ema_decay`` (its centre variable is already an average)."""
    if alpha is None:
        return
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"elastic_alpha must be a number in (0, 1) or None, got {alpha!r}")
    if type(rule) is not SGD:
        raise ValueError(
            f"elastic_alpha (EASGD) needs optimizer='sgd': the shards add the elastic "
            f"difference to the centre, got optimizer {rule.name!r}"
        )
    for name, value, allowed in (
        ("consistency", consistency, "async"), ("top_k", top_k, None),
        ("partitions", partitions, 1), ("ema_decay", ema_decay, None),
    ):  # fmt: skip
        if value != allowed:
            raise ValueError(f"elastic_alpha (EASGD) takes only {name}={allowed!r}, got {value!r}")
