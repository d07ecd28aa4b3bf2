"""The Sandblaster L-BFGS estimator (Dean et al., 2012): its arguments, their checks, and fit.

The driver is the paper's coordinator (:mod:`downpour_dask.sandblaster.coordinator`).  It runs
:class:`~downpour_dask.core.lbfgs.LBFGS`, which only ever sees scalars: every long vector (the
iterate, gradients, the search direction, the (s, y) history) lives on the parameter-server
shards (:mod:`downpour_dask.sandblaster.shard`), which run the coordinator's vector programs on
their ranges.  Each gradient is computed by a distributed pass of many small portions
(:mod:`downpour_dask.sandblaster.portions`), load-balanced over the workers with backup copies
of stragglers, and accumulated on the shards, never through the driver.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from distributed import Client, Security
from sklearn.exceptions import ConvergenceWarning

from ..base import ParamServerEstimator
from ..core.protocol import TrainableModel
from ..core.validation import check_int, check_positive
from ..data.datasets import Dataset
from ..data.shards import ShardedDataset
from ..inputs import evaluation_data, is_distributed, prepare_before_cluster, prepare_fit
from ..log import Progress
from ..runtime.cluster import check_security, cluster_client
from ..runtime.placement import persist_partitions
from .blocks import FILE_KINDS, ArrayBlocks, ShardBlocks
from .coordinator import Coordinator


class SandblasterLBFGS(ParamServerEstimator):
    """Sandblaster L-BFGS (Dean et al., 2012) on a Dask cluster.

    The objective is the model's own: mean loss over the batch plus ``0.5 * l2 * ||W||^2``.
    Every long vector stays on the parameter-server shards; the driver sends vector programs and
    receives scalars, and gathers full vectors only for ``params_``/``gradient_`` at the end.

    Parameters
    ----------
    model : model, str or None, default None
        A :mod:`downpour_dask.models` model, a JAX model, or any model of the protocol
        (:mod:`downpour_dask.core.protocol`); L-BFGS wants a smooth objective.  Or a model spec
        (``"softmax"``, ``"logistic"``, ``"mlp:64"``, ``"linear"``, ...) built at fit for the
        data's features and classes; None is ``"softmax"``.  A classifier model makes this a
        scikit-learn classifier (labels of any kind, kept in ``classes_``), ``"linear"`` or a
        regression model a regressor.
    n_shards : int, default 2
        Parameter-server shards (Dask actors); shard i is placed on the i-th worker by sorted
        address (modulo the number of workers).
    batch_size : int, optional
        Rows per batch; default: the whole dataset (full-batch L-BFGS, where each accepted step
        costs one distributed pass).  Smaller batches are disjoint random subsets cycled through;
        each iteration's gradient and line search then use one batch.
    portions_per_batch : int, optional
        Portions (tasks) each batch is cut into; default 1 per worker thread, more if that makes
        blocks of over 1 GiB of features (each portion costs a task and a round trip to every
        shard; a straggler's portion is copied by a backup task).  More portions let faster
        workers take more of them, at that cost each.  Files and Dask collections: one portion
        per file or partition, or per row range of one when this asks for more portions than
        there are.
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
    eval_every_iter : int, default 1
        Score ``eval_data`` every this many L-BFGS iterations (and at the end); counted in
        iterations, unlike DownpourSGD's ``eval_every`` in seconds.
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
    verbose : int, default 0
        0 is silent.  1 or more: a progress bar while ``fit`` runs (unless it is given a
        ``callback``), and the dashboard link of an embedded cluster it starts, on stderr.
    warm_start : bool, default False
        When True, ``fit`` continues from the previous fit's ``params_`` (same model, classes
        and features) instead of starting afresh, as scikit-learn's ``warm_start``.

    Attributes
    ----------
    model_ : model
        The model trained (``model`` itself, or built from its spec).
    classes_ : ndarray
        The class labels (classifiers); ``n_features_in_`` (``feature_names_in_``) as in
        scikit-learn.
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
        (``start``, ``batch_start``/``batch_done``, ``backup_launched``, ``portion_reassigned``,
        ``duplicate_discarded``, ``line_search``, ``history_reset``, ``history_skipped``,
        ``worker_lost``, ``data_restored``, ``shard_restored``, ``converged``, ``stop``), each
        with its facts as plain values in
        ``data`` (e.g. ``backup_launched``: ``portion``, ``worker``; ``worker_lost``: ``worker``;
        ``converged``: ``iteration``, ``objective``; ``shard_restored``: ``shard``, ``iteration``,
        ``restores``; ``data_restored``: ``portion`` or ``evaluation``).

    Notes
    -----
    A worker that dies mid-batch costs nothing but time: Dask re-runs its portions elsewhere, the
    driver re-scatters the data blocks it held (blocks from files are read again), and the
    shards count every portion once.  A lost
    shard is detected at once (its worker left) or within ``timeout`` (it stopped answering);
    the coordinator then starts new shards at the iterate of the last completed iteration and
    continues with an empty L-BFGS history (``shard_restored`` event), at most 3 times per fit.
    The new shards go to workers that never held a lost shard.  ``eval_data`` lives on one
    worker; if that worker dies it is scattered again from the driver (``data_restored`` event
    with ``evaluation``), and an evaluation lost with a shard is run again after the restore.
    Shards go to the first ``n_shards`` workers by sorted address.

    A fit that ends at ``max_iter`` or ``max_seconds`` without meeting ``tol``, or whose line
    search fails, warns with :class:`sklearn.exceptions.ConvergenceWarning`, as scikit-learn's
    L-BFGS solvers do; one stopped before its first iteration says the model is untrained.
    A warm start continues from the last ``params_`` with an empty L-BFGS history.
    """

    default_model = "softmax"

    def __init__(
        self,
        model: TrainableModel | str | None = None,
        n_shards: int = 2,
        batch_size: int | None = None,
        portions_per_batch: int | None = None,
        history: int = 10,
        max_iter: int = 100,
        tol: float = 1e-6,
        backup_tasks: bool = True,
        c1: float = 1e-4,
        c2: float = 0.9,
        eval_every_iter: int = 1,
        max_seconds: float | None = None,
        random_state: int | None = None,
        timeout: float = 120.0,
        security: Security | bool | None = None,
        verbose: int = 0,
        warm_start: bool = False,
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
        self.eval_every_iter = eval_every_iter
        self.max_seconds = max_seconds
        self.random_state = random_state
        self.timeout = timeout
        self.security = security
        self.verbose = verbose
        self.warm_start = warm_start

    def _check_arguments(self, callback: Any = None) -> None:
        """Check every constructor argument; raises before any cluster work."""
        self._check_fit_arguments(callback)
        if self.model is not None and not isinstance(self.model, str):
            self._check_model(self.model)  # a spec is built, and checked, at fit
        check_int("n_shards", self.n_shards, 1)
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
        check_int("eval_every_iter", self.eval_every_iter, 1)
        check_positive("max_seconds", self.max_seconds, allow_none=True)
        check_positive("timeout", self.timeout)
        check_security(self.security)
        if self.random_state is not None:
            check_int("random_state", self.random_state, 0)

    def _check_model(self, model: TrainableModel) -> None:
        """Raise if ``model`` has fewer parameters than ``n_shards``."""
        check_int("n_shards", self.n_shards, 1, model.n_params)

    def _blocks(
        self, client: Client, model: TrainableModel, rows: Any
    ) -> ArrayBlocks | ShardBlocks:
        """Where the checked training ``rows`` come from: the driver's arrays, files, or a Dask
        collection persisted on the cluster (its partitions then stay where they are)."""
        if not isinstance(rows, ShardedDataset):
            return ArrayBlocks(*rows)
        n_classes = getattr(model, "n_classes", None) if model.is_classifier else None
        if rows.kind in FILE_KINDS:
            return ShardBlocks(rows, n_classes)
        persisted = persist_partitions(client, rows, self.timeout)
        return ShardBlocks(persisted.dataset, n_classes, persisted)

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
        data : Dataset, (X, y) tuple, X, ShardedDataset of files, or Dask collection
            Training data in memory; with ``X``, pass the targets as ``y``.  Or data that
            stays on the cluster (full batch only: ``batch_size`` must be None): files
            (:func:`~downpour_dask.datasets.from_parquet`, ``from_npy``, ``from_csv``), each
            worker then reading its share of the rows itself, once, for the whole fit; or a
            Dask Array ``X`` with a Dask Array or Series ``y``, or
            :func:`~downpour_dask.datasets.from_dask` of a DataFrame.  A Dask collection is
            persisted (a no-op if it is already) and each partition is read into a float32
            block on the worker that holds it: no feature row goes through the driver or
            between workers.  A block is a view of its partition when the rows are aligned
            float32 already, else a copy the worker holds beside the partition for the fit.
        eval_data : Dataset or (X, y), optional
            Scored every ``eval_every_iter`` iterations, on a worker (``experiment_.evals``);
            in memory, whatever ``data`` is.
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
        self._check_arguments(callback)
        if is_distributed(eval_data):
            raise TypeError(
                f"eval_data is a {type(eval_data).__name__} "
                f"({getattr(eval_data, 'kind', 'Dask')}), but {type(self).__name__} scores "
                f"in-memory arrays and would have to gather it whole into the driver; for data "
                f"that fits in memory, pass eval_data.to_dataset() (or compute the collection)"
            )
        files = isinstance(data, ShardedDataset) and data.kind in FILE_KINDS
        if is_distributed(data) and self.batch_size is not None:
            raise ValueError(
                f"batch_size must be None when data is {'files' if files else 'Dask data'}: "
                f"every pass reads all the rows where the workers keep them (full batch), got "
                f"batch_size={self.batch_size}"
            )
        model, rows, evaluation = prepare_before_cluster(self, data, y, eval_data)
        callback, delay = self._callback(callback), dict(portion_delay or {})
        with cluster_client(client, self.security, announce=self.verbose >= 1) as active:
            if model is None:  # Dask collections: their labels are read on the cluster
                model, rows = prepare_fit(self, data, y, active)
                evaluation = evaluation_data(self, model, eval_data)
            blocks = self._blocks(active, model, rows)
            try:
                run = Coordinator(
                    self, active, blocks, evaluation, delay, callback, model,
                    self._initial_params(),
                )  # fmt: skip
                run.execute()
            finally:  # a Dask collection's persisted copy: not left to the cycle collector
                blocks.release()
        self.model_ = model
        self.params_, self.gradient_ = run.params, run.gradient
        self.objective_, self.n_iter_ = run.result.objective, run.result.n_iter
        self.experiment_ = run.experiment
        self._warn_stopped(
            run.result.n_iter > 0 or self.max_iter == 0,
            run.result.reason == "max_seconds",
            {"max_iter": self.max_iter},
        )
        reason = run.result.reason
        if reason in ("max_iter", "line_search_failed") and self.max_iter > 0:
            why = (
                "its line search failed to decrease the objective"
                if reason == "line_search_failed"
                else f"max_iter={self.max_iter} reached before tol={self.tol}; increase max_iter"
            )
            warnings.warn(
                f"{type(self).__name__} did not converge: {why} "
                f"(objective {run.result.objective:.6g})",
                ConvergenceWarning,
                stacklevel=2,
            )
        return self
