"""Streaming data: files and Dask collections as shards that replicas read on their workers.

The first half checks the data layer in-process (validation, assignment, the reader, the shuffle
buffer, prefetching); the second half trains on the session's local cluster (two single-thread
worker processes): every input kind end to end, every row exactly once per epoch as seen by the
model itself, Dask partitions read where they live, and each bad input stopping the run with an
error that names the file.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from pathlib import Path

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from downpour_dask import DownpourSGD, datasets, models, runs
from downpour_dask.data import readers
from downpour_dask.data.assignment import assign_shards
from downpour_dask.data.schema import ShardDataError, ShardReadError
from downpour_dask.data.stream import Handoff, ShardStream, StreamSpec, prefetched
from downpour_dask.runtime.cluster import cluster_workers
from downpour_dask.runtime.placement import place_replicas

pytestmark = pytest.mark.timeout(120)

N_FEATURES, N_CLASSES = 6, 3
TEACHER = np.random.default_rng(42).normal(size=(N_FEATURES, N_CLASSES))


def _frame(rows: int, start: int = 0, seed: int = 0) -> pd.DataFrame:
    """Learnable rows (labels from a fixed linear teacher) with a ``rid`` row-id column."""
    X = np.random.default_rng([seed, start]).normal(size=(rows, N_FEATURES)).astype(np.float32)
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(N_FEATURES)])
    frame.insert(0, "rid", np.arange(start, start + rows, dtype=np.float32))
    frame["label"] = np.argmax(X @ TEACHER, axis=1).astype(np.int64)
    return frame


def _write_parquet(folder: Path, sizes: list[int], row_group: int = 50) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, n in enumerate(sizes):
        path = str(folder / f"part-{i}.parquet")
        _frame(n, start).to_parquet(path, index=False, row_group_size=row_group)
        paths.append(path)
        start += n
    return paths


def test_files_named_relative_to_the_drivers_folder_are_kept_as_absolute_paths(
    tmp_path, monkeypatch
):
    """Workers read the files from folders of their own (a cluster started elsewhere): a path
    relative to the driver's folder would name nothing there."""
    _write_parquet(tmp_path / "shards", [30, 20])
    monkeypatch.chdir(tmp_path)
    listed = ["shards/part-0.parquet", "shards/part-1.parquet"]
    for named in ("shards", "shards/part-*.parquet", listed):
        ds = datasets.from_parquet(named)
        assert [s.path for s in ds.shards] == [
            str(tmp_path / "shards" / f"part-{i}.parquet") for i in range(2)
        ]


def _write(kind: str, folder: Path, sizes: list[int]) -> datasets.ShardedDataset:
    """The same rows (ids 0..sum(sizes)-1) as parquet, npy or csv files."""
    if kind == "parquet":
        return datasets.from_parquet(_write_parquet(folder, sizes), shuffle_buffer=40)
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys, start = [], [], 0
    for i, n in enumerate(sizes):
        frame = _frame(n, start)
        start += n
        if kind == "csv":
            xs.append(str(folder / f"part-{i}.csv"))
            frame.to_csv(xs[-1], index=False)
        else:
            xs.append(str(folder / f"X{i}.npy"))
            ys.append(str(folder / f"y{i}.npy"))
            np.save(xs[-1], frame.drop(columns="label").to_numpy(np.float32))
            np.save(ys[-1], frame["label"].to_numpy())
    if kind == "csv":
        return datasets.from_csv(xs, shuffle_buffer=40)
    return datasets.from_npy(xs, ys, shuffle_buffer=40)


def _epoch_ids(ds, n_replicas: int, rng_seed: int = 0, batch_size: int = 16) -> list[np.ndarray]:
    """Row ids each replica reads in one epoch, through the real assignment and reader."""
    out = []
    for r, shards in enumerate(assign_shards(ds.shards, n_replicas)):
        spec = StreamSpec(ds.schema, tuple(shards), batch_size, ds.shuffle_buffer, N_CLASSES)
        rng = np.random.default_rng([rng_seed, r])
        out.append(np.concatenate([Xb[:, 0].copy() for Xb, _ in ShardStream(spec).epoch(rng)]))
    return out


