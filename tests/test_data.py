"""The data layer in-process: shipped datasets, in-memory arrays, and the public module."""

import importlib

import numpy as np
import pandas as pd
import pytest

from downpour_dask import datasets
from downpour_dask.data.arrays import Dataset, minibatches
from downpour_dask.data.datasets import as_dataset


def test_downpour_dask_datasets_is_an_importable_module_and_the_data_layers_own():
    module = importlib.import_module("downpour_dask.datasets")
    assert module is datasets
    assert module.__name__ == "downpour_dask.data.datasets"
    from downpour_dask.datasets import from_parquet, load  # as the docstrings cite them

    assert load is datasets.load and from_parquet is datasets.from_parquet
    for name in module.__all__:
        assert hasattr(module, name), name


def test_shipped_datasets_load_with_fixed_splits_scaled_to_unit_range():
    for name, features, rows in [("digits", 64, 1797), ("mnist5k", 784, 5000)]:
        train, test = datasets.load(name)
        assert train.n_features == test.n_features == features
        assert train.n_rows + test.n_rows == rows
        assert train.X.dtype == np.float32 and train.y.dtype == np.int64
        assert train.X.flags["C_CONTIGUOUS"]  # rows are gathered per batch: keep them dense
        assert 0.0 <= train.X.min() and train.X.max() <= 1.0 and train.X.max() > 0.9
        assert set(np.unique(train.y)) == set(range(10))
    assert datasets.available() == ["digits", "mnist5k"]
    again, _ = datasets.load("mnist5k")
    assert np.array_equal(again.X, datasets.load("mnist5k")[0].X)


def test_unknown_dataset_names_the_available_ones():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'.*digits, mnist5k"):
        datasets.load("cifar")


@pytest.mark.parametrize(
    "X,y,match",
    [
        (np.zeros(5), np.zeros(5), "2-D"),
        (np.zeros((5, 2)), np.zeros((5, 2, 2)), "1-D or 2-D"),
        (np.zeros((5, 2)), np.zeros(4), "same number of rows, got 5 and 4"),
    ],
)
def test_from_arrays_rejects_malformed_arrays(X, y, match):
    with pytest.raises(ValueError, match=match):
        datasets.from_arrays(X, y)


def test_as_dataset_accepts_dataset_tuple_and_x_y():
    X, y = np.ones((4, 2)), np.arange(4)
    assert as_dataset((X, y)).n_rows == 4
    assert as_dataset(X, y).n_features == 2
    with pytest.raises(TypeError, match="train must be"):
        as_dataset([1, 2, 3], what="train")


def test_as_dataset_refuses_a_sharded_dataset_and_names_to_dataset(tmp_path):
    path = tmp_path / "rows.parquet"
    pd.DataFrame({"f0": [0.5, 1.5, 2.5], "label": [0, 1, 0]}).to_parquet(path, index=False)
    sharded = datasets.from_parquet(path)
    with pytest.raises(
        TypeError, match=r"eval_data is a ShardedDataset.*eval_data\.to_dataset\(\)"
    ):
        as_dataset(sharded, what="eval_data")
    explicit = as_dataset(sharded.to_dataset())  # the explicit way reads it into memory
    assert np.array_equal(explicit.X[:, 0], [0.5, 1.5, 2.5]) and explicit.y.tolist() == [0, 1, 0]


def test_partition_gives_every_row_to_exactly_one_replica():
    ds = Dataset(np.arange(20.0).reshape(10, 2), np.arange(10))
    parts = ds.partition(3)
    assert [len(p[1]) for p in parts] == [4, 3, 3]
    assert np.array_equal(np.concatenate([p[1] for p in parts]), np.arange(10))
    with pytest.raises(ValueError, match="only 10 rows"):
        ds.partition(11)


def test_minibatches_visit_each_row_once_per_epoch_and_reshuffle():
    X = np.arange(10, dtype=np.float32).reshape(10, 1)
    y = np.arange(10)
    rng = np.random.default_rng(0)
    epochs = []
    for _ in range(2):
        seen = [yb.copy() for _, yb in minibatches(X, y, 4, rng)]
        assert [len(b) for b in seen] == [4, 4, 2]
        order = np.concatenate(seen)
        assert sorted(order) == list(range(10))
        epochs.append(order)
    assert not np.array_equal(epochs[0], epochs[1])
    replay = np.concatenate([yb.copy() for _, yb in minibatches(X, y, 4, np.random.default_rng(0))])
    assert np.array_equal(replay, epochs[0])  # seeded: reproducible
    for Xb, yb in minibatches(X, y, 3, np.random.default_rng(1)):
        assert np.array_equal(Xb[:, 0], yb)  # rows stay aligned with their labels
