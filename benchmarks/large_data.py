"""The data of ``bench_large.py`` (and ``bench_rows_to_target.py``): 10^7 rows x 64 features.

The project's learnable synthetic set (``datasets.synthetic``: standard normal float32 features,
binary labels from a fixed random tanh teacher network), written once as 11 parquet files under
a cache folder (one per row count), the 11th holding the held-out test rows; and the readers
the in-process baselines use.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from downpour_dask import datasets

FEATURES, CLASSES, HIDDEN, SEED = 64, 2, 64, 0
TEST_ROWS = 20_000
COLUMNS = [f"f{j}" for j in range(FEATURES)]


def cached_data(root: Path, rows: int) -> tuple[list[str], str]:
    """The 10 training files and the test file of ``rows`` training rows, written if missing.

    The folder is written under a temporary name and renamed when complete, so an interrupted
    write is never taken for a cached dataset.
    """
    folder = root / f"rows{rows}-f{FEATURES}-c{CLASSES}-seed{SEED}"
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        start = time.perf_counter()
        print(f"writing {rows + rows // 10:,} rows x {FEATURES} to {folder} ...", flush=True)
        datasets.synthetic(partial, rows + rows // 10, FEATURES, CLASSES, seed=SEED, n_files=11)
        os.replace(partial, folder)
        print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
    files = sorted(str(p) for p in folder.glob("part-*.parquet"))
    return files[:10], files[10]


def read_test(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` rows of the held-out file."""
    table = pq.ParquetFile(path).read_row_group(0, columns=[*COLUMNS, "label"])[:n]
    X = np.column_stack([table.column(c).to_numpy() for c in COLUMNS]).astype(np.float32)
    return X, table.column("label").to_numpy()


def row_groups(files: list[str], rng: np.random.Generator) -> Iterator[tuple[np.ndarray, ...]]:
    """Endless ``(X, y)`` row groups of ``files``; files and groups in a new order each epoch."""
    while True:
        for i in rng.permutation(len(files)):
            pf = pq.ParquetFile(files[i])
            for g in rng.permutation(pf.metadata.num_row_groups):
                table = pf.read_row_group(int(g), columns=[*COLUMNS, "label"], use_threads=False)
                X = np.column_stack([table.column(c).to_numpy() for c in COLUMNS])
                yield X, table.column("label").to_numpy()
