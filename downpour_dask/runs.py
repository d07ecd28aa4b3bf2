"""Training jobs as a batch user runs them: settings in, a finished run directory out.

The command line (:mod:`downpour_dask.cli`) only parses arguments; everything it does lives here,
so a script or a notebook can run exactly the same job with :func:`train`::

    from downpour_dask import runs
    result = runs.train({"dataset": "mnist5k", "model": "mlp:128,64", "n_replicas": 4})
    result.path, result.summary

A run directory holds what :meth:`Experiment.save` writes (``config.json`` and the pushes, evals
and events tables) plus ``params.npz`` (the trained flat parameter vector) and, when matplotlib
is installed, ``accuracy_vs_time.png`` and ``loss_vs_time.png``.  It appears at its final path
only when complete: everything is written to a temporary sibling directory that is renamed into
place, so a failed or interrupted job leaves no run directory behind.

A Downpour job checkpoints while it runs into ``<out>/.<name>.partial/`` (its settings in
``job.json`` and the checkpoints of :mod:`downpour_dask.checkpoint`), every ``checkpoint_every``
seconds.  If the driver dies, :func:`resume` (``downpour-dask train --resume <out>/<name>``)
continues the job from the latest checkpoint; the partial directory is deleted once the run
directory is written.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .core import models
from .data import datasets
from .downpour.estimator import DownpourSGD
from .log import Experiment, Progress
from .sandblaster.estimator import SandblasterLBFGS

#: Estimators a job can use, by the name given as ``algorithm``.
ALGORITHMS: dict[str, type] = {"downpour": DownpourSGD, "sandblaster": SandblasterLBFGS}

#: What a job does when a setting is not given: the command line's "no argument" run.
DEFAULTS: dict[str, Any] = {
    "algorithm": "downpour",
    "dataset": "mnist5k",
    "model": "mlp:128",
    "out": "runs",
}

#: Estimator arguments a job sets unless told otherwise (else the estimator's own defaults):
#: Downpour + Adagrad with a warmstart, the setting that works on the shipped data.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "downpour": {
        "n_replicas": 4,
        "n_shards": 2,
        "optimizer": "adagrad",
        "learning_rate": 0.05,
        "batch_size": 32,
        "warmstart_steps": 100,
        "max_epochs": 3,
    },
    "sandblaster": {"max_iter": 60},
}

#: Settings of a job that are not estimator arguments.
JOB_SETTINGS = (
    "algorithm", "dataset", "eval_dataset", "model", "out", "name", "overwrite", "publish"
)  # fmt: skip


def estimator_arguments(algorithm: str) -> dict[str, inspect.Parameter]:
    """The constructor arguments of an algorithm's estimator, except ``model``."""
    cls = _estimator_class(algorithm)
    parameters = inspect.signature(cls.__init__).parameters
    return {name: p for name, p in parameters.items() if name not in ("self", "model")}


def _estimator_class(algorithm: str) -> type:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return ALGORITHMS[algorithm]


# -- datasets and models from their names ---------------------------------------------------------


def load_dataset(spec: str, eval_spec: str | None = None) -> tuple[Any, Any]:
    """Resolve ``--dataset`` (and ``--eval-dataset``) to ``(train, test)``.

    Parameters
    ----------
    spec : str
        The name of a shipped dataset (see :func:`downpour_dask.datasets.available`; its test
        split becomes the evaluation data) or a path: a parquet file, a directory or glob of
        parquet files, or a ``.csv`` file, with the label in a column named ``label``.  Files
        are streamed by the replicas, never loaded here.
    eval_spec : str, optional
        Evaluation data as a path of the same kinds (read into memory), or a shipped name (its
        test split).  For a path ``spec`` without it, the run is not evaluated.
    """
    if spec in datasets.available():
        train, test = datasets.load(spec)
    else:
        train, test = _from_path(spec, "dataset"), None
    if eval_spec is not None:
        if eval_spec in datasets.available():
            test = datasets.load(eval_spec)[1]
        else:
            test = _from_path(eval_spec, "eval_dataset").to_dataset()
    return train, test


def _from_path(spec: str, what: str) -> Any:
    looks_like_glob = any(c in spec for c in "*?[")
    if not looks_like_glob and not Path(spec).exists():
        raise ValueError(
            f"{what} {spec!r} is neither a shipped dataset ({', '.join(datasets.available())}) "
            f"nor an existing file or directory"
        )
    if spec.endswith(".csv"):
        return datasets.from_csv(spec, label="label")
    return datasets.from_parquet(spec, label="label")  # a file, a directory or a glob


