"""Compressed pushes: top-k sparsification with error feedback (Lin et al., Deep Gradient
Compression, ICLR 2018).

With ``DownpourSGD(top_k=f)`` a replica sends each shard only the ``k = ceil(f * n)`` largest
(in magnitude) of the ``n`` coordinates of its push to that shard, as a
:class:`SparseGradient` -- ``(indices, values)``, 8 bytes per coordinate sent instead of 4 per
coordinate owned.  What it leaves out is not lost: :class:`TopK` keeps it as a *residual* on
the replica and adds it to the next push (error feedback), so every coordinate's gradient
reaches the shard eventually.  ``top_k=1.0`` sends everything, as (indices, values): the
same updates as a dense push.

A :class:`SparseGradient` travels as it is on every transport: in-process and actor calls
hand the object to the shard, and the direct wire has sparse push ops
(:mod:`downpour_dask.ps.frames`).  The shard turns it into a dense gradient
(:meth:`SparseGradient.dense`) and applies it with its rule as any other push.  Numpy only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .params import DTYPE

#: The dtype of a sparse push's indices (a shard owns fewer than 2**31 parameters).
INDEX = np.dtype(np.int32)


class SparseGradient(NamedTuple):
    """A push that carries only some coordinates of a shard's slice: ``values`` at
    ``indices`` (distinct, in ``[0, size)``), zero elsewhere."""

    indices: np.ndarray  # int32
    values: np.ndarray  # float32, as many as indices
    size: int  # the coordinates of the slice

    @property
    def nbytes(self) -> int:
        """Bytes the push carries (indices and values)."""
        return int(self.indices.nbytes + self.values.nbytes)

    def copy(self) -> SparseGradient:
        """A copy owning its arrays (what a message delivers)."""
        return SparseGradient(self.indices.copy(), self.values.copy(), self.size)

    def dense(self) -> np.ndarray:
        """The slice's gradient as a dense float32 array.

        Raises
        ------
        ValueError
            If indices and values differ in length or an index is outside ``[0, size)``.
        """
        indices, values = np.asarray(self.indices), np.asarray(self.values)
        if indices.shape != values.shape or indices.ndim != 1:
            raise ValueError(
                f"a sparse push needs as many indices as values, got {indices.shape} and "
                f"{values.shape}"
            )
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.size):
            raise ValueError(
                f"a sparse push's indices must be in [0, {self.size}), got "
                f"[{int(indices.min())}, {int(indices.max())}]"
            )
        out = np.zeros(self.size, dtype=DTYPE)
        out[indices] = values
        return out


def check_fraction(top_k: float | None, partitions: int = 1) -> float | None:
    """``top_k`` if it is None or a fraction in ``(0, 1]`` (without model parallelism: its
    partitions' loop is not compressed); else a ValueError/TypeError."""
    if top_k is None:
        return None
    if partitions != 1:
        raise ValueError(f"top_k takes no model parallelism (partitions=1), got {partitions}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, float)):
        raise TypeError(f"top_k must be a fraction in (0, 1] or None, got {type(top_k).__name__}")
    if not 0 < top_k <= 1:
        raise ValueError(
            f"top_k must be a fraction in (0, 1] (1: send every coordinate), got {top_k}"
        )
    return float(top_k)


class TopK:
    """One replica's top-k sparsifier with its error-feedback residual.

    Parameters
    ----------
    fraction : float
        Of each shard's coordinates, the share a push sends (``k = ceil(fraction * n)``).
    size : int
        The replica's parameter count (the residual's size).
    """

    def __init__(self, fraction: float, size: int):
        self.fraction = check_fraction(fraction)
        self.residual = np.zeros(size, dtype=DTYPE)

    def compress(self, grad: np.ndarray, ranges: list[tuple[int, int]]) -> list[SparseGradient]:
        """One :class:`SparseGradient` per shard range for the push ``grad`` plus the residual.

        ``grad`` is overwritten with what is sent (zero where nothing is), so the caller can
        replay the push exactly as the shards apply it; the rest becomes the new residual.
        """
        acc = self.residual
        acc += grad
        out = []
        for lo, hi in ranges:
            part = acc[lo:hi]
            k = min(hi - lo, max(1, math.ceil(self.fraction * (hi - lo))))
            if k == hi - lo:
                indices = np.arange(hi - lo, dtype=INDEX)
            else:
                indices = np.argpartition(np.abs(part), hi - lo - k)[hi - lo - k :]
                indices = np.sort(indices).astype(INDEX)
            values = part[indices].copy()
            out.append(SparseGradient(indices, values, hi - lo))
            grad[lo:hi] = 0
            grad[lo:hi][indices] = values
            part[indices] = 0  # sent: what stays is the residual
        return out
