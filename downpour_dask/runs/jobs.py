"""A training job: checked settings (:func:`prepare`), run to a run directory (:func:`run`),
and continued after its driver died (:func:`resume`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import has_checkpoint, read_checkpoint
from ..live import check_name
from ..log import Progress, check_replaceable
from .directory import partial_directory, save_run, write_json
from .settings import (
    ALGORITHM_DEFAULTS,
    DEFAULTS,
    JOB_SETTINGS,
    LIMITS,
    estimator_arguments,
    estimator_class,
    misnamed_interval,
)
from .specs import describe_labels, load_dataset, make_model


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
        :data:`DEFAULTS` and :data:`ALGORITHM_DEFAULTS` (whose limits apply only when none of
        :data:`LIMITS` is given).  ``label`` names the label column of data files (default
        ``"label"``).  ``name`` defaults to
        ``<dataset>-<algorithm>-<date>-<time>``.

    Raises
    ------
    ValueError, TypeError
        For a bad setting (the message names it and what is allowed).
    FileExistsError
        If the run directory exists and ``overwrite`` is not set, or it exists and is not a
        run directory (``overwrite`` replaces only a run directory).
    """
    algorithm = settings.get("algorithm", DEFAULTS["algorithm"])
    accepted = estimator_arguments(algorithm)  # raises for an unknown algorithm
    wrong = misnamed_interval(algorithm, settings)
    if wrong is not None:
        raise ValueError(wrong)
    defaults = dict(ALGORITHM_DEFAULTS[algorithm])
    if any(settings.get(limit) is not None for limit in LIMITS):  # the user's limits only
        defaults = {k: v for k, v in defaults.items() if k not in LIMITS}
    if settings.get("consistency", "async") != "async":  # SSP/BSP: replica 0 cannot run alone
        defaults.pop("warmstart_steps", None)
    job = {**DEFAULTS, **defaults, **settings}
    unknown = sorted(set(job) - set(accepted) - set(JOB_SETTINGS))
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)} for algorithm {algorithm!r}; allowed: "
            f"{', '.join(sorted(set(accepted) | set(JOB_SETTINGS)))}"
        )
    arguments = {k: v for k, v in job.items() if k in accepted}
    label = str(job.get("label", "label"))
    train_data, test_data = load_dataset(str(job["dataset"]), job.get("eval_dataset"), label)
    n_features, n_classes = describe_labels(train_data)
    model = make_model(str(job["model"]), n_features, n_classes)
    estimator = estimator_class(algorithm)(model, **arguments)
    estimator._check_arguments()  # every argument error now, before a cluster is involved
    name = job.get("name") or (
        f"{Path(str(job['dataset'])).stem}-{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a plain directory name, got {name!r}")
    target = Path(job["out"]) / name
    check_replaceable(target, bool(job.get("overwrite")))
    publish = job.get("publish")
    if publish is not None:
        if algorithm != "downpour":
            raise ValueError(f"publish works with algorithm downpour only, not {algorithm!r}")
        check_name(publish)
    partial = None
    if "checkpoint_dir" in accepted:
        partial = partial_directory(target)
        if estimator.checkpoint_dir is None:
            estimator.set_params(checkpoint_dir=str(partial / "checkpoints"))
    return Job(estimator, train_data, test_data, target, job, partial)


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
    ours = job.resume_from is not None  # a partial directory this job (or its start) made
    if job.partial is not None:
        ours = ours or not job.partial.exists()
        job.partial.mkdir(parents=True, exist_ok=True)
        if job.resume_from is None:
            settings = {**job.settings, "name": job.target.name, "out": str(job.target.parent)}
            write_json(job.partial / "job.json", settings)
        else:
            extra["resume_from"] = job.resume_from
    try:
        estimator.fit(job.train, eval_data=job.test, client=client, callback=callback, **extra)
    except BaseException:
        if job.partial is not None and job.resume_from is None and ours:
            if not has_checkpoint(job.estimator.checkpoint_dir):  # nothing to resume from
                shutil.rmtree(job.partial, ignore_errors=True)
        raise
    experiment = estimator.experiment_
    experiment.config.update(dataset=str(job.settings["dataset"]), model_spec=job.settings["model"])
    overwrite = bool(job.settings.get("overwrite"))
    path = save_run(job.target, experiment, estimator.params_, overwrite=overwrite)
    if job.partial is not None and ours:
        shutil.rmtree(job.partial, ignore_errors=True)
    return RunResult(path, estimator, experiment.summary())


def train(
    settings: dict[str, Any],
    client: Any = None,
    callback: Callable[[Progress], None] | None = None,
) -> RunResult:
    """:func:`prepare` and :func:`run` in one call."""
    return run(prepare(settings), client, callback)