def make_model(spec: str, n_features: int, n_classes: int | None) -> models.Model:
    """Build a model from ``mlp:128,64``, ``mlp``, ``softmax``, ``logistic`` or ``linear``.

    ``n_classes`` is the number of class labels in the training data (``None`` for a regression
    target); it sets the output width of ``mlp`` and ``softmax``.
    """
    kind, _, arg = spec.partition(":")
    allowed = "mlp:H1,H2,... (hidden layer widths), mlp, softmax, logistic or linear"
    if kind == "mlp":
        try:
            hidden = tuple(int(h) for h in arg.split(",")) if arg else (128,)
        except ValueError:
            raise ValueError(f"model {spec!r}: hidden widths must be integers; {allowed}") from None
        if any(h < 1 for h in hidden):
            raise ValueError(f"model {spec!r}: hidden widths must be >= 1")
        return models.MLP(n_features, hidden, _classes(spec, n_classes))
    if arg:
        raise ValueError(f"model {spec!r}: only mlp takes arguments; {allowed}")
    if kind == "softmax":
        return models.SoftmaxRegression(n_features, _classes(spec, n_classes))
    if kind == "logistic":
        if n_classes != 2:
            raise ValueError(f"model 'logistic' needs labels 0/1, the data has {n_classes} classes")
        return models.LogisticRegression(n_features)
    if kind == "linear":
        return models.LinearRegression(n_features)
    raise ValueError(f"unknown model {spec!r}; allowed: {allowed}")


def _classes(spec: str, n_classes: int | None) -> int:
    if n_classes is None or n_classes < 2:
        raise ValueError(f"model {spec!r} is a classifier, but the labels are not classes 0..K-1")
    return n_classes


def _describe_labels(train: Any) -> tuple[int, int | None]:
    """Number of features and of classes (``None`` if the labels are not class indices)."""
    n_classes = getattr(train, "n_classes", None)
    if n_classes is None and hasattr(train, "y"):
        y = np.asarray(train.y)
        integral = y.ndim == 1 and len(y) and np.all(np.equal(np.mod(y, 1), 0)) and y.min() >= 0
        n_classes = int(y.max()) + 1 if integral else None
    return int(train.n_features), n_classes


# -- the job ------------------------------------------------------------------------------------


@dataclass
class Job:
    """A checked training job, ready to run: nothing has been started or written yet."""

    estimator: Any
    train: Any
    test: Any
    target: Path
    settings: dict[str, Any]
    partial: Path | None = None  # checkpoints while the job runs (Downpour only)
    resume_from: Path | None = None  # the partial directory of an interrupted run of this job


@dataclass
class RunResult:
    """What :func:`run` produced."""

    path: Path
    estimator: Any
    summary: dict[str, float]


def prepare(settings: dict[str, Any]) -> Job:
    """Check a job's settings, load its data and build its estimator, touching no cluster.

    Parameters
    ----------
    settings : dict
        Job settings (:data:`JOB_SETTINGS`) and estimator arguments; missing ones come from
        :data:`DEFAULTS` and :data:`ALGORITHM_DEFAULTS`.  ``name`` defaults to
        ``<dataset>-<algorithm>-<date>-<time>``.

    Raises
    ------
    ValueError, TypeError
        For a bad setting (the message names it and what is allowed).
    FileExistsError
        If the run directory exists and ``overwrite`` is not set.
    """
    algorithm = settings.get("algorithm", DEFAULTS["algorithm"])
    accepted = estimator_arguments(algorithm)  # raises for an unknown algorithm
    job = {**DEFAULTS, **ALGORITHM_DEFAULTS[algorithm], **settings}
    unknown = sorted(set(job) - set(accepted) - set(JOB_SETTINGS))
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)} for algorithm {algorithm!r}; allowed: "
            f"{', '.join(sorted(set(accepted) | set(JOB_SETTINGS)))}"
        )
    arguments = {k: v for k, v in job.items() if k in accepted}
    train_data, test_data = load_dataset(str(job["dataset"]), job.get("eval_dataset"))
    n_features, n_classes = _describe_labels(train_data)
    model = make_model(str(job["model"]), n_features, n_classes)
    estimator = _estimator_class(algorithm)(model, **arguments)
    estimator._check_arguments()  # every argument error now, before a cluster is involved
    name = job.get("name") or (
        f"{Path(str(job['dataset'])).stem}-{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a plain directory name, got {name!r}")
    target = Path(job["out"]) / name
    if target.exists() and not job.get("overwrite"):
        raise FileExistsError(f"run directory {str(target)!r} exists; choose another name")
    publish = job.get("publish")
    if publish is not None:
        if algorithm != "downpour":
            raise ValueError(f"publish works with algorithm downpour only, not {algorithm!r}")
        from .live import check_name

        check_name(publish)
    partial = None
    if "checkpoint_dir" in accepted:
        partial = partial_directory(target)
        if estimator.checkpoint_dir is None:
            estimator.set_params(checkpoint_dir=str(partial / "checkpoints"))
    return Job(estimator, train_data, test_data, target, job, partial)


