"""A Criteo-shaped synthetic click log: learnable, skewed, of any size, written as parquet.

Real click logs cannot be shipped, so :func:`write_criteo` writes files shaped like Criteo's
display-advertising data: a 0/1 ``label`` (``click``), 13 integer count columns ``I1..I13``
(heavy-tailed, 5 % missing) and 26 categorical columns ``C1..C26`` whose cardinalities range
from a handful to ``max_cardinality`` and whose values follow a Zipf law (a few values in most
rows, a long tail of rare ones), as in the real data.  The clicks are drawn from a hidden
logistic model -- an effect per category value plus a linear effect of ``log1p`` of each count
-- so a model over hashed features can learn them and log-loss / AUC measure how well.

Each file is drawn from its own generator keyed by ``(seed, file)``, the hidden effects from
generators keyed by ``(seed, field)``: files can be written in any order or in parallel, and the
same arguments always give the same data.  Categorical values are stored as int64 codes (the
real data's are hashed strings; both hash alike through :mod:`~downpour_dask.data.hashing`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .hashing import HashSpec
from .part_files import all_or_nothing

N_INTEGER, N_CATEGORICAL = 13, 26
INTEGER = tuple(f"I{j}" for j in range(1, N_INTEGER + 1))
CATEGORICAL = tuple(f"C{j}" for j in range(1, N_CATEGORICAL + 1))
LABEL = "click"
ZIPF = 1.1  # exponent of the category frequencies
MISSING = 0.05  # share of missing integer values


def cardinalities(max_cardinality: int) -> np.ndarray:
    """The 26 fields' numbers of distinct values, log-spaced from 4 to ``max_cardinality``."""
    return np.geomspace(4, max(4, max_cardinality), N_CATEGORICAL).astype(np.int64)


def _hidden(seed: int, max_cardinality: int) -> tuple[list, list, np.ndarray]:
    """Per field: the Zipf CDF over its values and each value's effect on the logit; and the
    count columns' coefficients."""
    cdfs, effects = [], []
    for f, card in enumerate(cardinalities(max_cardinality)):
        rng = np.random.default_rng([seed, 1, f])
        weights = 1.0 / np.arange(1, card + 1) ** ZIPF
        cdfs.append(np.cumsum(weights) / weights.sum())
        effects.append(rng.normal(0.0, 0.9 if f % 3 == 0 else 0.3, card))
    coef = np.random.default_rng([seed, 2]).normal(0.0, 0.25, N_INTEGER)
    return cdfs, effects, coef


def criteo_frame(
    n_rows: int, seed: int = 0, file: int = 0, max_cardinality: int = 100_000
) -> pa.Table:
    """``n_rows`` rows of file number ``file`` as a pyarrow table (see the module docstring)."""
    cdfs, effects, coef = _hidden(seed, max_cardinality)
    rng = np.random.default_rng([seed, 0, file])
    counts = np.floor(rng.lognormal(np.linspace(0.5, 3.0, N_INTEGER), 1.2, (n_rows, N_INTEGER)))
    logit = np.full(n_rows, -1.2) + (np.log1p(counts) - 1.5) @ coef
    columns: dict[str, pa.Array] = {}
    for f, (cdf, effect) in enumerate(zip(cdfs, effects)):
        codes = np.minimum(np.searchsorted(cdf, rng.random(n_rows)), len(cdf) - 1)
        logit += effect[codes] / np.sqrt(N_CATEGORICAL / 4)
        columns[CATEGORICAL[f]] = pa.array(codes.astype(np.int64))
    missing = rng.random((n_rows, N_INTEGER)) < MISSING
    label = (rng.random(n_rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    ints = {
        name: pa.array(counts[:, j].astype(np.int64), mask=missing[:, j])
        for j, name in enumerate(INTEGER)
    }
    return pa.table({LABEL: pa.array(label), **ints, **columns})


def write_criteo(
    directory: str | Path,
    n_rows: int,
    rows_per_file: int = 1_000_000,
    seed: int = 0,
    max_cardinality: int = 100_000,
    n_files: int | None = None,
) -> list[Path]:
    """Write ``n_rows`` rows as ``part-00000.parquet``... of at most ``rows_per_file`` rows
    each -- or, given ``n_files``, as exactly that many files whose sizes differ by at most one
    row -- into ``directory`` (created; existing part files of the same names are replaced).
    Stopped half way (an error, Ctrl-C), it removes the files it wrote, and ``directory`` if
    it created it (:mod:`.part_files`).

    Returns the paths written, in order.
    """
    for name, value, low in (("n_rows", n_rows, 1), ("rows_per_file", rows_per_file, 1),
                             ("max_cardinality", max_cardinality, 4)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if n_files is None:
        starts = list(range(0, n_rows, rows_per_file)) + [n_rows]
    elif isinstance(n_files, bool) or not isinstance(n_files, (int, np.integer)) or not (
        1 <= n_files <= n_rows
    ):
        raise ValueError(f"n_files must be an int in [1, n_rows={n_rows}], got {n_files!r}")
    else:
        starts = [n_rows * k // n_files for k in range(n_files + 1)]
    paths = []
    with all_or_nothing(Path(directory)) as written:  # stopped half way: none of them is left
        for file, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            table = criteo_frame(hi - lo, seed, file, max_cardinality)
            path = Path(directory) / f"part-{file:05d}.parquet"
            written.append(path)
            pq.write_table(table, path, row_group_size=min(len(table), 1 << 18))
            paths.append(path)
    return paths


def criteo_spec(n_rows: int, seed: int = 0) -> HashSpec:
    """The :class:`~downpour_dask.data.hashing.HashSpec` of the synthetic files: the counts
    ``log1p``-transformed, the 26 categorical fields hashed into ``n_rows`` table rows."""
    return HashSpec(INTEGER, CATEGORICAL, LABEL, n_rows, seed, "log1p")
