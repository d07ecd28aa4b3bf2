"""The passes of a stack of dense layers, computed in place in preallocated buffers.

These are the numerics under every model of :mod:`downpour_dask.core.models` (through
:class:`~downpour_dask.core.model.Model`) and under each partition of a model-parallel MLP
(:mod:`downpour_dask.core.partition`): the forward pass, the output loss with its gradient, back
propagation and the L2 penalty.  ``layers`` and ``grads`` are lists of ``(W, b)`` views into a
flat parameter (or gradient) vector.

Nothing here allocates an array the size of a batch: every intermediate lives in a
:class:`Workspace`, because Dask workers set ``MALLOC_TRIM_THRESHOLD_``, which makes every large
numpy temporary an ``mmap`` plus page faults.
"""

from __future__ import annotations

import functools

import numpy as np

#: Hidden-layer activations the passes know.
ACTIVATIONS = ("relu", "tanh")
#: Output kinds: cross-entropy of a softmax, binary cross-entropy of a sigmoid, squared error.
OUTPUT_KINDS = ("softmax", "sigmoid", "linear")

Layers = list[tuple[np.ndarray, np.ndarray]]


class Workspace:
    """Buffers for a forward and backward pass of up to ``capacity`` rows.

    A batch of ``n <= capacity`` rows uses ``buf[:n]`` of each: ``acts`` (every layer's output,
    the last one the logits), ``deltas`` (the back-propagated gradients of the hidden layers),
    two columns, a mask of the logits' shape (:func:`exp_flushed`), the labels' flat indices and
    a column of ones for the output loss, and ``scratch`` for the L2 term.

    Parameters
    ----------
    widths : list of int
        Output width of every layer, the last one the model's output.
    capacity : int
        Most rows a batch may have.
    dtype : numpy dtype
        The compute dtype (that of the parameters).
    scratch : int
        Elements of the largest weight matrix.
    """

    def __init__(self, widths: list[int], capacity: int, dtype: np.dtype, scratch: int):
        self.capacity = capacity
        self.acts = [np.empty((capacity, w), dtype) for w in widths]  # last one: logits
        self.deltas = [np.empty((capacity, w), dtype) for w in widths[:-1]]
        self.col_a = np.empty((capacity, 1), dtype)
        self.col_b = np.empty((capacity, 1), dtype)
        self.flushed = np.empty((capacity, widths[-1]), bool)  # see exp_flushed
        self.rows = np.arange(capacity)
        self.picks = np.empty(capacity, np.int64)  # flat index of each row's label
        self.ones = np.ones((widths[-1], 1), dtype)  # the logits' row sums, as a product
        self.scratch = np.empty(scratch, dtype)  # l2 * W, at most the largest weight matrix
        self.partial: np.ndarray | None = None  # a block's gradient, for batches over capacity


def activate(z: np.ndarray, activation: str) -> None:
    """Apply the hidden activation to ``z`` in place."""
    if activation == "relu":
        np.maximum(z, 0, out=z)
    else:
        np.tanh(z, out=z)


