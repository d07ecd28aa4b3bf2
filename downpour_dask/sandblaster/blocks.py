"""Where a Sandblaster fit's training rows live: portions of rows, each a block on one worker.

A fit cuts its rows into *portions* (the rows one task computes a gradient on), and each
portion's rows are a *block*, a Dask future held by one worker for the whole fit: every later
pass over the portion runs where its block is and moves no data.

:class:`ArrayBlocks` is in-memory training data: its blocks are scattered from the driver, whose
copy is also the backup from which a block lost with its worker is scattered again.
"""

from __future__ import annotations

import numpy as np
from distributed import Client, Future

from ..core.params import split_range


class ArrayBlocks:
    """In-memory training rows ``(X, y)``, scattered from the driver as one block per portion.

    Parameters
    ----------
    X, y : ndarray
        The checked training data (the model's ``check_data``).
    """

    def __init__(self, X: np.ndarray, y: np.ndarray):
        self.X, self.y = X, y

    @property
    def n_rows(self) -> int:
        """Number of training rows."""
        return len(self.X)

    def portions(self, size: int, per_batch: int, order: np.ndarray | None) -> list[list]:
        """Rows of every portion of every batch of ``size`` rows, ``per_batch`` portions each:
        slices in full-batch mode (views, no copy), else index arrays of the permutation
        ``order`` cut into disjoint batches."""
        batches = []
        for lo, hi in split_range(self.n_rows, -(-self.n_rows // size)):
            parts = split_range(hi - lo, min(per_batch, hi - lo))
            batches.append(
                [
                    slice(lo + a, lo + b) if order is None else order[lo + a : lo + b]
                    for a, b in parts
                ]
            )
        return batches

    def place(
        self, client: Client, rows: list, workers: list[str] | None, timeout: float
    ) -> list[Future]:
        """Scatter every portion's rows, spread over ``workers`` (default: any)."""
        X, y = self.X, self.y
        return client.scatter(
            [(X[idx], y[idx]) for idx in rows], workers=workers, hash=False, timeout=timeout
        )  # views when the rows are contiguous

    def replace(self, client: Client, rows: slice | np.ndarray, timeout: float) -> Future:
        """Send the rows of one portion again, to one worker (Dask picks it, spreading blocks)."""
        X, y = self.X, self.y
        return client.scatter([(X[rows], y[rows])], hash=False, timeout=timeout)[0]
