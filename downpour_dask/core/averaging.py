"""A moving average of a shard's parameters, published as the model while training goes on.

Asynchronous replicas push gradients computed at parameters that lack each other's latest
pushes, so the shards' values wander around the optimum more than serial SGD's would: each
replica's noise, and the staleness, move them.  Averaging the iterates (Polyak and Juditsky,
1992; the exponential form is TensorFlow's ``ExponentialMovingAverage``, Keras' and optax's
``ema``) takes that noise out of the *model* while the training goes on as before: replicas keep
fetching and pushing the raw values, and only what the fit publishes -- its evaluations, the
fitted ``params_`` -- is the average.

:class:`Averaged` wraps any :class:`~downpour_dask.core.optim.UpdateRule` and keeps the average
in the rule's state (``"average"``, and ``"averaged"``: the updates averaged), so a shard's
checkpoints, its replacement after a lost worker and a resumed fit carry it as they carry
Adagrad's sums of squares.  After each update it folds the new values in::

    average = decay * average + (1 - decay) * values          # from zero, like Adam's moments
    published = average / (1 - decay ** averaged)             # no pull towards zero early on

``decay`` is per update a shard applies, so the average spans about ``1 / (1 - decay)`` pushes
(0.98: the last ~50).  Two passes over the slice per push (a scale and BLAS's ``axpy``) on top
of the rule's.
Numpy only.
"""

from __future__ import annotations

import numpy as np

from .optim import UpdateRule, WrappedRule, axpy

#: The state an :class:`Averaged` rule adds to its wrapped rule's.
AVERAGE_STATE = ("average", "averaged")


def check_decay(decay: object) -> float:
    """``decay`` as a float, or a TypeError/ValueError that names ``ema_decay`` and what it
    allows (a number strictly between 0 and 1)."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float, np.integer, np.floating)):
        raise TypeError(f"ema_decay must be a number between 0 and 1 or None, got {decay!r}")
    value = float(decay)
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"ema_decay must be strictly between 0 and 1 (e.g. 0.98 averages the last ~50 "
            f"pushes), got {decay!r}"
        )
    return value


class Averaged(WrappedRule):
    """``rule``'s updates, and an exponential moving average of the parameters after each
    (module docstring).

    Parameters
    ----------
    rule : UpdateRule
        The rule that updates the parameters (plain, staleness-aware or delay-compensated).
    decay : float
        The average's decay per update, strictly between 0 and 1.
    """

    def __init__(self, rule: UpdateRule, decay: float):
        if not isinstance(rule, UpdateRule) or isinstance(rule, Averaged):
            raise TypeError(f"rule must be an UpdateRule (not already averaged), got {rule!r}")
        self.rule, self.decay = rule, check_decay(decay)
        self.name = rule.name

    def _hyper(self) -> dict[str, float]:
        return {**self.rule._hyper(), "ema_decay": self.decay}

    def init(self, size: int) -> dict[str, np.ndarray]:
        """The wrapped rule's state, the average (zero) and the count of updates averaged."""
        state = self.rule.init(size)
        state.update(average=np.zeros(size, np.float32), averaged=np.zeros((), np.int64))
        return state

    def update(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
        rate_scale: float = 1.0,
    ) -> None:
        """The wrapped rule's update, then :meth:`accumulate`."""
        self.rule.update(params, grad, state, staleness=staleness, rate_scale=rate_scale)
        self.accumulate(params, state)

    def accumulate(self, params: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Fold ``params`` into the average.  It stays finite whenever ``params`` is: it is a
        weighted mean of finite values (what :class:`~.guard.GuardedUpdate` relies on)."""
        average = state["average"]
        average *= average.dtype.type(self.decay)
        axpy(1.0 - self.decay, params, average)
        state["averaged"] += 1  # in place: the 0-d array the shard checkpoints


def published(rule: UpdateRule, params: np.ndarray, state: dict[str, np.ndarray]) -> np.ndarray:
    """What a shard publishes as the model: with an :class:`Averaged` rule the bias-corrected
    average (a new array; ``params`` itself before the first update), else ``params``."""
    if not isinstance(rule, Averaged) or int(state["averaged"]) == 0:
        return params
    correction = 1.0 - rule.decay ** int(state["averaged"])
    return np.divide(state["average"], np.float32(correction), dtype=np.float32)


def innermost(rule: UpdateRule) -> UpdateRule:
    """``rule`` without its :class:`Averaged` wrapper (what a shard's compensation and the
    guard's bounds look at)."""
    return rule.rule if isinstance(rule, Averaged) else rule
