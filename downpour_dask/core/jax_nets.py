"""Networks written in JAX and built through the adapter: a convolutional network and an MLP.

:func:`cnn` is the image model: conv-pool-conv-pool-dense on rows of flattened images (mnist5k's
784 columns are 28x28 pixels), which the numpy models cannot express.  :func:`jax_mlp` is the
numpy :class:`~downpour_dask.core.models.MLP` written in JAX, to compare the two paths.  Both
return a :class:`~downpour_dask.core.jax_model.JaxModel` with a config, so
:func:`downpour_dask.models.from_config` rebuilds them (run directories, ``attach``).

The forward passes are module-level functions bound with :func:`functools.partial`: they pickle
by reference to the workers, where the adapter compiles them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .jax_model import JaxModel
from .params import DTYPE
from .validation import require_int

_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _dense_init(rng: np.random.Generator, fan_in: int, fan_out: int, relu: bool) -> tuple:
    """He-normal weights before a ReLU, Glorot-uniform before the output (as the numpy
    models); zero biases.  In numpy: JAX would compile every random op on its own."""
    if relu:
        w = rng.standard_normal((fan_in, fan_out), dtype=DTYPE) * np.float32(math.sqrt(2 / fan_in))
    else:
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        w = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(DTYPE)
    return w, np.zeros(fan_out, DTYPE)


def _dense_apply(layers: Sequence[tuple], h: jax.Array) -> jax.Array:
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    return h


def _mlp_init(sizes: tuple[int, ...], rng: np.random.Generator) -> list:
    last = len(sizes) - 2
    return [
        _dense_init(rng, a, b, relu=i < last)
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    ]


def _mlp_apply(params: list, X: jax.Array) -> jax.Array:
    return _dense_apply(params, X)


def jax_mlp(
    n_inputs: int, hidden: Sequence[int] = (128,), n_classes: int = 10, seed: int = 0
) -> JaxModel:
    """The numpy :class:`~downpour_dask.core.models.MLP` classifier (ReLU, softmax
    cross-entropy) written in JAX: ``init(rng)`` draws He/Glorot weights as it does."""
    sizes = (
        require_int("n_inputs", n_inputs, 1),
        *(require_int("hidden", h, 1) for h in hidden),
        require_int("n_classes", n_classes, 2),
    )
    init = functools.partial(_mlp_init, sizes)
    config = {
        "type": "jax_mlp",
        "n_inputs": n_inputs,
        "hidden": list(hidden),
        "n_classes": n_classes,
        "seed": seed,
    }
    return JaxModel(
        _mlp_apply,
        init(np.random.default_rng(seed)),
        n_inputs=n_inputs,
        n_classes=n_classes,
        init=init,
        init_from="numpy",
        config=config,
    )


def _cnn_init(
    shape: tuple, channels: tuple, kernel: int, dense: tuple, n_classes: int,
    rng: np.random.Generator,
) -> dict[str, Any]:  # fmt: skip
    conv, c_in = [], shape[2]
    for c_out in channels:
        scale = np.float32(math.sqrt(2.0 / (kernel * kernel * c_in)))
        w = rng.standard_normal((kernel, kernel, c_in, c_out), dtype=DTYPE) * scale
        conv.append((w, np.zeros(c_out, DTYPE)))
        c_in = c_out
    h, w = shape[0], shape[1]
    for _ in channels:  # each 2x2 max pool halves the image (rounding down)
        h, w = h // 2, w // 2
    sizes = (h * w * c_in, *dense, n_classes)
    return {"conv": conv, "dense": _mlp_init(sizes, rng)}


def _cnn_apply(shape: tuple, params: dict[str, Any], X: jax.Array) -> jax.Array:
    h = X.reshape((X.shape[0], *shape))
    for w, b in params["conv"]:
        h = lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=_DIMENSIONS)
        h = jax.nn.relu(h + b)
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return _dense_apply(params["dense"], h.reshape(h.shape[0], -1))


def cnn(
    image_shape: Sequence[int] = (28, 28),
    n_classes: int = 10,
    channels: Sequence[int] = (8, 16),
    kernel: int = 5,
    dense: Sequence[int] = (64,),
    seed: int = 0,
) -> JaxModel:
    """A convolutional classifier: per entry of ``channels`` a ``kernel`` x ``kernel``
    convolution (same padding, ReLU) and a 2x2 max pool, then dense ReLU layers of widths
    ``dense`` and a softmax output.

    Rows of ``X`` are images flattened in row-major order: ``image_shape`` is (height, width)
    or (height, width, channels), and ``n_inputs`` is their product (784 for 28x28).
    ``init(rng)`` draws He-normal weights from ``rng``; ``seed`` gives the pytree the model
    is built with.
    """
    shape = tuple(require_int("image_shape", s, 1) for s in image_shape)
    if len(shape) == 2:
        shape = (*shape, 1)
    if len(shape) != 3:
        raise ValueError(f"image_shape must be (height, width[, channels]), got {image_shape!r}")
    channels = tuple(require_int("channels", c, 1) for c in channels)
    dense = tuple(require_int("dense", d, 1) for d in dense)
    kernel, n_classes = require_int("kernel", kernel, 1), require_int("n_classes", n_classes, 2)
    if min(shape[:2]) < 2 ** len(channels):
        raise ValueError(
            f"image_shape {shape[:2]} is too small for {len(channels)} 2x2 poolings; "
            f"use at most {int(math.log2(min(shape[:2])))} entries in channels"
        )
    init = functools.partial(_cnn_init, shape, channels, kernel, dense, n_classes)
    config = {
        "type": "cnn",
        "image_shape": list(shape),
        "n_classes": n_classes,
        "channels": list(channels),
        "kernel": kernel,
        "dense": list(dense),
        "seed": seed,
    }
    return JaxModel(
        functools.partial(_cnn_apply, shape),
        init(np.random.default_rng(seed)),
        n_inputs=math.prod(shape),
        n_classes=n_classes,
        init=init,
        init_from="numpy",
        config=config,
    )


#: Builders :func:`downpour_dask.models.from_config` reaches by a config's ``"type"``.
BUILDERS = {"cnn": cnn, "jax_mlp": jax_mlp}