# -- the data layer, in process ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "npy", "csv"])
@pytest.mark.parametrize("sizes,n_replicas", [([230], 3), ([90, 15, 160, 40], 2)])
def test_reader_visits_every_row_once_per_epoch_shuffled_and_reproducible(
    tmp_path, kind, sizes, n_replicas
):
    ds = _write(kind, tmp_path, sizes)
    assert (
        ds.n_rows == sum(sizes) and ds.n_features == N_FEATURES + 1 and len(ds.shards) == len(sizes)
    )
    assert ds.n_classes == N_CLASSES
    first = _epoch_ids(ds, n_replicas, rng_seed=0)
    together = np.sort(np.concatenate(first))
    assert np.array_equal(together, np.arange(sum(sizes)))  # every row exactly once
    assert abs(len(first[0]) - len(first[-1])) <= 1  # balanced by rows
    assert not np.array_equal(first[0], np.sort(first[0]))  # shuffled
    again = _epoch_ids(ds, n_replicas, rng_seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))  # seeded
    other = _epoch_ids(ds, n_replicas, rng_seed=1)
    assert not np.array_equal(first[0], other[0])  # reshuffled each epoch
    table = ds.to_dataset()
    assert np.array_equal(table.X[:, 0], np.arange(sum(sizes))) and table.y.dtype == np.int64


@pytest.mark.parametrize("staging_rows", [None, 16])  # 16: a chunk transposed in 3 parts
@pytest.mark.parametrize("kind", ["parquet", "npy", "csv"])
def test_a_streamed_row_carries_every_feature_and_the_label_of_its_file_row(
    tmp_path, monkeypatch, kind, staging_rows
):
    if staging_rows:
        monkeypatch.setattr(readers, "STAGING_BYTES", 4 * (N_FEATURES + 1) * staging_rows)
    sizes = [90, 15, 160]  # row groups of 50 read in chunks of 40: chunks split row groups
    ds = _write(kind, tmp_path, sizes)
    rows = pd.concat([_frame(n, sum(sizes[:i])) for i, n in enumerate(sizes)], ignore_index=True)
    X_file, y_file = rows.drop(columns="label").to_numpy(np.float32), rows["label"].to_numpy()
    spec = StreamSpec(ds.schema, tuple(ds.shards), 16, ds.shuffle_buffer, N_CLASSES)
    seen = 0
    for Xb, yb in ShardStream(spec).epoch(np.random.default_rng(0)):
        ids = Xb[:, 0].astype(np.int64)
        assert np.array_equal(Xb, X_file[ids]) and np.array_equal(yb, y_file[ids])
        seen += len(yb)
    assert seen == sum(sizes)


def test_batches_are_float32_c_contiguous_with_int64_labels(tmp_path):
    ds = _write("parquet", tmp_path, [100])
    spec = StreamSpec(ds.schema, tuple(ds.shards), 32, 40, N_CLASSES)
    sizes = []
    for Xb, yb in ShardStream(spec).epoch(np.random.default_rng(0)):
        assert Xb.dtype == np.float32 and Xb.flags.c_contiguous and yb.dtype == np.int64
        sizes.append(len(yb))
    assert sizes == [32, 32, 32, 4]


def test_prefetch_reraises_the_readers_error_and_stops_when_left_early():
    def failing():
        yield 1
        raise ShardReadError("cannot read x.parquet (row group 3): boom")

    with pytest.raises(ShardReadError, match=r"x.parquet \(row group 3\)"):
        list(prefetched(failing))
    produced = []

    def endless():
        while True:
            produced.append(1)
            yield len(produced)

    before = threading.active_count()
    stream = prefetched(endless, depth=2)
    assert [next(stream) for _ in range(3)] == [1, 2, 3]
    stream.close()
    time.sleep(0.3)
    assert threading.active_count() == before  # the reader thread has ended
    assert len(produced) <= 3 + 2 + 1  # bounded read-ahead


