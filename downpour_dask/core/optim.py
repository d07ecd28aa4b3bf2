"""Update rules a parameter-server shard applies to its slice of the parameter vector.

Each shard owns one contiguous slice of the flat parameter vector and applies every
accepted gradient push to it.  A rule is an ``(init, update)`` pair: ``init(size)``
builds the per-coordinate state for a slice (float32 arrays, counters as 0-d int64
arrays, so a shard can checkpoint it with ``np.savez`` and reload it with
``allow_pickle=False``) and ``update`` changes the slice and its state in place.

The rules are those of the DistBelief paper (SGD and per-coordinate AdaGrad) plus
momentum and Adam, and a wrapper that divides the step by the push's staleness
(Zhang et al., 2016, "Staleness-aware Async-SGD").  Updates write through ``out=``
and reuse one per-thread scratch vector, so large shards make no big temporaries.
"""

from __future__ import annotations

import abc
import math
import threading
from typing import Any

import numpy as np
from scipy.linalg import blas

BASE_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")
OPTIMIZERS = BASE_OPTIMIZERS + tuple(f"staleness_aware_{name}" for name in BASE_OPTIMIZERS)

_local = threading.local()


def _scratch(like: np.ndarray) -> np.ndarray:
    """A per-thread scratch vector shaped and typed like ``like`` (grown, never shrunk)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.dtype != like.dtype or buf.size < like.size:
        buf = _local.buf = np.empty(like.size, like.dtype)
    return buf[: like.size].reshape(like.shape)


#: BLAS's ``y += a * x`` for each dtype it has one for.
_AXPY = {np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy}


#: Elements a rule with several passes (AdaGrad, Adam) updates at a time: its passes over a
#: block that stays in the CPU cache are cheaper than the same passes over a whole shard.
BLOCK = 1 << 16


def axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a * x`` in place: one pass of BLAS over both vectors where it applies (same
    float dtype, contiguous), which reads and writes half the memory of numpy's ``y -=
    np.multiply(x, -a)``; numpy with the scratch vector otherwise (``x`` may be that
    vector's first ``y.size`` elements: it is then scaled in place)."""
    routine = _AXPY.get(y.dtype)
    if routine is not None and x.dtype == y.dtype and x.flags.c_contiguous and y.flags.c_contiguous:
        routine(x.reshape(-1), y.reshape(-1), a=a)  # in place: y has BLAS's dtype and layout
    else:
        y += np.multiply(x, a, out=_scratch(y))


def _check_real(
    name: str, value: Any, low: float, high: float | None = None, low_open: bool = False
) -> float:
    """``value`` as a float, or a TypeError/ValueError naming ``name`` and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or (high is not None and number >= high):
        allowed = f"{'>' if low_open else '>='} {low:g}"
        if high is not None:
            allowed += f" and < {high:g}"
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
    return number


class UpdateRule(abc.ABC):
    """Base of all update rules: a learning rate, per-slice state and an in-place update.

    Attributes
    ----------
    name : str
        Name as accepted by :func:`make` (one of :data:`OPTIMIZERS`).
    learning_rate : float
        Base step size; ``update`` uses ``learning_rate * rate_scale``.
    """

    name = ""

    def __init__(self, learning_rate: float):
        self.learning_rate = _check_real("learning_rate", learning_rate, 0.0, low_open=True)

    def _hyper(self) -> dict[str, float]:
        """Hyperparameters other than the learning rate (constructor keyword arguments)."""
        return {}

    def init(self, size: int) -> dict[str, np.ndarray]:
        """Zero state for a slice of ``size`` coordinates (empty for plain SGD)."""
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        return self._state(int(size))

    def _state(self, size: int) -> dict[str, np.ndarray]:
        return {}

    def update(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
        rate_scale: float = 1.0,
    ) -> None:
        """Apply one gradient to ``params`` and ``state`` in place.

        Parameters
        ----------
        params : ndarray
            The shard's float32 slice; modified in place.
        grad : ndarray
            Gradient for that slice, same shape.
        state : dict
            As returned by :meth:`init`; modified in place.
        staleness : int
            Updates applied since the pusher fetched its parameters (ignored by base rules).
        rate_scale : float
            Multiplies the learning rate for this step.
        """
        if params.shape != grad.shape:
            raise ValueError(f"grad must have the shape of params {params.shape}, got {grad.shape}")
        self._step(params, grad, state, self.learning_rate * float(rate_scale))

    @abc.abstractmethod
    def _step(
        self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], lr: float
    ) -> None:
        """The rule itself, with the effective learning rate ``lr``; each rule defines it."""

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable name, learning rate and hyperparameters; see :func:`from_config`."""
        return {"name": self.name, "learning_rate": self.learning_rate, **self._hyper()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UpdateRule) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class SGD(UpdateRule):
    """Plain SGD: ``p -= lr * g``; no state."""

    name = "sgd"

    def _step(self, params, grad, state, lr):
        axpy(-lr, grad, params)


