"""A sparse fit's evaluation log, and a sparse run published by name (attach, watch)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Client

import downpour_dask
from downpour_dask.cli.app import run as cli_run
from downpour_dask.core import optim
from downpour_dask.core.sparse import SparseBatch
from downpour_dask.core.sparse_models import SparseLogisticRegression
from downpour_dask.data.criteo import criteo_spec
from downpour_dask.downpour.sparse_eval import EVAL_FRAME_COLUMNS, SparseEvaluator, scores
from downpour_dask.downpour.sparse_fit import fit_sparse
from downpour_dask.ps.rows import SparseLayout
from downpour_dask.ps.table import SparseShard


def click_data(n=1200, n_rows=500, fields=4, numeric=2, seed=0):
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1.5, n_rows)
    ids = rng.integers(0, n_rows, (n, fields))
    p = 1 / (1 + np.exp(-effect[ids].sum(axis=1)))
    x = rng.normal(size=(n, numeric)).astype(np.float32)
    return SparseBatch(x, ids, (rng.random(n) < p).astype(np.int64))


class Answered:
    """What an actor call returns, for shards called in-process."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


class CountingShard:
    """A shard object called as an actor is, remembering the rows each pull asked for."""

    def __init__(self, shard: SparseShard):
        self.shard, self.asked = shard, []

    def pull_rows(self, requests):
        self.asked.append([np.array(r) for r in requests])
        return Answered(self.shard.rows_into(requests))

    def status(self):
        return Answered(self.shard.counters())


def test_an_evaluation_pulls_only_the_rows_the_held_out_data_touches():
    model = SparseLogisticRegression(10_000, 4, n_numeric=2)
    layout = SparseLayout.build(model.n_dense, model.tables, 3)
    shards = [
        CountingShard(SparseShard(s, lo, hi, np.zeros(hi - lo, np.float32), optim.sgd(0.1),
                                  tables=layout.shard_tables(s), seed=0))
        for s, (lo, hi) in enumerate(layout.dense)
    ]
    held_out = click_data(n=50, n_rows=10_000, seed=1)
    evaluator = SparseEvaluator(model, held_out, layout, timeout=10)
    row = evaluator.evaluate(shards, elapsed=1.5)
    wanted = np.unique(held_out.ids)
    asked = np.concatenate([s.asked[0][0] for s in shards])
    assert asked.tolist() == wanted.tolist()  # each touched row once, nothing else
    assert evaluator.n_rows_read == len(wanted) < 200 < model.tables[0].n_rows
    for s, shard in enumerate(shards):  # each shard was asked only for its own rows
        lo, hi = layout.tables[0][s]
        assert ((shard.asked[0][0] >= lo) & (shard.asked[0][0] < hi)).all()
    # untrained weights are zeros: p = 0.5 for every example
    assert row["loss"] == pytest.approx(np.log(2)) and row["version"] == 0
    assert row["time"] == 1.5 and row["examples_seen"] == 0
    assert evaluator.frame().dtypes.to_dict() == {k: np.dtype(v)
                                                  for k, v in EVAL_FRAME_COLUMNS.items()}


def test_scores_of_perfect_and_one_class_predictions():
    y = np.array([0, 1, 1, 0])
    perfect = scores(y, np.array([0.1, 0.9, 0.8, 0.2]))
    assert perfect["accuracy"] == 1.0 and perfect["auc"] == 1.0 and perfect["loss"] < 0.25
    single = scores(np.ones(3, np.int64), np.full(3, 0.7))
    assert np.isnan(single["auc"]) and single["accuracy"] == 1.0
    assert np.isnan(scores(y, np.array([np.nan, 0.5, 0.5, 0.5]))["loss"])