def test_a_full_handoff_wakes_its_producer_only_at_the_low_water_mark():
    """The prefetch thread, once ahead, sleeps until half the batches were taken and then
    refills in a burst: a thread switch per half-queue, not per batch.  Order is kept, at most
    ``depth`` items wait, and a sleeping producer gives up when told to stop."""
    stop = threading.Event()
    items = Handoff(depth=4, resume_at=2, stop=stop, poll=0.05)
    assert all(items.put(i) for i in range(4))
    fifth = threading.Event()
    producer = threading.Thread(target=lambda: items.put(4) and fifth.set(), daemon=True)
    producer.start()
    assert items.get() == 0
    # 3 left: above the mark, so the producer sleeps on (a plain queue.Queue would let it in)
    assert not fifth.wait(0.3) and len(items) == 3
    assert items.get() == 1
    assert fifth.wait(10) and len(items) == 3  # 2 left: it resumed
    assert [items.get() for _ in range(3)] == [2, 3, 4]
    with pytest.raises(queue.Empty):
        items.get()

    assert all(items.put(i) for i in range(4))
    stopped = []
    producer = threading.Thread(target=lambda: stopped.append(items.put(9)), daemon=True)
    producer.start()
    stop.set()
    producer.join(10)
    assert stopped == [False] and len(items) == 4
    with pytest.raises(ValueError, match=r"resume_at must be in \[0, depth\), got 4 for depth 4"):
        Handoff(depth=4, resume_at=4, stop=stop)


def test_the_read_ahead_is_about_8_mib_of_batches_between_2_and_32(tmp_path):
    ds = datasets.from_parquet(_write_parquet(tmp_path, [30]))
    small = StreamSpec(ds.schema, tuple(ds.shards), 32, 64, N_CLASSES)
    huge = StreamSpec(ds.schema, tuple(ds.shards), 10**6, 10**6, N_CLASSES)
    assert (small.prefetch, huge.prefetch) == (32, 2)


def _parquet_with(tmp_path: Path, name: str, frame: pd.DataFrame, **kw) -> str:
    path = str(tmp_path / name)
    frame.to_parquet(path, index=False, **kw)
    return path


def test_validation_errors_name_the_file(tmp_path):
    good = _parquet_with(tmp_path, "good.parquet", _frame(20))
    path = _parquet_with(tmp_path, "nolabel.parquet", _frame(20).drop(columns="label"))
    with pytest.raises(ValueError, match="nolabel.parquet: label column 'label' not found"):
        datasets.from_parquet(path)
    text = _frame(20).assign(f2="x")
    path = _parquet_with(tmp_path, "text.parquet", text)
    with pytest.raises(TypeError, match=r"text.parquet: .*non-numeric column\(s\): f2"):
        datasets.from_parquet(path)
    narrow = _parquet_with(tmp_path, "narrow.parquet", _frame(20).drop(columns="f3"))
    with pytest.raises(ValueError, match="narrow.parquet: column 'f3' is missing, but .*good"):
        datasets.from_parquet([good, narrow])
    wide = _frame(20).astype({"f1": np.float64})
    wide_path = _parquet_with(tmp_path, "f64.parquet", wide)
    with pytest.raises(ValueError, match="f64.parquet: column 'f1' has dtype double, but"):
        datasets.from_parquet([good, wide_path])
    empty = _parquet_with(tmp_path, "empty.parquet", _frame(0))
    with pytest.raises(ValueError, match="empty.parquet: the file has 0 rows"):
        datasets.from_parquet([good, empty])
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not a parquet file PAR1")
    with pytest.raises(ShardReadError, match="corrupt.parquet"):
        datasets.from_parquet([good, str(corrupt)])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        datasets.from_parquet(str(tmp_path / "nothing-*.parquet"))
    # npy and csv: the same checks from headers / the first block
    np.save(tmp_path / "X.npy", np.zeros((5, 3), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="X.npy has 5 rows but .*y.npy has 4"):
        datasets.from_npy(tmp_path / "X.npy", tmp_path / "y.npy")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ShardReadError, match="bad.npy"):
        datasets.from_npy(tmp_path / "bad.npy", tmp_path / "y.npy")
    (tmp_path / "a.csv").write_text("f0,f1,label\n1,2,0\n3,4,1\n")
    (tmp_path / "b.csv").write_text("f0,label\n1,0\n")
    with pytest.raises(ValueError, match=r"b.csv: column\(s\) \['f1'\] missing"):
        datasets.from_csv([tmp_path / "a.csv", tmp_path / "b.csv"])
    (tmp_path / "c.csv").write_text("f0,f1,label\n")
    with pytest.raises(ValueError, match="c.csv: the file has 0 rows"):
        datasets.from_csv([tmp_path / "a.csv", tmp_path / "c.csv"])
    (tmp_path / "d.csv").write_text("f0,f1,label\n1,red,0\n")
    with pytest.raises(TypeError, match="d.csv: .*f1"):
        datasets.from_csv(tmp_path / "d.csv")


