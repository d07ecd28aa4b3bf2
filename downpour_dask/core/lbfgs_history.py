"""The L-BFGS memory as the coordinator sees it: inner products, not vectors.

The history pairs ``(s_i, y_i)`` and the gradient ``g`` live on the shards (see
:mod:`~downpour_dask.core.lbfgs`).  The classic two-loop recursion needs one dot product of the
partly built direction per history pair and loop, each depending on the one before: ``2m + 1``
shard round trips per iteration.  Every vector the recursion ever forms is, however, a linear
combination of the basis ``s_1..s_m, y_1..y_m, g``, and every dot product it needs is a
combination of the basis's inner products (the vector-free L-BFGS of Chen, Wang and Zhou,
"Large-scale L-BFGS using MapReduce", NIPS 2014).  So :class:`History` keeps those inner
products (the Gram matrix), runs the recursion on ``2m + 1`` coefficients in the coordinator,
and sends the shards one program that forms ``d`` -- which the coordinator prepends to the line
search's first trial, so the direction costs no round trip of its own.  The Gram matrix is kept
current by dot products that ride along with the programs the coordinator sends anyway: when a
pair is stored, its products with the pairs kept and with the new ``g``.

Plain numpy and arithmetic on scalars: no Dask, testable against the dense inverse-Hessian.
"""

from __future__ import annotations

from collections.abc import Sequence

from .vectors import Command, Program


class History:
    """Which shard slots hold the kept ``(s, y)`` pairs, and the inner products among them.

    Parameters
    ----------
    m : int
        Pairs kept; the shards hold ``m + 1`` slots (``s0..sm``, ``y0..ym``) so that a new pair
        is written into a free slot before it is known to be kept.
    """

    def __init__(self, m: int):
        self.m = m
        self.ring: list[tuple[int, float]] = []  # (slot, rho = 1/s'y), oldest first
        self.gamma = 1.0  # initial Hessian scaling s'y / y'y of the newest pair
        self._gram: dict[tuple[str, str], float] = {}

    def __len__(self) -> int:
        return len(self.ring)

    def reset(self) -> None:
        """Forget every pair (the next direction is steepest descent)."""
        self.ring = []

    def free_slot(self) -> int:
        """A slot no kept pair uses, for the next pair."""
        used = {slot for slot, _ in self.ring}
        return next(i for i in range(self.m + 1) if i not in used)

    # -- the dot products that keep the Gram matrix current ---------------------------------------
    def _kept_vectors(self) -> list[str]:
        return [f"{kind}{slot}" for slot, _ in self.ring for kind in "sy"]

    def pair_dots(self, slot: int) -> list[tuple[str, str]]:
        """Inner products to compute once the pair in ``slot`` and the new ``g`` are written:
        the new pair with itself and with every kept pair, and ``g`` with all of them."""
        new = [f"s{slot}", f"y{slot}"]
        kept = self._kept_vectors()
        pairs = [(new[0], new[0]), *((a, b) for a in new for b in kept)]
        return pairs + self.gradient_dots(extra=new)

    def gradient_dots(self, extra: Sequence[str] = ()) -> list[tuple[str, str]]:
        """Inner products of a new ``g`` with every kept vector (and ``extra`` ones)."""
        return [("g", v) for v in [*self._kept_vectors(), *extra]]

    @staticmethod
    def program(pairs: list[tuple[str, str]]) -> Program:
        """The ``dot`` commands computing ``pairs``, in order."""
        return [("dot", a, b) for a, b in pairs]

    def record(self, pairs: list[tuple[str, str]], values: list[float]) -> None:
        """Store the inner products ``pairs`` (as computed by :meth:`program`)."""
        if len(pairs) != len(values):
            raise ValueError(f"{len(pairs)} inner products expected, got {len(values)}")
        for (a, b), value in zip(pairs, values):
            self._gram[(a, b)] = self._gram[(b, a)] = float(value)

    def keep(self, slot: int, sy: float, yy: float) -> None:
        """Add the pair in ``slot`` (its ``s'y`` and ``y'y`` already recorded), dropping the
        oldest pair when ``m`` are kept."""
        self._gram[(f"s{slot}", f"y{slot}")] = self._gram[(f"y{slot}", f"s{slot}")] = sy
        self._gram[(f"y{slot}", f"y{slot}")] = yy
        self.ring = [*self.ring[max(0, len(self.ring) + 1 - self.m) :], (slot, 1.0 / sy)]
        self.gamma = sy / yy

    # -- the two-loop recursion on coefficients ---------------------------------------------------
    def direction(self) -> tuple[Program, float]:
        """The program that stores ``d = -H g`` on the shards, and ``g'd``.

        ``H`` is the L-BFGS inverse-Hessian approximation of the kept pairs with initial scaling
        ``gamma``; the recursion is the classic two-loop one, applied to the coefficients of
        ``q`` over the basis instead of to ``q`` itself.
        """
        basis = [*self._kept_vectors(), "g"]
        coef = dict.fromkeys(basis, 0.0)
        coef["g"] = 1.0  # q = g

        def dot(name: str) -> float:  # name . q
            return sum(c * self._gram[(name, b)] for b, c in coef.items() if c)

        alphas = []
        for slot, rho in reversed(self.ring):  # newest to oldest
            alpha = rho * dot(f"s{slot}")
            alphas.append(alpha)
            coef[f"y{slot}"] -= alpha
        for name in coef:
            coef[name] *= self.gamma
        for (slot, rho), alpha in zip(self.ring, reversed(alphas)):  # oldest to newest
            beta = rho * dot(f"y{slot}")
            coef[f"s{slot}"] += alpha - beta
        gd = -dot("g")  # d = -q
        program: list[Command] = [("zero", "d")]
        program += [("axpy", -c, name, "d") for name, c in coef.items() if c]
        return program, gd
