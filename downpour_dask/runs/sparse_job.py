"""A sparse training job as a batch user runs it: files of click data in, a run directory out.

``downpour-dask train-sparse`` (and a script) trains a sparse model
(:mod:`downpour_dask.core.sparse_models`) with :func:`~downpour_dask.downpour.sparse_fit.
fit_sparse` on parquet/CSV files whose categorical columns are hashed to table rows
(:class:`~downpour_dask.data.hashing.HashSpec`), and writes a run directory as ``train`` does:
``config.json`` (every setting, the model's configuration, the files), ``pushes.parquet``,
``evals.parquet`` (the evaluation log of ``eval_data``: log-loss, accuracy, AUC),
``events.parquet`` and ``tables.npz`` -- the dense vector and, per table, the rows the run
updated (``table<t>_ids``, ``table<t>_values``); every other row keeps its initial value, which
:func:`~downpour_dask.core.sparse.table_rows` makes again from the ``seed`` in the config.  So
a table of 10^8 rows is saved at the size of the rows the data touched.

:func:`prepare_sparse` checks every setting and reads only the files' schemas: bad input is a
ValueError/TypeError naming the setting and what is allowed, or FileExistsError for a run
directory in the way, before any cluster work.  The run directory appears at its path only
when complete (a staging sibling renamed into place): a failed job leaves nothing.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from distributed import Client

from ..core import optimizer_spec
from ..core.rows import row_state_shapes
from ..data.hashing import TRANSFORMS, HashSpec
from ..downpour.replica_count import AUTO
from ..downpour.sparse_estimator import MODELS
from ..downpour.sparse_fit import SparseFit, fit_sparse
from ..log import Experiment, Progress, check_replaceable
from ..runtime.cluster import cluster_client
from .directory import write_run

#: Settings of a sparse job and their defaults (None: required, or off).
SPARSE_DEFAULTS: dict[str, Any] = {
    "data": None, "eval_data": None, "categorical": None, "numeric": (), "label": "label",
    "model": "logistic", "n_rows": 2**20, "n_factors": 8, "dim": 8, "hidden": (32,),
    "n_shards": 2, "n_replicas": 2, "optimizer": "adagrad", "learning_rate": 0.05,
    "batch_size": 256, "max_epochs": 1, "max_steps": None, "seed": 0, "hash_seed": 0,
    "transform": "none", "eval_every": 5.0, "run_dir": None, "overwrite": False,
    "publish": None, "timeout": 120.0, "max_replicas": None,
}  # fmt: skip

#: Model options by model name (the rest of a model's arguments come from the data).
MODEL_OPTIONS = {"logistic": (), "fm": ("n_factors",), "embedding_mlp": ("dim", "hidden")}


@dataclass
class SparseJob:
    """A checked sparse job: nothing has been started or written yet."""

    model: Any
    data: tuple[list[Path], HashSpec]
    eval_data: tuple[list[Path], HashSpec] | None
    target: Path
    settings: dict[str, Any]
    fit_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SparseResult:
    """What :func:`run_sparse` produced: the run directory and the headline numbers."""

    path: Path
    summary: dict[str, float]


def data_files(pattern: Any, what: str) -> list[Path]:
    """The sorted ``.parquet``/``.csv`` files ``pattern`` names: a file, a directory (its
    files) or a glob.  ValueError if there is none or one of another kind."""
    if not isinstance(pattern, (str, os.PathLike)) or not str(pattern).strip():
        raise ValueError(f"{what} must name parquet/CSV files (a file, directory or glob), "
                         f"got {pattern!r}")
    path = Path(pattern)
    if path.is_dir():
        found = [p for p in path.iterdir() if p.suffix in (".parquet", ".csv")]
    else:
        found = [Path(p) for p in glob.glob(str(pattern)) if Path(p).is_file()]
    if not found:
        raise ValueError(f"{what} {str(pattern)!r} matches no file")
    wrong = [str(p) for p in found if p.suffix not in (".parquet", ".csv")]
    if wrong:
        raise ValueError(f"{what} {str(pattern)!r}: only .parquet and .csv files can be read, "
                         f"got {', '.join(sorted(wrong)[:3])}")
    return sorted(found)


def columns_of(path: Path) -> list[str]:
    """The column names of a parquet or CSV file (its schema or header only)."""
    try:
        if path.suffix == ".parquet":
            return list(pq.read_schema(path).names)
        with pacsv.open_csv(path) as reader:
            return list(reader.schema.names)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"cannot read the columns of {str(path)!r}: {err}") from None


def _names(settings: dict[str, Any], key: str) -> tuple[str, ...]:
    value = settings[key]
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{key} must be column names (a comma-separated list), got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{key} names a column twice: {list(value)}")
    return tuple(value)


def _count(settings: dict[str, Any], key: str, low: int) -> int:
    value = settings[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_columns(files: list[Path], spec: HashSpec, what: str) -> None:
    for path in files:
        have = columns_of(path)
        missing = [c for c in spec.columns if c not in have]
        if missing:
            raise ValueError(f"{what} file {str(path)!r} has no column(s) {missing}; it has "
                             f"{have[:12]}{' ...' if len(have) > 12 else ''}")


def prepare_sparse(settings: dict[str, Any]) -> SparseJob:
    """Check a sparse job's settings (:data:`SPARSE_DEFAULTS`) and the files' columns, build
    its model; nothing is started or written.  See the module docstring for the errors."""
    unknown = sorted(set(settings) - set(SPARSE_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; allowed: {sorted(SPARSE_DEFAULTS)}")
    s = {**SPARSE_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    for key in ("data", "categorical", "run_dir"):
        if s[key] is None:
            raise ValueError(f"{key} is required")
    if s["model"] not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {s['model']!r}")
    if s["transform"] not in TRANSFORMS:
        raise ValueError(f"transform must be one of {', '.join(TRANSFORMS)}, "
                         f"got {s['transform']!r}")
    categorical, numeric = _names(s, "categorical"), _names(s, "numeric") if s["numeric"] else ()
    both = sorted(set(categorical) & set(numeric))
    if both or s["label"] in (*categorical, *numeric):
        raise ValueError(f"a column is named twice among categorical, numeric and label: "
                         f"{both or [s['label']]}")
    auto = s["n_replicas"] == AUTO  # a replica per worker (and per joining worker)
    counts = {k: _count(s, k, low) for k, low in (
        ("n_rows", 1), ("n_shards", 1), ("n_replicas", 1), ("batch_size", 1), ("max_epochs", 1),
        ("seed", 0), ("hash_seed", 0)) if not (auto and k == "n_replicas")}
    for key, low in (("max_steps", 1), ("max_replicas", 1 if auto else counts["n_replicas"])):
        if s[key] is not None:
            counts[key] = _count(s, key, low)
    row_state_shapes(optimizer_spec.build(s["optimizer"], s["learning_rate"]))  # names the fault
    for key in ("eval_every", "timeout"):
        if isinstance(s[key], bool) or not isinstance(s[key], (int, float)) or not s[key] > 0:
            raise ValueError(f"{key} must be a number of seconds > 0, got {s[key]!r}")
    options = {k: s[k] for k in MODEL_OPTIONS[s["model"]]}
    if "hidden" in options and isinstance(options["hidden"], str):
        try:
            options["hidden"] = tuple(int(h) for h in options["hidden"].split(","))
        except ValueError:
            raise ValueError(f"hidden must be layer widths like 32,16, got "
                             f"{options['hidden']!r}") from None
    model = MODELS[s["model"]](counts["n_rows"], len(categorical), n_numeric=len(numeric),
                               **options)
    spec = HashSpec(numeric, categorical, str(s["label"]), counts["n_rows"], counts["hash_seed"],
                    s["transform"])
    files = data_files(s["data"], "data")
    if not auto and len(files) < counts["n_replicas"]:
        raise ValueError(f"n_replicas={counts['n_replicas']} but data has {len(files)} file(s): "
                         f"each replica streams whole files, so give at least one per replica")
    _check_columns(files, spec, "data")
    held_out = None
    if s["eval_data"] is not None:
        held_out = (data_files(s["eval_data"], "eval_data"), spec)
        _check_columns(held_out[0], spec, "eval_data")
    target = Path(s["run_dir"])
    check_replaceable(target, bool(s["overwrite"]))
    fit_args = {
        "n_replicas": AUTO if auto else counts["n_replicas"], "n_shards": counts["n_shards"],
        "optimizer": s["optimizer"], "learning_rate": s["learning_rate"],
        "batch_size": counts["batch_size"], "max_epochs": counts["max_epochs"],
        "max_steps": counts.get("max_steps"), "seed": counts["seed"], "timeout": s["timeout"],
        "eval_every": s["eval_every"], "publish": s["publish"],
        "max_replicas": counts.get("max_replicas"),
    }  # fmt: skip
    recorded = {**s, "categorical": list(categorical), "numeric": list(numeric),
                "data_files": [str(p) for p in files], "model_config": model.get_config()}
    return SparseJob(model, (files, spec), held_out, target, recorded, fit_args)


def run_sparse(job: SparseJob, client: Client | None = None,
               callback: Callable[[Progress], Any] | None = None) -> SparseResult:
    """Train ``job`` on ``client``'s cluster (None: the current client, else an embedded local
    cluster) and write its run directory; returns its path and headline numbers.  ``callback``
    gets the fit's progress snapshots (a :class:`~downpour_dask.progress.ProgressBar`)."""
    with cluster_client(client) as active:
        fit = fit_sparse(job.model, job.data, client=active, eval_data=job.eval_data,
                         callback=callback, **job.fit_args)
        try:
            calls = [actor.export_state() for actor in fit.actors]
            exports = [call.result(timeout=fit.timeout) for call in calls]
        finally:
            fit.close()
    config = {**job.settings, "kind": "sparse"}
    if config["n_replicas"] == AUTO:  # the count it started with, as a dense run records it
        config.update(n_replicas=fit.n_replicas, n_replicas_given=AUTO)
    experiment = Experiment(config, fit.pushes, fit.evaluations, fit.events)
    path = save_sparse_run(job.target, experiment, exports, bool(job.settings["overwrite"]))
    return SparseResult(path, summarize(fit))


