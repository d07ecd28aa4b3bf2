"""L-BFGS over vectors that never leave their shards: the vector machine and the coordinator.

Sandblaster L-BFGS (Dean et al., 2012) keeps every long vector -- the parameters, the gradient,
the search direction and the L-BFGS history of ``(s, y)`` pairs -- on the parameter-server shards,
each shard owning the same element range of every vector.  The coordinator runs L-BFGS by sending
the shards small *programs* of vector commands and receives only scalars back (partial dot
products, which it sums over shards).

This module is plain numpy, free of Dask, so both halves are testable in one process:

* :class:`VectorStore` is one shard's vector machine: named float64 vectors and the commands
  ``dot``, ``axpy``, ``scale``, ``copy``, ``mul`` (coefficient-wise) and ``zero``.
* :class:`LBFGS` is the coordinator: the two-loop recursion, a backtracking line search satisfying
  the Armijo condition (and the curvature condition, checked for free because the trial point's
  gradient is computed anyway) and the stopping rules.  It talks to the shards through a
  :class:`Space`: ``run(program)`` executes a program on every shard and returns the summed
  scalars; ``evaluate(batch, prelude)`` runs a distributed pass over one batch.

Vector names used by the coordinator: ``x`` (iterate), ``g`` (gradient at ``x``), ``d``
(direction), ``xt`` (trial point), ``acc`` (gradient accumulator, becomes the trial gradient),
``xb``/``gb`` (best trial kept while the line search expands), ``tmp``, ``l2mask`` (``l2`` on
penalised weights, 0 on biases) and ``s0..s{m-1}``, ``y0..y{m-1}`` (the history ring: ``m + 1``
slots, so a new pair is written into a free slot before it is known to be kept).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


def sum_replies(replies: Sequence[Sequence[float]]) -> np.ndarray:
    """Sum the per-shard results of one program, in float64 (the coordinator's only reduction)."""
    return np.sum(np.asarray(replies, dtype=np.float64).reshape(len(replies), -1), axis=0)


class Space(Protocol):
    """What the coordinator needs from the shards and the workers."""

    def run(self, program: Program) -> np.ndarray:
        """Run ``program`` on every shard; return its dot products summed over shards."""

    def evaluate(self, batch: int, prelude: Program) -> tuple[float, int]:
        """Run ``prelude`` on every shard, then evaluate the data loss at vector ``xt`` on
        ``batch``: leave ``sum_i grad loss_i`` in ``acc`` and return ``(sum_i loss_i, n)``."""


@dataclass
class LBFGSResult:
    """Outcome of :meth:`LBFGS.minimize`."""

    objective: float
    grad_norm: float
    n_iter: int
    reason: str  # "converged", "max_iter", "max_seconds", "line_search_failed"
    history: list[dict[str, Any]] = field(default_factory=list)


class LBFGS:
    """The Sandblaster coordinator: L-BFGS that only ever holds scalars.

    Parameters
    ----------
    space : Space
        The shards (vector programs) and the workers (distributed evaluations).
    history : int
        Memory ``m``: number of ``(s, y)`` pairs kept on the shards.
    max_iter : int
        Maximum number of L-BFGS iterations (accepted steps).
    tol : float
        Stop when the relative objective decrease of an iteration,
        ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1)``, is at most ``tol`` (as scipy's ``ftol``),
        or when ``||g|| <= tol * max(1, ||g_0||)``.
    n_batches : int
        Batches cycled through; with 1 (full batch) the trial point's gradient is reused as the
        next iteration's gradient, so each accepted step costs one distributed pass.
    c1, c2 : float
        Armijo and (weak) curvature constants.
    max_evals : int
        Distributed passes allowed per line search.
    precision : float
        Relative precision of one objective evaluation.  A step whose predicted decrease
        ``-t g'd`` is below ``precision * max(|f|, 1)`` cannot be told from rounding noise by the
        Armijo test, so L-BFGS stops there as converged instead of backtracking in vain
        (:class:`~downpour_dask.sandblaster.estimator.SandblasterLBFGS` uses float32's epsilon).
    max_seconds : float, optional
        Wall-clock budget.
    log : callable, optional
        ``log(kind, detail, **data)`` receives the events: ``line_search`` (data: ``iteration``,
        ``step``, ``evaluations``, ``objective``; or ``iteration``, ``found=False``),
        ``history_reset`` (``iteration``, ``gd``), ``history_skipped`` (``iteration``, ``sy``)
        and ``converged`` (``iteration``, ``objective``, ``rule``: ``gradient_norm``,
        ``predicted_decrease``, ``line_search_precision`` or ``relative_decrease``).
        ``detail`` says the same in a sentence.
    on_iteration : callable, optional
        ``on_iteration(record)`` after every accepted step (``iteration``, ``objective``,
        ``grad_norm``, ``step``, ``evals``).
    """

    def __init__(
        self,
        space: Space,
        history: int = 10,
        max_iter: int = 100,
        tol: float = 1e-6,
        n_batches: int = 1,
        c1: float = 1e-4,
        c2: float = 0.9,
        max_evals: int = 20,
        precision: float = 0.0,
        max_seconds: float | None = None,
        log: Callable[..., Any] | None = None,
        on_iteration: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.space, self.m, self.max_iter, self.tol = space, history, max_iter, tol
        self.n_batches, self.c1, self.c2, self.max_evals = n_batches, c1, c2, max_evals
        self.precision = precision
        self.max_seconds = max_seconds
        self.log = log or (lambda kind, detail, **data: None)
        self.on_iteration = on_iteration or (lambda record: None)
        self.ring: list[tuple[int, float]] = []  # (slot, rho = 1/s'y), oldest first
        self.gamma = 1.0  # initial Hessian scaling s'y / y'y of the newest pair

    # -- one distributed evaluation ---------------------------------------------------------------
    def _evaluate(self, batch: int, prelude: Program, extra: Program = ()) -> tuple[float, list]:
        """Objective at ``xt`` on ``batch``; ``acc`` becomes its gradient (mean + L2 term)."""
        loss_sum, n = self.space.evaluate(batch, prelude)
        dots = self.space.run(
            [
                ("scale", "acc", 1.0 / n),
                ("mul", "l2mask", "xt", "tmp"),
                ("axpy", 1.0, "tmp", "acc"),
                ("dot", "tmp", "xt"),  # l2 * ||W||^2
                *extra,
            ]
        )
        return loss_sum / n + 0.5 * float(dots[0]), [float(v) for v in dots[1:]]

    def _gradient_at_x(self, batch: int) -> tuple[float, float]:
        """Evaluate at ``x``: objective and ||g||^2, with the gradient stored in ``g``."""
        f, (gg,) = self._evaluate(batch, [("copy", "x", "xt")], [("dot", "acc", "acc")])
        self.space.run([("copy", "acc", "g")])
        return f, gg

    # -- the two-loop recursion, one shard round trip per history entry ---------------------------
    def _direction(self) -> float:
        """Store ``d = -H g`` on the shards; return ``g'd``."""
        alphas: list[float] = []
        program: list[Command] = [("copy", "g", "d")]
        for slot, rho in reversed(self.ring):  # newest to oldest
            program.append(("dot", f"s{slot}", "d"))
            alpha = rho * float(self.space.run(program)[-1])
            alphas.append(alpha)
            program = [("axpy", -alpha, f"y{slot}", "d")]
        program.append(("scale", "d", self.gamma))
        for (slot, rho), alpha in zip(self.ring, reversed(alphas)):  # oldest to newest
            program.append(("dot", f"y{slot}", "d"))
            beta = rho * float(self.space.run(program)[-1])
            program = [("axpy", alpha - beta, f"s{slot}", "d")]
        program += [("scale", "d", -1.0), ("dot", "g", "d")]
        return float(self.space.run(program)[-1])

    # -- the optimisation loop --------------------------------------------------------------------
    def minimize(self) -> LBFGSResult:
        """Minimise from the point stored as ``x`` on the shards; leaves the result in ``x``."""
        start = time.time()
        batch = 0
        f, gg = self._gradient_at_x(batch)
        g0 = math.sqrt(gg)
        records: list[dict[str, Any]] = []
        reason, k = "max_iter", 0
        self.on_iteration({"iteration": 0, "objective": f, "grad_norm": g0, "step": 0.0})
        while k < self.max_iter:
            if math.sqrt(gg) <= self.tol * max(1.0, g0):
                detail = f"gradient norm {math.sqrt(gg):.3g} <= tol * max(1, |g0|)"
                reason = self._converged("gradient_norm", detail, k, f)
                break
            if self.max_seconds is not None and time.time() - start >= self.max_seconds:
                reason = "max_seconds"
                break
            gd = self._direction() if self.ring else -gg
            if not self.ring or not (gd < 0 and math.isfinite(gd)):
                if self.ring:
                    self.log(
                        "history_reset", f"g'd = {gd:.3g} is not a descent direction",
                        iteration=k, gd=gd,
                    )  # fmt: skip
                self.ring = []
                self.space.run([("copy", "g", "d"), ("scale", "d", -1.0)])
                gd = -gg
            t = 1.0 if self.ring else min(1.0, 1.0 / math.sqrt(gg))
            floor = self.precision * max(abs(f), 1.0)
            if -t * gd <= floor:
                detail = f"predicted decrease {-t * gd:.3g} below precision"
                reason = self._converged("predicted_decrease", detail, k, f)
                break
            found = self._line_search(batch, f, gd, t, floor, k + 1)
            if found is None:
                reason = "line_search_failed"
                self.log(
                    "line_search", f"iteration {k + 1}: no Armijo step found",
                    iteration=k + 1, found=False,
                )  # fmt: skip
                break
            if found[0] is None:
                detail = f"line search reached precision {self.precision:.3g}"
                reason = self._converged("line_search_precision", detail, k, f)
                break
            f_new, t, evals = found
            sy, yy, gg = self._accept(t, k + 1)
            k += 1
            decrease = (f - f_new) / max(abs(f), abs(f_new), 1.0)
            f = f_new
            if self.n_batches > 1:  # the next iteration's gradient is on the next batch
                batch = k % self.n_batches
                f, gg = self._gradient_at_x(batch)
            record = {
                "iteration": k,
                "objective": f,
                "grad_norm": math.sqrt(gg),
                "step": t,
                "evals": evals,
            }
            records.append(record)
            self.on_iteration(record)
            if decrease <= self.tol:
                detail = f"relative decrease {decrease:.3g} <= tol={self.tol}"
                reason = self._converged("relative_decrease", detail, k, f)
                break
        return LBFGSResult(f, math.sqrt(gg), k, reason, records)

    def _converged(self, rule: str, detail: str, iteration: int, objective: float) -> str:
        """Log which stopping ``rule`` ended the run; return the reason, ``"converged"``."""
        self.log("converged", detail, iteration=iteration, objective=objective, rule=rule)
        return "converged"

    def _line_search(
        self, batch: int, f: float, gd: float, t: float, floor: float, iteration: int
    ) -> tuple[float | None, float, int] | None:
        """Backtracking Armijo search along ``d``; expands while the curvature condition fails.

        Each trial costs one distributed pass.  The trial point's gradient (in ``acc``) comes
        with it, so the weak curvature condition ``g(x+td)'d >= c2 g'd`` is checked for free:
        when the first trial satisfies Armijo but the slope is still steep, the step is doubled
        (at most 3 times) and the best Armijo point kept.  Returns ``(f_new, t, evals)`` with
        ``xt``/``acc`` holding the accepted point and its gradient; ``(None, t, evals)`` when
        backtracking fell below the precision ``floor``; None after ``max_evals`` passes.
        """
        best: tuple[float, float] | None = None
        backtracked, evals = False, 0
        while evals < self.max_evals:
            ft, (gtd,) = self._evaluate(
                batch, [("copy", "x", "xt"), ("axpy", t, "d", "xt")], [("dot", "acc", "d")]
            )
            evals += 1
            armijo = math.isfinite(ft) and ft <= f + self.c1 * t * gd
            if best is not None and (not armijo or ft >= best[0]):
                self.space.run([("copy", "xb", "xt"), ("copy", "gb", "acc")])  # revert
                ft, t = best
                break
            if not armijo:
                t *= 0.5
                backtracked = True
                if -t * gd <= floor:
                    return None, t, evals
                continue
            curvature = gtd >= self.c2 * gd
            if curvature or backtracked or evals > 3:
                break
            best = (ft, t)
            self.space.run([("copy", "xt", "xb"), ("copy", "acc", "gb")])
            t *= 2.0
        else:
            return None
        self.log(
            "line_search", f"step {t:.4g} after {evals} evaluation(s), objective {ft:.6g}",
            iteration=iteration, step=t, evaluations=evals, objective=ft,
        )  # fmt: skip
        return ft, t, evals

    def _accept(self, t: float, iteration: int = 0) -> tuple[float, float, float]:
        """Move to the trial point; push ``s = t d``, ``y = g_new - g`` into the history ring."""
        used = {e[0] for e in self.ring}
        slot = next(i for i in range(self.m + 1) if i not in used)  # m + 1 slots: one spare
        s, y = f"s{slot}", f"y{slot}"
        sy, yy, gg = self.space.run(
            [
                ("copy", "d", s),
                ("scale", s, t),
                ("copy", "acc", y),
                ("axpy", -1.0, "g", y),
                ("copy", "xt", "x"),
                ("copy", "acc", "g"),
                ("dot", s, y),
                ("dot", y, y),
                ("dot", "g", "g"),
            ]
        )
        if sy > 1e-10 * yy and yy > 0:  # keep H positive definite
            self.ring = [*self.ring[max(0, len(self.ring) + 1 - self.m) :], (slot, 1.0 / sy)]
            self.gamma = sy / yy
        else:
            self.log(
                "history_skipped", f"s'y = {sy:.3g} <= eps * y'y: pair not stored",
                iteration=iteration, sy=float(sy),
            )  # fmt: skip
        return float(sy), float(yy), float(gg)
