"""Sandblaster on data in files: the workers read their own rows once and keep them all fit."""

import numpy as np
import pandas as pd
import pytest
import scipy.optimize

from downpour_dask import datasets, models
from downpour_dask.sandblaster.blocks import ShardBlocks, read_block
from downpour_dask.sandblaster.estimator import SandblasterLBFGS
from downpour_dask.sandblaster.portions import Portions
from downpour_dask.sandblaster.runners import Runners


@pytest.fixture(scope="module")
def digits_files(tmp_path_factory):
    """The digits training set (labels >= 5 vs < 5) as 3 parquet files, and in memory."""
    train, _ = datasets.load("digits")
    X, y = train.X.astype(np.float32), (train.y >= 5).astype(np.int64)
    path = tmp_path_factory.mktemp("digits_parquet")
    for i, rows in enumerate(np.array_split(np.arange(len(X)), 3)):
        frame = pd.DataFrame(X[rows], columns=[f"x{j}" for j in range(64)]).assign(label=y[rows])
        frame.to_parquet(path / f"part-{i}.parquet")
    return datasets.from_parquet(str(path), label="label"), X, y


def _recording(client, monkeypatch):
    """Record the client's scatters and the keys of the tasks it submits."""
    scattered, submitted = [], []
    scatter, submit = client.scatter, client.submit

    def count_scatter(data, *args, **kwargs):
        scattered.append(data)
        return scatter(data, *args, **kwargs)

    def count_submit(func, *args, **kwargs):
        submitted.append((getattr(func, "__name__", ""), kwargs.get("key")))
        return submit(func, *args, **kwargs)

    monkeypatch.setattr(client, "scatter", count_scatter)
    monkeypatch.setattr(client, "submit", count_submit)
    return scattered, submitted


@pytest.mark.timeout(120)
def test_files_reach_scipys_optimum_with_each_block_read_once_and_no_rows_sent(
    client, digits_files, monkeypatch
):
    files, X, y = digits_files
    model = models.LogisticRegression(64, l2=3e-2)  # well conditioned: few passes
    scattered, submitted = _recording(client, monkeypatch)
    sent, call = [], Runners.call

    def recording_call(self, worker, block_key, *args):  # which block, and was it there
        held = {str(key) for key in self.client.has_what([worker]).get(worker, ())}
        sent.append(str(block_key) in held)
        return call(self, worker, block_key, *args)

    monkeypatch.setattr(Runners, "call", recording_call)
    est = SandblasterLBFGS(
        model, portions_per_batch=4, max_iter=100, tol=1e-8, backup_tasks=False, random_state=0
    ).fit(files, client=client)
    x0 = model.init(np.random.default_rng(0)).astype(np.float64)
    ref = scipy.optimize.minimize(
        lambda w: model.loss_and_grad(w, X.astype(np.float64), y), x0, jac=True,
        method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 2000},
    )  # fmt: skip
    ours = model.loss_and_grad(est.params_.astype(np.float64), X.astype(np.float64), y)[0]
    assert abs(ours - ref.fun) / ref.fun <= 1e-4
    passes = (est.experiment_.events["kind"] == "batch_done").sum()
    print(f"{passes} passes, {est.n_iter_} iterations")
    assert passes >= 3
    # the rows went from the files to the workers: the driver scattered nothing, and each of
    # the 6 portions (4 wanted over 3 files: each file cut in 2) was read once for all passes
    assert scattered == []
    reads = [key for name, key in submitted if name == "read_block"]
    assert len(reads) == 6 and len(set(reads)) == 6
    # every portion of every pass went straight to the runner on the worker holding its block
    # (runners.py), none through the scheduler as a task
    assert [key for name, key in submitted if name == "run_portion"] == []
    assert len(sent) == 6 * passes and all(sent)
    pushes = est.experiment_.pushes
    assert (pushes.groupby("version")["examples"].sum() == len(X)).all()
    assert est.classes_.tolist() == [0, 1] and est.n_features_in_ == 64
    assert est.score(X, y) > 0.85


def test_file_portions_cut_files_into_row_ranges_covering_every_row_once(digits_files):
    files, X, y = digits_files
    blocks = ShardBlocks(files, n_classes=2)
    (batch,) = blocks.portions(blocks.n_rows, 7, None)  # 7 wanted over 3 files: 3 per file
    assert batch == list(range(9))
    read = [read_block(blocks.shards[pid], files.schema, 2) for pid in batch]
    np.testing.assert_array_equal(np.concatenate([Xb for Xb, _ in read]), X)
    np.testing.assert_array_equal(np.concatenate([yb for _, yb in read]), y)
    assert all(Xb.flags.c_contiguous and Xb.dtype == np.float32 for Xb, _ in read)


def test_bad_file_data_is_refused_before_any_cluster_work(digits_files):
    files, X, y = digits_files
    est = SandblasterLBFGS(models.LogisticRegression(64), batch_size=100)
    with pytest.raises(ValueError, match="batch_size must be None when data is files"):
        est.fit(files, client=object())  # never used: the checks come first
    with pytest.raises(TypeError, match=r"eval_data is a ShardedDataset .*gather it whole"):
        SandblasterLBFGS(models.LogisticRegression(64)).fit(X, y, eval_data=files, client=object())


@pytest.mark.parametrize("local_only", [True, False])
def test_a_free_worker_waits_for_a_live_workers_block_instead_of_moving_it(local_only):
    portions = Portions.__new__(Portions)  # only the dispatch state; no cluster
    portions.LOCAL_ONLY = local_only
    portions.capacity, portions.load = {"a": 2, "b": 3}, {}
    portions.where = {0: {"a"}, 1: {"a"}, 2: {"a"}, 3: {"b"}, 4: {"gone"}}
    submitted = []

    def submit(version, pid, worker, backup):
        submitted.append((pid, worker))
        portions.load[worker] = portions.load.get(worker, 0) + 1

    portions._submit = submit
    todo = [0, 1, 2, 3, 4]
    portions._dispatch(0, todo, {})
    on_a = [pid for pid, worker in submitted if worker == "a"]
    on_b = [pid for pid, worker in submitted if worker == "b"]
    assert on_a == [0, 1]  # its own blocks
    if local_only:  # b runs its block and the one of a worker that left, never one of a's
        assert on_b == [3, 4] and todo == [2]
    else:  # the dispatch before: b's free slot takes a's block, which then moves to b
        assert on_b == [3, 4, 2] and todo == []
