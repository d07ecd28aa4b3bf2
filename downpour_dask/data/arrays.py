"""Data held in memory: the :class:`Dataset` of features and targets, and its minibatches.

A :class:`Dataset` holds features and labels; :meth:`Dataset.partition` cuts it into the
contiguous, row-balanced subsets that Downpour's model replicas train on (one subset per replica,
as in the paper; the cut is :func:`~downpour_dask.data.assignment.split_rows`), and
:func:`minibatches` streams one subset as shuffled minibatches, reshuffled every epoch from a
seeded generator so that runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .assignment import split_rows


class Dataset:
    """Features ``X`` (rows x features) and targets ``y`` held in memory.

    Parameters
    ----------
    X : array-like of shape (n_rows, n_features)
    y : array-like of shape (n_rows,) or (n_rows, n_outputs)
    name : str, optional
        A label for logs and reports.

    Raises
    ------
    ValueError
        If ``X`` is not 2-D, ``y`` is not 1-D/2-D, or their lengths differ.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, name: str | None = None):
        X = np.asarray(X)
        y = np.asarray(y)
        if X.ndim != 2:
            raise ValueError(f"X must be a 2-D array (rows x features), got shape {X.shape}")
        if y.ndim not in (1, 2):
            raise ValueError(f"y must be a 1-D or 2-D array, got shape {y.shape}")
        if len(X) != len(y):
            raise ValueError(
                f"X and y must have the same number of rows, got {len(X)} and {len(y)}"
            )
        self.X, self.y, self.name = X, y, name

    @property
    def n_rows(self) -> int:
        """Number of rows (examples)."""
        return int(self.X.shape[0])

    @property
    def n_features(self) -> int:
        """Number of feature columns."""
        return int(self.X.shape[1])

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"Dataset({label}rows={self.n_rows}, features={self.n_features})"

    def partition(self, n_parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Split into ``n_parts`` contiguous ``(X, y)`` subsets whose sizes differ by at most one.

        The subsets are views (no copy) and together hold every row exactly once.

        Raises
        ------
        ValueError
            If there are fewer rows than parts (a replica would have no data).
        """
        return [(self.X[lo:hi], self.y[lo:hi]) for lo, hi in split_rows(self.n_rows, n_parts)]


def minibatches(
    X: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield one epoch of shuffled minibatches of ``(X, y)``; the last one may be smaller.

    The order is a fresh permutation drawn from ``rng``, so successive calls with the same
    generator give the successive epochs of a reproducible run.  Batches are gathered into two
    preallocated buffers that are *reused*: a yielded batch is valid until the next one is
    requested (copy it to keep it).  Reusing the buffers avoids a large allocation per step.
    """
    n = len(X)
    order = rng.permutation(n)
    size = min(batch_size, n)
    xbuf = np.empty((size,) + X.shape[1:], dtype=X.dtype)
    ybuf = np.empty((size,) + y.shape[1:], dtype=y.dtype)
    for start in range(0, n, size):
        idx = order[start : start + size]
        k = len(idx)
        np.take(X, idx, axis=0, out=xbuf[:k], mode="clip")  # indices are valid;
        np.take(y, idx, axis=0, out=ybuf[:k], mode="clip")  # "raise" would buffer
        yield xbuf[:k], ybuf[:k]
