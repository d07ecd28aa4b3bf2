"""The models users build: linear, logistic and softmax regression, and the MLP.

Each is a :class:`~downpour_dask.core.model.Model` -- a stack of dense layers whose parameters
live in one flat float32 vector -- that only chooses its layer sizes, hidden activation and
output kind, and checks its constructor arguments.  :func:`from_config` rebuilds any of them from
:meth:`Model.get_config`, which is how run directories and checkpoints name their model.

This module is also ``downpour_dask.models``: it re-exports :class:`Model` so that
``models.Model`` works wherever the concrete models do, and the model protocol
(:class:`TrainableModel`, :func:`check_model`) that any model of a user's satisfies.

JAX models (:func:`from_jax`, :func:`cnn`, :func:`jax_mlp`) live in
:mod:`downpour_dask.core.jax_model` and :mod:`downpour_dask.core.jax_nets`, which import JAX.  JAX
is an optional extra, so those functions import them when called: ``import downpour_dask`` never
needs JAX.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dense import ACTIVATIONS
from .model import Model
from .protocol import CUSTOM, TrainableModel, check_model
from .validation import require_int, require_l2

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "MODELS",
    "OUTPUTS",
    "LinearRegression",
    "LogisticRegression",
    "Model",
    "SoftmaxRegression",
    "TrainableModel",
    "check_model",
    "cnn",
    "from_config",
    "from_jax",
    "jax_mlp",
]

#: Output layers an :class:`MLP` can have: a classifier's softmax or a regressor's identity.
OUTPUTS = ("softmax", "linear")


class LinearRegression(Model):
    """Least squares, ``W`` (n_inputs, n_outputs) and ``b`` (n_outputs,); see :class:`Model`."""

    def __init__(self, n_inputs: int, n_outputs: int = 1, l2: float = 0.0):
        n_outputs = require_int("n_outputs", n_outputs, 1)
        self._build(require_int("n_inputs", n_inputs, 1), n_outputs, "linear", require_l2(l2))


class LogisticRegression(Model):
    """Binary logistic regression on labels 0/1, mean binary cross-entropy (stable).

    One weight column ``W`` (n_inputs, 1) and bias ``b`` (1,): ``n_outputs`` is 1 and
    ``n_classes`` is 2.
    """

    def __init__(self, n_inputs: int, l2: float = 0.0):
        self._build(require_int("n_inputs", n_inputs, 1), 1, "sigmoid", require_l2(l2))


class SoftmaxRegression(Model):
    """Multinomial logistic regression (mean cross-entropy of a stable log-softmax).

    Parameters ``W`` (n_inputs, n_classes) and ``b`` (n_classes,); ``n_outputs == n_classes``.
    """

    def __init__(self, n_inputs: int, n_classes: int, l2: float = 0.0):
        n_classes = require_int("n_classes", n_classes, 2)
        self._build(require_int("n_inputs", n_inputs, 1), n_classes, "softmax", require_l2(l2))


class MLP(Model):
    """Fully connected network: ``hidden`` layers with ReLU or tanh, then the output layer.

    ``output="softmax"`` makes a classifier (cross-entropy, ``n_classes = n_outputs``);
    ``output="linear"`` a regressor with :class:`LinearRegression`'s squared error.
    Parameters are ``W0, b0, W1, b1, ...`` in layer order, ``W_i`` of shape
    (fan_in, fan_out); ``hidden=()`` means no hidden layer.
    """

    def __init__(
        self,
        n_inputs: int,
        hidden: Sequence[int] = (128,),
        n_outputs: int = 10,
        activation: str = "relu",
        output: str = "softmax",
        l2: float = 0.0,
    ):
        n_inputs = require_int("n_inputs", n_inputs, 1)
        if isinstance(hidden, (int, np.integer)) and not isinstance(hidden, bool):
            hidden = (hidden,)
        if isinstance(hidden, (str, bytes)) or not np.iterable(hidden):
            raise TypeError(f"hidden must be a sequence of layer widths, got {hidden!r}")
        self.hidden = tuple(require_int(f"hidden[{i}]", h, 1) for i, h in enumerate(hidden))
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        n_outputs = require_int("n_outputs", n_outputs, 2 if output == "softmax" else 1)
        self.activation, self.output = activation, output
        self._build(
            n_inputs, n_outputs, output, require_l2(l2), self.hidden, activation, numbered=True
        )


MODELS: dict[str, type[Model]] = {
    cls.__name__: cls for cls in (LinearRegression, LogisticRegression, SoftmaxRegression, MLP)
}


#: Config types of the JAX networks (:mod:`downpour_dask.core.jax_nets`).
JAX_NETS = ("cnn", "jax_mlp")


def from_jax(apply: Any, params: Any, **kwargs: Any) -> Any:
    """Wrap a JAX model as a protocol model (needs the ``jax`` extra).

    Parameters
    ----------
    apply : callable
        ``apply(params, X) -> outputs``: logits (n, n_classes) for ``loss="cross_entropy"``,
        predictions (n,) or (n, n_outputs) for ``loss="squared_error"``.  ``X`` is a float32
        (n, n_inputs) batch.  A pure JAX function; it is compiled on each worker.
    params : pytree
        The parameters (dicts, lists, tuples of arrays, a Flax ``params`` dict, or the array
        part of an Equinox module from ``eqx.partition``); flattened into one float32 vector.
    n_inputs : int
        Features per row of X.
    n_classes : int, optional
        Classes of a classifier; needed with ``loss="cross_entropy"`` or a classifier's own
        loss function.
    n_outputs : int, optional
        Outputs of a regressor (default 1).
    loss : {"cross_entropy", "squared_error"} or callable, default "cross_entropy"
        The objective, a **mean** over the batch.  A callable ``loss(params, X, y)`` replaces it
        (add penalties there); it makes a classifier if ``n_classes`` is given.
    init : callable, optional
        ``init(key) -> params pytree``; ``model.init(rng)`` then draws a key from ``rng``.
        Without it every ``init`` returns ``params``.
    init_from : {"key", "numpy"}, default "key"
        ``"numpy"``: ``init`` takes the numpy Generator itself (numpy initialisers compile
        nothing; each eager ``jax.random`` call compiles on its own).
    config : dict, optional
        What ``get_config`` returns (``from_config`` rebuilds only the types it knows).

    Returns
    -------
    JaxModel
        See :class:`downpour_dask.core.jax_model.JaxModel`.
    """
    from .jax_model import JaxModel

    return JaxModel(apply, params, **kwargs)


def cnn(**kwargs: Any) -> Any:
    """A JAX convolutional classifier (conv-pool-conv-pool-dense) for flattened images; see
    :func:`downpour_dask.core.jax_nets.cnn` for the arguments (needs the ``jax`` extra)."""
    from .jax_nets import cnn as build

    return build(**kwargs)


def jax_mlp(n_inputs: int, hidden: Sequence[int] = (128,), n_classes: int = 10, seed: int = 0):
    """The :class:`MLP` classifier written in JAX (needs the ``jax`` extra); see
    :func:`downpour_dask.core.jax_nets.jax_mlp`."""
    from .jax_nets import jax_mlp as build

    return build(n_inputs, hidden, n_classes, seed)


def from_config(config: dict[str, Any]) -> Model | TrainableModel:
    """Rebuild a model from its ``get_config()`` output: the four numpy models, and the JAX
    networks :func:`cnn` and :func:`jax_mlp` (with JAX installed).

    Raises
    ------
    ValueError
        If ``config["type"]`` is not a model of this module (e.g. a user's own model, whose
        config only describes it), or names arguments it does not take.
    """
    kwargs = dict(config)
    kind = kwargs.pop("type", None)
    if kind in JAX_NETS:
        from .jax_nets import BUILDERS

        return BUILDERS[kind](**kwargs)
    if kind not in MODELS:
        what = f"{kind!r}" if kind != CUSTOM else f"a user's model ({config.get('class')})"
        raise ValueError(
            f"config['type'] must be one of {sorted([*MODELS, *JAX_NETS])}, got {what}: "
            f"only those can be rebuilt from a config; pass the model itself"
        )
    cls = MODELS[kind]
    unknown = sorted(set(kwargs) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(f"config for {kind} has unknown argument(s) {unknown}")
    return cls(**kwargs)
