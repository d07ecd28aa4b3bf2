"""Sandblaster L-BFGS (Dean et al., 2012): batch L-BFGS run by a coordinator on Dask.

The driver is the paper's coordinator.  It runs :class:`downpour_dask.lbfgs.LBFGS`, which only
ever sees scalars: every long vector (the iterate, gradients, the search direction, the (s, y)
history) lives on the parameter-server shards, which run the coordinator's vector programs on
their ranges.  Each gradient is computed by a distributed pass of many small portions
(:mod:`downpour_dask.portions`), load-balanced over the workers with backup copies of
stragglers, and accumulated on the shards, never through the driver.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client, Security

from .._version import __version__
from ..base import ParamServerEstimator, check_int, check_positive
from ..core import optim
from ..core.lbfgs import LBFGS
from ..core.models import Model, from_config
from ..core.params import DTYPE, split_range
from ..data.datasets import Dataset, as_dataset
from ..log import EVAL_COLUMNS, PUSH_COLUMNS, Experiment, Progress, events_frame
from ..ps.server import ParameterServer
from ..runtime.cluster import check_security, cluster_client, cluster_workers
from .portions import PortionResult, Portions, SandblasterShard, evaluate_task, forget_run

# -- the estimator --------------------------------------------------------------------------------


class SandblasterLBFGS(ParamServerEstimator):
    """Sandblaster L-BFGS (Dean et al., 2012) on a Dask cluster.

    The objective is the model's own: mean loss over the batch plus ``0.5 * l2 * ||W||^2``.
    Every long vector stays on the parameter-server shards; the driver sends vector programs and
    receives scalars, and gathers full vectors only for ``params_``/``gradient_`` at the end.

    Parameters
    ----------
    model : Model
        A :mod:`downpour_dask.models` model.
    n_shards : int, default 2
        Parameter-server shards (Dask actors); shard i is placed on the i-th worker by sorted
        address (modulo the number of workers).
    batch_size : int, optional
        Rows per batch; default: the whole dataset (full-batch L-BFGS, where each accepted step
        costs one distributed pass).  Smaller batches are disjoint random subsets cycled through;
        each iteration's gradient and line search then use one batch.
    portions_per_batch : int, optional
        Portions (tasks) each batch is cut into; default 10 per worker thread, so faster workers
        can take more of them.
    history : int, default 10
        L-BFGS memory m: (s, y) pairs kept on the shards.
    max_iter : int, default 100
        Maximum number of L-BFGS iterations (accepted steps); 0 only evaluates the gradient.
    tol : float, default 1e-6
        Stop when an iteration's relative objective decrease
        ``(f_k - f_k+1) / max(|f_k|, |f_k+1|, 1)`` is at most ``tol``, or when the gradient norm
        falls to ``tol * max(1, ||g_0||)``.  It also stops (as converged) once the decrease a
        step predicts is below float32's resolution of the objective, which workers compute in.
    backup_tasks : bool, default True
        Re-submit straggling portions on idle workers near the end of each batch.
    c1, c2 : float, default 1e-4, 0.9
        Armijo and curvature constants of the backtracking line search.
    eval_every : int, default 1
        Evaluate ``eval_data`` every this many iterations (and at the end).
    max_seconds : float, optional
        Wall-clock budget; checked between iterations.
    random_state : int, optional
        Seeds the initial parameters and the assignment of rows to batches.
    timeout : float, default 120
        Seconds any shard call or batch may take before the run fails instead of hanging.
    security : distributed.Security or True, optional
        TLS for the embedded local cluster started when ``fit`` gets no client: ``True`` for
        temporary self-signed certificates (``Security.temporary()``), or a ``Security`` with
        certificates for every role.  Give a client of an existing cluster its own ``security``.

    Attributes
    ----------
    params_ : ndarray
        The optimised flat float32 parameter vector.
    gradient_ : ndarray
        The objective's gradient at ``params_`` (float64, as accumulated on the shards).
    objective_ : float
        The objective at ``params_`` (on the last batch).
    n_iter_ : int
        L-BFGS iterations performed.
    experiment_ : Experiment
        ``pushes`` (one row per counted portion: ``replica`` is the worker's index, ``step`` and
        ``version`` the batch's version), ``evals`` (one row per iteration, with ``objective``,
        ``grad_norm`` and ``step``; ``loss``/score on ``eval_data`` if given) and ``events``
        (``start``, ``batch_start``/``batch_done``, ``backup_launched``, ``duplicate_discarded``,
        ``line_search``, ``history_skipped``, ``worker_lost``, ``data_restored``, ``converged``,
        ``stop``).

    Notes
    -----
    A worker that dies mid-batch costs nothing but time: Dask re-runs its portions elsewhere, the
    driver re-scatters the data blocks it held, and the shards count every portion once.  Shards
    themselves are not recovered (a lost shard fails the run), so on small clusters keep them on
    workers you expect to live; they go to the first ``n_shards`` workers by sorted address.
    """

    def __init__(
        self,
        model: Model,
        n_shards: int = 2,
        batch_size: int | None = None,
        portions_per_batch: int | None = None,
        history: int = 10,
        max_iter: int = 100,
        tol: float = 1e-6,
        backup_tasks: bool = True,
        c1: float = 1e-4,
        c2: float = 0.9,
        eval_every: int = 1,
        max_seconds: float | None = None,
        random_state: int | None = None,
        timeout: float = 120.0,
        security: Security | bool | None = None,
    ):
        self.model = model
        self.n_shards = n_shards
        self.batch_size = batch_size
        self.portions_per_batch = portions_per_batch
        self.history = history
        self.max_iter = max_iter
        self.tol = tol
        self.backup_tasks = backup_tasks
        self.c1 = c1
        self.c2 = c2
        self.eval_every = eval_every
        self.max_seconds = max_seconds
        self.random_state = random_state
        self.timeout = timeout
        self.security = security

    def _check_arguments(self) -> None:
        """Check every constructor argument; raises before any cluster work."""
        if not isinstance(self.model, Model):
            raise TypeError(
                f"model must be a downpour_dask.models model (e.g. models.MLP), "
                f"got {type(self.model).__name__}"
            )
        check_int("n_shards", self.n_shards, 1, self.model.layout.size)
        check_int("batch_size", self.batch_size, 1, allow_none=True)
        check_int("portions_per_batch", self.portions_per_batch, 1, allow_none=True)
        check_int("history", self.history, 1)
        check_int("max_iter", self.max_iter, 0)
        check_positive("tol", self.tol, allow_zero=True)
        if not isinstance(self.backup_tasks, (bool, np.bool_)):
            raise TypeError(f"backup_tasks must be True or False, got {self.backup_tasks!r}")
        check_positive("c1", self.c1)
        check_positive("c2", self.c2)
        if not self.c1 < self.c2 < 1:
            raise ValueError(f"c1 and c2 must satisfy 0 < c1 < c2 < 1, got {self.c1}, {self.c2}")
        check_int("eval_every", self.eval_every, 1)
        check_positive("max_seconds", self.max_seconds, allow_none=True)
        check_positive("timeout", self.timeout)
        check_security(self.security)
        if self.random_state is not None:
            check_int("random_state", self.random_state, 0)

    def _check_data(self, data: Any, y: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
        dataset = as_dataset(data, y, what=what)
        try:
            return self.model.check_data(dataset.X, dataset.y)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{what}: {err}") from None

    def fit(
        self,
        data: Dataset | tuple | np.ndarray,
        y: np.ndarray | None = None,
        *,
        eval_data: Dataset | tuple | None = None,
        client: Client | None = None,
        callback: Callable[[Progress], None] | None = None,
        portion_delay: Mapping[str, float] | None = None,
    ) -> SandblasterLBFGS:
        """Minimise the model's objective on ``data`` with Sandblaster L-BFGS; returns ``self``.

        Parameters
        ----------
        data : Dataset, (X, y) tuple, or X
            Training data; with ``X``, pass the targets as ``y``.
        eval_data : Dataset or (X, y), optional
            Scored every ``eval_every`` iterations, on a worker (``experiment_.evals``).
        client : distributed.Client, optional
            The cluster; by default an embedded local cluster is started and closed.
        callback : callable, optional
            Called with a :class:`~downpour_dask.log.Progress` snapshot after every iteration
            (``loss`` is the objective, ``pushes`` the portions counted so far).  An exception
            it raises ends the run and propagates out of ``fit``.
        portion_delay : mapping of worker address to seconds, optional
            Fault injection for tests and benchmarks: every portion running on that worker
            sleeps this long first, making the worker a straggler.
        """
        self._check_arguments()
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        X, y = self._check_data(data, y, "data")
        evaluation = None if eval_data is None else self._check_data(eval_data, None, "eval_data")
        with cluster_client(client, self.security) as active:
            run = _Run(self, active, X, y, evaluation, dict(portion_delay or {}))
            run.callback = callback
            run.execute()
        self.params_, self.gradient_ = run.params, run.gradient
        self.objective_, self.n_iter_ = run.result.objective, run.result.n_iter
        self.experiment_ = run.experiment
        return self


class _Run:
    """One execution of :meth:`SandblasterLBFGS.fit`: placement, data, the coordinator, logs."""

    def __init__(self, est: SandblasterLBFGS, client: Client, X, y, evaluation, delay: dict):
        self.est, self.client, self.X, self.y = est, client, X, y
        self.evaluation, self.delay = evaluation, delay
        self.token = uuid.uuid4().hex[:12]
        self.events: list[tuple[float, str, str]] = []
        self.pushes: list[tuple] = []
        self.evals: list[dict[str, Any]] = []
        self.worker_index: dict[str, int] = {}
        self.metric = "accuracy" if est.model.is_classifier else "r2"
        self.callback: Callable[[Progress], None] | None = None

    def event(self, kind: str, detail: str = "") -> None:
        self.events.append((time.time() - self.t0, kind, detail))

    def push(self, r: PortionResult, now: float) -> None:
        replica = self.worker_index.setdefault(r.worker, len(self.worker_index))
        loss = r.loss_sum / r.examples
        self.pushes.append(
            (now - self.t0, replica, r.version, loss, r.examples, 0, r.version, True, 0)
        )

    def _batches(self, workers: dict) -> list[list]:
        """Rows of every portion of every batch: slices in full-batch mode (views, no copy),
        else index arrays of a seeded permutation cut into disjoint batches."""
        est, n = self.est, len(self.X)
        rng = np.random.default_rng(est.random_state)
        self.initial = est.model.init(rng)
        size = n if est.batch_size is None else min(est.batch_size, n)
        order = None if size == n else rng.permutation(n)
        threads = sum(info.get("nthreads", 1) for info in workers.values())
        per_batch = est.portions_per_batch or 10 * threads
        batches = []
        for lo, hi in split_range(n, -(-n // size)):
            parts = split_range(hi - lo, min(per_batch, hi - lo))
            batches.append(
                [
                    slice(lo + a, lo + b) if order is None else order[lo + a : lo + b]
                    for a, b in parts
                ]
            )
        return batches

    def execute(self) -> None:
        est, client, model = self.est, self.client, self.est.model
        workers = cluster_workers(client)
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        self.t0 = time.time()
        rows = self._batches(workers)
        mask = np.zeros(model.layout.size)
        for name, shape in model.layout.shapes.items():  # weight matrices, not biases
            if len(shape) == 2:
                lo, hi = model.layout.offsets[name]
                mask[lo:hi] = model.l2
        self.server = ParameterServer.create(
            client, self.initial, est.n_shards, optim.sgd(1.0), sorted(workers), est.timeout,
            shard_class=SandblasterShard, l2mask=mask,
        )  # fmt: skip
        try:
            self._optimise(rows, workers)
        finally:
            try:  # first: straggling portions stop before their shards go away
                client.run(forget_run, self.token)
            except Exception:  # a worker that died with the run has nothing to forget
                pass
            self.server.close()
        self.experiment = self._experiment(sorted(workers))

    def _optimise(self, rows: list[list], workers: dict) -> None:
        est, client = self.est, self.client
        flat = [idx for batch in rows for idx in batch]
        data_model = from_config({**est.model.get_config(), "l2": 0.0})
        [model_future] = client.scatter([data_model], broadcast=True, hash=False)
        eval_future = None
        if self.evaluation is not None:
            [eval_future] = client.scatter([self.evaluation], hash=False)
        ids, k = [], 0
        for batch in rows:
            ids.append(list(range(k, k + len(batch))))
            k += len(batch)
        self.portions = Portions(self, ids, flat, model_future)
        self.event(
            "start",
            f"{len(flat)} portions in {len(rows)} batch(es), {est.n_shards} shards on "
            f"{len(workers)} workers",
        )
        self._eval_future, self._pending_eval = eval_future, None
        optimizer = LBFGS(
            self.portions, history=est.history, max_iter=est.max_iter, tol=est.tol,
            n_batches=len(rows), c1=est.c1, c2=est.c2, max_seconds=est.max_seconds,
            precision=float(np.finfo(DTYPE).eps),  # workers evaluate in float32
            log=self.event, on_iteration=self._on_iteration,
        )  # fmt: skip
        self.result = optimizer.minimize()
        self.event("stop", f"{self.result.reason} after {self.result.n_iter} iteration(s)")
        x = self.server.call_all("vector", "x", timeout=est.timeout)
        g = self.server.call_all("vector", "g", timeout=est.timeout)
        self.params = np.concatenate(x).astype(DTYPE)
        self.gradient = np.concatenate(g)
        self._finish_eval()
        if eval_future is not None and np.isnan(self.evals[-1]["loss"]):  # score the result too
            self._submit_eval(self.evals[-1])
            self._finish_eval()
        if self.callback is not None and self.evals:
            self.callback(self._progress(self.evals[-1], "done"))
        extra = [f for f in (model_future, eval_future) if f is not None]
        client.cancel(self.portions.blocks + extra)

    def _on_iteration(self, record: dict[str, Any]) -> None:
        """Log one evals row per iteration; score ``eval_data`` on a worker every eval_every."""
        self._finish_eval()
        row = {
            "time": time.time() - self.t0,
            "version": record["iteration"],
            "examples_seen": self.portions.examples_seen,
            "loss": np.nan,
            self.metric: np.nan,
            "objective": record["objective"],
            "grad_norm": record["grad_norm"],
            "step": record.get("step", 0.0),
        }
        self.evals.append(row)
        if self._eval_future is not None and record["iteration"] % self.est.eval_every == 0:
            self._submit_eval(row)
        if self.callback is not None:
            self.callback(self._progress(row, "training"))

    def _progress(self, row: dict[str, Any], phase: str) -> Progress:
        """A snapshot for the callback: the newest finished score, iterations/time done."""
        est = self.est
        scores = [r[self.metric] for r in self.evals if not np.isnan(r[self.metric])]
        fractions = [row["version"] / est.max_iter if est.max_iter else 1.0]
        if est.max_seconds is not None:
            fractions.append(row["time"] / est.max_seconds)
        return Progress(
            time=row["time"],
            examples=self.portions.examples_seen,
            pushes=len(self.pushes),
            loss=row["objective"],
            score=scores[-1] if scores else float("nan"),
            metric=self.metric,
            fraction=1.0 if phase == "done" else min(1.0, max(fractions)),
            phase=phase,
        )

    def _submit_eval(self, row: dict[str, Any]) -> None:
        """Score a snapshot of ``x`` on a worker while the coordinator goes on iterating."""
        self.portions.run([("copy", "x", "xe")])  # the next iterations may move x
        future = self.client.submit(
            evaluate_task, self.server.portable(), self.est.model, self._eval_future,
            self.est.timeout, pure=False,
        )  # fmt: skip
        self._pending_eval = (row, future)

    def _finish_eval(self) -> None:
        """Wait for the pending evaluation, if any, and fill in its row."""
        if self._pending_eval is not None:
            row, future = self._pending_eval
            row["loss"], row[self.metric] = future.result(timeout=self.est.timeout)
            self._pending_eval = None

    def _experiment(self, workers: list[str]) -> Experiment:
        pushes = pd.DataFrame(self.pushes, columns=list(PUSH_COLUMNS)).astype(PUSH_COLUMNS)
        columns = {
            **EVAL_COLUMNS,
            self.metric: "float64",
            "objective": "float64",
            "grad_norm": "float64",
            "step": "float64",
        }
        evals = pd.DataFrame(self.evals, columns=list(columns)).astype(columns)
        est = self.est
        config = {k: v for k, v in est.get_params().items() if k not in ("model", "security")}
        config.update(
            tls=est.security is not None,  # the Security object itself is not JSON
            model=est.model.get_config(),
            estimator=type(est).__name__,
            library_version=__version__,
            n_rows=len(self.X),
            workers=workers,
            reason=self.result.reason,
        )
        return Experiment(config, pushes, evals, events_frame(self.events))
