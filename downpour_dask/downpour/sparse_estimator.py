"""A scikit-learn classifier over :func:`~.sparse_fit.fit_sparse`: fit on a DataFrame.

:class:`SparseDownpourClassifier` hashes the named categorical columns of a pandas DataFrame
into table rows (:func:`~downpour_dask.data.hashing.hash_frame`, the hashing trick, seeded),
trains a sparse model with Downpour SGD on the Dask cluster (table shards, asynchronous
replicas, shard recovery: everything :func:`~.sparse_fit.fit_sparse` does) and keeps the
trained parameters in the estimator, so ``predict_proba``, ``predict`` and ``score`` run
locally, as a scikit-learn estimator's do, and the shards are released when ``fit`` returns.

It is scikit-learn's estimator (``BaseEstimator``: ``get_params``/``set_params``/``clone``;
``ClassifierMixin``: ``score`` is the accuracy).  Keeping the tables in the estimator is for
tables that fit in the driver's memory; larger ones train with :func:`~.sparse_fit.fit_sparse`
directly and stay on the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from ..core.sparse import SparseBatch
from ..core.sparse_models import EmbeddingMLP, FactorizationMachine, SparseLogisticRegression
from ..data.hashing import HashSpec, hash_frame
from ..log import Progress
from ..runtime.cluster import cluster_client
from .replica_count import check_replicas
from .sparse_accrual import check_schedule
from .sparse_fit import fit_sparse

#: The models ``model=`` names.
MODELS = {"logistic": SparseLogisticRegression, "fm": FactorizationMachine,
          "embedding_mlp": EmbeddingMLP}
_LABEL = "__downpour_label__"


class SparseDownpourClassifier(ClassifierMixin, BaseEstimator):
    """Click-through style binary classifier on hashed categorical (and numeric) columns.

    Parameters
    ----------
    categorical : sequence of str
        Columns hashed to one table row id each.
    numeric : sequence of str, default ()
        Numeric columns, fed as they are (``transform="log1p"`` for heavy-tailed counts).
    model : {"logistic", "fm", "embedding_mlp"}, default "logistic"
        Sparse logistic regression, a factorisation machine or embeddings + MLP.
    n_rows : int, default 2**18
        Rows of the table the columns hash into.
    model_options : dict, optional
        Further arguments of the model (``n_factors``; ``dim``, ``hidden``; ``init_scale``).
    n_replicas, n_shards, optimizer, learning_rate, batch_size, max_epochs, seed, timeout
        As for :func:`~.sparse_fit.fit_sparse`.
    hash_seed : int, default 0
        The hash's seed.
    transform : {"none", "log1p"}, default "none"
    n_fetch, n_push : int, default 1
        A replica fetches the rows of its next ``n_fetch`` batches every ``n_fetch`` steps and
        pushes its accrued gradient every ``n_push`` steps (see :func:`~.sparse_fit.fit_sparse`).
    local_learning_rate : float, optional
        The replica's rate between fetches; default ``learning_rate``.
    eval_every : float, default 5.0
        Seconds between evaluations of ``fit``'s ``eval_data`` while training.
    max_replicas : int, optional
        A worker that joins the cluster during the fit gets a new replica while fewer than this
        many train (``replica_added``), with ``1/n`` of what each of the others reads; None:
        no replica is added, unless ``n_replicas="auto"`` (a replica per worker, and one on
        each worker that joins; see :func:`~.sparse_fit.fit_sparse`).

    Attributes
    ----------
    classes_ : ndarray ``[0, 1]``
    model_ : the trained model object; ``dense_`` and ``tables_`` its parameters
    pushes_, events_ : DataFrame
        The fit's push log and its events (``shard_lost`` / ``shard_restored``,
        ``shard_migrated`` for a worker that left gracefully, ``replica_failed`` /
        ``replica_restarted``, ``replica_added`` for a worker that joined ...).
    lost_updates_ : list of int
        Updates lost per shard to lost shards.
    evaluations_ : DataFrame
        With ``fit(..., eval_data=)``: the evaluation log (time, version, examples_seen, loss,
        accuracy, auc; see :mod:`.sparse_eval`), else empty.
    """

    def __init__(
        self,
        categorical: Sequence[str] = (),
        numeric: Sequence[str] = (),
        model: str = "logistic",
        n_rows: int = 2**18,
        model_options: dict[str, Any] | None = None,
        n_replicas: int | str = 1,
        n_shards: int = 1,
        optimizer: str = "adagrad",
        learning_rate: float = 0.05,
        batch_size: int = 256,
        max_epochs: int = 1,
        seed: int = 0,
        timeout: float = 120.0,
        hash_seed: int = 0,
        transform: str = "none",
        n_fetch: int = 1,
        n_push: int = 1,
        local_learning_rate: float | None = None,
        eval_every: float = 5.0,
        max_replicas: int | None = None,
    ):
        self.categorical, self.numeric, self.model = categorical, numeric, model
        self.n_rows = n_rows
        self.model_options, self.n_replicas, self.n_shards = model_options, n_replicas, n_shards
        self.optimizer, self.learning_rate, self.batch_size = optimizer, learning_rate, batch_size
        self.max_epochs, self.seed, self.timeout = max_epochs, seed, timeout
        self.hash_seed, self.transform, self.eval_every = hash_seed, transform, eval_every
        self.n_fetch, self.n_push = n_fetch, n_push
        self.local_learning_rate, self.max_replicas = local_learning_rate, max_replicas

    def _spec(self) -> HashSpec:
        return HashSpec(tuple(self.numeric), tuple(self.categorical), _LABEL, self.n_rows,
                        self.hash_seed, self.transform)

    def _batch(self, X: Any, y: Any) -> SparseBatch:
        if not isinstance(X, pd.DataFrame):
            raise TypeError(f"X must be a pandas DataFrame with the columns "
                            f"{[*self.numeric, *self.categorical]}, got {type(X).__name__}")
        frame = X.assign(**{_LABEL: y})
        return hash_frame(frame, self._spec())

    def fit(self, X: pd.DataFrame, y: Any, client: Client | None = None,
            eval_data: tuple[pd.DataFrame, Any] | None = None, publish: str | None = None,
            callback: Callable[[Progress], Any] | None = None) -> SparseDownpourClassifier:
        """Train on the rows of ``X`` (a DataFrame) with 0/1 labels ``y``; returns self.

        ``client``: the cluster to train on; as for ``DownpourSGD.fit``, by default the current
        Dask client, else an embedded local cluster closed afterwards.  ``eval_data``: held-out
        ``(X, y)``, scored every ``eval_every`` seconds and at the end (``evaluations_``).
        ``publish``: a name to publish the running fit under, ``callback``: called with progress
        snapshots, e.g. a :class:`~downpour_dask.progress.ProgressBar` (see
        :func:`.sparse_fit.fit_sparse`).
        """
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        check_schedule(self.n_fetch, self.n_push, self.local_learning_rate)
        check_replicas(self.n_replicas, self.max_replicas)
        y = np.asarray(y)
        if y.ndim != 1 or len(y) != len(X) or not np.isin(y, (0, 1)).all():
            raise ValueError(f"y must be {len(X)} labels of 0 and 1 only")
        batch = self._batch(X, y)
        held_out = None
        if eval_data is not None:
            if not (isinstance(eval_data, tuple) and len(eval_data) == 2):
                raise TypeError("eval_data must be (X, y): a DataFrame and its 0/1 labels")
            held_out = self._batch(*eval_data)
        model = MODELS[self.model](self.n_rows, len(self.categorical),
                                   n_numeric=len(self.numeric), **(self.model_options or {}))
        with cluster_client(client) as active:
            fit = fit_sparse(model, batch, client=active, n_replicas=self.n_replicas,
                             n_shards=self.n_shards, optimizer=self.optimizer,
                             learning_rate=self.learning_rate, batch_size=self.batch_size,
                             max_epochs=self.max_epochs, seed=self.seed, timeout=self.timeout,
                             n_fetch=self.n_fetch, n_push=self.n_push,
                             local_learning_rate=self.local_learning_rate,
                             eval_data=held_out, eval_every=self.eval_every, publish=publish,
                             callback=callback, max_replicas=self.max_replicas)
            try:
                self.dense_, self.tables_ = fit.state()
            finally:
                fit.close()
        self.model_, self.classes_ = model, np.array([0, 1])
        self.pushes_, self.events_, self.lost_updates_ = fit.pushes, fit.events, fit.lost_updates
        self.evaluations_ = fit.evaluations
        self.feature_names_in_ = np.array([*self.numeric, *self.categorical], dtype=object)
        return self

    def predict_proba(self, X: pd.DataFrame) -> np.ndarray:
        """``[P(0), P(1)]`` per row of ``X``, computed locally from the trained parameters."""
        check_is_fitted(self, "dense_")
        batch = self._batch(X, np.zeros(len(X), np.int64))
        touched = self.model_.touched(batch)
        rows = [(ids, self.tables_[t][ids]) for t, ids in enumerate(touched)]
        p = np.asarray(self.model_.predict_proba(self.dense_, rows, batch), np.float64)
        return np.column_stack([1 - p, p])

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        """The more probable class of each row of ``X``."""
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(np.int64)
