"""The base of every model: a stack of dense layers over one flat parameter vector.

Downpour SGD ships parameters and gradients between replicas and parameter-server shards as flat
``float32`` vectors (see :mod:`downpour_dask.core.params`), so :class:`Model` reads its weight
matrices as zero-copy views of such a vector and writes its gradient straight into views of a
caller-supplied ``out`` vector.  The concrete models (:mod:`downpour_dask.core.models`) only
choose layer sizes, the hidden activation and the output kind.

``loss_and_grad`` runs thousands of times a second inside Dask workers, so it works in place in
per-thread :class:`~downpour_dask.core.dense.Workspace` buffers (sized for the largest batch
seen; see :mod:`downpour_dask.core.dense` for why).  Workspaces are dropped on pickling, so models
stay cheap to send.
Computation runs in the dtype of ``params``: float32 normally, float64 for exact
finite-difference gradient checks.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .dense import Workspace, backward, forward, output_loss, penalty
from .params import DTYPE, ParamLayout
from .protocol import default_check_data, score_predictions

_CHUNK = 2048  # rows per forward pass in loss/predict/score: bounds the workspace size

#: Bytes of features a large batch's gradient takes at a time (at least ``_CHUNK`` rows).  The
#: forward and the backward pass each read the features; a block this size is still in the
#: cache for the second read, so memory is read once, where the whole batch at once read it
#: twice: what bounds a full-batch gradient, the more when processes share the memory bus.
GRAD_BLOCK_BYTES = 2**21


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
        n_outputs: int,
        kind: str,
        l2: float,
        hidden: Sequence[int] = (),
        activation: str = "relu",
        numbered: bool = False,
    ) -> None:
        """Set up the layers: ``hidden`` widths with ``activation``, then the ``kind`` output
        ("softmax", "sigmoid" or "linear"); parameters ``W, b`` or, ``numbered``, ``W0, b0 ...``."""
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
        self._ws: dict[tuple[int, str], Workspace] = {}

    @property
    def n_params(self) -> int:
        """Length of the flat parameter vector (``layout.size``)."""
        return self.layout.size

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

    # -- the engine: cheap checks, workspaces, row blocks (the passes are in .dense) -----

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

    def _workspace(self, n: int, dtype: np.dtype) -> Workspace:
        key = (threading.get_ident(), dtype.char)  # per thread: a model may be shared
        ws = self._ws.get(key)
        if ws is None or ws.capacity < n:
            ws = self._ws[key] = Workspace(self._widths, n, dtype, self._scratch_size)
        return ws

    def _chunks(self, params: np.ndarray, X: np.ndarray) -> Iterator[tuple]:
        """Yield ``(lo, hi, logits, workspace)`` for row blocks of at most ``_CHUNK`` rows."""
        dtype, X = self._prepare(params, np.asarray(X))
        layers = self._layers(params)
        for lo in range(0, X.shape[0], _CHUNK):
            hi = min(lo + _CHUNK, X.shape[0])
            ws = self._workspace(hi - lo, dtype)
            yield lo, hi, forward(layers, X[lo:hi], ws, self._act), ws

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

        Notes
        -----
        A batch of more than ``GRAD_BLOCK_BYTES`` of features (a full-batch pass) is taken in
        blocks, whose gradients are summed: each block's features are read from memory once.
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
        step = max(_CHUNK, GRAD_BLOCK_BYTES // (self.n_inputs * X.itemsize))
        ws = self._workspace(min(n, step), dtype)
        into, data_loss = grads, 0.0  # the first block's gradient goes straight into out
        for lo in range(0, n, step):  # one block for a minibatch
            hi = min(lo + step, n)
            z = forward(layers, X[lo:hi], ws, self._act)
            data_loss += output_loss(self._kind, z, y[lo:hi], ws, delta=True)
            z *= scale / n
            backward(layers, into, X[lo:hi], ws, z, self._act)
            if lo:
                out += ws.partial
            elif hi < n:  # later blocks' gradients go to a buffer and are added to out
                if ws.partial is None:
                    ws.partial = np.empty(self.layout.size, dtype)
                into = self._layers(ws.partial)
        return data_loss / n + penalty(layers, self.l2, grads, ws, scale), out

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """The objective of :meth:`loss_and_grad`, without the gradient, in row blocks."""
        total = 0.0
        for lo, hi, z, ws in self._chunks(params, X):
            total += output_loss(self._kind, z, y[lo:hi], ws, delta=False)
        return total / len(X) + penalty(self._layers(params), self.l2)

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class labels (int64, (n,)) or regression outputs (float32, (n,) or (n, n_outputs))."""
        pred = self._predictions(len(X))
        for lo, hi, z, _ in self._chunks(params, X):
            self._predict_into(z, pred[lo:hi])
        return pred[:, 0] if pred.ndim == 2 and self.n_outputs == 1 else pred

    def loss_and_score(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, float]:
        """:meth:`loss` and :meth:`score` from one forward pass over ``X`` instead of two: what
        a fit's evaluations compute, every ``eval_every`` seconds, on the cores it trains on."""
        pred, total = self._predictions(len(X)), 0.0
        for lo, hi, z, ws in self._chunks(params, X):
            self._predict_into(z, pred[lo:hi])  # before the loss, which overwrites z
            total += output_loss(self._kind, z, y[lo:hi], ws, delta=False)
        loss = total / len(X) + penalty(self._layers(params), self.l2)
        return loss, score_predictions(pred, y, self.is_classifier)  # (it takes (n, 1) outputs)

    def _predictions(self, n: int) -> np.ndarray:
        """An empty array for ``n`` rows' predictions (labels, or every output's value)."""
        if self.is_classifier:
            return np.empty(n, np.int64)
        return np.empty((n, self.n_outputs), DTYPE)

    def _predict_into(self, z: np.ndarray, out: np.ndarray) -> None:
        """The predictions of the output layer's values ``z`` (logits) into ``out``."""
        if not self.is_classifier:
            out[...] = z
        elif self._kind == "sigmoid":
            np.greater(z[:, 0], 0, out=out, casting="unsafe")
        else:
            np.argmax(z, axis=1, out=out)

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
        return score_predictions(self.predict(params, X), y, self.is_classifier)

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
        return default_check_data(self, X, y)
