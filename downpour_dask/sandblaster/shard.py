"""Sandblaster's parameter-server shard: the L-BFGS vector machine over its range of every vector.

A :class:`SandblasterShard` is a Dask actor.  It runs the coordinator's vector programs
(:class:`~downpour_dask.core.vectors.VectorStore`) on its range of the iterate, the gradients, the
search direction and the history; publishes the point workers evaluate, as float32 ``values``
with a new ``version`` per distributed pass; and accumulates the portions' gradients exactly once
per ``(version, portion)``, however many copies of a portion run.

Its methods are coroutines (that never await): Dask runs them on the worker's event loop, one at a
time, where a plain method would go to the actor's thread and back -- two thread switches per
call, each waiting for a core that the worker's portions are computing on.  A program over a
shard's range of a model with millions of parameters holds the loop for its duration (about
0.5 ms per command and million float64 values here); the loop answers nothing else meanwhile.
"""

from __future__ import annotations

import numpy as np

from ..core import optim
from ..core.vectors import Program, VectorStore
from ..ps.shard import ParameterServerShard


class SandblasterShard(ParameterServerShard):
    """A shard holding its range of every L-BFGS vector, plus the published float32 point.

    ``values``/``version`` (inherited) are the point workers evaluate; ``store`` holds the float64
    vectors the coordinator's programs work on (``x``, ``g``, ``d``, ``acc``, the history ...).
    The inherited update rule is unused: L-BFGS moves the parameters by vector programs.
    """

    def __init__(
        self,
        shard_id: int,
        start: int,
        stop: int,
        values: np.ndarray,
        rule: optim.UpdateRule,
        *,
        l2mask: np.ndarray,
        x: np.ndarray | None = None,
    ):
        super().__init__(shard_id, start, stop, values, rule)  # the rule is never applied
        self.store = VectorStore(stop - start)
        self.store.set("x", values if x is None else x)  # x: float64, exact (a restore)
        self.store.set("l2mask", l2mask)
        self.store.run([("zero", "acc")])
        self._accepted: set[int] = set()
        self._scratch = np.empty(stop - start, np.float64)

    async def run(self, program: Program) -> list[float]:
        """Run a vector program (see :meth:`VectorStore.run`); return its partial dot products."""
        return self.store.run(program)

    async def run_and_copy(
        self, program: Program, names: list[str]
    ) -> tuple[list[float], list[np.ndarray]]:
        """Run a vector program; return its partial dot products and a copy of each vector in
        ``names`` as the program left it (one round trip where the coordinator needs both)."""
        return self.store.run(program), [self.store[name].copy() for name in names]

    async def begin(
        self, prelude: Program, publish: str = "xt", send: bool = False
    ) -> tuple[int, np.ndarray | None]:
        """Run ``prelude``, zero the accumulator and publish vector ``publish`` as a new version;
        return the version and, with ``send``, a copy of the published values (so that a small
        model's point can travel with the portion tasks instead of being fetched by them)."""
        self.store.run([*prelude, ("zero", "acc")])
        np.copyto(self.values, self.store[publish], casting="same_kind")
        self.version += 1
        self._accepted = set()
        return self.version, (self.values.copy() if send else None)

    async def fetch(self, version: int) -> np.ndarray | None:
        """The published values if ``version`` is still current, else None (a stale portion)."""
        return self.values.copy() if version == self.version else None

    async def wanted(self, version: int, portion: int) -> bool:
        """Whether ``portion`` of batch ``version`` still has to be computed."""
        return self._wanted(version, portion)

    def _wanted(self, version: int, portion: int) -> bool:
        return version == self.version and portion not in self._accepted

    async def accumulate(self, version: int, portion: int, grad: np.ndarray, examples: int) -> bool:
        """Add ``examples * grad`` (a portion's summed gradient) to ``acc``, once per portion.

        A copy of a portion already counted, or of an earlier batch, is discarded and counted in
        ``duplicates``; both copies of a portion compute the same gradient from the same
        parameters, so deduplicating on every shard independently is still exactly-once.
        """
        if not self._wanted(version, portion):
            self.duplicates += 1
            return False
        np.multiply(grad, float(examples), out=self._scratch)
        acc = self.store["acc"]
        acc += self._scratch
        self._accepted.add(portion)
        self.examples += int(examples)
        return True

    async def vector(self, name: str) -> np.ndarray:
        """A copy of this shard's range of vector ``name`` (e.g. ``xe``, for an evaluation)."""
        return self.store[name].copy()

    async def vectors(self, names: list[str]) -> list[np.ndarray]:
        """Copies of this shard's range of each vector in ``names`` (``params_`` and its
        gradient at the end of a fit, in one round trip)."""
        return [self.store[name].copy() for name in names]
