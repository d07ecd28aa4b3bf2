"""The JAX adapter: a JAX model as a protocol model over one flat float32 vector.

:class:`JaxModel` (built by :func:`downpour_dask.models.from_jax`) takes an ``apply(params, X)``
function, or a whole ``objective(params, X, y)``, and a parameter pytree.  The pytree is flattened
once into one float32 vector (:func:`jax.flatten_util.ravel_pytree`), so the parameter server,
its shards and update rules see the same flat vector as for the numpy models; the model unravels
it inside the compiled function.

Compiled functions are never pickled.  A model carries its functions and its parameter pytree
(as numpy arrays) to the workers; the first call in each process compiles ``value_and_grad`` with
:func:`jax.jit` and keeps it in a per-process cache under the model's token, so every copy of
the same model in a worker (replicas, restarted replicas, evaluations) shares one compilation,
and every new batch shape is compiled once and then cached by JAX.

This module imports JAX: ``downpour_dask.models`` reaches it only when a JAX model is built, so
JAX stays an optional extra (``pip install downpour-dask[jax]``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .params import DTYPE
from .protocol import CUSTOM, default_check_data, score_predictions

#: Built-in objectives of :class:`JaxModel` when it is given ``apply``.
LOSSES = ("cross_entropy", "squared_error")
_CHUNK = 2048  # rows per forward pass in predict and loss
_COMPILED: dict[str, tuple[Callable, Callable, Callable]] = {}  # token -> jitted, per process
_INITS: dict[str, Callable] = {}  # token -> jitted init(key)
_LOCK = threading.Lock()


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer labels ``y`` under ``logits`` (n, n_classes)."""
    picked = jnp.take_along_axis(logits, y[:, None].astype(jnp.int32), axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)


def squared_error(pred: jax.Array, y: jax.Array) -> jax.Array:
    """``0.5 * mean_rows(sum_outputs((pred - y)**2))``, as the numpy regression models."""
    n = pred.shape[0]
    return 0.5 * jnp.mean(jnp.sum((pred.reshape(n, -1) - y.reshape(n, -1)) ** 2, axis=1))


