"""The driver-side coordinator of one Sandblaster fit: placement, batches, L-BFGS, the record.

The paper's coordinator runs on the driver.  :class:`Coordinator` starts the
:class:`~downpour_dask.sandblaster.shard.SandblasterShard` actors, cuts the data into batches of
portions, scatters them (through :class:`~downpour_dask.sandblaster.portions.Portions`), and runs
:class:`~downpour_dask.core.lbfgs.LBFGS`, which only ever sees scalars: every long vector lives on
the shards.  Evaluations of ``eval_data`` run on a worker while the coordinator iterates on.
Everything the fit records -- events with structured data, one push row per counted portion,
one evaluation row per iteration, progress snapshots -- goes through a
:class:`~downpour_dask.base.RunRecorder`.

**Shard loss.** After every iteration the coordinator keeps the iterate ``x`` (one vector, the only
one it ever gathers during the fit; it comes back with the program that accepted the step, which the
shards run as they finish the pass: no call of its own).  When a shard is lost (its worker dies or
stops answering: :class:`~downpour_dask.ps.protocol.ShardLostError` from a pass, see
:mod:`~downpour_dask.sandblaster.portions`), it starts new shards holding that iterate, records a
``shard_restored`` event and continues L-BFGS from there with the iterations and seconds left.  The
curvature history and the search direction were on the lost shard's range too, so the restarted
L-BFGS begins with an empty history (its first step is a gradient step); nothing already counted is
lost, but the iterations after a restore may differ from an undisturbed run's.  After
:attr:`Coordinator.MAX_RESTORES` restores the error is raised.  The new shards, data blocks and
evaluation data go only to workers the scheduler lists that never held a lost shard: the scheduler
may still list a worker that was just killed, and an actor placed there never starts.  The
evaluation data lives on one worker; when that worker dies it is scattered again from the driver's
copy (``data_restored`` event), as the training blocks are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client, Future

from ..base import ParamServerEstimator, RunRecorder
from ..core import optim
from ..core.lbfgs import LBFGS, LBFGSResult
from ..core.models import Model, from_config
from ..core.params import DTYPE
from ..core.protocol import TrainableModel
from ..log import Experiment, Progress, PushRow
from ..ps.protocol import ShardLostError
from ..ps.server import ParameterServer
from ..runtime.cluster import cluster_workers
from ..runtime.dask_client_calls import run_within
from ..runtime.malloc import tune_malloc
from .blocks import ArrayBlocks, ShardBlocks, default_portions
from .portions import Portions
from .scoring import Scoring
from .shard import SandblasterShard
from .tasks import PortionResult, forget_run

#: Seconds the coordinator waits for the workers to run a call it can do without: the allocator
#: tuned before the data arrives, the fit's records dropped at its end.  A worker that is stopped
#: or hung must not hold the fit (``client.run`` waits for every worker it asks).
OPTIONAL_RUN_TIMEOUT = 5.0

#: Evaluation columns Sandblaster adds to every run's ``evals``: one row per iteration.
ITERATION_COLUMNS = {"objective": "float64", "grad_norm": "float64", "step": "float64"}


class Coordinator:
    """One execution of :meth:`SandblasterLBFGS.fit
    <downpour_dask.sandblaster.estimator.SandblasterLBFGS.fit>` on the driver.

    Parameters
    ----------
    est : SandblasterLBFGS
        The estimator, whose (already checked) arguments the fit runs with.
    client : distributed.Client
    data : ArrayBlocks or ShardBlocks
        The training rows, checked by the model.
    evaluation : (X, y) or None
        Evaluation data, scored every ``est.eval_every_iter`` iterations.
    delay : dict of worker address to seconds
        Fault injection for straggling workers (see ``fit``'s ``portion_delay``).
    callback : callable, optional
        Gets a :class:`~downpour_dask.log.Progress` after every iteration and at the end.
    model : Model, optional
        The model built for this fit (default: ``est.model``).
    initial : ndarray, optional
        The starting parameters (``warm_start``); default: the model's seeded initialisation.

    Attributes
    ----------
    params, gradient : ndarray
        The result and its gradient, gathered from the shards at the end.
    result : LBFGSResult
    experiment : Experiment
    """

    #: Lost-shard restores one fit makes before it fails with the loss.
    MAX_RESTORES = 3

    def __init__(
        self,
        est: ParamServerEstimator,
        client: Client,
        data: ArrayBlocks | ShardBlocks,
        evaluation: tuple[np.ndarray, np.ndarray] | None,
        delay: dict[str, float],
        callback: Callable[[Progress], None] | None = None,
        model: Model | None = None,
        initial: np.ndarray | None = None,
    ):
        self.est, self.client, self.data = est, client, data
        self.model = est.model if model is None else model  # the model built at fit
        self.start = initial  # warm start: the previous fit's parameters
        self.evaluation, self.delay, self.callback = evaluation, delay, callback
        self.token = ""  # the current attempt's (see _attempt); workers cache parameters by it
        self.tokens: list[str] = []
        self.x_last: np.ndarray | None = None  # the iterate of the last completed iteration
        self.done_iter = -1  # ... and its number
        self._offset = 0  # iterations completed before the current attempt
        self._spent = 0.0  # seconds L-BFGS ran in earlier attempts (max_seconds counts them)
        self.worker_index: dict[str, int] = {}
        self.metric = "accuracy" if self.model.is_classifier else "r2"
        self.scoring: Scoring | None = None  # eval_data's scores, if there is eval_data
        self.lost_workers: set[str] = set()  # workers that held a lost shard: never used again

    # -- what the passes report (the PassObserver of portions.py) ---------------------------------
    def event(self, kind: str, detail: str = "", **data: Any) -> object:
        """Record an event of the fit (see :meth:`RunRecorder.event`)."""
        return self.recorder.event(kind, detail, **data)

    def portion_counted(self, result: PortionResult) -> None:
        """One push row per counted portion: ``replica`` is the worker's index, ``step`` and
        ``version`` the batch's version."""
        replica = self.worker_index.setdefault(result.worker, len(self.worker_index))
        loss = result.loss_sum / result.examples
        self.recorder.push(
            PushRow(
                time=self.recorder.elapsed(), replica=replica, step=result.version, loss=loss,
                examples=result.examples, staleness=0, version=result.version, accepted=True,
            )
        )  # fmt: skip

    # -- the fit ----------------------------------------------------------------------------------
    def _batches(self, workers: dict) -> list[list]:
        """Rows of every portion of every batch (see :meth:`ArrayBlocks.portions`), cut from a
        seeded permutation of the rows unless the batch is the whole data."""
        est, n = self.est, self.data.n_rows
        rng = np.random.default_rng(est.random_state)
        self.initial = self.model.init(rng)  # drawn in any case: the batches stay the same
        if self.start is not None:
            self.initial = self.start
        size = n if est.batch_size is None else min(est.batch_size, n)
        order = None if size == n else rng.permutation(n)
        threads = sum(info.get("nthreads", 1) for info in workers.values())
        per_batch = est.portions_per_batch or default_portions(
            threads, size * self.model.n_inputs * np.dtype(DTYPE).itemsize
        )
        return self.data.portions(size, per_batch, order)

    def execute(self) -> None:
        """Run the fit: start the shards, optimise, gather the result, build the experiment."""
        client, model = self.client, self.model
        workers = cluster_workers(client)
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        self.recorder = RunRecorder(self.metric, ITERATION_COLUMNS)  # the clock starts here
        rows = self._batches(workers)
        mask = np.zeros(model.n_params)  # other models keep any penalty in their own loss
        for name, shape in model.layout.shapes.items() if isinstance(model, Model) else ():
            if len(shape) == 2:
                lo, hi = model.layout.offsets[name]
                mask[lo:hi] = model.l2
        self.mask = mask
        self.server: ParameterServer | None = None
        try:
            self._optimise(rows, workers)
        finally:
            self._end_attempt()
        self.experiment = self._experiment(sorted(workers))

    def _end_attempt(self) -> None:
        """Release the current shards; straggling portions of the attempt stop first."""
        for token in self.tokens:  # (not on a lost shard's worker: it may be dead, not yet gone)
            with contextlib.suppress(Exception):  # a worker that died has nothing to forget
                forget = functools.partial(forget_run, token)
                run_within(self.client, forget, self.survivors(), OPTIONAL_RUN_TIMEOUT)
        if self.server is not None:
            self.server.close()
            self.server = None

    def _optimise(self, rows: list[list], workers: dict) -> None:
        est, client = self.est, self.client
        flat = [idx for batch in rows for idx in batch]
        # A built-in model's L2 penalty is added once, on the shards (``l2mask``).  The model is
        # small: it goes with each task, by value.  (A broadcast scatter of it hung for good when
        # a worker died during the scatter.)
        data_model = (
            from_config({**self.model.get_config(), "l2": 0.0})
            if isinstance(self.model, Model)
            else self.model
        )
        if self.evaluation is not None:
            self.scoring = Scoring(
                client, self.model, self.evaluation, self.metric, est.timeout, self.survivors,
                self.event,
            )  # fmt: skip
        ids, k = [], 0
        for batch in rows:
            ids.append(list(range(k, k + len(batch))))
            k += len(batch)
        self.event(
            "start",
            f"{len(flat)} portions in {len(rows)} batch(es), {est.n_shards} shards on "
            f"{len(workers)} workers",
            portions=len(flat), batches=len(rows), shards=est.n_shards, workers=len(workers),
        )  # fmt: skip
        restores = 0
        while True:
            try:
                self._attempt(ids, flat, data_model)
                break
            except ShardLostError as err:
                restores += 1
                if restores > self.MAX_RESTORES:
                    raise
                self._restore(err, restores)
        self.event(
            "stop", f"{self.result.reason} after {self.result.n_iter} iteration(s)",
            reason=self.result.reason, iterations=self.result.n_iter,
        )  # fmt: skip
        self._finish_eval()
        evals = self.recorder.evals
        if self.scoring is not None and np.isnan(evals[-1]["loss"]):  # score the result
            self._submit_eval(evals[-1])
            self._finish_eval()
        if self.callback is not None and evals:
            self.callback(self._progress(evals[-1], "done"))
        extra = [] if self.scoring is None else self.scoring.futures()
        client.cancel(self.portions.blocks + extra)

    def _attempt(self, ids: list[list[int]], flat: list, data_model: TrainableModel) -> None:
        """Start shards at the last completed iterate (the initial point at first) and run
        L-BFGS with the iterations and seconds left; gather the result."""
        est, client = self.est, self.client
        start = self.initial if self.x_last is None else self.x_last
        self.server = ParameterServer.create(
            client, start, est.n_shards, optim.sgd(1.0), self.survivors(), est.timeout,
            shard_class=SandblasterShard, l2mask=self.mask, x=start,
        )  # fmt: skip
        self.token = uuid.uuid4().hex[:12]
        self.tokens.append(self.token)
        self._offset = max(0, self.done_iter)
        # before the data blocks arrive (see runtime/malloc.py); a worker leaving is no matter
        with contextlib.suppress(Exception):
            run_within(client, tune_malloc, self.survivors(), OPTIONAL_RUN_TIMEOUT)
        self.portions = Portions(
            client, self.server, self.data, ids, flat, data_model, self,
            token=self.token, timeout=est.timeout, backup_tasks=bool(est.backup_tasks),
            delay=self.delay, workers=self.survivors(), keep=("x",),
        )  # fmt: skip
        seconds = est.max_seconds  # counted while L-BFGS runs, over all attempts
        if seconds is not None:
            seconds = max(0.0, seconds - self._spent)
        optimizer = LBFGS(
            self.portions, history=est.history, max_iter=est.max_iter - self._offset, tol=est.tol,
            n_batches=len(ids), c1=est.c1, c2=est.c2, max_seconds=seconds,
            precision=float(np.finfo(DTYPE).eps),  # workers evaluate in float32
            log=self.event, on_iteration=self._on_iteration,
        )  # fmt: skip
        started = time.time()
        try:
            result = optimizer.minimize()
        finally:
            self._spent += time.time() - started
        replies = self.server.call_all(SandblasterShard.vectors, ["x", "g"], timeout=est.timeout)
        self.params = np.concatenate([x for x, _ in replies]).astype(DTYPE)
        self.gradient = np.concatenate([g for _, g in replies])
        self.result: LBFGSResult = dataclasses.replace(result, n_iter=self._offset + result.n_iter)

    def _restore(self, error: ShardLostError, restores: int) -> None:
        """After ``error``: drop the attempt's shards, portions and pending evaluation; the next
        attempt starts new shards at the last completed iterate."""
        if self.scoring is not None:
            self.scoring.drop()
        if self.server is not None:
            self.lost_workers.add(self.server.workers[error.shard])
        old = self.portions if hasattr(self, "portions") else None
        self._end_attempt()
        if old is not None:
            with contextlib.suppress(Exception):
                tasks = [f for f in old.inflight if isinstance(f, Future)]
                self.client.cancel([*tasks, *old.blocks])
        iteration = max(0, self.done_iter)
        self.event(
            "shard_restored",
            f"{error}; all shards restarted from iteration {iteration}'s point (L-BFGS history "
            f"reset), restore {restores} of at most {self.MAX_RESTORES}",
            shard=error.shard, iteration=iteration, restores=restores,
        )  # fmt: skip

    def _on_iteration(self, record: dict[str, Any]) -> None:
        """Log one evals row per iteration; score ``eval_data`` on a worker every
        ``eval_every_iter`` iterations."""
        iteration = self._offset + record["iteration"]
        if iteration <= self.done_iter:  # a restored attempt's start: recorded already
            row, due = self.recorder.evals[-1], iteration % self.est.eval_every_iter == 0
            if self.scoring is not None and np.isnan(row["loss"]) and due:
                self._submit_eval(row)  # its evaluation died with the lost shard
            return
        self._finish_eval()
        if record["iteration"] == 0:  # the attempt's starting point, which the driver has
            self.x_last = self.initial if self.x_last is None else self.x_last
        else:  # the accepted step wrote x, which came back with its dot products
            self.x_last = self.portions.kept["x"]
        self.done_iter = iteration  # ... and x_last is what a restore starts at
        row = self.recorder.evaluation(
            version=iteration, examples_seen=self.portions.examples_seen,
            loss=np.nan, **{self.metric: np.nan}, objective=record["objective"],
            grad_norm=record["grad_norm"], step=record.get("step", 0.0),
        )  # fmt: skip
        if self.scoring is not None and iteration % self.est.eval_every_iter == 0:
            self._submit_eval(row)
        if self.callback is not None:
            self.callback(self._progress(row, "training"))

    def _progress(self, row: dict[str, Any], phase: str) -> Progress:
        """A snapshot for the callback: the newest finished score, iterations/time done."""
        est = self.est
        fractions = [row["version"] / est.max_iter if est.max_iter else 1.0]
        if est.max_seconds is not None:
            fractions.append(row["time"] / est.max_seconds)
        return self.recorder.progress(
            time=row["time"], examples=self.portions.examples_seen,
            pushes=len(self.recorder.pushes), loss=row["objective"],
            fraction=1.0 if phase == "done" else min(1.0, max(fractions)), phase=phase,
        )  # fmt: skip

    def survivors(self) -> list[str]:
        """The workers to place shards and data on: the live ones (sorted) that never held a
        lost shard (all the live ones if that leaves none)."""
        workers = sorted(cluster_workers(self.client))
        return [w for w in workers if w not in self.lost_workers] or workers

    def _submit_eval(self, row: dict[str, Any]) -> None:
        """Score the iterate into ``row`` on a worker while the coordinator goes on iterating
        (see :mod:`~downpour_dask.sandblaster.scoring`)."""
        if self.scoring is not None:
            self.scoring.submit(row, self.portions, self.server, self.token)

    def _finish_eval(self) -> None:
        """Wait for the pending score, if any (a lost shard raises :class:`ShardLostError`)."""
        if self.scoring is not None:
            self.scoring.finish(self.portions, self.server, self.token)

    def _experiment(self, workers: list[str]) -> Experiment:
        est = self.est
        config = est._config(self.model)
        config.update(
            n_rows=self.data.n_rows,
            workers=workers,
            push_workers=list(self.worker_index),  # the worker behind each push row's replica
            reason=self.result.reason,
        )
        return self.recorder.experiment(config)
