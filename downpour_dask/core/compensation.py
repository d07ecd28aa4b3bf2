"""Delay-compensated asynchronous SGD (DC-ASGD; Zheng et al., ICML 2017).

A replica's gradient ``g`` was computed at the parameters it fetched, ``w_fetched``; by the
time it reaches the shard the parameters are ``w_now``.  DC-ASGD corrects ``g`` with a cheap
first-order Taylor term, the Hessian approximated by the outer product's diagonal ``g * g``::

    g_compensated = g + lam * g * g * (w_now - w_fetched)

and applies the compensated gradient with the wrapped rule.  :class:`DelayCompensated` wraps
any :class:`~downpour_dask.core.optim.UpdateRule` (``optimizer="dc_sgd"``, ``"dc_adagrad"``, ...
through :func:`~.optimizer_spec.resolve`); this is the paper's DC-ASGD-c, with a constant
``lam`` (its adaptive variant DC-ASGD-a, ``lam / sqrt(mean square of g)``, is not implemented).

**Memory.**  The shard keeps ``w_fetched`` per replica (:class:`FetchedCopies`): one copy of
its slice per replica that pulled from it -- a whole extra parameter vector per replica over
all shards (float32: 4 bytes per parameter per replica).  The copies are not checkpointed: a
restored shard compensates a replica's pushes again from that replica's next fetch on (until
then they are applied as plain ``g``).  With no delay ``w_now == w_fetched`` and the rule is
exactly the wrapped one.  Numpy only.
"""

from __future__ import annotations

import numpy as np

from .optim import UpdateRule, WrappedRule

#: DC-ASGD's ``lam`` when none is given (the paper's lambda_0 for DC-ASGD-c on CIFAR-10).
DEFAULT_LAMBDA = 0.04

#: How an ``optimizer`` name spells a delay-compensated rule: this prefix and a rule's name
#: (:func:`~.optimizer_spec.resolve`).
PREFIX = "dc_"


class DelayCompensated(WrappedRule):
    """``rule`` applied to delay-compensated gradients (module docstring).

    Parameters
    ----------
    rule : UpdateRule
        The rule applied to the compensated gradient.
    lam : float, default 0.04
        The variance-control parameter lambda (0: no compensation).
    """

    def __init__(self, rule: UpdateRule, lam: float = DEFAULT_LAMBDA):
        if not isinstance(rule, UpdateRule) or isinstance(rule, DelayCompensated):
            raise TypeError(f"rule must be an UpdateRule (not already compensated), got {rule!r}")
        if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not lam >= 0:
            raise ValueError(f"lam must be a number >= 0, got {lam!r}")
        self.rule, self.lam = rule, float(lam)
        self.name = PREFIX + rule.name

    def _hyper(self) -> dict[str, float]:
        return {**self.rule._hyper(), "lam": self.lam}

    def update(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
        rate_scale: float = 1.0,
    ) -> None:
        """The wrapped rule's update (``grad`` already compensated, see :meth:`compensate`)."""
        self.rule.update(params, grad, state, staleness=staleness, rate_scale=rate_scale)

    def compensate(self, grad: np.ndarray, now: np.ndarray, fetched: np.ndarray) -> np.ndarray:
        """``grad + lam * grad * grad * (now - fetched)`` as a new array (``grad`` untouched)."""
        out = np.subtract(now, fetched)
        out *= grad
        out *= grad
        out *= out.dtype.type(self.lam)
        out += grad
        return out


class FetchedCopies:
    """What one shard last sent each replica (its ``w_fetched``), for :class:`DelayCompensated`:
    one array the size of the shard's slice per replica that pulled."""

    def __init__(self) -> None:
        self.copies: dict[int, np.ndarray] = {}

    def keep(self, replica: int, values: np.ndarray) -> None:
        """Note that ``replica`` was just sent ``values`` (copied into its own buffer)."""
        if replica < 0:  # the driver's or an evaluation's pull: no replica computes on it
            return
        copy = self.copies.get(replica)
        if copy is None or copy.shape != values.shape:
            self.copies[replica] = values.copy()
        else:
            np.copyto(copy, values)

    def compensate(
        self, rule: DelayCompensated, replica: int, grad: np.ndarray, now: np.ndarray
    ) -> np.ndarray:
        """``replica``'s gradient compensated for the parameters moving since its fetch (as it
        is if this shard sent it nothing yet)."""
        fetched = self.copies.get(replica)
        return grad if fetched is None else rule.compensate(grad, now, fetched)

    @property
    def nbytes(self) -> int:
        """Memory the copies take."""
        return sum(copy.nbytes for copy in self.copies.values())