def test_the_fit_logs_evaluations_and_the_last_one_scores_the_final_parameters(client):
    model = SparseLogisticRegression(500, 4, n_numeric=2)
    everything = click_data(n=2400, seed=0)
    data, held_out = everything.take(slice(0, 2000)), everything.take(slice(2000, None))
    fit = fit_sparse(model, data, client=client, n_shards=2, batch_size=32, max_epochs=3,
                     eval_data=held_out, eval_every=0.2, seed=1, timeout=60)
    try:
        evals = fit.evaluations
        assert list(evals.columns) == list(EVAL_FRAME_COLUMNS) and len(evals) >= 1
        assert evals["time"].is_monotonic_increasing
        assert evals["examples_seen"].is_monotonic_increasing
        assert evals["version"].is_monotonic_increasing
        last = evals.iloc[-1]
        counters = fit.counters()
        assert last["version"] == min(c["version"] for c in counters) == len(fit.pushes) // 2
        assert last["examples_seen"] == 3 * len(data.y)
        dense, (table,) = fit.state()
        touched = model.touched(held_out)
        p = model.predict_proba(dense, [(touched[0], table[touched[0]])], held_out)
        assert last["loss"] == pytest.approx(scores(held_out.y, p)["loss"], rel=1e-6)
        start = scores(held_out.y, np.full(len(held_out.y), 0.5))["loss"]
        assert last["loss"] < start and last["auc"] > 0.75
    finally:
        fit.close()


def test_bad_eval_data_and_publish_are_refused_before_any_work(client, tmp_path):
    model = SparseLogisticRegression(500, 4, n_numeric=2)
    data = click_data(n=100)
    with pytest.raises(ValueError, match="the model takes n_numeric=2 and n_fields=4"):
        fit_sparse(model, data, client=client,
                   eval_data=([tmp_path / "x.parquet"], criteo_spec(100)))
    with pytest.raises(TypeError, match=r"eval_data must be a SparseBatch or \(paths, HashSpec\)"):
        fit_sparse(model, data, client=client, eval_data=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="eval_every must be a number of seconds > 0"):
        fit_sparse(model, data, client=client, eval_data=data, eval_every=0)
    with pytest.raises(ValueError, match="publish must be a non-empty str"):
        fit_sparse(model, data, client=client, publish=" ")
    client.publish_dataset(taken=[1])
    try:
        with pytest.raises(ValueError, match="already published"):
            fit_sparse(model, data, client=client, publish="taken")
        assert client.get_dataset("taken") == [1]  # left alone
    finally:
        client.unpublish_dataset("taken")
    assert not [k for k in client.list_datasets() if k != "taken"]


class GatedLogistic(SparseLogisticRegression):
    """Trains ``free`` steps per replica, then waits (up to 60 s) for file ``gate``: the run
    outlives the attached view's looks however slow the machine is."""

    def __init__(self, *args, gate: str, free: int, **kw):
        super().__init__(*args, **kw)
        self.gate, self.free, self.steps = gate, free, 0

    def loss_and_grad(self, dense, rows, batch):
        self.steps += 1
        deadline = time.monotonic() + 60
        while self.steps > self.free and not Path(self.gate).exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return super().loss_and_grad(dense, rows, batch)