def test_model_mismatch_is_caught_from_metadata_before_any_cluster_work(tmp_path):
    ds = _write("parquet", tmp_path, [50])
    est = DownpourSGD(models.SoftmaxRegression(3, N_CLASSES), n_replicas=1, n_shards=1)
    with pytest.raises(ValueError, match="data: X has 7 features, but SoftmaxRegression expects 3"):
        est.fit(ds, client="never touched")
    est = DownpourSGD(models.SoftmaxRegression(7, N_CLASSES), n_replicas=51, n_shards=1)
    with pytest.raises(ValueError, match="only 50 rows"):
        est.fit(ds, client="never touched")
    with pytest.raises(TypeError, match="y must be None"):
        est.fit(ds, np.zeros(50), client="never touched")


def test_sharded_eval_data_is_refused_before_any_cluster_work_naming_to_dataset(tmp_path):
    ds = _write("parquet", tmp_path, [50])
    est = DownpourSGD(models.SoftmaxRegression(7, N_CLASSES), n_replicas=1, n_shards=1)
    with pytest.raises(TypeError, match=r"eval_data is a ShardedDataset.*eval_data\.to_dataset"):
        est.fit(ds, eval_data=ds, client="never touched")


def test_from_dask_checks_metadata_only_and_placing_describes_a_new_dataset():
    frame = _frame(100)
    ddf = dd.from_pandas(frame, npartitions=4)
    ds = datasets.from_dask(ddf, label="label")
    assert ds.kind == "frame" and ds.n_features == N_FEATURES + 1 and ds.n_partitions == 4
    assert ds.shards == [] and ds.n_rows is None  # unknown until persisted on a cluster
    placed = ds.with_partitions(ddf, [30, 0, 40, 30], [f"partition {i}" for i in range(4)])
    assert placed is not ds and placed.n_rows == 100 and placed.describe()["n_shards"] == 3
    assert [s.part for s in placed.shards] == [0, 2, 3]  # the empty partition has no shard
    assert ds.shards == [] and ds.n_rows is None and ds.collection is ddf
    arrays = datasets.from_dask((da.ones((10, 3), chunks=(4, 3)), da.zeros(10, chunks=5)))
    assert arrays.n_rows == 10 and arrays.n_partitions == 3  # y follows X's row blocks
    with pytest.raises(TypeError, match="from_dask expects a dask.dataframe.DataFrame"):
        datasets.from_dask(frame)  # pandas, not Dask
    with pytest.raises(TypeError, match=r"non-numeric column\(s\): f2"):
        datasets.from_dask(ddf.assign(f2="x"), label="label")
    with pytest.raises(ValueError, match="label column 'y' not found"):
        datasets.from_dask(ddf, label="y")


def test_read_time_errors_name_the_file_and_row_group(tmp_path):
    frame = _frame(200)
    frame.loc[130, "f2"] = np.nan
    path = _parquet_with(tmp_path, "nan.parquet", frame, row_group_size=50)
    ds = datasets.from_parquet(path)  # metadata is fine: NaN is found while streaming
    spec = StreamSpec(ds.schema, tuple(ds.shards), 16, 64, N_CLASSES)
    with pytest.raises(ShardDataError, match=r"nan.parquet \(row group 2\): .*NaN.*row 130"):
        list(ShardStream(spec).epoch(np.random.default_rng(0)))
    labels = _frame(100).assign(label=7)
    path = _parquet_with(tmp_path, "labels.parquet", labels)
    ds = datasets.from_parquet(path)
    spec = StreamSpec(ds.schema, tuple(ds.shards), 16, 64, N_CLASSES)
    with pytest.raises(ShardDataError, match=r"labels.parquet .*labels \[7\] are outside"):
        list(ShardStream(spec).epoch(np.random.default_rng(0)))