def row_max(z: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Each row's largest value of ``z`` into the column ``out``; returns ``out``.

    numpy's reduction along short rows steps through them one at a time: over 256 rows of two
    logits it took 9 us, where one ``maximum`` per column takes 1 us.  So with few columns
    (at most 4, or one per 16 rows) the columns are compared in turn.
    """
    n, k = z.shape
    if k > 4 and 16 * k > n:
        return np.max(z, axis=1, keepdims=True, out=out)
    column = out[:, 0]
    np.copyto(column, z[:, 0])
    for j in range(1, k):
        np.maximum(column, z[:, j], out=column)
    return out


@functools.cache
def log_floor(dtype: np.dtype) -> float:
    """The log of the smallest probability the output passes resolve: ``sqrt(tiny)`` of
    ``dtype`` (about 1e-19 in float32; see :func:`exp_flushed` for why)."""
    return 0.5 * float(np.log(np.finfo(dtype).tiny))


def softplus(z: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """``log(1 + exp(z))`` into ``out``, stably, as ``max(z, 0) + log1p(exp(-|z|))``; ``tmp``
    (``z``'s shape) is scratch.  Returns ``out``.

    ``np.logaddexp(0, z)`` computes the same, but element by element without SIMD: over a
    logistic gradient's 250,000 rows it took longer than both matrix products together.
    ``exp(-|z|)`` is taken at :func:`log_floor` at least: beyond it (``|z|`` above 44 in
    float32) the result would be a subnormal number, many times slower to compute, so such a
    row's softplus is ``max(z, 0)`` plus ``sqrt(tiny)`` instead of plus something smaller.
    """
    np.abs(z, out=out)
    np.negative(out, out=out)
    np.maximum(out, log_floor(out.dtype), out=out)
    np.exp(out, out=out)  # in (0, 1]: no overflow, and log1p of it is exact to float precision
    np.log1p(out, out=out)
    np.maximum(z, 0, out=tmp)
    return np.add(out, tmp, out=out)


def exp_flushed(z: np.ndarray, flushed: np.ndarray) -> None:
    """``exp(z)`` in place for log-probabilities ``z``, with those below :func:`log_floor` set to
    exactly 0 (``flushed``, a bool array of ``z``'s shape, is scratch).

    Once a model is confident, most of a batch's wrong-class probabilities fall below float32's
    smallest normal number (a logit 88 below the row's largest), and so would the gradients
    back-propagated from them.  Arithmetic on such subnormal numbers takes a slow path on common
    CPUs, several times slower per operation, so a fitted model's steps would slow down the
    better it fits.  A probability below ``sqrt(tiny)`` changes no float32 gradient; as an exact
    0 it costs nothing, and what is kept stays normal through the backward pass's products.
    """
    floor = log_floor(z.dtype)
    np.less(z, floor, out=flushed)
    np.maximum(z, floor, out=z)
    np.exp(z, out=z)
    np.copyto(z, 0, where=flushed)


def times_derivative(delta: np.ndarray, a: np.ndarray, activation: str) -> None:
    """``delta *= act'(z)`` from the activation ``a = act(z)``, in place and without
    temporaries: ``a`` is overwritten with the derivative, so it must not be needed again.

    relu' is ``a > 0`` written as 1.0 / 0.0 into ``a``: numpy's ``sign`` gives the same values
    but is many times slower when it writes over its own input.
    """
    if activation == "relu":
        np.greater(a, 0, out=a)
    else:  # tanh' = 1 - tanh**2
        np.multiply(a, a, out=a)
        np.subtract(1, a, out=a)
    delta *= a


def forward(layers: Layers, X: np.ndarray, ws: Workspace, activation: str) -> np.ndarray:
    """Fill ``ws.acts[i][:n]`` with each layer's output; return the logits view."""
    a, n, last = X, X.shape[0], len(layers) - 1
    for i, (W, b) in enumerate(layers):
        z = ws.acts[i][:n]
        np.dot(a, W, out=z)
        z += b
        if i < last:
            activate(z, activation)
        a = z
    return a


def output_loss(kind: str, z: np.ndarray, y: np.ndarray, ws: Workspace, delta: bool) -> float:
    """Summed loss over the rows of logits ``z``; with ``delta``, z becomes d(sum)/dz.

    ``kind`` is one of :data:`OUTPUT_KINDS`; ``y`` holds int64 labels (softmax, sigmoid) or
    targets of ``z``'s size (linear: ``0.5 * sum((z - y)**2)``).
    """
    n = z.shape[0]
    if kind == "softmax":
        if not z.flags.c_contiguous:  # the labels are picked through a flat view of z
            raise ValueError("the logits must be C-contiguous (a Workspace's rows)")
        m, s = ws.col_a[:n], ws.col_b[:n]
        row_max(z, m)
        z -= m
        flat, at = z.reshape(-1), ws.picks[:n]  # a 1-d fancy index is cheaper than a 2-d one
        np.multiply(ws.rows[:n], z.shape[1], out=at)
        at += y
        picked = float(np.add.reduce(flat[at], dtype=np.float64))
        exp_flushed(z, ws.flushed[:n])
        np.dot(z, ws.ones, out=s)  # row sums: a matrix-vector product beats a short reduction
        if delta:  # softmax - onehot
            z /= s
            flat[at] -= 1
        return float(np.add.reduce(np.log(s, out=s), axis=None, dtype=np.float64)) - picked
    if kind == "sigmoid":
        sp, yf = ws.col_a[:n], ws.col_b[:n]
        softplus(z, out=sp, tmp=yf)  # loss per row = softplus(z) - y * z
        yf[:, 0] = y
        total = float(sp.sum(dtype=np.float64)) - float(np.vdot(yf, z))
        if delta:  # sigmoid(z) - y, with sigmoid(z) = exp(z - softplus(z)) (no overflow)
            np.subtract(z, sp, out=z)
            exp_flushed(z, ws.flushed[:n])
            z -= yf
        return total
    np.subtract(z, y.reshape(z.shape), out=z)  # residuals = d(sum)/dz
    return 0.5 * float(np.vdot(z, z))


def backward(
    layers: Layers,
    grads: Layers,
    X: np.ndarray,
    ws: Workspace,
    delta: np.ndarray,
    activation: str,
) -> None:
    """Back-propagate ``delta`` (dLoss/dlogits) into the gradient views ``grads``.

    Overwrites the hidden activations in ``ws`` (they become derivatives).
    """
    n = X.shape[0]
    for i in range(len(layers) - 1, -1, -1):
        a_prev = X if i == 0 else ws.acts[i - 1][:n]
        np.dot(a_prev.T, delta, out=grads[i][0])
        np.sum(delta, axis=0, out=grads[i][1])
        if i == 0:
            return
        d_prev = ws.deltas[i - 1][:n]
        np.dot(delta, layers[i][0].T, out=d_prev)
        times_derivative(d_prev, a_prev, activation)  # a_prev is not needed any more
        delta = d_prev


def penalty(
    layers: Layers,
    l2: float,
    grads: Layers | None = None,
    ws: Workspace | None = None,
    scale: float = 1.0,
) -> float:
    """``0.5 * l2 * sum(W**2)`` over the weight matrices (not biases); with ``grads`` (and the
    ``ws`` whose scratch it uses), also add ``scale * l2 * W`` to the weight gradients."""
    if l2 == 0:
        return 0.0
    total = 0.0
    for (W, _), (gW, _) in zip(layers, grads or layers, strict=True):
        total += float(np.vdot(W, W))
        if grads is not None:
            tmp = np.multiply(W, l2 * scale, out=ws.scratch[: W.size].reshape(W.shape))
            np.add(gW, tmp, out=gW)
    return 0.5 * l2 * total
