"""One shard's vector machine for Sandblaster L-BFGS: named vectors and the commands on them.

The coordinator (:mod:`~downpour_dask.core.lbfgs`) never holds a long vector: it sends each
shard a *program*, a list of commands over the shard's element range of every vector, and sums
the scalars that come back.  :class:`VectorStore` executes a program; :func:`sum_replies` is the
coordinator's only reduction.  Plain numpy, no Dask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Command = tuple  # ("dot", a, b) | ("axpy", alpha, x, y) | ("scale", a, alpha) | ...
Program = Sequence[Command]


class VectorStore:
    """One shard's named float64 vectors of equal length, and the commands run on them.

    Float64 keeps the reductions and the L-BFGS history accurate even though the model computes
    in float32: only the point published to the workers is rounded to float32.

    Parameters
    ----------
    size : int
        Length of every vector (the shard's element range).
    """

    def __init__(self, size: int):
        self.size = size
        self.vectors: dict[str, np.ndarray] = {}
        self._scratch = np.empty(size, np.float64)

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.vectors[name]
        except KeyError:
            raise KeyError(f"no vector named {name!r} on this shard") from None

    def set(self, name: str, values: np.ndarray) -> None:
        """Store a float64 copy of ``values`` under ``name``."""
        values = np.asarray(values)
        if values.shape != (self.size,):
            raise ValueError(f"vector {name!r} must have shape ({self.size},), got {values.shape}")
        self.vectors[name] = np.array(values, dtype=np.float64)

    def _out(self, name: str) -> np.ndarray:
        """The vector ``name``, created (uninitialised) if it is written for the first time."""
        vec = self.vectors.get(name)
        if vec is None:
            vec = self.vectors[name] = np.empty(self.size, np.float64)
        return vec

    def run(self, program: Program) -> list[float]:
        """Execute the commands in order; return the results of the ``dot`` commands, in order.

        Commands: ``("dot", a, b)`` -> a.b; ``("axpy", alpha, x, y)``: y += alpha*x;
        ``("scale", a, alpha)``: a *= alpha; ``("copy", src, dst)``: dst = src;
        ``("mul", a, b, dst)``: dst = a*b coefficient-wise; ``("zero", a)``: a = 0.
        """
        out: list[float] = []
        for command in program:
            op, *args = command
            if op == "dot":
                out.append(float(np.dot(self[args[0]], self[args[1]])))
            elif op == "axpy":
                alpha, x, y = args
                self[y]  # must exist
                np.multiply(self[x], float(alpha), out=self._scratch)
                self.vectors[y] += self._scratch
            elif op == "scale":
                vec = self[args[0]]
                vec *= float(args[1])
            elif op == "copy":
                np.copyto(self._out(args[1]), self[args[0]])
            elif op == "mul":
                np.multiply(self[args[0]], self[args[1]], out=self._out(args[2]))
            elif op == "zero":
                self._out(args[0]).fill(0.0)
            else:
                raise ValueError(f"unknown vector command {op!r} in {command!r}")
        return out


#: Position of the vector a command writes, among its arguments (``dot`` writes none).
_WRITES = {"axpy": 2, "scale": 0, "copy": 1, "mul": 2, "zero": 0}


def written(program: Program) -> set[str]:
    """The names of the vectors ``program`` writes (see :meth:`VectorStore.run`)."""
    return {command[1 + _WRITES[command[0]]] for command in program if command[0] in _WRITES}


def sum_replies(replies: Sequence[Sequence[float]]) -> np.ndarray:
    """Sum the per-shard results of one program, in float64 (the coordinator's only reduction)."""
    return np.sum(np.asarray(replies, dtype=np.float64).reshape(len(replies), -1), axis=0)
