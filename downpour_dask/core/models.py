"""Numpy models whose parameters live in one flat float32 vector.

Downpour SGD ships parameters and gradients between replicas and parameter-server
shards as flat ``float32`` vectors (see :mod:`downpour_dask.params`), so every model
here reads its weight matrices as zero-copy views of such a vector and writes its
gradient straight into views of a caller-supplied ``out`` vector.

All four models are stacks of dense layers run by one engine in :class:`Model`; the
linear ones have no hidden layer.  ``loss_and_grad`` runs thousands of times a second
inside Dask workers, so it works in place in per-thread workspaces (activations and
deltas, sized for the largest batch seen): Dask workers set ``MALLOC_TRIM_THRESHOLD_``,
which makes every large numpy temporary an ``mmap`` plus page faults.  Workspaces are
dropped on pickling, so models stay cheap to send.  Computation runs in the dtype of
``params``: float32 normally, float64 for exact finite-difference gradient checks.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from downpour_dask.core.params import DTYPE, ParamLayout

ACTIVATIONS = ("relu", "tanh")
OUTPUTS = ("softmax", "linear")
_CHUNK = 2048  # rows per forward pass in loss/predict/score: bounds the workspace size


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_l2(l2: Any) -> float:
    if isinstance(l2, bool) or not isinstance(l2, (int, float, np.integer, np.floating)):
        raise TypeError(f"l2 must be a real number, got {type(l2).__name__} {l2!r}")
    if not (math.isfinite(l2) and l2 >= 0):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    return float(l2)


def _numeric(name: str, value: Any) -> np.ndarray:
    """``value`` as an array of real numbers, or a TypeError/ValueError naming ``name``."""
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular array of numbers; {exc}") from None
    if arr.dtype.kind == "O":
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must contain real numbers, got Python objects that are not numbers"
            ) from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must contain real numbers (bool, int or float), got dtype {arr.dtype}"
        )
    return arr


def _to_float32(name: str, arr: np.ndarray) -> np.ndarray:
    """C-contiguous float32 version of ``arr``; NaN/inf (also from overflow) rejected."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.ascontiguousarray(arr, dtype=DTYPE)
    rows = out.reshape(out.shape[0], -1)
    for lo in range(0, rows.shape[0], 8192):  # blockwise: no bool temporary the size of X
        if not np.isfinite(rows[lo : lo + 8192]).all():
            bad = ~np.isfinite(rows)
            raise ValueError(
                f"{name} contains {int(bad.sum())} NaN or infinite value(s), first in row "
                f"{int(np.argmax(bad.any(axis=1)))} (values beyond float32's ~3.4e38 count "
                "too); remove or impute them"
            )
    return out


def times_derivative(delta: np.ndarray, a: np.ndarray, activation: str) -> None:
    """``delta *= act'(z)`` from the activation ``a = act(z)``, in place and without
    temporaries: ``a`` is overwritten with the derivative, so it must not be needed again."""
    if activation == "relu":
        np.sign(a, out=a)
    else:  # tanh' = 1 - tanh**2
        np.multiply(a, a, out=a)
        np.subtract(1, a, out=a)
    delta *= a


class _Workspace:
    """Buffers for up to ``capacity`` rows; a batch of ``n <= capacity`` uses ``buf[:n]``."""

    def __init__(self, widths: list[int], capacity: int, dtype: np.dtype, scratch: int):
        self.capacity = capacity
        self.acts = [np.empty((capacity, w), dtype) for w in widths]  # last one: logits
        self.deltas = [np.empty((capacity, w), dtype) for w in widths[:-1]]
        self.col_a = np.empty((capacity, 1), dtype)
        self.col_b = np.empty((capacity, 1), dtype)
        self.rows = np.arange(capacity)
        self.scratch = np.empty(scratch, dtype)  # l2 * W, at most the largest weight matrix