class Momentum(UpdateRule):
    """Heavy-ball momentum: ``v = momentum * v + g; p -= lr * v``."""

    name = "momentum"

    def __init__(self, learning_rate: float, momentum: float = 0.9):
        super().__init__(learning_rate)
        self.momentum = _check_real("momentum", momentum, 0.0, 1.0)

    def _hyper(self):
        return {"momentum": self.momentum}

    def _state(self, size):
        return {"velocity": np.zeros(size, np.float32)}

    def _step(self, params, grad, state, lr):
        v = state["velocity"]
        v *= self.momentum
        v += grad
        axpy(-lr, v, params)


class Adagrad(UpdateRule):
    """DistBelief's per-coordinate AdaGrad: ``eta_i = lr / sqrt(sum_j g_ij**2)``.

    ``acc += g*g; p -= lr * g / (sqrt(acc) + eps)``; ``eps`` only guards the 0/0 of a
    coordinate that has never had a non-zero gradient.
    """

    name = "adagrad"

    def __init__(self, learning_rate: float, eps: float = 1e-8):
        super().__init__(learning_rate)
        self.eps = _check_real("eps", eps, 0.0, low_open=True)

    def _hyper(self):
        return {"eps": self.eps}

    def _state(self, size):
        return {"sum_sq": np.zeros(size, np.float32)}

    def _step(self, params, grad, state, lr):
        params, grad, acc = params.reshape(-1), grad.reshape(-1), state["sum_sq"].reshape(-1)
        scratch = _scratch(params[:BLOCK])
        for lo in range(0, params.size, BLOCK):
            hi = min(lo + BLOCK, params.size)
            g, tmp = grad[lo:hi], scratch[: hi - lo]
            acc[lo:hi] += np.multiply(g, g, out=tmp)
            np.sqrt(acc[lo:hi], out=tmp)
            tmp += self.eps
            np.divide(g, tmp, out=tmp)
            axpy(-lr, tmp, params[lo:hi])


class Adam(UpdateRule):
    """Adam (Kingma & Ba, 2015) with bias correction; the step count is state ``"t"``."""

    name = "adam"

    def __init__(
        self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ):
        super().__init__(learning_rate)
        self.beta1 = _check_real("beta1", beta1, 0.0, 1.0)
        self.beta2 = _check_real("beta2", beta2, 0.0, 1.0)
        self.eps = _check_real("eps", eps, 0.0, low_open=True)

    def _hyper(self):
        return {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}

    def _state(self, size):
        return {
            "m": np.zeros(size, np.float32),
            "v": np.zeros(size, np.float32),
            "t": np.zeros((), np.int64),
        }

    def _step(self, params, grad, state, lr):
        state["t"] += 1  # in place: the 0-d array the shard checkpoints
        step = int(state["t"])
        # p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m / (1 - beta1**t) etc.
        unbias_v = 1.0 / math.sqrt(1.0 - self.beta2**step)
        rate = -lr / (1.0 - self.beta1**step)
        params, grad = params.reshape(-1), grad.reshape(-1)
        m, v = state["m"].reshape(-1), state["v"].reshape(-1)
        scratch = _scratch(params[:BLOCK])
        for lo in range(0, params.size, BLOCK):
            hi = min(lo + BLOCK, params.size)
            g, mb, vb, tmp = grad[lo:hi], m[lo:hi], v[lo:hi], scratch[: hi - lo]
            mb *= self.beta1
            axpy(1.0 - self.beta1, g, mb)
            vb *= self.beta2
            axpy(1.0 - self.beta2, np.multiply(g, g, out=tmp), vb)
            np.sqrt(vb, out=tmp)
            tmp *= unbias_v
            tmp += self.eps
            np.divide(mb, tmp, out=tmp)
            axpy(rate, tmp, params[lo:hi])


