"""Hashed categorical columns (stable across processes) and the Criteo-shaped synthetic data."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from downpour_dask.core import optim
from downpour_dask.core.sparse_models import SparseLogisticRegression
from downpour_dask.core.sparse_serial import serial_train
from downpour_dask.data.criteo import CATEGORICAL, INTEGER, LABEL, criteo_spec, write_criteo
from downpour_dask.data.hashing import HashSpec, hash_column, load_hashed, minibatches, read_hashed

VALUES = ["a", "b", None, "a", "zz", "b"]


@pytest.mark.slow  # seconds of training (or processes): out of the quick loop
def test_hashes_are_stable_across_processes_and_depend_on_seed_and_field():
    here = hash_column(np.array(VALUES, object), "C1", 1000, seed=3)
    code = (
        "import numpy as np; from downpour_dask.data.hashing import hash_column; "
        f"print(hash_column(np.array({VALUES!r}, object), 'C1', 1000, seed=3).tolist())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60)
    assert eval(other.stdout) == here.tolist()  # another process (another hash() salt)
    assert here[0] == here[3] and here[1] == here[5] and here.min() >= 0 and here.max() < 1000
    assert hash_column(np.array(VALUES, object), "C1", 1000, seed=4).tolist() != here.tolist()
    assert hash_column(np.array(VALUES, object), "C2", 1000, seed=3).tolist() != here.tolist()


def test_integers_hash_by_value_with_or_without_missing_values():
    ints = hash_column(pd.Series([5, 7, 5], dtype="int64"), "f", 2**40)
    floats = hash_column(pd.Series([5.0, 7.0, np.nan]), "f", 2**40)
    assert ints[0] == ints[2] == floats[0] and ints[1] == floats[1]
    assert floats[2] not in ints
    with pytest.raises(ValueError, match="n_rows must be an int >= 1"):
        hash_column(np.array([1]), "f", 0)


def test_csv_and_parquet_stream_the_same_hashed_rows(tmp_path):
    frame = pd.DataFrame({"x": [1.0, 2.0, np.nan, 4.0], "c": ["u", "v", "u", None],
                          "d": ["p", "p", "q", "q"], "y": [0, 1, 1, 0]})
    frame.to_csv(tmp_path / "a.csv", index=False)
    frame.to_parquet(tmp_path / "a.parquet")
    spec = HashSpec(("x",), ("c", "d"), "y", 64, seed=1)
    from_csv, from_parquet = load_hashed(tmp_path / "a.csv", spec), load_hashed(
        tmp_path / "a.parquet", spec)
    for a, b in zip(from_csv, from_parquet):
        assert np.array_equal(a, b)
    assert from_csv.numeric[:, 0].tolist() == [1.0, 2.0, 0.0, 4.0]
    assert from_csv.ids[0, 0] == from_csv.ids[2, 0] != from_csv.ids[0, 1]
    batches = list(read_hashed(tmp_path / "a.csv", spec, 3, np.random.default_rng(0)))
    assert sorted(len(b.y) for b in batches) == [1, 3]
    assert sorted(np.concatenate([b.ids[:, 1] for b in batches])) == sorted(from_csv.ids[:, 1])
    with pytest.raises(ValueError, match=r"columns \['nope'\] are missing"):
        load_hashed(tmp_path / "a.csv", HashSpec(("x",), ("nope",), "y", 64))
    with pytest.raises(FileNotFoundError, match="no such data file"):
        load_hashed(tmp_path / "none.csv", spec)


def test_criteo_files_stopped_half_way_are_removed_with_the_folder_the_call_made(
    tmp_path, monkeypatch
):
    write_table, written = pq.write_table, []

    def failing(table, where, **kwargs):
        written.append(where)
        if len(written) == 2:  # the second file, half written: the disk is full, say
            write_table(table.slice(0, 10), where, **kwargs)
            raise OSError(28, "No space left on device")
        return write_table(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", failing)
    with pytest.raises(OSError, match="No space left"):
        write_criteo(tmp_path / "clicks", 3_000, rows_per_file=1_000, max_cardinality=100)
    assert len(written) == 2 and not (tmp_path / "clicks").exists()


def test_criteo_data_is_shaped_skewed_reproducible_and_learnable(tmp_path):
    paths = write_criteo(tmp_path / "a", 30_000, rows_per_file=12_000, seed=5, max_cardinality=5000)
    assert [p.name for p in paths] == [f"part-0000{i}.parquet" for i in range(3)]
    table = pq.read_table(paths[0])
    assert table.column_names == [LABEL, *INTEGER, *CATEGORICAL] and len(INTEGER) == 13
    assert len(CATEGORICAL) == 26 and table.num_rows == 12_000
    again = write_criteo(tmp_path / "b", 30_000, rows_per_file=12_000, seed=5, max_cardinality=5000)
    assert pq.read_table(again[2]).equals(pq.read_table(paths[2]))
    top = table.column("C26").to_pandas().value_counts()
    assert top.iloc[0] > 50 * top.median()  # a few values in most rows, a long tail
    spec = criteo_spec(1 << 16)
    data = load_hashed(paths, spec)
    rate = data.y.mean()
    assert 0.1 < rate < 0.4
    model = SparseLogisticRegression(1 << 16, 26, n_numeric=13)
    train = data.take(slice(0, 24_000))
    batches = list(minibatches(train, 128, np.random.default_rng(0)))
    state, _ = serial_train(model, batches * 2, optim.adagrad(0.1))
    test = data.take(slice(24_000, None))
    p = np.clip(state.predict_proba(test), 1e-7, 1 - 1e-7)
    logloss = -np.mean(test.y * np.log(p) + (1 - test.y) * np.log(1 - p))
    base = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert logloss < base - 0.03
