"""What :class:`~.estimator.DownpourSGD`'s arguments allow, and what follows from them.

:class:`DownpourArguments` is the part of the estimator that reads its constructor arguments:
the checks ``fit`` runs before any cluster work (each bad value is named, with what is allowed),
and what the arguments decide -- the update rule, the consistency model, the partition plan
and the shards' ranges of the parameter vector.  It keeps no state: the estimator's
``__init__`` stores the arguments as they are, as scikit-learn asks.
"""

from __future__ import annotations

from typing import Any

from ..core import averaging, compression, consistency, optim, optimizer_spec
from ..core.params import split_range
from ..core.partition import PartitionPlan
from ..core.protocol import TrainableModel
from ..core.validation import check_int, check_positive
from ..runtime.cluster import check_security
from .checkpoints import check_path
from .easgd_loop import check_elastic
from .replica_count import check_replicas

#: Values of ``DownpourSGD(transport=...)``.
TRANSPORTS = ("auto", "one-sided", "dask")


class DownpourArguments:
    """The argument checks and derived settings of :class:`~.estimator.DownpourSGD` (a mixin
    of it: the attributes are the estimator's constructor arguments)."""

    def _check_arguments(self, callback: Any = None) -> optim.UpdateRule:
        """Check every constructor argument (and a model given ready-built against them);
        return the update rule.  Raises before any Dask work."""
        self._check_fit_arguments(callback)
        check_replicas(self.n_replicas, self.max_replicas)
        check_int("partitions", self.partitions, 1)
        if self.model is not None and not isinstance(self.model, str):
            self._check_model(self.model)  # a spec is built, and checked, at fit
        for name in ("n_shards", "batch_size", "n_fetch", "n_push", "max_inflight"):
            check_int(name, getattr(self, name), 1)
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                f"got {self.transport!r}"
            )
        check_int("warmstart_steps", self.warmstart_steps, 0)
        check_int("max_epochs", self.max_epochs, 1, allow_none=True)
        check_int("max_steps", self.max_steps, 1, allow_none=True)
        check_positive("max_seconds", self.max_seconds, allow_none=True)
        check_positive("learning_rate", self.learning_rate)
        check_positive(
            "local_learning_rate", self.local_learning_rate, allow_none=True, allow_zero=True
        )
        check_positive("eval_every", self.eval_every)
        check_positive("timeout", self.timeout)
        check_positive("max_grad_norm", self.max_grad_norm, allow_none=True)
        check_security(self.security)
        self._consistency()
        compression.check_fraction(self.top_k, self.partitions)
        check_positive("checkpoint_every", self.checkpoint_every)
        check_path("checkpoint_dir", self.checkpoint_dir, allow_none=True)
        if self.random_state is not None:
            check_int("random_state", self.random_state, 0)
        rule = optimizer_spec.resolve(self.optimizer, self.learning_rate)
        check_elastic(self.elastic_alpha, rule, self.consistency, self.top_k, self.partitions,
                      self.ema_decay)  # fmt: skip
        return rule if self.ema_decay is None else averaging.Averaged(rule, self.ema_decay)

    def _check_model(self, model: TrainableModel) -> None:
        """Raise if ``model`` cannot take ``n_shards`` or ``partitions``."""
        check_int("n_shards", self.n_shards, 1, model.n_params)
        self._shard_ranges(model)  # partitions the model cannot take, or too few shards

    def _plan(self, model: TrainableModel) -> PartitionPlan | None:
        """How replicas are split (None without model parallelism)."""
        return None if self.partitions == 1 else PartitionPlan(model, self.partitions)

    def _shard_ranges(self, model: TrainableModel) -> list[tuple[int, int]]:
        """The shards' ranges of the server's vector: balanced, or aligned with partitions."""
        plan = self._plan(model)
        if plan is None:
            return split_range(model.n_params, self.n_shards)
        return plan.shard_ranges(self.n_shards)

    def _consistency(self) -> consistency.Consistency:
        """The checked ``consistency`` / ``staleness_bound`` (see core/consistency.py)."""
        args = (self.consistency, self.staleness_bound, self.warmstart_steps, self.partitions)
        return consistency.resolve(*args)
