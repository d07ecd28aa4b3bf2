"""Model parallelism: one MLP replica split by neurons into P partitions (no Dask here).

DistBelief partitions each model replica across machines and lets only the values on edges that
cross a partition boundary travel (see ``PAPER.md``, "Model parallelism").  For a fully
connected network the split that keeps P partitions equally busy is by **neurons within
layers**: partition ``p`` owns the ``p``-th block of units of every hidden layer, so each
partition does 1/P of every matrix product whatever the layer widths.  (A split by layers would
leave the partitions as unequal as the layers: MLP 1024-4096-4096-10 has 4.2M parameters in its
first layer and 16.8M in its second, so at best 1.25x on two workers, and micro-batch pipelining
would only hide that behind bubbles.)

Partition ``p`` holds:

* for every hidden layer ``l``: the incoming weights and biases of its units,
  ``W_l[:, block_l(p)]`` and ``b_l[block_l(p)]`` (column split);
* for the output layer: the outgoing weights of its units of the last hidden layer,
  ``W_L[block_{L-1}(p), :]`` (row split); the output bias belongs to partition 0.

One step on a minibatch ``X`` (every partition reads the same batches) then moves, per example:

* forward, after each hidden layer but the last: every partition's block of activations to every
  other partition (all-gather), because the next layer's units read all of them;
* forward, at the output: each partition's partial logits (``n_outputs`` values), summed
  (all-reduce), so that every partition computes the same loss and output gradient;
* backward, below each hidden layer but the first: each partition's partial gradient with
  respect to the previous layer's activations, block ``q`` going to partition ``q`` who sums them
  (reduce-scatter).

The last hidden layer's activations and gradients never travel: the row split of the output
layer keeps them local.  Sums are taken in partition order, so every partition gets bitwise the
same logits.  The mathematics is the unpartitioned model's (the passes of
:mod:`downpour_dask.core.dense`): only the order of floating-point additions inside matrix
products differs (tested against :class:`~downpour_dask.core.models.MLP`).

One partition's passes are :class:`~downpour_dask.core.partition_part.MLPPart`'s.  How messages
travel is a :class:`Link`'s business: :mod:`downpour_dask.downpour.model_parallel`
sends them through Dask actors, the tests through threads.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .models import MLP, Model
from .params import ParamLayout, split_range


class Link(Protocol):
    """How one partition exchanges messages with the other partitions of its replica.

    Messages are identified by sender and tag; every partition runs the same sequence of
    collectives, so tags match without coordination.  ``send`` takes ownership of ``payload``
    (the caller never writes to it again), and must not block for long.
    """

    def send(self, to: int, tag: int, payload: Any) -> None: ...

    def receive(self, sender: int, tag: int) -> Any: ...


class PartitionPlan:
    """How the neurons of an MLP are divided among ``partitions`` partitions.

    Parameters
    ----------
    model : MLP
        A network with at least one hidden layer.
    partitions : int
        Number of partitions P; at most the width of the narrowest hidden layer (every
        partition must own at least one unit of every hidden layer).

    Attributes
    ----------
    blocks : list of list of (start, stop)
        ``blocks[l][p]``: the units of hidden layer ``l`` that partition ``p`` owns.
    layouts : list of ParamLayout
        Each partition's own parameters, in the names and order of its flat vector.
    offsets : list of (start, stop)
        Where each partition's vector lies in the concatenated ("packed") vector that the
        parameter server holds.

    Raises
    ------
    TypeError
        If ``model`` is not an MLP with a hidden layer.
    ValueError
        If ``partitions`` is not between 1 and the narrowest hidden layer's width.
    """

    def __init__(self, model: Model, partitions: int):
        if not isinstance(model, MLP) or not model.hidden:
            name = type(model).__name__
            hint = f"{name} has no hidden layer" if isinstance(model, Model) else f"{name} is not"
            raise TypeError(
                f"model parallelism (partitions > 1) is supported only for models.MLP with at "
                f"least one hidden layer (it splits the hidden units); {hint}: use partitions=1 "
                f"for this model"
            )
        if isinstance(partitions, bool) or not isinstance(partitions, (int, np.integer)):
            raise TypeError(f"partitions must be an int, got {type(partitions).__name__}")
        narrowest = min(model.hidden)
        if not 1 <= partitions <= narrowest:
            raise ValueError(
                f"partitions must be between 1 and {narrowest} (the narrowest hidden layer of "
                f"hidden={list(model.hidden)}: each partition owns at least one unit of every "
                f"hidden layer), got {partitions}"
            )
        self.model, self.partitions = model, int(partitions)
        self.fan_in = [model.n_inputs, *model.hidden]
        self.blocks = [split_range(width, self.partitions) for width in model.hidden]
        self.layouts = [self._layout(p) for p in range(self.partitions)]
        bounds = np.cumsum([0] + [layout.size for layout in self.layouts]).tolist()
        self.offsets = list(zip(bounds[:-1], bounds[1:]))
        self.size = bounds[-1]

    @property
    def n_hidden(self) -> int:
        """Number of hidden layers."""
        return len(self.model.hidden)

    def _layout(self, p: int) -> ParamLayout:
        shapes: dict[str, tuple[int, ...]] = {}
        for layer, blocks in enumerate(self.blocks):
            lo, hi = blocks[p]
            shapes[f"W{layer}"] = (self.fan_in[layer], hi - lo)
            shapes[f"b{layer}"] = (hi - lo,)
        lo, hi = self.blocks[-1][p]
        out = self.n_hidden
        shapes[f"W{out}"] = (hi - lo, self.model.n_outputs)
        if p == 0:
            shapes[f"b{out}"] = (self.model.n_outputs,)
        return ParamLayout(shapes)

    def _pieces(self, p: int, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Partition ``p``'s arrays as views into the full model's named arrays."""
        pieces = {}
        for layer, blocks in enumerate(self.blocks):
            lo, hi = blocks[p]
            pieces[f"W{layer}"] = full[f"W{layer}"][:, lo:hi]
            pieces[f"b{layer}"] = full[f"b{layer}"][lo:hi]
        lo, hi = self.blocks[-1][p]
        out = self.n_hidden
        pieces[f"W{out}"] = full[f"W{out}"][lo:hi, :]
        if p == 0:
            pieces[f"b{out}"] = full[f"b{out}"]
        return pieces

    def pack(self, params: np.ndarray) -> np.ndarray:
        """The model's flat vector rearranged partition by partition (what the server holds)."""
        full = self.model.layout.views(np.asarray(params))
        packed = np.empty(self.size, dtype=params.dtype)
        for p, (lo, hi) in enumerate(self.offsets):
            views = self.layouts[p].views(packed[lo:hi])
            for name, piece in self._pieces(p, full).items():
                views[name][...] = piece
        return packed

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`pack`: the model's own flat vector (for predict, score...)."""
        if packed.shape != (self.size,):
            raise ValueError(f"packed must have shape ({self.size},), got {packed.shape}")
        params = np.empty(self.model.layout.size, dtype=packed.dtype)
        full = self.model.layout.views(params)
        for p, (lo, hi) in enumerate(self.offsets):
            views = self.layouts[p].views(packed[lo:hi])
            for name, piece in self._pieces(p, full).items():
                piece[...] = views[name]
        return params

    def shard_ranges(self, n_shards: int) -> list[tuple[int, int]]:
        """Ranges of ``n_shards`` parameter-server shards aligned with the partitions: each
        partition's range is cut into its share of the shards, so no shard spans two partitions.

        Raises
        ------
        ValueError
            If ``n_shards`` is smaller than the number of partitions.
        """
        if n_shards < self.partitions:
            raise ValueError(
                f"n_shards must be at least partitions={self.partitions} (every partition "
                f"needs a parameter-server shard of its own), got {n_shards}"
            )
        ranges = []
        for p, (start, count) in enumerate(zip(self.offsets, self.shards_per_partition(n_shards))):
            ranges += [(start[0] + lo, start[0] + hi) for lo, hi in self.layouts[p].split(count)]
        return ranges

    def shards_per_partition(self, n_shards: int) -> list[int]:
        """How many of ``n_shards`` shards each partition gets (as even as possible)."""
        return [hi - lo for lo, hi in split_range(n_shards, self.partitions)]

    def boundary_values_per_example(self) -> int:
        """Values that cross partition boundaries per example and step (both directions)."""
        P = self.partitions
        gathered = sum(self.model.hidden[:-1])  # all-gather and reduce-scatter of these layers
        return 2 * (P - 1) * gathered + P * (P - 1) * self.model.n_outputs
