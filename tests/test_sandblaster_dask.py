"""Sandblaster on Dask collections: each partition is read where it is, and never gathered."""

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, futures_of, get_task_stream

from downpour_dask import datasets, models
from downpour_dask.data.dask_collections import distinct_labels
from downpour_dask.data.schema import Schema, Shard, ShardDataError
from downpour_dask.runtime.cluster import cluster_workers
from downpour_dask.sandblaster.blocks import read_block
from downpour_dask.sandblaster.estimator import SandblasterLBFGS


@pytest.fixture(scope="module")
def digits_signed():
    """The digits training set with labels -1 (digit < 5) and 1: not the codes 0..K-1."""
    train, _ = datasets.load("digits")
    return train.X.astype(np.float32), np.where(train.y >= 5, 1, -1)


def _transferred(client: Client) -> set[str]:
    """Every key a worker has fetched from another worker so far."""

    def keys(dask_worker) -> list[str]:
        return [str(k) for entry in dask_worker.transfer_incoming_log for k in entry["keys"]]

    return {key for found in client.run(keys).values() for key in found}


def _recording(client, monkeypatch) -> list:
    """Record what the client scatters."""
    scattered, scatter = [], client.scatter

    def count_scatter(data, *args, **kwargs):
        scattered.append(data)
        return scatter(data, *args, **kwargs)

    monkeypatch.setattr(client, "scatter", count_scatter)
    return scattered


@pytest.mark.timeout(120)
def test_a_dask_array_fit_matches_the_in_memory_fit_and_no_feature_row_moves(
    client, digits_signed, monkeypatch
):
    X, y = digits_signed
    model = models.LogisticRegression(64, l2=3e-2)
    settings = dict(max_iter=100, tol=1e-8, backup_tasks=False, random_state=0)
    ref = SandblasterLBFGS(model, portions_per_batch=4, **settings).fit(X, y, client=client)
    Xd = da.from_array(X, chunks=(300, 64))  # more partitions than the 4 portions wanted
    yd = da.from_array(y, chunks=300)
    n_parts = len(Xd.chunks[0])
    assert n_parts > 4
    Xd, yd = client.persist([Xd, yd])  # the user's data already on the cluster
    before = _transferred(client)
    scattered = _recording(client, monkeypatch)
    est = SandblasterLBFGS(model, portions_per_batch=4, **settings).fit(Xd, yd, client=client)
    assert scattered == []  # nothing went through the driver
    moved = [k for k in _transferred(client) - before if Xd.name in k or "sandblaster-block" in k]
    assert moved == []  # every block was read on the worker holding its features
    assert est.classes_.tolist() == [-1, 1] and est.n_features_in_ == 64
    assert est.objective_ == pytest.approx(ref.objective_, rel=1e-5)
    np.testing.assert_allclose(est.params_, ref.params_, atol=1e-3)
    pushes = est.experiment_.pushes
    assert (pushes.groupby("version")["examples"].sum() == len(X)).all()
    assert (pushes.groupby("version").size() == n_parts).all()  # a portion per partition
    assert est.score(X, y) == pytest.approx(ref.score(X, y))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("known", [True, False], ids=["known-chunks", "unknown-chunks"])
def test_partition_lengths_are_counted_on_the_workers_only_when_the_chunks_do_not_say(
    client, digits_signed, known
):
    X, y = digits_signed
    Xd, yd = da.from_array(X, chunks=(500, 64)), da.from_array(y, chunks=500)
    if not known:  # a boolean mask leaves the row chunks unknown (NaN) until computed
        keep = da.from_array(np.ones(len(X), bool), chunks=500)
        Xd, yd = Xd[keep], yd[keep]
        assert np.isnan(Xd.chunks[0]).all()
    with get_task_stream(client) as tasks:
        est = SandblasterLBFGS(
            models.LogisticRegression(64, l2=3e-2), max_iter=3, random_state=0
        ).fit(Xd, yd, client=client)
    counted = [t["key"] for t in tasks.data if str(t["key"]).startswith("len-")]
    assert bool(counted) is not known  # a round trip to the workers only where needed
    pushes = est.experiment_.pushes
    assert (pushes.groupby("version")["examples"].sum() == len(X)).all()  # every row, once