def test_large_finite_features_pass_the_check_and_infinities_still_fail(tmp_path):
    """The check sums each chunk in float32: a sum that overflows on finite values near
    float32's maximum is no error; +inf and -inf in one chunk (a NaN sum) still are."""
    frame = _frame(200)
    frame["f1"] = np.float32(3.0e38)  # X's column 2 (after "rid"); 200 overflow a float32 sum
    path = _parquet_with(tmp_path, "large.parquet", frame, row_group_size=50)
    ds = datasets.from_parquet(path)
    spec = StreamSpec(ds.schema, tuple(ds.shards), 16, 64, N_CLASSES)
    rows = np.concatenate([X[:, 2] for X, _ in ShardStream(spec).epoch(np.random.default_rng(0))])
    assert len(rows) == 200 and (rows == np.float32(3.0e38)).all()
    frame.loc[60, "f1"], frame.loc[70, "f1"] = np.inf, -np.inf
    path = _parquet_with(tmp_path, "infs.parquet", frame, row_group_size=50)
    ds = datasets.from_parquet(path)
    spec = StreamSpec(ds.schema, tuple(ds.shards), 16, 64, N_CLASSES)
    bad = r"infs.parquet \(row group 1\): features contain 2 NaN.*row 60"
    with pytest.raises(ShardDataError, match=bad):
        list(ShardStream(spec).epoch(np.random.default_rng(0)))


# -- end to end on the local cluster --------------------------------------------------------------


class RecordingSoftmax(models.SoftmaxRegression):
    """Softmax regression that appends the row ids (feature 0) of every batch it trains on to
    a file of its own: the rows each replica actually trained on, seen from inside the model."""

    def __init__(self, n_inputs: int, n_classes: int, log_dir: str):
        super().__init__(n_inputs, n_classes)
        self.log_dir = log_dir

    def loss_and_grad(self, params, X, y, out=None):
        if not hasattr(self, "_log"):
            self._log = os.path.join(self.log_dir, f"{uuid.uuid4().hex}.txt")
        with open(self._log, "a") as f:
            f.write(" ".join(str(int(v)) for v in X[:, 0]) + "\n")
        return super().loss_and_grad(params, X, y, out)


def _trained_ids(log_dir: Path) -> list[np.ndarray]:
    logs = sorted(log_dir.glob("*.txt"))
    return [np.array(p.read_text().split(), dtype=np.int64) for p in logs]


def _test_set():
    frame = _frame(600, start=10**6, seed=9)
    return frame.drop(columns=["label"]).to_numpy(np.float32), frame["label"].to_numpy()


def _fit(data, client, n_replicas=2, epochs=4, **kw):
    est = DownpourSGD(
        models.SoftmaxRegression(N_FEATURES, N_CLASSES),
        n_replicas=n_replicas,
        n_shards=1,
        optimizer="adagrad",
        learning_rate=0.2,
        batch_size=32,
        max_epochs=epochs,
        random_state=0,
        **kw,
    )
    return est.fit(data, client=client)


def _features_only(folder: Path, sizes: list[int], kind: str):
    """Learnable files without the row-id column."""
    folder.mkdir(parents=True, exist_ok=True)
    frames = [_frame(n, start=sum(sizes[:i])).drop(columns="rid") for i, n in enumerate(sizes)]
    if kind == "parquet":
        paths = [str(folder / f"{i}.parquet") for i in range(len(sizes))]
        for f, p in zip(frames, paths):
            f.to_parquet(p, index=False, row_group_size=200)
        return datasets.from_parquet(paths)
    if kind == "csv":
        paths = [str(folder / f"{i}.csv") for i in range(len(sizes))]
        for f, p in zip(frames, paths):
            f.to_csv(p, index=False)
        return datasets.from_csv(paths)
    if kind == "npy":
        frame = pd.concat(frames)
        np.save(folder / "X.npy", frame.drop(columns="label").to_numpy(np.float32))
        np.save(folder / "y.npy", frame["label"].to_numpy())
        return datasets.from_npy(folder / "X.npy", folder / "y.npy")
    frame = pd.concat(frames, ignore_index=True)
    if kind == "dask-frame":
        return datasets.from_dask(dd.from_pandas(frame, npartitions=5), label="label")
    X = da.from_array(frame.drop(columns="label").to_numpy(np.float32), chunks=(400, 3))
    y = da.from_array(frame["label"].to_numpy(), chunks=300)  # rechunked to X's rows
    return datasets.from_dask((X, y))


@pytest.mark.parametrize("kind", ["parquet", "npy", "csv", "dask-frame", "dask-array"])
def test_each_input_kind_trains_a_model_end_to_end(client, tmp_path, kind):
    data = _features_only(tmp_path, [700, 300, 1000], kind)
    est = _fit(data, client)
    X_test, y_test = _test_set()
    X_test = X_test[:, 1:]  # no row id
    accuracy = est.score(X_test, y_test)
    assert accuracy > 0.9, accuracy
    config = est.experiment_.config
    assert config["n_rows"] == 2000 and config["data"]["rows"] == 2000
    assert config["data"]["kind"] == {"dask-frame": "frame", "dask-array": "array"}.get(kind, kind)
    assert est.experiment_.pushes["examples"].sum() == 4 * 2000