def partial_directory(target: str | os.PathLike[str]) -> Path:
    """Where a job writing run directory ``target`` keeps its settings and checkpoints."""
    target = Path(target)
    return target.parent / f".{target.name}.partial"


def resume(run_dir: str | os.PathLike[str]) -> Job:
    """The job of an interrupted run, ready to :func:`run` on from its latest checkpoint.

    Parameters
    ----------
    run_dir : path
        The run directory the interrupted job was writing (``<out>/<name>``), or its partial
        directory ``<out>/.<name>.partial``.

    Raises
    ------
    FileNotFoundError
        If there is no interrupted job there.
    FileExistsError
        If the run directory was completed meanwhile.
    downpour_dask.checkpoint.CheckpointError
        (a ValueError) If its checkpoint is missing, truncated or corrupt.
    """
    from .checkpoint import read_checkpoint

    path = Path(run_dir)
    partial = path if (path / "job.json").is_file() else partial_directory(path)
    if not (partial / "job.json").is_file():
        raise FileNotFoundError(
            f"no interrupted job to resume at {str(path)!r}: {str(partial / 'job.json')!r} "
            f"does not exist"
        )
    try:
        settings = json.loads((partial / "job.json").read_text())
    except ValueError as err:
        raise ValueError(f"{str(partial / 'job.json')!r} is not valid JSON: {err}") from None
    job = prepare(settings)
    read_checkpoint(job.estimator.checkpoint_dir)  # a clear error now, before any cluster work
    job.resume_from = Path(job.estimator.checkpoint_dir)
    return job


def run(
    job: Job, client: Any = None, callback: Callable[[Progress], None] | None = None
) -> RunResult:
    """Fit the job's estimator and write its run directory (only once training succeeded).

    Parameters
    ----------
    job : Job
        From :func:`prepare`.
    client : distributed.Client, optional
        The cluster to train on; ``None`` starts an embedded local cluster.
    callback : callable, optional
        Passed to ``fit`` (a progress display).
    """
    estimator = job.estimator
    extra = {}
    if job.settings.get("publish") is not None:  # watch it: downpour-dask watch NAME
        extra["publish"] = job.settings["publish"]
    if job.partial is not None:
        job.partial.mkdir(parents=True, exist_ok=True)
        if job.resume_from is None:
            settings = {**job.settings, "name": job.target.name, "out": str(job.target.parent)}
            _write_json(job.partial / "job.json", settings)
        else:
            extra["resume_from"] = job.resume_from
    try:
        estimator.fit(job.train, eval_data=job.test, client=client, callback=callback, **extra)
    except BaseException:
        if job.partial is not None and job.resume_from is None:
            from .checkpoint import has_checkpoint

            if not has_checkpoint(job.estimator.checkpoint_dir):  # nothing to resume from
                shutil.rmtree(job.partial, ignore_errors=True)
        raise
    experiment = estimator.experiment_
    experiment.config.update(dataset=str(job.settings["dataset"]), model_spec=job.settings["model"])
    overwrite = bool(job.settings.get("overwrite"))
    path = save_run(job.target, experiment, estimator.params_, overwrite=overwrite)
    if job.partial is not None:
        shutil.rmtree(job.partial, ignore_errors=True)
    return RunResult(path, estimator, experiment.summary())


def _write_json(path: Path, value: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def train(
    settings: dict[str, Any],
    client: Any = None,
    callback: Callable[[Progress], None] | None = None,
) -> RunResult:
    """:func:`prepare` and :func:`run` in one call."""
    return run(prepare(settings), client, callback)


def save_run(
    path: str | os.PathLike[str],
    experiment: Experiment,
    params: np.ndarray,
    overwrite: bool = False,
) -> Path:
    """Write a complete run directory atomically: the experiment, ``params.npz`` and plots."""
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"run directory {str(target)!r} exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        inner = experiment.save(staging / "run")
        np.savez(inner / "params.npz", params=np.asarray(params))
        _plot_run(experiment, inner)
        if target.exists():
            shutil.rmtree(target)
        os.replace(inner, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _plot_run(experiment: Experiment, directory: Path) -> None:
    from .report import plot_runs

    try:
        plot_runs({"run": experiment}, directory, which=("accuracy", "loss"))
    except ImportError:  # matplotlib is optional (the "plot" extra)
        pass


def load_run(path: str | os.PathLike[str]) -> tuple[Experiment, models.Model, np.ndarray]:
    """Read a run directory back: its experiment, its model and the trained parameters."""
    experiment = Experiment.load(path)
    with np.load(Path(path) / "params.npz", allow_pickle=False) as f:
        params = f["params"]
    return experiment, models.from_config(experiment.config["model"]), params
