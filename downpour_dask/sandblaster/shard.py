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

from typing import NamedTuple

import numpy as np

from ..core import optim
from ..core.vectors import Program, VectorStore
from ..ps.shard import ParameterServerShard


class Finish(NamedTuple):
    """How a batch ends on a shard: when every portion in ``portions`` is accepted, ``acc`` is
    divided by the examples accepted, then ``program`` runs; copies of ``names`` are kept."""

    portions: frozenset[int]
    program: Program
    names: tuple[str, ...] = ()


class Finished(NamedTuple):
    """A finish program's partial dot products, and copies of the vectors it was to keep."""

    dots: list[float]
    copies: list[np.ndarray]


class SandblasterShard(ParameterServerShard):
    """A shard holding its range of every L-BFGS vector, plus the published float32 point.

    ``values``/``version`` (inherited) are the point workers evaluate; ``store`` holds the float64
    vectors the coordinator's programs work on (``x``, ``g``, ``d``, ``acc``, the history ...).
    The inherited update rule is unused: L-BFGS moves the parameters by vector programs.
    """

    #: A finish program's copies go back with the portion task that completed the batch only
    #: up to this size; larger ones (a large model's iterate) would travel twice, shard to
    #: task to coordinator, so the coordinator fetches them from the shard (:meth:`finished`).
    RETURNED_COPY_BYTES = 256 * 2**10

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
        self._batch_examples = 0  # examples accepted in the current version
        self._finish: Finish | None = None  # how the current batch ends, if the shard ends it
        self._missing = 0  # portions of the finish still to be accepted
        self._finished: Finished | None = None
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
        self,
        prelude: Program,
        publish: str = "xt",
        send: bool = False,
        finish: Finish | None = None,
    ) -> tuple[int, np.ndarray | None]:
        """Run ``prelude``, zero the accumulator and publish vector ``publish`` as a new version;
        return the version and, with ``send``, a copy of the published values (so that a small
        model's point can travel with the portion tasks instead of being fetched by them).

        With ``finish``, the batch ends on the shard itself: once every portion it names is
        accepted, ``acc`` becomes the mean gradient and the program runs (see
        :meth:`accumulate`), with no call from the coordinator.
        """
        self.store.run([*prelude, ("zero", "acc")])
        np.copyto(self.values, self.store[publish], casting="same_kind")
        self.version += 1
        self._accepted = set()
        self._batch_examples = 0
        self._finish, self._finished = finish, None
        self._missing = 0 if finish is None else len(finish.portions)
        return self.version, (self.values.copy() if send else None)

    async def fetch(self, version: int) -> np.ndarray | None:
        """The published values if ``version`` is still current, else None (a stale portion)."""
        return self.values.copy() if version == self.version else None

    async def wanted(self, version: int, portion: int) -> bool:
        """Whether ``portion`` of batch ``version`` still has to be computed."""
        return self._wanted(version, portion)

    def _wanted(self, version: int, portion: int) -> bool:
        return version == self.version and portion not in self._accepted

    async def accumulate(
        self, version: int, portion: int, grad: np.ndarray, examples: int
    ) -> tuple[bool, Finished | None]:
        """Add ``examples * grad`` (a portion's summed gradient) to ``acc``, once per portion.

        A copy of a portion already counted, or of an earlier batch, is discarded and counted in
        ``duplicates``; both copies of a portion compute the same gradient from the same
        parameters, so deduplicating on every shard independently is still exactly-once.

        Returns whether it was accepted and, from the call that completed a batch begun with a
        ``finish``, what the finish program gave (also kept for :meth:`finished`; its copies
        only up to :attr:`RETURNED_COPY_BYTES`).
        """
        if not self._wanted(version, portion):
            self.duplicates += 1
            return False, None
        np.multiply(grad, float(examples), out=self._scratch)
        acc = self.store["acc"]
        acc += self._scratch
        self._accepted.add(portion)
        self.examples += int(examples)
        self._batch_examples += int(examples)
        if self._finish is not None and portion in self._finish.portions:
            self._missing -= 1  # a count, not a set comparison on every portion's call
        if self._finish is not None and not self._missing:
            program, names = self._finish.program, self._finish.names
            self._finish = None
            dots = self.store.run([("scale", "acc", 1.0 / self._batch_examples), *program])
            self._finished = Finished(dots, [self.store[name].copy() for name in names])
            if sum(copy.nbytes for copy in self._finished.copies) > self.RETURNED_COPY_BYTES:
                return True, Finished(dots, [])  # the coordinator fetches them from here
            return True, self._finished
        return True, None

    async def finished(self, version: int) -> Finished | None:
        """What the finish program of batch ``version`` gave, or None if it has not run."""
        return self._finished if version == self.version else None

    async def vector(self, name: str) -> np.ndarray:
        """A copy of this shard's range of vector ``name`` (e.g. ``xe``, for an evaluation)."""
        return self.store[name].copy()

    async def vectors(self, names: list[str]) -> list[np.ndarray]:
        """Copies of this shard's range of each vector in ``names`` (``params_`` and its
        gradient at the end of a fit, in one round trip)."""
        return [self.store[name].copy() for name in names]