@pytest.mark.parametrize(
    "sizes,n_replicas",
    [([450], 3), ([100, 20, 230, 60, 90], 2)],
    ids=["fewer-files-than-replicas", "more-uneven-files-than-replicas"],
)
def test_every_row_is_trained_on_exactly_once_per_epoch(client, tmp_path, sizes, n_replicas):
    ds = _write("parquet", tmp_path / "data", sizes)
    logs = tmp_path / "logs"
    logs.mkdir()
    est = DownpourSGD(
        RecordingSoftmax(N_FEATURES + 1, N_CLASSES, str(logs)),
        n_replicas=n_replicas,
        n_shards=1,
        optimizer="sgd",
        learning_rate=1e-4,
        batch_size=16,
        max_epochs=2,
        random_state=0,
    ).fit(ds, client=client)
    per_replica = _trained_ids(logs)
    assert len(per_replica) == n_replicas
    epochs = [[], []]
    for ids in per_replica:
        half = len(ids) // 2
        assert np.array_equal(np.sort(ids[:half]), np.sort(ids[half:]))  # same rows each epoch
        assert not np.array_equal(ids[:half], ids[half:])  # in a new order
        epochs[0].append(ids[:half])
        epochs[1].append(ids[half:])
    for epoch in epochs:  # across all replicas, every row exactly once
        assert np.array_equal(np.sort(np.concatenate(epoch)), np.arange(sum(sizes)))
    assert est.experiment_.config["data"]["n_shards"] == len(sizes)


def test_dask_partitions_are_read_on_the_worker_that_holds_them(client, tmp_path):
    frame = _frame(1200)
    ddf = dd.from_pandas(frame, npartitions=6)
    ds = datasets.from_dask(ddf, label="label", shuffle_buffer=40)
    workers = sorted(cluster_workers(client))
    model = models.SoftmaxRegression(N_FEATURES + 1, N_CLASSES)
    placed = place_replicas(client, ds, 4, workers, 16, model, timeout=60)
    assert placed.n_rows == 1200 and placed.info["n_shards"] == 6
    rows = {}
    for p in placed.replicas:
        holders = client.who_has(p.parts)
        assert all(p.worker in holders[f.key] for f in p.parts)  # data is local to the replica
        rows.setdefault(p.worker, []).append(sum(s.rows for s in p.data.shards))
        assert p.rows == rows[p.worker][-1]
    assert sum(map(sum, rows.values())) == 1200
    assert all(max(r) - min(r) <= 1 for r in rows.values())  # balanced on each worker
    # and training through them visits every row once per epoch
    logs = tmp_path / "logs"
    logs.mkdir()
    est = DownpourSGD(
        RecordingSoftmax(N_FEATURES + 1, N_CLASSES, str(logs)),
        n_replicas=3,
        n_shards=1,
        optimizer="sgd",
        learning_rate=1e-4,
        batch_size=16,
        max_epochs=1,
    ).fit(ds, client=client)
    ids = np.concatenate(_trained_ids(logs))
    assert np.array_equal(np.sort(ids), np.arange(1200))
    assert est.experiment_.config["data"]["kind"] == "frame"


@pytest.mark.parametrize("kind", ["dask-frame", "dask-array"])
def test_fit_leaves_the_callers_dask_dataset_and_collection_unchanged(client, tmp_path, kind):
    data = _features_only(tmp_path, [300, 100, 200], kind)
    attributes = dict(vars(data))
    collections = data.collection if kind == "dask-array" else (data.collection,)
    keys = [c.__dask_keys__() for c in collections]
    rows_before = data.n_rows
    est = _fit(data, client, epochs=1)
    assert est.experiment_.config["n_rows"] == 600  # the placed copy knows the partitions
    assert est.experiment_.config["data"]["rows"] == 600
    assert vars(data).keys() == attributes.keys()
    assert all(getattr(data, name) is value for name, value in attributes.items()), vars(data)
    assert data.shards == [] and data.n_rows == rows_before
    assert [c.__dask_keys__() for c in collections] == keys  # the same graphs, not persisted ones


