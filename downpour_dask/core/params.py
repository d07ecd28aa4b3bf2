"""A model's parameters as one flat float32 vector with named, zero-copy views.

Every model in :mod:`downpour_dask.core.models` stores all of its weights in a single
contiguous ``float32`` vector.  The parameter server shards that vector by
*element* ranges (one large matrix may span several shards), replicas push and
pull slices of it, and the model reads its weight matrices as reshaped views of
it.  Keeping one flat vector means no copy between "the model's matrices" and
"what goes over the wire", and update rules only ever see flat slices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DTYPE = np.float32

#: The float dtypes BLAS computes in (a dot product or a matrix product of these runs at memory
#: speed; other dtypes take numpy's generic loops).
BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class ParamLayout:
    """Names and shapes of a model's parameters inside one flat vector.

    Parameters
    ----------
    shapes : mapping of str to tuple of int
        Parameter name -> array shape, in storage order.

    Examples
    --------
    >>> layout = ParamLayout({"W": (3, 2), "b": (2,)})
    >>> flat = layout.zeros()
    >>> layout.views(flat)["W"].shape
    (3, 2)
    >>> layout.split(2)
    [(0, 4), (4, 8)]
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]]):
        if not shapes:
            raise ValueError("shapes must name at least one parameter, got an empty mapping")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, shape in shapes.items():
            shape = tuple(int(s) for s in shape)
            if any(s < 1 for s in shape):
                raise ValueError(
                    f"parameter {name!r} must have positive dimensions, got shape {shape}"
                )
            size = int(np.prod(shape, dtype=np.int64))
            self.shapes[name] = shape
            self.offsets[name] = (start, start + size)
            start += size
        self.size: int = start

    @property
    def names(self) -> list[str]:
        """Parameter names in storage order."""
        return list(self.shapes)

    def zeros(self) -> np.ndarray:
        """A new all-zero flat vector of this layout's size (float32)."""
        return np.zeros(self.size, dtype=DTYPE)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named, reshaped views into ``flat`` (no copy: writing a view writes ``flat``).

        Raises
        ------
        ValueError
            If ``flat`` is not a 1-D vector of exactly ``size`` elements.
        """
        if flat.ndim != 1 or flat.shape[0] != self.size:
            raise ValueError(
                f"flat must be a 1-D vector of {self.size} elements, got shape {flat.shape}"
            )
        return {
            name: flat[lo:hi].reshape(self.shapes[name]) for name, (lo, hi) in self.offsets.items()
        }

    def split(self, n_shards: int) -> list[tuple[int, int]]:
        """Contiguous ``(start, stop)`` ranges for ``n_shards`` shards (:func:`split_range`)."""
        return split_range(self.size, n_shards)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParamLayout) and self.shapes == other.shapes

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in self.shapes.items())
        return f"ParamLayout({inner}; size={self.size})"


def split_range(size: int, n_parts: int) -> list[tuple[int, int]]:
    """Cut ``range(size)`` into ``n_parts`` contiguous ranges whose lengths differ by at most one.

    The ranges cover ``[0, size)`` exactly once, in order.

    Raises
    ------
    ValueError
        If ``n_parts`` is not an integer in ``[1, size]``.
    """
    if isinstance(n_parts, bool) or not isinstance(n_parts, (int, np.integer)):
        raise TypeError(f"n_parts must be an int, got {type(n_parts).__name__}")
    if not 1 <= n_parts <= size:
        raise ValueError(
            f"n_parts must be between 1 and {size} (the number of elements), got {n_parts}"
        )
    base, extra = divmod(size, n_parts)
    bounds = [0]
    for i in range(n_parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))