def summarize(fit: SparseFit) -> dict[str, float]:
    """Headline numbers of a finished sparse fit: duration, examples/s, pushes (one per step;
    the log has a row per step and shard), staleness, refused pushes, final evaluation."""
    pushes = fit.pushes[fit.pushes["shard"] == 0] if len(fit.pushes) else fit.pushes
    duration = float(fit.pushes["time"].max()) if len(fit.pushes) else 0.0
    examples = float(pushes["examples"].sum()) if len(pushes) else 0.0
    out = {
        "duration": duration, "steps": float(len(pushes)), "examples": examples,
        "examples_per_s": examples / duration if duration > 0 else float("nan"),
        "staleness_mean": float(fit.pushes["staleness"].mean()) if len(pushes) else float("nan"),
        "refused_pushes": float((~fit.pushes["accepted"].astype(bool)).sum())
        if len(pushes) else 0.0,
    }  # fmt: skip
    if len(fit.evaluations):
        last = fit.evaluations.iloc[-1]
        out.update(final_loss=float(last["loss"]), final_auc=float(last["auc"]),
                   final_accuracy=float(last["accuracy"]))
    return out


def save_sparse_run(path: str | os.PathLike[str], experiment: Experiment,
                    exports: list[dict[str, Any]], overwrite: bool = False) -> Path:
    """Write a sparse run directory atomically: the experiment and ``tables.npz`` (the dense
    vector, and per table the updated rows) from the shards' ``export_state``."""

    def fill(inner: Path) -> None:
        arrays = {"dense": np.concatenate([e["values"] for e in exports])}
        for t in range(len(exports[0]["tables"])):
            ids = np.concatenate([e["tables"][t]["ids"] for e in exports])
            values = np.concatenate([e["tables"][t]["values"] for e in exports])
            order = np.argsort(ids, kind="stable")
            arrays[f"table{t}_ids"], arrays[f"table{t}_values"] = ids[order], values[order]
        np.savez(inner / "tables.npz", **arrays)

    return write_run(path, experiment, fill, overwrite)


def load_sparse_tables(path: str | os.PathLike[str]) -> tuple[np.ndarray, list[pd.DataFrame]]:
    """A sparse run directory's dense vector and, per table, its updated rows (``id`` and the
    row's values)."""
    with np.load(Path(path) / "tables.npz", allow_pickle=False) as f:
        dense = f["dense"]
        n = sum(1 for k in f.files if k.endswith("_ids"))
        tables = []
        for t in range(n):
            values = f[f"table{t}_values"]
            frame = pd.DataFrame(values, columns=[f"v{j}" for j in range(values.shape[1])])
            frame.insert(0, "id", f[f"table{t}_ids"])
            tables.append(frame)
    return dense, tables
