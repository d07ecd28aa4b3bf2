"""The evaluation log of a sparse fit: the current parameters scored on held-out hashed data.

As the dense :class:`~downpour_dask.downpour.estimator.DownpourSGD` does with ``eval_data``,
:func:`~.sparse_fit.fit_sparse` with ``eval_data`` scores the parameters the shards hold every
``eval_every`` seconds while the replicas train and once at the end, and returns the rows as
``SparseFit.evaluations`` (a pandas DataFrame, :data:`EVAL_FRAME_COLUMNS`): ``time`` (seconds
since the fit started), ``version`` (the smallest shard version read), ``examples_seen``
(examples in the pushes the shards had applied), ``loss`` (log-loss), ``accuracy`` and ``auc``.

Reading the parameters for an evaluation pulls from each shard its dense slice and only the rows
the evaluation data touches (:class:`SparseEvaluator` works out which once, deduplicated, and
splits them by shard as a replica's pull is split), never the whole table: a 10^8-row table is
evaluated at the cost of the rows its held-out examples name.  The pulls of all shards start
before any is awaited, so one evaluation costs one round trip per shard.  It is read-only: a
shard counts no push and changes no row for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import log_loss, roc_auc_score

from ..core.params import DTYPE
from ..core.sparse import SparseBatch, check_batch
from ..data.hashing import HashSpec, is_hashed_files, load_hashed
from ..log import EVAL_COLUMNS
from ..ps.rows import SparseLayout

#: Columns and dtypes of ``SparseFit.evaluations``.
EVAL_FRAME_COLUMNS = {**EVAL_COLUMNS, "accuracy": "float64", "auc": "float64"}


def check_spec(model: Any, spec: HashSpec, what: str = "data") -> None:
    """ValueError unless files hashed by ``spec`` feed ``model`` (columns and table rows)."""
    if (len(spec.numeric), len(spec.categorical)) != (model.n_numeric, model.n_fields):
        raise ValueError(
            f"{what}: the spec has {len(spec.numeric)} numeric and {len(spec.categorical)} "
            f"categorical columns; the model takes n_numeric={model.n_numeric} and "
            f"n_fields={model.n_fields}"
        )
    n_rows = min(t.n_rows for t in model.tables)
    if spec.n_rows > n_rows:
        raise ValueError(f"{what}: the spec hashes into {spec.n_rows} rows; the model's tables "
                         f"have {n_rows}")


def evaluation_batch(model: Any, data: Any) -> SparseBatch:
    """``eval_data`` as one checked :class:`SparseBatch`: a batch as it is, or ``(paths, spec)``
    of parquet/CSV files read and hashed (in this process).  TypeError/ValueError for data that
    does not fit ``model`` or holds no example."""
    if is_hashed_files(data):
        paths, spec = data
        check_spec(model, spec, "eval_data")
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        data = load_hashed(paths, spec)
    elif not isinstance(data, SparseBatch):
        raise TypeError(f"eval_data must be a SparseBatch or (paths, HashSpec), got "
                        f"{type(data).__name__}")
    batch = check_batch(model, data)
    if len(batch.y) == 0:
        raise ValueError("eval_data holds no example")
    return batch


def scores(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """Log-loss, accuracy (threshold 0.5) and ROC AUC (nan when ``y`` has one class only) of
    probabilities ``p`` of class 1 for 0/1 labels ``y``."""
    p = np.asarray(p, np.float64)
    if not np.isfinite(p).all():
        return {"loss": math.nan, "accuracy": math.nan, "auc": math.nan}
    y = np.asarray(y)
    both = len(np.unique(y)) == 2
    return {
        "loss": float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[0, 1])),
        "accuracy": float(np.mean((p >= 0.5) == (y == 1))),
        "auc": float(roc_auc_score(y, p)) if both else math.nan,
    }


class SparseEvaluator:
    """Scores the parameters on the shards of a fit on one held-out batch (see the module
    docstring); :meth:`evaluate` returns one row of the evaluation log."""

    def __init__(self, model: Any, batch: SparseBatch, layout: SparseLayout, timeout: float):
        self.model, self.batch, self.timeout = model, batch, timeout
        self.touched = model.touched(batch)
        self.parts = layout.split(self.touched)
        self.rows: list[dict[str, Any]] = []

    @property
    def n_rows_read(self) -> int:
        """Table rows one evaluation pulls (over all tables and shards)."""
        return sum(len(ids) for ids in self.touched)

    def read(self, actors: list[Any]) -> tuple[np.ndarray, list, int, int]:
        """The dense vector, the touched rows per table as ``(ids, values)``, the smallest
        shard version and the examples the shards applied, from the shard ``actors``."""
        pulls = [actor.pull_rows(part) for actor, part in zip(actors, self.parts)]
        counts = [actor.status() for actor in actors]
        replies = [call.result(timeout=self.timeout) for call in pulls]
        counters = [call.result(timeout=self.timeout) for call in counts]
        dense = np.concatenate([r.pull.values for r in replies]).astype(DTYPE, copy=False)
        rows = [(ids, np.concatenate([r.rows[t] for r in replies]))
                for t, ids in enumerate(self.touched)]
        version = min(int(r.pull.version) for r in replies)
        examples = max(int(c["examples"]) for c in counters)
        return dense, rows, version, examples

    def evaluate(self, actors: list[Any], elapsed: float) -> dict[str, Any]:
        """Read the shards, score, append the row to :attr:`rows` and return it."""
        dense, rows, version, examples = self.read(actors)
        p = self.model.predict_proba(dense, rows, self.batch)
        row = {"time": float(elapsed), "version": version, "examples_seen": examples,
               **scores(self.batch.y, p)}
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        """The evaluation log so far (:data:`EVAL_FRAME_COLUMNS`)."""
        return evaluation_frame(self.rows)


def evaluation_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Evaluation rows as the log's DataFrame (empty with its columns when there are none)."""
    frame = pd.DataFrame(rows, columns=list(EVAL_FRAME_COLUMNS))
    return frame.astype(EVAL_FRAME_COLUMNS)
