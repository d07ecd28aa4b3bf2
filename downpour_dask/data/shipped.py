"""The small real datasets shipped with downpour-dask (``digits``, ``mnist5k``).

They live in the project's ``data/`` folder (``downpour_dask/_data`` in an installed wheel) as
parquet files with fixed train/test splits and a ``manifest.json``; ``data/make_datasets.py``
wrote them and ``data/README.md`` gives their provenance and licences.  :func:`load` reads them
without needing scikit-learn or mlxtend.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from .arrays import Dataset


def _data_dir() -> Path:
    """Where the shipped datasets are: inside an installed wheel, or the source tree's data/."""
    package = Path(__file__).resolve().parents[1]  # downpour_dask/
    for candidate in (package / "_data", package.parent / "data"):
        if (candidate / "manifest.json").is_file():
            return candidate
    raise FileNotFoundError(
        "the shipped datasets are missing: neither downpour_dask/_data nor data/ next to the "
        "package holds manifest.json (reinstall downpour-dask)"
    )


def _manifest() -> dict:
    with open(_data_dir() / "manifest.json") as f:
        return json.load(f)


def available() -> list[str]:
    """Names of the datasets shipped with downpour-dask."""
    return sorted(_manifest())


def load(name: str) -> tuple[Dataset, Dataset]:
    """Load a shipped dataset as ``(train, test)`` with features scaled into [0, 1] (float32).

    Parameters
    ----------
    name : {"digits", "mnist5k"}
        ``digits``: scikit-learn's 8x8 digits (1,797 images, 64 features); ``mnist5k``: a
        5,000-image MNIST sample (784 features).  Both have 10 classes and a fixed split; see
        ``data/README.md`` for provenance and licences.

    Raises
    ------
    ValueError
        If ``name`` is not a shipped dataset (the message lists the available ones).
    """
    root = _data_dir()
    manifest = _manifest()
    if name not in manifest:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(sorted(manifest))}")
    info = manifest[name]
    scale = np.float32(info["feature_scale"])
    parts = []
    for split in ("train", "test"):
        frame = pd.read_parquet(root / info["files"][split])
        X = np.ascontiguousarray(frame.drop(columns="label").to_numpy(dtype=np.float32)) / scale
        y = frame["label"].to_numpy(dtype=np.int64)
        parts.append(Dataset(X, y, name=f"{name}:{split}"))
    return parts[0], parts[1]
