"""L-BFGS over vectors that never leave their shards: the coordinator.

Sandblaster L-BFGS (Dean et al., 2012) keeps every long vector -- the parameters, the gradient,
the search direction and the L-BFGS history of ``(s, y)`` pairs -- on the parameter-server shards,
each shard owning the same element range of every vector.  The coordinator runs L-BFGS by sending
the shards small *programs* of vector commands (:mod:`~downpour_dask.core.vectors`) and receives
only scalars back (partial dot products, which it sums over shards).

:class:`LBFGS` is the coordinator: the two-loop recursion (on inner products, see
:mod:`~downpour_dask.core.lbfgs_history`), a backtracking line search satisfying the Armijo
condition (and the curvature condition, checked for free because the trial point's gradient is
computed anyway) and the stopping rules.  It talks to the shards through a :class:`Space`:
``run(program)`` executes a program on every shard and returns the summed scalars;
``evaluate(batch, prelude, finish)`` runs a distributed pass over one batch, with a program
before it and one after it that the shards run as part of the pass.  Plain numpy, free of Dask,
so it is testable in one process.  Round trips to the shards per iteration: the pass itself,
however long the history.  The step is accepted in the program that finishes a trial's
gradient, *speculatively*: the program keeps the iterate and the gradient (``xp``, ``gp``)
before it moves them, and a trial the line search does not accept is undone at the start of
the next program the coordinator sends (no round trip of its own).

Vector names used by the coordinator: ``x`` (iterate), ``g`` (gradient at ``x``), ``d``
(direction), ``xt`` (trial point), ``acc`` (gradient accumulator, becomes the trial gradient),
``xb``/``gb`` (best trial kept while the line search expands), ``xp``/``gp`` (the iterate and
gradient a speculative accept replaced), ``tmp``, ``l2mask`` (``l2`` on
penalised weights, 0 on biases) and ``s0..s{m}``, ``y0..y{m}`` (the history ring: ``m + 1``
slots, so a new pair is written into a free slot before it is known to be kept).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .lbfgs_history import History
from .vectors import Command, Program


class Space(Protocol):
    """What the coordinator needs from the shards and the workers."""

    def run(self, program: Program) -> np.ndarray:
        """Run ``program`` on every shard; return its dot products summed over shards."""

    def evaluate(self, batch: int, prelude: Program, finish: Program) -> tuple[float, int, list]:
        """Run ``prelude`` on every shard, then evaluate the data loss at vector ``xt`` on
        ``batch``: leave the mean gradient ``sum_i grad loss_i / n`` in ``acc``, run ``finish``
        on every shard and return ``(sum_i loss_i, n, finish's summed dot products)``."""


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
        self.history = History(history)
        self._pending: list[Command] = []  # undoes a speculative accept: leads the next program
        self._speculated: tuple[int, list, list] | None = None  # an accept done with its trial

    # -- one distributed evaluation ---------------------------------------------------------------
    def _after_pending(self, program: Program) -> list[Command]:
        """``program``, led by the undo of a speculative accept if one is due (then no longer)."""
        pending, self._pending = self._pending, []
        return [*pending, *program]

    def _run(self, program: Program) -> np.ndarray:
        """Run ``program`` on the shards, after the undo of a speculative accept if one is due."""
        return self.space.run(self._after_pending(program))

    def _evaluate(self, batch: int, prelude: Program, extra: Program = ()) -> tuple[float, list]:
        """Objective at ``xt`` on ``batch``; ``acc`` becomes its gradient (mean + L2 term).
        ``extra`` runs on the shards right after, as part of the pass (no round trip)."""
        finish: list[Command] = [
            ("mul", "l2mask", "xt", "tmp"),
            ("axpy", 1.0, "tmp", "acc"),
            ("dot", "tmp", "xt"),  # l2 * ||W||^2
            *extra,
        ]
        loss_sum, n, dots = self.space.evaluate(batch, self._after_pending(prelude), finish)
        return loss_sum / n + 0.5 * float(dots[0]), [float(v) for v in dots[1:]]

    def _gradient_at_x(self, batch: int) -> tuple[float, float]:
        """Evaluate at ``x``: objective and ||g||^2, with the gradient stored in ``g`` (and its
        inner products with the history recorded)."""
        f, (gg,) = self._evaluate(batch, [("copy", "x", "xt")], [("dot", "acc", "acc")])
        pairs = [("g", "g"), *self.history.gradient_dots()]
        dots = self._run([("copy", "acc", "g"), *self.history.program(pairs[1:])])
        self.history.record(pairs, [gg, *dots])
        return f, gg

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
            direction, gd = self.history.direction() if self.history else ([], -gg)
            if not self.history or not (gd < 0 and math.isfinite(gd)):
                if self.history:
                    self.log(
                        "history_reset", f"g'd = {gd:.3g} is not a descent direction",
                        iteration=k, gd=gd,
                    )  # fmt: skip
                self.history.reset()
                direction, gd = [("copy", "g", "d"), ("scale", "d", -1.0)], -gg
            t = 1.0 if self.history else min(1.0, 1.0 / math.sqrt(gg))
            floor = self.precision * max(abs(f), 1.0)
            if -t * gd <= floor:
                detail = f"predicted decrease {-t * gd:.3g} below precision"
                reason = self._converged("predicted_decrease", detail, k, f)
                break
            found = self._line_search(batch, f, gd, t, floor, k + 1, direction)
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
        if self._pending:  # the last trial was not accepted: x and g back to the iterate
            self._run([])
        return LBFGSResult(f, math.sqrt(gg), k, reason, records)

    def _converged(self, rule: str, detail: str, iteration: int, objective: float) -> str:
        """Log which stopping ``rule`` ended the run; return the reason, ``"converged"``."""
        self.log("converged", detail, iteration=iteration, objective=objective, rule=rule)
        return "converged"

    def _line_search(
        self,
        batch: int,
        f: float,
        gd: float,
        t: float,
        floor: float,
        iteration: int,
        direction: Program = (),
    ) -> tuple[float | None, float, int] | None:
        """Backtracking Armijo search along ``d``; expands while the curvature condition fails.

        Each trial costs one distributed pass.  The trial point's gradient (in ``acc``) comes
        with it, so the weak curvature condition ``g(x+td)'d >= c2 g'd`` is checked for free:
        when the first trial satisfies Armijo but the slope is still steep, the step is doubled
        (at most 3 times) and the best Armijo point kept.  Returns ``(f_new, t, evals)`` with
        ``xt``/``acc`` holding the accepted point and its gradient; ``(None, t, evals)`` when
        backtracking fell below the precision ``floor``; None after ``max_evals`` passes.
        ``direction`` (the program storing ``d``) runs on the shards just before the first trial.
        """
        best: tuple[float, float] | None = None
        backtracked, evals = False, 0
        while evals < self.max_evals:
            trial: list[Command] = [("copy", "x", "xt"), ("axpy", t, "d", "xt")]
            prelude = [*direction, *trial] if evals == 0 else trial
            accept, slot, pairs = self._accept_program(t)
            keep: list[Command] = [("copy", "x", "xp"), ("copy", "g", "gp")]
            ft, (gtd, *accepted) = self._evaluate(
                batch, prelude, [("dot", "acc", "d"), *keep, *accept]
            )
            self._pending = [("copy", "xp", "x"), ("copy", "gp", "g")]  # unless it stands
            evals += 1
            armijo = math.isfinite(ft) and ft <= f + self.c1 * t * gd
            if best is not None and (not armijo or ft >= best[0]):
                self._run([("copy", "xb", "xt"), ("copy", "gb", "acc")])  # revert
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
                self._pending, self._speculated = [], (slot, pairs, accepted)  # it stands
                break
            best = (ft, t)
            self._run([("copy", "xt", "xb"), ("copy", "acc", "gb")])
            t *= 2.0
        else:
            return None
        self.log(
            "line_search", f"step {t:.4g} after {evals} evaluation(s), objective {ft:.6g}",
            iteration=iteration, step=t, evaluations=evals, objective=ft,
        )  # fmt: skip
        return ft, t, evals

    def _accept_program(self, t: float) -> tuple[list[Command], int, list[tuple[str, str]]]:
        """The program that moves to the trial point ``xt`` (step ``t`` along ``d``): it writes
        ``s = t d`` and ``y = g_new - g`` into a free history slot and returns the inner products
        the next directions need; also the slot and those products' names."""
        slot = self.history.free_slot()
        s, y = f"s{slot}", f"y{slot}"
        pairs = self.history.pair_dots(slot)
        program: list[Command] = [
            ("copy", "d", s),
            ("scale", s, t),
            ("copy", "acc", y),
            ("axpy", -1.0, "g", y),
            ("copy", "xt", "x"),
            ("copy", "acc", "g"),
            ("dot", s, y),
            ("dot", y, y),
            ("dot", "g", "g"),
            *self.history.program(pairs),
        ]
        return program, slot, pairs

    def _accept(self, t: float, iteration: int = 0) -> tuple[float, float, float]:
        """Move to the trial point (unless the trial's own program did, speculatively); push
        ``s = t d``, ``y = g_new - g`` into the history ring and record the inner products the
        next directions need."""
        if self._speculated is not None:
            (slot, pairs, dots), self._speculated = self._speculated, None
        else:  # a reverted expansion: the best trial, moved to by a program of its own
            program, slot, pairs = self._accept_program(t)
            dots = list(self._run(program))
        sy, yy, gg, *rest = dots
        self.history.record([("g", "g"), *pairs], [gg, *rest])
        if sy > 1e-10 * yy and yy > 0:  # keep H positive definite
            self.history.keep(slot, float(sy), float(yy))
        else:
            self.log(
                "history_skipped", f"s'y = {sy:.3g} <= eps * y'y: pair not stored",
                iteration=iteration, sy=float(sy),
            )  # fmt: skip
        return float(sy), float(yy), float(gg)