class JaxModel:
    """A JAX model behind the model protocol (:mod:`downpour_dask.core.protocol`).

    Build it with :func:`downpour_dask.models.from_jax`, whose parameters it takes.  Attributes
    ``n_params``, ``n_inputs``, ``is_classifier``, ``n_classes`` (classifiers) or ``n_outputs``.
    """

    def __init__(
        self,
        apply: Callable[[Any, jax.Array], jax.Array],
        params: Any,
        *,
        n_inputs: int,
        n_classes: int | None = None,
        n_outputs: int | None = None,
        loss: str | Callable[[Any, jax.Array, jax.Array], jax.Array] = "cross_entropy",
        init: Callable[[Any], Any] | None = None,
        init_from: str = "key",
        config: dict[str, Any] | None = None,
    ):
        if not callable(apply):
            raise TypeError(f"apply must be a function apply(params, X), got {apply!r}")
        if not (callable(loss) or loss in LOSSES):
            raise ValueError(f"loss must be one of {LOSSES} or a function, got {loss!r}")
        if init is not None and not callable(init):
            raise TypeError(f"init must be a function init(key) -> params pytree, got {init!r}")
        if init_from not in ("key", "numpy"):
            raise ValueError(f"init_from must be 'key' or 'numpy', got {init_from!r}")
        if isinstance(n_inputs, bool) or not isinstance(n_inputs, (int, np.integer)):
            raise TypeError(f"n_inputs must be an int, got {n_inputs!r}")
        self.is_classifier = loss == "cross_entropy" or (callable(loss) and n_classes is not None)
        if self.is_classifier:
            if not isinstance(n_classes, (int, np.integer)) or n_classes < 2:
                raise ValueError(
                    f"a classifier (loss='cross_entropy' or a loss function with n_classes) "
                    f"needs n_classes >= 2, got {n_classes!r}"
                )
            self.n_classes = self.n_outputs = int(n_classes)
        else:
            self.n_outputs = 1 if n_outputs is None else int(n_outputs)
        leaves = jax.tree_util.tree_leaves(params)
        if not leaves or not all(np.issubdtype(np.asarray(v).dtype, np.floating) for v in leaves):
            raise TypeError("params must be a pytree of floating-point arrays (at least one)")
        # Pickled to the workers: numpy leaves, never device arrays or compiled functions.
        self._template = jax.tree_util.tree_map(lambda v: np.asarray(v, DTYPE), params)
        self.n_params = int(sum(np.size(v) for v in jax.tree_util.tree_leaves(self._template)))
        self.n_inputs = int(n_inputs)
        self.apply, self.objective, self._init, self._init_from = apply, loss, init, init_from
        self._config = None if config is None else dict(config)
        self._token = uuid.uuid4().hex

    def __repr__(self) -> str:
        name = getattr(self.apply, "__qualname__", type(self.apply).__name__)
        return f"JaxModel(apply={name}, n_params={self.n_params}, n_inputs={self.n_inputs})"

    def get_config(self) -> dict[str, Any]:
        """The builder's config (:func:`downpour_dask.models.cnn` ...), which
        :func:`~downpour_dask.models.from_config` rebuilds from; else a description of type
        ``"custom"`` (a run directory of it is read with ``load_run(path, model=...)``)."""
        if self._config is not None:
            return dict(self._config)
        name = getattr(self.apply, "__qualname__", type(self.apply).__name__)
        module = getattr(self.apply, "__module__", "?")
        return {
            "type": CUSTOM,
            "class": "JaxModel",
            "apply": f"{module}.{name}",
            "n_params": self.n_params,
        }

    # -- compiled functions: per process, never pickled -------------------------------------------

    def _objective(self, tree: Any, X: jax.Array, y: jax.Array) -> jax.Array:
        if callable(self.objective):
            return self.objective(tree, X, y)
        out = self.apply(tree, X)
        return cross_entropy(out, y) if self.objective == "cross_entropy" else squared_error(out, y)

    def _functions(self) -> tuple[Callable, Callable, Callable]:
        """``(value_and_grad, forward, objective)`` over the flat vector, jitted once per
        process for this model (and its copies) and shared by every thread."""
        fns = _COMPILED.get(self._token)
        if fns is None:
            with _LOCK:
                fns = _COMPILED.get(self._token)
                if fns is None:
                    _, unravel = ravel_pytree(self._template)

                    def objective(flat: jax.Array, X: jax.Array, y: jax.Array) -> jax.Array:
                        return self._objective(unravel(flat), X, y)

                    def forward(flat: jax.Array, X: jax.Array) -> jax.Array:
                        return self.apply(unravel(flat), X)

                    fns = (
                        jax.jit(jax.value_and_grad(objective)),
                        jax.jit(forward),
                        jax.jit(objective),
                    )
                    _COMPILED[self._token] = fns
        return fns

    # -- the protocol -----------------------------------------------------------------------------

    def init(self, rng: np.random.Generator | int | None) -> np.ndarray:
        """Initial float32 vector: ``init(key)`` of a key drawn from ``rng`` when the model has
        an ``init`` function (``init(rng)`` itself with ``init_from="numpy"``), else the
        ``params`` it was built with (the same for every rng)."""
        if self._init is None:
            tree = self._template
        elif self._init_from == "numpy":
            tree = self._init(np.random.default_rng(rng))
        else:
            seed = int(np.random.default_rng(rng).integers(2**31 - 1))
            with _LOCK:  # compiled once per process too: eager, each op would compile alone
                init = _INITS.get(self._token) or _INITS.setdefault(
                    self._token, jax.jit(self._init)
                )
            tree = init(jax.random.PRNGKey(seed))
        flat, _ = ravel_pytree(tree)
        if flat.size != self.n_params:
            raise ValueError(
                f"init returned {flat.size} parameters, but the model has {self.n_params}"
            )
        return np.array(flat, dtype=DTYPE)

    def loss_and_grad(
        self,
        params: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> tuple[float, np.ndarray]:
        """Mean loss over the batch and its gradient (times ``scale``), as
        :meth:`downpour_dask.core.model.Model.loss_and_grad`; JAX computes in float32."""
        if out is None:
            out = np.empty(self.n_params, params.dtype)
        elif (
            out.shape != (self.n_params,)
            or out.dtype != params.dtype
            or not out.flags.c_contiguous
            or np.may_share_memory(out, params)
        ):
            raise ValueError(
                f"out must be a contiguous {params.dtype} vector of {self.n_params} elements "
                f"not sharing memory with params, got {out.dtype} of shape {out.shape}"
            )
        value, grad = self._functions()[0](params, X, y)
        np.multiply(np.asarray(grad), scale, out=out, casting="unsafe")
        return float(value), out

    def _forward(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        forward = self._functions()[1]
        return np.concatenate(
            [np.asarray(forward(params, X[lo : lo + _CHUNK])) for lo in range(0, len(X), _CHUNK)]
        )

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class labels (int64) for classifiers, else float32 outputs ((n,) for one output)."""
        out = self._forward(params, X)
        if self.is_classifier:
            return out.argmax(axis=1).astype(np.int64)
        out = out.reshape(len(X), -1).astype(DTYPE)
        return out[:, 0] if out.shape[1] == 1 else out

    def predict_proba(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class probabilities (softmax of the outputs); ``loss="cross_entropy"`` only, where
        the outputs are logits (a loss function of the user's says nothing of what they are)."""
        if self.objective != "cross_entropy":
            raise AttributeError(
                "predict_proba needs loss='cross_entropy' (outputs that are logits); this model "
                "has its own loss function"
            )
        logits = self._forward(params, X).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        odds = np.exp(logits)
        return odds / odds.sum(axis=1, keepdims=True)

    def score(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Accuracy for classifiers; R^2 averaged over outputs for regressors."""
        return score_predictions(self.predict(params, X), y, self.is_classifier)

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """The objective of :meth:`loss_and_grad` without the gradient, in row blocks."""
        objective = self._functions()[2]
        total = sum(
            float(objective(params, X[lo : lo + _CHUNK], y[lo : lo + _CHUNK]))
            * len(X[lo : lo + _CHUNK])
            for lo in range(0, len(X), _CHUNK)
        )
        return total / len(X)

    def check_data(self, X: Any, y: Any = None) -> tuple[np.ndarray, Any]:
        """Validate user data once (see :func:`~downpour_dask.core.protocol.default_check_data`)."""
        return default_check_data(self, X, y)