class Model:
    """A stack of dense layers over a flat parameter vector (base of every model here).

    Subclasses choose the layer sizes, the hidden activation and the output kind:
    ``"softmax"`` (cross-entropy), ``"sigmoid"`` (binary cross-entropy) or ``"linear"``
    (``0.5 * mean_rows(sum_outputs((pred - y)**2))``).  The objective is the mean loss
    over the batch plus ``0.5 * l2 * sum(W**2)`` over weight matrices (not biases).

    Attributes
    ----------
    n_inputs, n_outputs : int
        Feature width and output width.
    layout : ParamLayout
        Names and shapes of the parameters inside the flat vector.
    l2 : float
        L2 penalty strength on weight matrices.
    n_classes : int
        Number of classes (classifiers only).
    """

    def _build(
        self,
        n_inputs: int,
        hidden: Sequence[int],
        n_outputs: int,
        activation: str,
        kind: str,
        l2: float,
        numbered: bool,
    ) -> None:
        self.n_inputs, self.n_outputs, self.l2 = n_inputs, n_outputs, l2
        self._act, self._kind = activation, kind
        self._widths = [*hidden, n_outputs]
        fans = list(zip([n_inputs, *hidden], self._widths, strict=True))
        names = [(f"W{i}", f"b{i}") for i in range(len(fans))] if numbered else [("W", "b")]
        shapes: dict[str, tuple[int, ...]] = {}
        for (w, b), (fan_in, fan_out) in zip(names, fans, strict=True):
            shapes[w], shapes[b] = (fan_in, fan_out), (fan_out,)
        self._names, self.layout = names, ParamLayout(shapes)
        self._scratch_size = max(a * b for a, b in fans)
        if self.is_classifier:
            self.n_classes = 2 if kind == "sigmoid" else n_outputs
        self._ws: dict[tuple[int, str], _Workspace] = {}

    @property
    def is_classifier(self) -> bool:
        """True for models that predict class labels (softmax or sigmoid output)."""
        return self._kind != "linear"

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments plus ``"type"`` (the class name)."""
        config: dict[str, Any] = {"type": type(self).__name__}
        for name in inspect.signature(type(self)).parameters:  # each is stored as an attribute
            value = getattr(self, name)
            config[name] = list(value) if isinstance(value, tuple) else value
        return config

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Model) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "type")
        return f"{type(self).__name__}({args})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ws": {}}  # workspaces are rebuilt on first use

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """New float32 parameters: He-normal weights before ReLU, Glorot-uniform elsewhere.

        Biases start at zero.  The result depends only on the state of ``rng`` (a
        Generator, or a seed for :func:`numpy.random.default_rng`), so replicas that seed
        alike start from the same point.
        """
        rng = np.random.default_rng(rng)
        flat = self.layout.zeros()
        views = self.layout.views(flat)
        for i, (w_name, _) in enumerate(self._names):
            w = views[w_name]
            fan_in, fan_out = w.shape
            if self._act == "relu" and i < len(self._names) - 1:
                rng.standard_normal(dtype=DTYPE, out=w)
                w *= math.sqrt(2.0 / fan_in)
            else:
                limit = math.sqrt(6.0 / (fan_in + fan_out))
                rng.random(dtype=DTYPE, out=w)
                w *= 2 * limit
                w -= limit
        return flat

    # -- the engine: cheap checks, workspaces, forward, output loss, backward, penalty ----

    def _layers(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        views = self.layout.views(flat)
        return [(views[w], views[b]) for w, b in self._names]

    def _prepare(self, params: np.ndarray, X: np.ndarray) -> tuple[np.dtype, np.ndarray]:
        """O(1) checks for the hot path; returns the compute dtype and X in it."""
        if params.dtype not in (np.float32, np.float64):
            raise TypeError(f"params must be float32 (or float64 for checks), got {params.dtype}")
        if X.ndim != 2 or X.shape[1] != self.n_inputs or X.shape[0] == 0:
            raise ValueError(
                f"X must have shape (n_samples >= 1, {self.n_inputs}), got "
                f"{X.shape}; validate user data with check_data"
            )
        return params.dtype, (X if X.dtype == params.dtype else X.astype(params.dtype))

    def _workspace(self, n: int, dtype: np.dtype) -> _Workspace:
        key = (threading.get_ident(), dtype.char)  # per thread: a model may be shared
        ws = self._ws.get(key)
        if ws is None or ws.capacity < n:
            ws = self._ws[key] = _Workspace(self._widths, n, dtype, self._scratch_size)
        return ws

    def _forward(self, layers: list, X: np.ndarray, ws: _Workspace) -> np.ndarray:
        """Fill ``ws.acts[i][:n]`` with each layer's output; return the logits view."""
        a, n, last = X, X.shape[0], len(layers) - 1
        for i, (W, b) in enumerate(layers):
            z = ws.acts[i][:n]
            np.dot(a, W, out=z)
            z += b
            if i < last and self._act == "relu":
                np.maximum(z, 0, out=z)
            elif i < last:
                np.tanh(z, out=z)
            a = z
        return a

    def _output_loss(self, z: np.ndarray, y: np.ndarray, ws: _Workspace, delta: bool) -> float:
        """Summed loss over the rows of logits ``z``; with ``delta``, z becomes d(sum)/dz."""
        n = z.shape[0]
        if self._kind == "softmax":
            m, s = ws.col_a[:n], ws.col_b[:n]
            np.max(z, axis=1, keepdims=True, out=m)
            z -= m
            picked = float(z[ws.rows[:n], y].sum(dtype=np.float64))
            np.exp(z, out=z)
            np.sum(z, axis=1, keepdims=True, out=s)
            if delta:  # softmax - onehot
                z /= s
                z[ws.rows[:n], y] -= 1
            return float(np.log(s, out=s).sum(dtype=np.float64)) - picked
        if self._kind == "sigmoid":
            sp, yf = ws.col_a[:n], ws.col_b[:n]
            np.logaddexp(0, z, out=sp)  # softplus(z); loss per row = softplus(z) - y * z
            yf[:, 0] = y
            total = float(sp.sum(dtype=np.float64)) - float(np.vdot(yf, z))
            if delta:  # sigmoid(z) - y, with sigmoid(z) = exp(z - softplus(z)) (no overflow)
                np.subtract(z, sp, out=z)
                np.exp(z, out=z)
                z -= yf
            return total
        np.subtract(z, y.reshape(n, self.n_outputs), out=z)  # residuals = d(sum)/dz
        return 0.5 * float(np.vdot(z, z))

    def _backward(
        self, layers: list, grads: list, X: np.ndarray, ws: _Workspace, delta: np.ndarray
    ) -> None:
        """Back-propagate ``delta`` (dLoss/dlogits) into the gradient views ``grads``."""
        n = X.shape[0]
        for i in range(len(layers) - 1, -1, -1):
            a_prev = X if i == 0 else ws.acts[i - 1][:n]
            np.dot(a_prev.T, delta, out=grads[i][0])
            np.sum(delta, axis=0, out=grads[i][1])
            if i == 0:
                return
            d_prev = ws.deltas[i - 1][:n]
            np.dot(delta, layers[i][0].T, out=d_prev)
            times_derivative(d_prev, a_prev, self._act)  # a_prev is not needed any more
            delta = d_prev

    def _penalty(
        self, layers: list, grads: list | None, ws: _Workspace | None, scale: float = 1.0
    ) -> float:
        """``0.5 * l2 * sum(W**2)``; with ``grads``, also add ``scale * l2 * W`` to the weight
        gradients."""
        if self.l2 == 0:
            return 0.0
        total = 0.0
        for (W, _), (gW, _) in zip(layers, grads or layers, strict=True):
            total += float(np.vdot(W, W))
            if grads is not None:
                tmp = np.multiply(W, self.l2 * scale, out=ws.scratch[: W.size].reshape(W.shape))
                np.add(gW, tmp, out=gW)
        return 0.5 * self.l2 * total

    def _chunks(self, params: np.ndarray, X: np.ndarray) -> Iterator[tuple]:
        """Yield ``(lo, hi, logits, workspace)`` for row blocks of at most ``_CHUNK`` rows."""
        dtype, X = self._prepare(params, np.asarray(X))
        layers = self._layers(params)
        for lo in range(0, X.shape[0], _CHUNK):
            hi = min(lo + _CHUNK, X.shape[0])
            ws = self._workspace(hi - lo, dtype)
            yield lo, hi, self._forward(layers, X[lo:hi], ws), ws

    # -- public API -------------------------------------------------------------------

    def loss_and_grad(
        self,
        params: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> tuple[float, np.ndarray]:
        """Objective on one batch and its gradient (times ``scale``), a flat vector of
        ``layout.size``.

        Parameters
        ----------
        params : ndarray
            Flat float32 parameter vector; not modified.
        X, y : ndarray
            A batch as returned by :meth:`check_data` (not re-validated: this is the hot path).
        out : ndarray, optional
            Contiguous flat vector of ``params``' dtype that receives the gradient, so the
            call allocates nothing once its workspace exists.
        scale : float, default 1
            Multiplies the gradient, not the loss.  The scaling is folded into the backward
            pass at no cost, so a caller that wants ``lr * grad`` (an SGD step) saves a pass
            over the parameter vector.

        Returns
        -------
        loss : float
            Mean loss over the batch plus the L2 penalty.
        grad : ndarray
            ``out`` if given, else a new vector.
        """
        dtype, X = self._prepare(params, X)
        if out is None:
            out = np.empty(self.layout.size, dtype)
        elif (
            out.shape != (self.layout.size,)
            or out.dtype != dtype
            or not out.flags.c_contiguous
            or np.may_share_memory(out, params)
        ):
            raise ValueError(
                f"out must be a contiguous {dtype} vector of {self.layout.size} "
                f"elements not sharing memory with params, got {out.dtype} of "
                f"shape {out.shape}"
            )
        n = X.shape[0]
        layers, grads = self._layers(params), self._layers(out)
        ws = self._workspace(n, dtype)
        z = self._forward(layers, X, ws)
        data_loss = self._output_loss(z, y, ws, delta=True) / n
        z *= scale / n
        self._backward(layers, grads, X, ws, z)
        return data_loss + self._penalty(layers, grads, ws, scale), out

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """The objective of :meth:`loss_and_grad`, without the gradient, in row blocks."""
        total = 0.0
        for lo, hi, z, ws in self._chunks(params, X):
            total += self._output_loss(z, y[lo:hi], ws, delta=False)
        return total / len(X) + self._penalty(self._layers(params), None, None)

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class labels (int64, (n,)) or regression outputs (float32, (n,) or (n, n_outputs))."""
        if self.is_classifier:
            labels = np.empty(len(X), np.int64)
            for lo, hi, z, _ in self._chunks(params, X):
                labels[lo:hi] = (z[:, 0] > 0) if self._kind == "sigmoid" else z.argmax(axis=1)
            return labels
        pred = np.empty((len(X), self.n_outputs), DTYPE)
        for lo, hi, z, _ in self._chunks(params, X):
            pred[lo:hi] = z
        return pred[:, 0] if self.n_outputs == 1 else pred

    def predict_proba(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class probabilities, shape (n, n_classes), rows summing to one (classifiers only)."""
        if not self.is_classifier:
            raise TypeError(
                f"predict_proba needs a classifier; {type(self).__name__} is a regression model"
            )
        proba = np.empty((len(X), self.n_classes), DTYPE)
        for lo, hi, z, _ in self._chunks(params, X):
            p = proba[lo:hi]
            if self._kind == "sigmoid":  # log P(1) = -softplus(-z), log P(0) = -softplus(z)
                p[:, 1] = np.exp(-np.logaddexp(0, -z[:, 0]))
                p[:, 0] = np.exp(-np.logaddexp(0, z[:, 0]))
            else:
                np.subtract(z, z.max(axis=1, keepdims=True), out=p)
                np.exp(p, out=p)
                p /= p.sum(axis=1, keepdims=True)
        return proba

    def score(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Accuracy for classifiers; R^2 averaged over outputs (as sklearn's r2_score) else."""
        pred = self.predict(params, X)
        if self.is_classifier:
            return float(np.mean(pred == np.asarray(y).reshape(pred.shape)))
        truth = np.asarray(y, np.float64).reshape(len(pred), -1)
        pred = pred.astype(np.float64).reshape(truth.shape)
        sse = ((truth - pred) ** 2).sum(axis=0)
        sst = ((truth - truth.mean(axis=0)) ** 2).sum(axis=0)
        # constant targets: a perfect fit scores 1, anything else 0 (sklearn's force_finite)
        r2 = np.where(sst > 0, 1 - sse / np.where(sst > 0, sst, 1), np.where(sse == 0, 1.0, 0.0))
        return float(r2.mean())

    def check_data(self, X: Any, y: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Validate user data once and convert it to what the hot path expects.

        Returns
        -------
        X : ndarray
            C-contiguous float32 of shape (n_samples, n_inputs).
        y : ndarray or None
            int64 labels of shape (n,) for classifiers; float32 targets of shape (n,) if
            ``n_outputs == 1`` else (n, n_outputs) for regression; None if y is None.

        Raises
        ------
        TypeError
            Non-numeric X or y.
        ValueError
            Wrong shapes, empty X, NaN/inf, or labels outside ``0..n_classes-1``.
        """
        name = type(self).__name__
        X = _numeric("X", X)
        if X.ndim != 2:
            raise ValueError(
                f"X must be a 2-D array of shape (n_samples, n_features), got a "
                f"{X.ndim}-D array of shape {X.shape}; use X.reshape(1, -1) for "
                "a single sample"
            )
        if X.shape[0] == 0:
            raise ValueError(f"X is empty: got 0 samples (shape {X.shape}); at least 1 is needed")
        if X.shape[1] != self.n_inputs:
            raise ValueError(
                f"X has {X.shape[1]} features, but {name} expects "
                f"{self.n_inputs} features (n_inputs)"
            )
        X = _to_float32("X", X)
        if y is None:
            return X, None
        y = _numeric("y", y)
        if y.ndim == 0 or y.shape[0] != X.shape[0]:
            got = "a scalar" if y.ndim == 0 else f"{y.shape[0]} rows"
            raise ValueError(
                f"X and y must have the same number of samples: X has "
                f"{X.shape[0]} rows, y has {got}"
            )
        if y.ndim == 2 and y.shape[1] == 1 and (self.is_classifier or self.n_outputs == 1):
            y = y[:, 0]
        if self.is_classifier:
            return X, self._check_labels(y)
        if y.shape[1:] != ((self.n_outputs,) if self.n_outputs > 1 else ()):
            want = "(n_samples,)" if self.n_outputs == 1 else f"(n_samples, {self.n_outputs})"
            raise ValueError(
                f"y has shape {y.shape}, but {name} expects {self.n_outputs} "
                f"target column(s) (n_outputs): shape {want}"
            )
        return X, _to_float32("y", y)

    def _check_labels(self, y: np.ndarray) -> np.ndarray:
        k = self.n_classes
        if y.ndim != 1:
            raise ValueError(
                f"y must be a 1-D array of class labels of shape (n_samples,), "
                f"got shape {y.shape} (one-hot labels? pass y.argmax(axis=1))"
            )
        if y.dtype.kind == "f":
            odd = ~np.isfinite(y) | (y != np.round(y))
            if odd.any():
                raise ValueError(
                    f"y must contain integer class labels 0..{k - 1}, got "
                    f"non-integer values {np.unique(y[odd])[:10].tolist()}"
                )
        bad = (y < 0) | (y >= k)
        if bad.any():
            vals = [int(v) for v in np.unique(y[bad])[:10]]
            raise ValueError(
                f"y contains labels {vals} outside the model's classes 0..{k - 1} (n_classes={k})"
            )
        return y.astype(np.int64)


class LinearRegression(Model):
    """Least squares, ``W`` (n_inputs, n_outputs) and ``b`` (n_outputs,); see :class:`Model`."""

    def __init__(self, n_inputs: int, n_outputs: int = 1, l2: float = 0.0):
        self._build(
            _check_int("n_inputs", n_inputs, 1),
            (),
            _check_int("n_outputs", n_outputs, 1),
            "relu",
            "linear",
            _check_l2(l2),
            numbered=False,
        )


class LogisticRegression(Model):
    """Binary logistic regression on labels 0/1, mean binary cross-entropy (stable).

    One weight column ``W`` (n_inputs, 1) and bias ``b`` (1,): ``n_outputs`` is 1 and
    ``n_classes`` is 2.
    """

    def __init__(self, n_inputs: int, l2: float = 0.0):
        self._build(
            _check_int("n_inputs", n_inputs, 1),
            (),
            1,
            "relu",
            "sigmoid",
            _check_l2(l2),
            numbered=False,
        )


class SoftmaxRegression(Model):
    """Multinomial logistic regression (mean cross-entropy of a stable log-softmax).

    Parameters ``W`` (n_inputs, n_classes) and ``b`` (n_classes,); ``n_outputs == n_classes``.
    """

    def __init__(self, n_inputs: int, n_classes: int, l2: float = 0.0):
        self._build(
            _check_int("n_inputs", n_inputs, 1),
            (),
            _check_int("n_classes", n_classes, 2),
            "relu",
            "softmax",
            _check_l2(l2),
            numbered=False,
        )


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
        n_inputs = _check_int("n_inputs", n_inputs, 1)
        if isinstance(hidden, (int, np.integer)) and not isinstance(hidden, bool):
            hidden = (hidden,)
        if isinstance(hidden, (str, bytes)) or not np.iterable(hidden):
            raise TypeError(f"hidden must be a sequence of layer widths, got {hidden!r}")
        self.hidden = tuple(_check_int(f"hidden[{i}]", h, 1) for i, h in enumerate(hidden))
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        n_outputs = _check_int("n_outputs", n_outputs, 2 if output == "softmax" else 1)
        self.activation, self.output = activation, output
        self._build(
            n_inputs, self.hidden, n_outputs, activation, output, _check_l2(l2), numbered=True
        )


MODELS: dict[str, type[Model]] = {
    cls.__name__: cls for cls in (LinearRegression, LogisticRegression, SoftmaxRegression, MLP)
}


def from_config(config: dict[str, Any]) -> Model:
    """Rebuild a model from :meth:`Model.get_config` output.

    Raises
    ------
    ValueError
        If ``config["type"]`` is not a model of this module, or names arguments it does not take.
    """
    kwargs = dict(config)
    kind = kwargs.pop("type", None)
    if kind not in MODELS:
        raise ValueError(f"config['type'] must be one of {sorted(MODELS)}, got {kind!r}")
    cls = MODELS[kind]
    unknown = sorted(set(kwargs) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(f"config for {kind} has unknown argument(s) {unknown}")
    return cls(**kwargs)
