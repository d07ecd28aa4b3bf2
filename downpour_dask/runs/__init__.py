"""Training jobs as a batch user runs them: settings in, a finished run directory out.

The command line (:mod:`downpour_dask.cli`) only parses arguments; everything it does lives here,
so a script or a notebook can run exactly the same job with :func:`train`::

    from downpour_dask import runs
    result = runs.train({"dataset": "mnist5k", "model": "mlp:128,64", "n_replicas": 4})
    result.path, result.summary

A run directory (:mod:`.directory`) appears at its final path only when complete: everything is
written to a temporary sibling directory that is renamed into place, so a failed or interrupted
job leaves no run directory behind.

A Downpour job checkpoints while it runs into ``<out>/.<name>.partial/`` (its settings in
``job.json`` and the checkpoints of :mod:`downpour_dask.checkpoint`), every ``checkpoint_every``
seconds.  If the driver dies, :func:`resume` (``downpour-dask train --resume <out>/<name>``)
continues the job from the latest checkpoint; the partial directory is deleted once the run
directory is written.

The package: :mod:`.settings` (algorithms, defaults, the settings each accepts), :mod:`.specs`
(datasets and models from their names), :mod:`.jobs` (prepare, run, resume) and
:mod:`.directory` (run directories).
"""

from .directory import load_run, partial_directory, save_run
from .jobs import Job, RunResult, prepare, resume, run, train
from .settings import (
    ALGORITHM_DEFAULTS,
    ALGORITHMS,
    DEFAULTS,
    EVALUATION_INTERVALS,
    JOB_SETTINGS,
    estimator_arguments,
    misnamed_interval,
)
from .specs import load_dataset, make_model

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_DEFAULTS",
    "DEFAULTS",
    "EVALUATION_INTERVALS",
    "JOB_SETTINGS",
    "Job",
    "RunResult",
    "estimator_arguments",
    "load_dataset",
    "load_run",
    "make_model",
    "misnamed_interval",
    "partial_directory",
    "prepare",
    "resume",
    "run",
    "save_run",
    "train",
]
