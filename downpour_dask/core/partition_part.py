"""One partition of a model-parallel MLP replica: its share of every step's loss and gradient.

:class:`MLPPart` runs the forward and backward passes of partition ``p`` of a
:class:`~downpour_dask.core.partition.PartitionPlan` (the neuron split and what crosses
partitions are described there), exchanging the values that cross partition boundaries with
the other partitions through a :class:`~downpour_dask.core.partition.Link`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .dense import Workspace, activate, output_loss, times_derivative
from .partition import Link, PartitionPlan


class MLPPart:
    """Partition ``p`` of an MLP replica: computes the gradient of its own parameters.

    It is used by the replica loop exactly like a :class:`~downpour_dask.core.model.Model` (only
    :meth:`loss_and_grad` and ``layout``), but each call runs in lockstep with the other
    partitions' calls, exchanging activations and their gradients through ``link``.

    ``vote`` (optional) is asked on every step whether this partition wants to stop (its shards
    said so); the answers of all partitions are combined with the logits, and
    :attr:`agreed_stop` becomes true on every partition at the same step.

    With :attr:`overlap` (the default) the messages travel while the partition computes what
    does not need them: the next layer's product with its own block of activations while the
    other blocks arrive, and the previous layer's weight gradient while the pieces of the
    reduce-scatter are on their way; without it, each collective waits before the compute.
    """

    #: Hide the messages' latency behind the compute that does not depend on them (False: the
    #: plain order, kept for benchmarks/bench_model_parallel.py's A/B).
    overlap: bool = True

    def __init__(
        self,
        plan: PartitionPlan,
        partition: int,
        link: Link,
        vote: Callable[[], bool] | None = None,
    ):
        self.plan, self.p, self.link = plan, int(partition), link
        self.layout = plan.layouts[self.p]
        self.vote = vote
        self.agreed_stop = False
        self.values_sent = 0
        self._tag = 0
        self._ws: dict[tuple[int, str], dict[str, Any]] = {}
        self._act = plan.model.activation

    # -- collectives -----------------------------------------------------------------------------
    def _next_tag(self) -> int:
        self._tag += 1
        return self._tag

    def _send(self, to: int, tag: int, payload: Any, values: int) -> None:
        self.values_sent += values
        self.link.send(to, tag, payload)

    def _all_gather(self, block: np.ndarray, out: np.ndarray, blocks: list) -> None:
        """Fill ``out`` (n x width) with every partition's ``block`` in its columns."""
        tag, me = self._next_tag(), self.p
        for q in range(self.plan.partitions):
            if q != me:
                self._send(q, tag, block.copy(), block.size)
        lo, hi = blocks[me]
        out[:, lo:hi] = block
        for q in range(self.plan.partitions):
            if q != me:
                lo, hi = blocks[q]
                out[:, lo:hi] = self.link.receive(q, tag)

    def _share(self, block: np.ndarray) -> int:
        """Start an all-gather: send ``block`` to every other partition; returns its tag."""
        tag = self._next_tag()
        for q in range(self.plan.partitions):
            if q != self.p:
                self._send(q, tag, block.copy(), block.size)
        return tag

    def _gathered_dot(
        self,
        tag: int,
        block: np.ndarray,
        W: np.ndarray,
        out: np.ndarray,
        full: np.ndarray,
        blocks: list,
    ) -> None:
        """Finish the all-gather ``tag`` of ``block`` into ``full`` and compute
        ``out = full @ W``: the own block's rows first, each other block's as it arrives."""
        me = self.p
        lo, hi = blocks[me]
        full[:, lo:hi] = block
        np.dot(block, W[lo:hi], out=out)
        for q in range(self.plan.partitions):
            if q != me:
                lo, hi = blocks[q]
                received = self.link.receive(q, tag)
                full[:, lo:hi] = received
                out += np.dot(received, W[lo:hi])

    def _scatter(self, d: np.ndarray, W: np.ndarray, blocks: list) -> int:
        """Start a reduce-scatter of ``d @ W.T``: compute and send each other partition its
        block of columns; returns the tag."""
        tag = self._next_tag()
        for q in range(self.plan.partitions):
            if q != self.p:
                lo, hi = blocks[q]
                piece = np.dot(d, W[lo:hi].T)
                self._send(q, tag, piece, piece.size)
        return tag

    def _reduced(self, tag: int, d: np.ndarray, W: np.ndarray, out: np.ndarray, blocks) -> None:
        """Finish the reduce-scatter ``tag``: ``out`` = the sum in partition order of every
        partition's piece of the own block (this one's: ``d @ W[own rows].T``)."""
        me = self.p
        lo, hi = blocks[me]
        for q in range(self.plan.partitions):
            part = np.dot(d, W[lo:hi].T) if q == me else self.link.receive(q, tag)
            if q == 0:
                out[...] = part
            else:
                out += part

    def _reduce_scatter(self, partial: np.ndarray, out: np.ndarray, blocks: list) -> None:
        """``out`` = the sum over partitions of their ``partial[:, own block]``, in partition
        order."""
        tag, me = self._next_tag(), self.p
        for q in range(self.plan.partitions):
            if q != me:
                lo, hi = blocks[q]
                piece = np.ascontiguousarray(partial[:, lo:hi])
                self._send(q, tag, piece, piece.size)
        lo, hi = blocks[me]
        for q in range(self.plan.partitions):
            part = partial[:, lo:hi] if q == me else self.link.receive(q, tag)
            if q == 0:
                out[...] = part
            else:
                out += part

    def _all_reduce_output(
        self, logits: np.ndarray, penalty: float, stop: bool
    ) -> tuple[float, bool]:
        """Sum every partition's partial ``logits`` in place (in partition order) and their
        penalties; OR their stop votes."""
        tag, me = self._next_tag(), self.p
        for q in range(self.plan.partitions):
            if q != me:
                self._send(q, tag, (logits.copy(), penalty, stop), logits.size)
        own = logits.copy()
        total_penalty, any_stop = 0.0, False
        for q in range(self.plan.partitions):
            part, pen, vote = (own, penalty, stop) if q == me else self.link.receive(q, tag)
            if q == 0:
                logits[...] = part
            else:
                logits += part
            total_penalty += pen
            any_stop = any_stop or bool(vote)
        return total_penalty, any_stop

    # -- the gradient ----------------------------------------------------------------------------
    def _workspace(self, n: int, dtype: np.dtype) -> dict[str, Any]:
        key = (n, dtype.char)
        ws = self._ws.get(key)
        if ws is None:
            plan, p = self.plan, self.p
            own = [hi - lo for lo, hi in (blocks[p] for blocks in plan.blocks)]
            ws = {
                "h": [np.empty((n, w), dtype) for w in own],  # own activations per hidden layer
                "full": [np.empty((n, w), dtype) for w in plan.model.hidden[:-1]],  # gathered
                "d": [np.empty((n, w), dtype) for w in own],  # own deltas
                "partial": [np.empty((n, w), dtype) for w in plan.model.hidden[:-1]],
                "out": Workspace([plan.model.n_outputs], n, dtype, 1),
            }
            self._ws = {key: ws}  # one batch size at a time (the last batch may be smaller)
        return ws

    def _penalty(
        self,
        layers: dict[str, np.ndarray],
        grads: dict[str, np.ndarray] | None,
        scale: float = 1.0,
    ) -> float:
        l2 = self.plan.model.l2
        if l2 == 0:
            return 0.0
        total = 0.0
        for name, W in layers.items():
            if name.startswith("W"):
                total += float(np.vdot(W, W))
                if grads is not None:
                    grads[name] += (l2 * scale) * W
        return 0.5 * l2 * total

    def loss_and_grad(
        self,
        params: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> tuple[float, np.ndarray]:
        """The whole model's objective on one batch and the gradient (times ``scale``, as in
        :meth:`Model.loss_and_grad`) of this partition's own parameters (``out``, a flat vector
        of ``layout.size``).

        Every partition must call it with the same batch; it returns once the partitions have
        exchanged what crosses their boundaries.
        """
        plan, me, model = self.plan, self.p, self.plan.model
        dtype = params.dtype
        X = X if X.dtype == dtype else X.astype(dtype)
        n, L = X.shape[0], plan.n_hidden
        if out is None:
            out = np.empty(self.layout.size, dtype)
        layers, grads = self.layout.views(params), self.layout.views(out)
        ws = self._workspace(n, dtype)
        # forward: own units of each hidden layer, gathering all units but the last layer's
        a, overlap, tag = X, self.overlap, 0
        for layer in range(L):
            h = ws["h"][layer]
            if overlap and layer > 0:  # the own block's product while the others arrive
                previous = plan.blocks[layer - 1]
                self._gathered_dot(tag, a, layers[f"W{layer}"], h, ws["full"][layer - 1], previous)
            else:
                np.dot(a, layers[f"W{layer}"], out=h)
            h += layers[f"b{layer}"]
            activate(h, self._act)
            if layer < L - 1 and overlap:
                a, tag = h, self._share(h)
            elif layer < L - 1:
                a = ws["full"][layer]
                self._all_gather(h, a, plan.blocks[layer])
        logits = ws["out"].acts[0][:n]
        np.dot(ws["h"][L - 1], layers[f"W{L}"], out=logits)
        if me == 0:
            logits += layers[f"b{L}"]
        penalty = self._penalty(layers, None)
        vote = bool(self.vote()) if self.vote is not None else False
        penalty, self.agreed_stop = self._all_reduce_output(logits, penalty, vote)
        data_loss = output_loss(model.output, logits, y, ws["out"], delta=True) / n
        delta = logits
        delta *= scale / n
        # backward: the output layer's rows, then down through the hidden layers
        h_last = ws["h"][L - 1]
        np.dot(h_last.T, delta, out=grads[f"W{L}"])
        if me == 0:
            np.sum(delta, axis=0, out=grads[f"b{L}"])
        d = ws["d"][L - 1]
        np.dot(delta, layers[f"W{L}"].T, out=d)
        times_derivative(d, h_last, self._act)
        for layer in range(L - 1, -1, -1):
            W, previous = layers[f"W{layer}"], plan.blocks[layer - 1] if layer else None
            if overlap and layer > 0:  # the pieces travel while the weight gradient is computed
                tag = self._scatter(d, W, previous)
            a_prev = X if layer == 0 else ws["full"][layer - 1]
            np.dot(a_prev.T, d, out=grads[f"W{layer}"])
            np.sum(d, axis=0, out=grads[f"b{layer}"])
            if layer == 0:
                break
            d_prev = ws["d"][layer - 1]
            if overlap:
                self._reduced(tag, d, W, d_prev, previous)
            else:
                partial = ws["partial"][layer - 1]
                np.dot(d, W.T, out=partial)
                self._reduce_scatter(partial, d_prev, previous)
            d = d_prev
            times_derivative(d, ws["h"][layer - 1], self._act)
        self._penalty(layers, grads, scale)
        return data_loss + penalty, out