@pytest.mark.timeout(120)
def test_a_finished_fit_lets_go_of_its_shards_and_its_copy_of_the_data_but_not_the_users(
    client, digits_signed, no_cycle_collector, cluster_keys
):
    """A fit on a lazy collection persists a copy of it for the fit; once the fit returns, that
    copy and the shards must be gone from the workers' memory (the cycle collector is off: the
    fit must let go itself, not leave it to a collector that may not run for a long time).  A
    collection the user persisted stays, whole."""
    X, y = digits_signed
    before = cluster_keys()
    lazy = da.from_array(X, chunks=(500, 64)), da.from_array(y, chunks=500)
    model = models.LogisticRegression(64, l2=3e-2)
    SandblasterLBFGS(model, max_iter=3, random_state=0).fit(*lazy, client=client)
    assert cluster_keys(beyond=before) == set()
    Xd, yd = client.persist(list(lazy))  # the user's own copy
    SandblasterLBFGS(model, max_iter=3, random_state=0).fit(Xd, yd, client=client)
    users = {str(f.key) for f in futures_of([Xd, yd])}
    assert cluster_keys(beyond=before | users) == set()
    assert users <= cluster_keys()  # the user's copy stays
    np.testing.assert_array_equal(client.compute(Xd).result(timeout=30), X)
    np.testing.assert_array_equal(client.compute(yd).result(timeout=30), y)


def test_an_array_block_is_a_view_of_float32_rows_and_checked_like_a_file():
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((100, 3)).astype(np.float32), rng.integers(0, 2, 100)
    shard = Shard("array", "block 0 of Dask Array x", 10, 60, part=0)
    schema = Schema("array", 3, "float32", "int64")
    Xb, yb = read_block(shard, schema, 2, (X, y))
    assert np.shares_memory(Xb, X)  # the worker holds the rows once, not twice
    np.testing.assert_array_equal(Xb, X[10:60])
    np.testing.assert_array_equal(yb, y[10:60])
    X64 = X.astype(np.float64)  # other dtypes: one converted copy
    Xc, _ = read_block(shard, schema, 2, (X64, y))
    assert Xc.dtype == np.float32 and Xc.flags.c_contiguous and not np.shares_memory(Xc, X64)
    np.testing.assert_array_equal(Xc, X[10:60])
    raw = np.zeros(X.nbytes + 2, np.uint8)  # float32 rows 2 bytes off alignment, as unpickled
    odd = raw[2:].view(np.float32).reshape(X.shape)
    odd[:] = X
    assert not odd.flags.aligned
    Xa, _ = read_block(shard, schema, 2, (odd, y))
    assert Xa.flags.aligned and not np.shares_memory(Xa, odd)  # copied: aligned rows are faster
    np.testing.assert_array_equal(Xa, X[10:60])
    X64[42, 1] = np.nan
    with pytest.raises(ShardDataError, match=r"block 0 of Dask Array x \(rows 10-60\).*row 42"):
        read_block(shard, schema, 2, (X64, y))
    with pytest.raises(ShardDataError, match=r"labels \[7\] are outside .* 0..1"):
        read_block(shard, schema, 2, (X, np.where(np.arange(100) == 20, 7, y)))


@pytest.mark.timeout(120)
def test_a_dask_dataframe_fit_knows_its_feature_names_and_covers_every_row(client, digits_signed):
    X, y = digits_signed
    columns = [f"pixel{j}" for j in range(64)]
    frame = dd.from_pandas(pd.DataFrame(X, columns=columns).assign(digit=y), npartitions=3)
    est = SandblasterLBFGS(
        models.LogisticRegression(64, l2=3e-2), portions_per_batch=6, max_iter=20,
        random_state=0,
    ).fit(datasets.from_dask(frame, label="digit"), client=client)  # fmt: skip
    assert est.feature_names_in_.tolist() == columns
    pushes = est.experiment_.pushes
    assert (pushes.groupby("version")["examples"].sum() == len(X)).all()
    assert (pushes.groupby("version").size() == 6).all()  # 6 wanted over 3 partitions: cut in 2
    assert est.score(pd.DataFrame(X, columns=columns), y) > 0.85


@pytest.mark.parametrize(
    "labels",
    [
        np.array([3, -1, 7, 3, 7, 7, -1, 12, 3]),
        np.array(["cat", "dog", "cat", "eel", "dog", "ant", "cat", "eel", "dog"]),
        np.array([0.5, 2.0, 0.5, -1.0, 2.0, 2.0, 0.5, 9.0, -1.0]),
    ],
    ids=["int", "str", "float"],
)
def test_the_label_scan_finds_exactly_the_distinct_labels_of_every_block(labels):
    """The classes a fit on a Dask collection learns: each block's distinct values, whatever
    their order within the block, found for an Array and a Series alike."""
    expected = np.unique(labels)
    as_array = distinct_labels(da.from_array(labels, chunks=4)).compute(scheduler="sync")
    series = dd.from_pandas(pd.Series(labels, name="y"), npartitions=3)
    as_series = distinct_labels(series).compute(scheduler="sync")
    for found in (np.asarray(as_array), as_series.to_numpy()):
        assert len(found) <= len(labels) and np.array_equal(np.unique(found), expected)
    assert len(as_array) == sum(len(np.unique(labels[i : i + 4])) for i in range(0, 9, 4))