class WrappedRule(UpdateRule):
    """A rule that applies another rule, ``rule``, with something changed (the staleness-aware
    rate below, DC-ASGD's compensated gradient in :mod:`~downpour_dask.core.compensation`):
    the learning rate, the hyperparameters and the state are the wrapped rule's."""

    rule: UpdateRule

    @property
    def learning_rate(self) -> float:
        """The wrapped rule's learning rate."""
        return self.rule.learning_rate

    def _hyper(self) -> dict[str, float]:
        return self.rule._hyper()

    def init(self, size: int) -> dict[str, np.ndarray]:
        """The wrapped rule's state."""
        return self.rule.init(size)

    def _step(
        self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], lr: float
    ) -> None:
        self.rule._step(params, grad, state, lr)


class StalenessAware(WrappedRule):
    """Wrap a rule so a push of staleness ``s`` steps with rate ``lr / max(1, s)``.

    Staleness 0 and 1 leave the inner rule unchanged.  The state is the inner rule's.
    """

    def __init__(self, rule: UpdateRule):
        if not isinstance(rule, UpdateRule) or isinstance(rule, StalenessAware):
            raise TypeError(
                f"rule must be a base UpdateRule (not already staleness-aware), got {rule!r}"
            )
        self.rule = rule
        self.name = "staleness_aware_" + rule.name

    def update(
        self,
        params: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        staleness: int = 0,
        rate_scale: float = 1.0,
    ) -> None:
        """The inner rule's update with ``rate_scale / max(1, staleness)``."""
        super().update(
            params, grad, state, staleness=staleness, rate_scale=rate_scale / max(1, staleness)
        )


def sgd(learning_rate: float) -> SGD:
    """Plain SGD rule; see :class:`SGD`."""
    return SGD(learning_rate)


def momentum(learning_rate: float, momentum: float = 0.9) -> Momentum:
    """Momentum rule; see :class:`Momentum`."""
    return Momentum(learning_rate, momentum)


def adagrad(learning_rate: float, eps: float = 1e-8) -> Adagrad:
    """DistBelief's AdaGrad rule; see :class:`Adagrad`."""
    return Adagrad(learning_rate, eps)


def adam(learning_rate: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> Adam:
    """Adam rule; see :class:`Adam`."""
    return Adam(learning_rate, beta1, beta2, eps)


def staleness_aware(rule: UpdateRule) -> StalenessAware:
    """Divide ``rule``'s step by the push's staleness; see :class:`StalenessAware`."""
    return StalenessAware(rule)


_RULES: dict[str, type[UpdateRule]] = {
    "sgd": SGD,
    "momentum": Momentum,
    "adagrad": Adagrad,
    "adam": Adam,
}
_OPTIONS = {
    "sgd": (),
    "momentum": ("momentum",),
    "adagrad": ("eps",),
    "adam": ("beta1", "beta2", "eps"),
}


def make(name: str, learning_rate: float, **options: float) -> UpdateRule:
    """Build a rule by name: one of :data:`OPTIMIZERS`, with its hyperparameters as options.

    Raises
    ------
    ValueError
        Unknown ``name``, or ``learning_rate`` (or an option) out of range.
    TypeError
        Non-numeric ``learning_rate``, or an option the rule does not take.
    """
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    base = name.removeprefix("staleness_aware_")
    unknown = sorted(set(options) - set(_OPTIONS[base]))
    if unknown:
        allowed = ", ".join(_OPTIONS[base]) or "none"
        raise TypeError(f"unknown option(s) {unknown} for optimizer {name!r}; allowed: {allowed}")
    rule = _RULES[base](learning_rate, **options)
    return StalenessAware(rule) if base != name else rule


def resolve(optimizer: str | UpdateRule, learning_rate: float) -> UpdateRule:
    """The rule an estimator's ``optimizer`` and ``learning_rate`` arguments name: a rule given
    ready-built (whose learning rate must be ``learning_rate``), or one built by :func:`make`."""
    if isinstance(optimizer, UpdateRule):
        if optimizer.learning_rate != learning_rate:
            raise ValueError(
                f"optimizer has learning_rate {optimizer.learning_rate}, but "
                f"learning_rate={learning_rate}; give the same value to both"
            )
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)} or an UpdateRule, "
            f"got {type(optimizer).__name__}"
        )
    return make(optimizer, learning_rate)


def from_config(config: dict[str, Any]) -> UpdateRule:
    """Rebuild a rule from :meth:`UpdateRule.get_config` output."""
    options = dict(config)
    if "name" not in options or "learning_rate" not in options:
        raise ValueError(f"config must have 'name' and 'learning_rate' keys, got {sorted(config)}")
    return make(options.pop("name"), options.pop("learning_rate"), **options)
