"""Run directories: written atomically when a job has finished, read back by :func:`load_run`.

A run directory holds what :meth:`Experiment.save` writes (``config.json`` and the pushes, evals
and events tables) plus ``params.npz`` (the trained flat parameter vector) and, when matplotlib
is installed, ``accuracy_vs_time.png`` and ``loss_vs_time.png``.  The config holds the model's
``get_config()`` (or, for a model without one, a description: :func:`load_run` then needs the
model).  While a Downpour job runs, its settings and checkpoints live in a partial directory
next to it (:func:`partial_directory`).
``overwrite`` replaces only a run directory (:func:`~downpour_dask.log.check_replaceable`):
never a user's directory that happens to have the same name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..core import models
from ..core.protocol import check_model
from ..log import Experiment, check_replaceable
from ..report import plot_runs


def partial_directory(target: str | os.PathLike[str]) -> Path:
    """Where a job writing run directory ``target`` keeps its settings and checkpoints."""
    target = Path(target)
    return target.parent / f".{target.name}.partial"


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically and durably (temp file, fsync, rename, fsync of the directory):
    a resumed job reads its settings from here."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(value, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_run(
    path: str | os.PathLike[str],
    experiment: Experiment,
    params: np.ndarray,
    overwrite: bool = False,
) -> Path:
    """Write a complete run directory atomically: the experiment, ``params.npz`` and plots.

    ``overwrite`` replaces an existing *run* directory only (see :func:`check_replaceable`).
    """

    def fill(inner: Path) -> None:
        np.savez(inner / "params.npz", params=np.asarray(params))
        _plot_run(experiment, inner, target.name)

    target = Path(path)
    return write_run(target, experiment, fill, overwrite)


def write_run(
    path: str | os.PathLike[str],
    experiment: Experiment,
    fill: Callable[[Path], None],
    overwrite: bool = False,
) -> Path:
    """Write a run directory atomically: ``experiment`` saved in a staging directory beside
    ``path``, ``fill(directory)`` adding the files of the run's kind, then one rename; a
    failure leaves nothing at ``path`` (and an existing run directory there as it was).

    ``overwrite`` replaces an existing *run* directory only (see :func:`check_replaceable`),
    checked again just before the rename, since the directory may have changed while the fit ran.
    """
    target = Path(path)
    check_replaceable(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        inner = experiment.save(staging / "run")
        fill(inner)
        if target.exists() or target.is_symlink():
            check_replaceable(target, overwrite)
            shutil.rmtree(target)
        os.replace(inner, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _plot_run(experiment: Experiment, directory: Path, name: str) -> None:
    try:  # the lines are labelled with the run's name
        plot_runs({name: experiment}, directory, which=("accuracy", "loss"))
    except ImportError:  # matplotlib is optional (the "plot" extra)
        pass


def load_run(
    path: str | os.PathLike[str], model: Any = None
) -> tuple[Experiment, Any, np.ndarray]:
    """Read a run directory back: its experiment, its model and the trained parameters.

    Parameters
    ----------
    path : path
        The run directory.
    model : model, optional
        The run's model.  By default it is rebuilt from the config the run stored (built-in and
        JAX-network models); a user's own model is described there but cannot be rebuilt
        without running code, so pass it here.

    Raises
    ------
    ValueError
        If the model cannot be rebuilt from the config and none is given, or the given model's
        parameter count differs from the stored parameters'.
    """
    experiment = Experiment.load(path)
    with np.load(Path(path) / "params.npz", allow_pickle=False) as f:
        params = f["params"]
    if model is None:
        try:
            model = models.from_config(experiment.config["model"])
        except ValueError as err:
            raise ValueError(
                f"run directory {str(path)!r}: its model cannot be rebuilt from the config it "
                f"stored ({err}); pass it: load_run(path, model=...)"
            ) from None
    else:
        check_model(model)
    if model.n_params != params.size:
        raise ValueError(
            f"run directory {str(path)!r} holds {params.size} parameters, but the model given "
            f"has n_params={model.n_params}; pass the model the run trained"
        )
    return experiment, model, params