def wait_published(client, name, seconds=60.0):
    deadline = time.monotonic() + seconds
    while name not in client.list_datasets():
        assert time.monotonic() < deadline, f"{name} was not published"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_published_sparse_run_is_attached_read_only_and_watched_from_a_second_client(
        client, tmp_path, capsys):
    gate = tmp_path / "go"
    model = GatedLogistic(500, 4, n_numeric=2, gate=str(gate), free=10)
    result: dict = {}

    def train():
        try:
            result["fit"] = fit_sparse(model, click_data(n=1000), client=client, n_replicas=2,
                                       n_shards=2, batch_size=20, max_epochs=1, timeout=90,
                                       publish="sparse-live")
        except BaseException as err:  # noqa: BLE001 - re-raised by the test
            result["error"] = err

    driver = threading.Thread(target=train)
    driver.start()
    watched: dict = {}
    try:
        with Client(client.scheduler.address, timeout=30) as other:
            wait_published(other, "sparse-live")
            view = downpour_dask.attach("sparse-live", other)
            assert view.info["sparse"] and view.info["n_shards"] == 2
            assert view.running and not hasattr(view, "push")
            deadline = time.monotonic() + 60
            poll = downpour_dask.attach("sparse-live", other)  # view's rate: since the start
            while (status := poll.status())["version"].min() < 20:  # both replicas at the gate
                assert time.monotonic() < deadline, status
                time.sleep(0.05)
            status = view.status()
            assert status["version"].tolist() == [20, 20]
            assert status["accepted_by_replica"].tolist() == [{0: 10, 1: 10}] * 2
            assert (status["examples"] == 400).all() and status["examples_per_s"].iloc[0] > 0
            assert {"rows_updated", "row_ranges", "staleness_mean", "worker"} <= set(status)
            with pytest.raises(ValueError, match="sparse run"):
                view.evaluate(click_data(n=10))
            watcher = threading.Thread(target=lambda: watched.update(code=cli_run(
                ["watch", "sparse-live", "--scheduler", client.scheduler.address,
                 "--interval", "0.2"])))
            watcher.start()
            gate.touch()
            driver.join(timeout=90)
            watcher.join(timeout=60)
            assert not view.running
    finally:
        gate.touch()
        driver.join(timeout=90)
    if "error" in result:
        raise result["error"]
    fit = result["fit"]
    try:
        assert watched["code"] == 0
        out = capsys.readouterr().out
        assert "watching 'sparse-live': fit_sparse, 2 replicas, 2 shards" in out
        assert "run 'sparse-live' finished" in out
        assert fit.counters()[0]["version"] == 50  # 1000 examples / 20 per step
        assert "sparse-live" not in client.list_datasets()
    finally:
        fit.close()



class Stop(Exception):
    """What a user's callback raises to end a fit."""


@pytest.mark.timeout(120)
def test_the_callback_gets_the_progress_and_what_it_raises_ends_the_fit(client, tmp_path):
    model = SparseLogisticRegression(500, 4, n_numeric=2)
    seen = []
    everything = click_data(n=1200)
    fit = fit_sparse(model, everything.take(slice(0, 1000)), client=client, n_shards=2,
                     batch_size=10, max_epochs=2, eval_data=everything.take(slice(1000, None)),
                     callback=seen.append, timeout=60)
    fit.close()
    assert [p.phase for p in seen] == ["training"] * (len(seen) - 1) + ["done"]
    assert [p.examples for p in seen] == sorted(p.examples for p in seen)
    last = seen[-1]
    assert last.examples == 2 * 1000 and last.fraction == 1.0 and last.pushes == 200
    assert last.metric == "accuracy" and 0.5 < last.score <= 1.0

    gate = tmp_path / "go"  # the replica waits after 5 steps until the callback raised
    gated = GatedLogistic(500, 4, n_numeric=2, gate=str(gate), free=5)
    stops = []

    def stop(progress):
        stops.append(progress)
        gate.touch()
        raise Stop("enough")

    with pytest.raises(Stop, match="enough"):
        fit_sparse(gated, click_data(n=1000), client=client, n_shards=2, batch_size=10,
                   max_epochs=1, callback=stop, timeout=60, publish="stopped")
    assert len(stops) == 1 and stops[0].phase == "training"
    assert "stopped" not in client.list_datasets()
    deadline = time.monotonic() + 60  # the replica ends on the closed shards: no task is left
    while any(client.processing().values()):
        assert time.monotonic() < deadline, client.processing()
        time.sleep(0.1)


def _replicas_running(dask_worker) -> list[str]:
    return [str(key) for key in dask_worker.active_threads.values() if "replica" in str(key)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_replicas_of_a_fit_its_callback_stopped_in_mid_training_end_with_it(client):
    """The fit stops its replicas through the shards and waits for them before it lets the
    shards go.  It used to let the shards go at once, and the replicas trained on against them
    for the rest of their epochs, on threads left running long after ``fit`` raised."""

    def stop(progress):
        if progress.examples >= 20_000:
            raise Stop("enough")

    with pytest.raises(Stop, match="enough"):
        fit_sparse(SparseLogisticRegression(500, 4, n_numeric=2), click_data(n=20_000),
                   client=client, n_shards=2, batch_size=10, max_epochs=100, callback=stop,
                   timeout=60)
    deadline = time.monotonic() + 10
    while any(client.run(_replicas_running).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(client.run(_replicas_running).values())