def test_bad_dask_data_is_refused_before_any_cluster_work(digits_signed):
    X, y = digits_signed
    Xd, yd = da.from_array(X, chunks=(300, 64)), da.from_array(y, chunks=300)
    est = SandblasterLBFGS(models.LogisticRegression(64), batch_size=100)
    with pytest.raises(ValueError, match="batch_size must be None when data is Dask data"):
        est.fit(Xd, yd, client=object())  # never used: the checks come first
    with pytest.raises(TypeError, match=r"eval_data is a Array .*gather it whole"):
        SandblasterLBFGS(models.LogisticRegression(64)).fit(Xd, yd, eval_data=Xd, client=object())
    with pytest.raises(TypeError, match=r"needs y as a Dask Series or Array too.*numpy.ndarray"):
        SandblasterLBFGS(models.LogisticRegression(64)).fit(Xd, y, client=object())


def _fit_slowly(est: SandblasterLBFGS, client: Client, Xd, yd) -> SandblasterLBFGS:
    """Fit with every portion sleeping 0.25 s first, so that a kill lands inside the batch."""
    return est.fit(
        Xd, yd, client=client, portion_delay=dict.fromkeys(cluster_workers(client), 0.25)
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killing_the_worker_holding_the_partitions_mid_batch_loses_nothing(
    digits_signed, three_workers, kill_during_fit
):
    X, y = digits_signed
    model = models.LogisticRegression(64, l2=1e-2)
    client = three_workers
    victim = sorted(cluster_workers(client))[2]  # shards go to the other two workers
    Xd, yd = da.from_array(X, chunks=(150, 64)), da.from_array(y, chunks=150)
    # every partition on the victim, recomputable elsewhere once it is gone
    Xd, yd = client.persist([Xd, yd], workers=[victim], allow_other_workers=True)
    n_parts = len(Xd.chunks[0])
    est = SandblasterLBFGS(  # no backups: only the victim runs portions until it dies
        model, portions_per_batch=n_parts, max_iter=0, backup_tasks=False, random_state=0
    )
    done = kill_during_fit(client, victim, lambda: _fit_slowly(est, client, Xd, yd))
    assert victim not in cluster_workers(client)  # the kill hit: the fit outlived the worker
    assert "est" in done, done.get("error")
    params = model.init(np.random.default_rng(0))
    codes = (y > 0).astype(np.int64)
    loss, grad = model.loss_and_grad(params.astype(np.float64), X.astype(np.float64), codes)
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)
    pushes = est.experiment_.pushes
    # every row counted once: Dask recomputed the lost partitions and blocks and re-ran the
    # killed portion, and the shards count a portion once however many copies of it run
    assert pushes["examples"].sum() == len(X) and len(pushes) == n_parts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_losing_scattered_partitions_ends_the_fit_with_an_error_naming_them(
    digits_signed, three_workers, kill_during_fit
):
    X, y = digits_signed
    client = three_workers
    victim = sorted(cluster_workers(client))[2]
    rows = np.array_split(np.arange(len(X)), 6)
    xs = client.scatter([X[r] for r in rows], workers=[victim])  # no graph: not recomputable
    ys = client.scatter([y[r] for r in rows], workers=[victim])
    Xd = da.concatenate([da.from_delayed(f, (len(r), 64), X.dtype) for f, r in zip(xs, rows)])
    yd = da.concatenate([da.from_delayed(f, (len(r),), y.dtype) for f, r in zip(ys, rows)])
    est = SandblasterLBFGS(
        models.LogisticRegression(64), portions_per_batch=6, max_iter=0, backup_tasks=False,
        random_state=0, timeout=120,
    )  # fmt: skip
    done = kill_during_fit(client, victim, lambda: _fit_slowly(est, client, Xd, yd))
    # an error naming the lost rows, not a fit waiting out its timeout re-reading them
    assert "error" in done, "the fit finished without the rows it lost"
    assert isinstance(done["error"], RuntimeError)
    assert "were lost with their worker, and Dask cannot recompute them" in str(done["error"])
    assert f"Dask Array {Xd.name}" in str(done["error"])