def _break(kind: str, folder: Path) -> tuple[datasets.ShardedDataset, str]:
    """A dataset that validates, then fails while streaming; and the file name to expect."""
    paths = _write_parquet(folder, [200, 200])
    if kind == "nan":
        frame = _frame(200, 200)
        frame.loc[170, "f4"] = np.inf
        frame.to_parquet(paths[1], index=False, row_group_size=50)
        return datasets.from_parquet(paths), r"part-1.parquet \(row group 3\).*infinite"
    ds = datasets.from_parquet(paths)
    if kind == "deleted":
        os.remove(paths[1])
    else:  # corrupt: the footer is intact, the data pages are not
        raw = bytearray(Path(paths[1]).read_bytes())
        raw[8:2000] = os.urandom(1992)
        Path(paths[1]).write_bytes(bytes(raw))
    return ds, r"cannot read .*part-1.parquet"


@pytest.mark.parametrize("kind", ["nan", "deleted", "corrupt"])
def test_a_bad_file_stops_the_run_with_its_name_and_writes_nothing(client, tmp_path, kind):
    ds, match = _break(kind, tmp_path / "data")
    est = DownpourSGD(
        models.SoftmaxRegression(N_FEATURES + 1, N_CLASSES),
        n_replicas=2,
        n_shards=1,
        batch_size=16,
        max_epochs=3,
        timeout=30,
    )
    job = runs.Job(est, ds, None, tmp_path / "run", {"dataset": "x", "model": "softmax"})
    with pytest.raises(RuntimeError, match=match):  # stopped with the file's name, not hung
        runs.run(job, client=client)
    assert not hasattr(est, "experiment_")
    assert not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no half-written run directory
    # the cluster is still usable afterwards
    assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3


def test_synthetic_writes_learnable_reproducible_parquet_shards(client, tmp_path):
    ds = datasets.synthetic(tmp_path / "a", rows=3000, features=10, classes=3, seed=5, n_files=3)
    assert ds.n_rows == 3000 and len(ds.shards) == 3 and ds.n_classes == 3
    again = datasets.synthetic(tmp_path / "b", rows=3000, features=10, classes=3, seed=5)
    a, b = ds.to_dataset(), again.to_dataset()
    assert np.array_equal(a.X, b.X) and np.array_equal(a.y, b.y)  # same seed, same data
    assert np.bincount(a.y).min() > 300  # no class is starved
    with pytest.raises(FileExistsError, match="already holds parquet files"):
        datasets.synthetic(tmp_path / "a", rows=10, features=2, classes=2)
    est = DownpourSGD(
        models.MLP(10, (32,), 3),
        n_replicas=2,
        n_shards=1,
        learning_rate=0.05,
        batch_size=32,
        max_epochs=5,
        random_state=0,
    ).fit(ds, eval_data=again.to_dataset(), client=client)
    assert est.experiment_.evals["accuracy"].iloc[-1] > 0.75


@pytest.mark.parametrize("folder_existed", [False, True])
def test_a_synthetic_dataset_stopped_half_way_leaves_none_of_its_files(
    tmp_path, monkeypatch, folder_existed
):
    """Ctrl-C in the second of four files: the first (finished) and the second (half written,
    a .tmp) go, and the folder if the call made it; what was there before stays."""
    out = tmp_path / "big"
    if folder_existed:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    write_table, writes = pq.ParquetWriter.write_table, []

    def interrupted(self, table, *args, **kwargs):
        writes.append(table.num_rows)
        if len(writes) == 5:  # 3 row groups a file: the second group of the second file
            raise KeyboardInterrupt
        return write_table(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        datasets.synthetic(out, rows=1000, features=4, classes=2, n_files=4, row_group_rows=100)
    if folder_existed:
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    else:
        assert not out.exists()
    monkeypatch.undo()  # the same folder takes the whole dataset afterwards
    assert datasets.synthetic(out, rows=1000, features=4, classes=2, n_files=4).n_rows == 1000


def test_writes_are_pyarrow_readable_row_groups(tmp_path):
    ds = datasets.synthetic(tmp_path, rows=1000, features=4, classes=2, row_group_rows=300)
    meta = pq.read_metadata(ds.shards[0].path)
    assert (
        meta.num_row_groups == 4 and meta.schema.to_arrow_schema().field("f0").type == pa.float32()
    )
