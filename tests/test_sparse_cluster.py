"""Sparse tables on a real local cluster: the reference run, checkpoints into other shards."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from distributed import Client

from downpour_dask import live
from downpour_dask.core import optim
from downpour_dask.core.sparse import SparseBatch
from downpour_dask.core.sparse_models import EmbeddingMLP, SparseLogisticRegression
from downpour_dask.core.sparse_serial import serial_train
from downpour_dask.data.criteo import criteo_spec
from downpour_dask.data.hashing import minibatches
from downpour_dask.downpour.dask_cluster import DaskCluster
from downpour_dask.downpour.sparse_checkpoints import read_sparse
from downpour_dask.downpour.sparse_fit import fit_sparse
from downpour_dask.downpour.sparse_replicas import records_after


def click_data(n=1200, n_rows=500, fields=4, numeric=2, seed=0):
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1.5, n_rows)
    ids = rng.integers(0, n_rows, (n, fields))
    p = 1 / (1 + np.exp(-effect[ids].sum(axis=1)))
    x = rng.normal(size=(n, numeric)).astype(np.float32)
    return SparseBatch(x, ids, (rng.random(n) < p).astype(np.int64))


def test_one_replica_one_shard_on_the_cluster_equals_the_serial_loop(client):
    model = EmbeddingMLP(500, 4, n_numeric=2, dim=3, hidden=(6,))
    data = click_data()
    fit = fit_sparse(model, data, client=client, optimizer="adagrad", learning_rate=0.05,
                     batch_size=64, max_epochs=2, seed=3, timeout=60)
    try:
        rng = np.random.default_rng([3, 0])
        batches = [b for _ in range(2) for b in minibatches(data, 64, rng)]
        state, losses = serial_train(model, batches, optim.adagrad(0.05), seed=3)
        assert fit.pushes["loss"].tolist() == pytest.approx(losses, rel=1e-5)
        assert (fit.pushes["staleness"] == 0).all() and fit.pushes["accepted"].all()
        dense, (table,) = fit.state()
        assert np.allclose(dense, state.dense, rtol=1e-5, atol=1e-6)
        assert np.allclose(table, state.tables[0].values, rtol=1e-5, atol=1e-6)
        assert fit.counters()[0]["version"] == len(batches)
    finally:
        fit.close()


def test_incremental_checkpoints_of_4_shards_restore_into_3(client, tmp_path):
    model = SparseLogisticRegression(5000, 4, n_numeric=2)
    data = click_data(n=3000, n_rows=5000)
    fit = fit_sparse(model, data, client=client, n_replicas=2, n_shards=4, batch_size=32,
                     max_epochs=4, checkpoint_dir=tmp_path, checkpoint_every=0.05, timeout=60)
    try:
        saved = read_sparse(tmp_path)
        dense, (table,) = fit.state()
        pushes = fit.pushes
        assert set(pushes["shard"]) == {0, 1, 2, 3} and set(pushes["replica"]) == {0, 1}
        assert pushes["staleness"].max() >= 0 and "bytes" in pushes
        # each replica has two shards on its own worker and two it reaches over the wire
        assert set(pushes["transport"]) == {"local", "wire"}
    finally:
        fit.close()
    assert saved["increments"] == len(fit.checkpoints) >= 2
    assert len(saved["tables"][0]["ids"]) == len(np.unique(data.ids))  # every touched row
    again = fit_sparse(model, data, client=client, n_shards=3, max_steps=0, restore=tmp_path)
    try:
        dense3, (table3,) = again.state()
        assert np.array_equal(dense3, dense) and np.array_equal(table3, table)
        assert [c["row_ranges"] for c in again.counters()] == [[(0, 1666)], [(1666, 3333)],
                                                              [(3333, 5000)]]
    finally:
        again.close()


def test_a_reachable_shard_is_replaced_from_its_fenced_final_state_rows_included(client):
    model = SparseLogisticRegression(2000, 4, n_numeric=2)
    data = click_data(n=600, n_rows=2000)
    fit = fit_sparse(model, data, client=client, n_shards=2, batch_size=32, timeout=60)
    recovery = fit.recovery
    try:
        dense, (table,) = fit.state()
        before, old, worker = fit.counters()[0], fit.actors[0], fit.workers[0]
        assert fit.events.empty and fit.lost_updates == [0, 0]  # nothing was lost while it ran
        alive = sorted(client.scheduler_info()["workers"])
        recovery.recover(0, "replaced by the test", alive)
        restored = recovery.recorder.events[-1]
        assert restored.kind == "shard_restored"
        assert restored.data["source"] == "retired_shard" and restored.data["fenced"]
        assert restored.data["lost_updates"] == 0 and restored.data["generation"] == 1
        assert restored.data["version"] == before["version"]
        assert fit.workers[0] != worker and restored.data["worker"] == fit.workers[0]
        dense2, (table2,) = fit.state()  # every row and the dense part moved exactly
        assert np.array_equal(dense2, dense) and np.array_equal(table2, table)
        after = fit.counters()[0]
        assert after["version"] == before["version"] and after["generation"] == 1
        with pytest.raises(Exception, match="retired"):  # the old incarnation serves no one
            old.pull_rows([np.array([0])]).result(timeout=30)
    finally:
        recovery.cluster.forget()
        fit.close()


def test_data_that_does_not_fit_the_model_is_refused_before_any_work(client, tmp_path):
    model = SparseLogisticRegression(100, 26, n_numeric=13)
    files = [tmp_path / "a.parquet"]
    with pytest.raises(ValueError, match="n_replicas=2 but the data has 1 file"):
        fit_sparse(model, (files, criteo_spec(100)), client=client, n_replicas=2)
    with pytest.raises(ValueError, match="hashes into 1000 rows; the model's tables have 100"):
        fit_sparse(model, (files, criteo_spec(1000)), client=client)
    small = SparseLogisticRegression(500, 4, n_numeric=2)
    with pytest.raises(ValueError, match="the model takes n_numeric=2 and n_fields=4"):
        fit_sparse(small, (files, criteo_spec(100)), client=client)
    bad = click_data(n=10, n_rows=600)._replace(ids=np.full((10, 4), 550))
    with pytest.raises(ValueError, match=r"ids must be row ids in \[0, 500\)"):
        fit_sparse(small, bad, client=client)


class _NoCluster:
    """A client stand-in that fails any use: a fit refused up front never reaches it."""

    def __getattr__(self, name):
        raise AssertionError(f"the fit used its client ({name}) before refusing its input")


def test_adam_is_refused_for_tables_before_a_shard_starts():
    model = SparseLogisticRegression(500, 4, n_numeric=2)
    with pytest.raises(ValueError, match="'adam' keeps a state 't' that is not per coordinate"):
        fit_sparse(model, click_data(n=64), client=_NoCluster(), optimizer="adam")


def kill_after_a_checkpoint(pid, root, shard, updates=0, after=None):
    """A thread that SIGKILLs process ``pid`` once a checkpoint under ``root`` holds more than
    ``updates`` updates of ``shard`` and the event ``after`` (if given) is set (within 120 s)."""

    def checkpointed():
        manifests = root.glob("sparse-*/manifest.json")
        return any(json.loads(m.read_text())["versions"][shard] > updates for m in manifests)

    def kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if checkpointed() and (after is None or after.is_set()):
                break
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    return killer


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_shard_worker_is_restored_and_the_fit_finishes_with_exact_lost_updates(
        three_workers, tmp_path):
    client = three_workers
    model = SparseLogisticRegression(3000, 4, n_numeric=2)
    data = click_data(n=2000, n_rows=3000)
    victim = sorted(client.scheduler_info()["workers"])[2]  # holds shard 2, not the replica
    pid = client.run(os.getpid, workers=[victim])[victim]

    killer = kill_after_a_checkpoint(pid, tmp_path, shard=2)
    held_out = click_data(n=2300, n_rows=3000).take(slice(2000, None))  # (same effects)
    # a newer client, closed after the fit: the replacement's handle must use the fit's client
    other = Client(client.scheduler.address, timeout=30)
    fit = fit_sparse(model, data, client=client, n_shards=3, batch_size=16, max_epochs=10_000,
                     max_steps=2000, checkpoint_dir=tmp_path, checkpoint_every=0.2, timeout=30,
                     eval_data=held_out, eval_every=1.0, publish="sparse-recovery")
    killer.join(timeout=130)
    other.close()
    try:
        events = fit.events
        assert events["kind"].tolist()[:2] == ["shard_lost", "shard_restored"], events
        lost, restored = events.iloc[0]["data"], events.iloc[1]["data"]
        assert lost["shard"] == 2 and lost["worker"] == victim and lost["generation"] == 0
        assert restored["shard"] == 2 and restored["generation"] == 1
        assert restored["worker"] != victim and not restored["fenced"]  # SIGKILL: unreachable
        assert restored["source"] == "checkpoint" and restored["version"] > 0
        pushes = fit.pushes
        shard2 = pushes[(pushes["shard"] == 2) & pushes["accepted"]]
        old, new = shard2[shard2["generation"] == 0], shard2[shard2["generation"] == 1]
        assert len(new) > 0 and new["step"].min() > old["step"].max()
        # lost = acknowledged by generation 0 minus what its replacement started from, exactly
        assert fit.lost_updates == [0, 0, old["version"].max() - restored["version"]]
        assert fit.lost_updates[2] >= 0
        # the replacement went on from the checkpoint's version, one update per accepted push
        assert new["version"].tolist() == list(range(restored["version"] + 1,
                                                     restored["version"] + 1 + len(new)))
        assert fit.counters()[2]["version"] == new["version"].max()
        # its count of accepted pushes went on from the checkpoint's, as its version did
        assert fit.counters()[2]["accepted_by_replica"] == {0: new["version"].max()}
        for s in (0, 1):  # the other shards lost nothing: one update per accepted push
            mine = pushes[(pushes["shard"] == s) & pushes["accepted"]]
            assert fit.counters()[s]["version"] == len(mine) == mine["version"].max()
        assert pushes["step"].max() == 1999  # the fit ran to its end
        dense, (table,) = fit.state()
        assert np.isfinite(dense).all() and np.isfinite(table).all()
        # evaluations went on through the loss; the last one read the final parameters
        last = fit.evaluations.iloc[-1]
        assert last["version"] == min(c["version"] for c in fit.counters())
        assert np.isfinite(fit.evaluations["loss"]).all()
        # the published run was described again with the replacement, so views follow it
        records = [json.loads(m["json"]) for _, m in client.get_events(live.topic(
            "sparse-recovery")) if m.get("kind") == "run"]
        assert records[0]["shards"][2]["worker"] == victim
        assert records[-1]["shards"][2]["worker"] == restored["worker"]
        assert "sparse-recovery" not in client.list_datasets()  # released at the end
    finally:
        fit.close()
    read_sparse(tmp_path)  # every increment written is complete and readable


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("collected", [True, False], ids=["some-collected", "none-collected"])
def test_a_killed_replica_worker_is_restarted_and_the_fit_finishes_with_every_step_once(
        three_workers, tmp_path, monkeypatch, collected):
    client = three_workers
    # every other collection of the replicas' records runs on the workers but its answer comes
    # too late (as on a busy machine): the records it carried must come with the next one.
    # "some-collected": the kill waits until the driver holds some of replica 2's records, and
    # the shards' memory of its later pushes is numbered on from them; "none-collected": every
    # answer before the kill is late, and the task's first session says where it started.
    collections, collect = itertools.count(), DaskCluster.collect
    held = threading.Event()

    def half_of_them_late(self, function, *args):
        found = collect(self, function, *args)
        late = next(collections) % 2 == 0 or (not collected and killer.is_alive())
        if function is records_after and late:
            return {worker: TimeoutError("answered too late") for worker in found}
        if function is records_after and any(
            records and key.startswith("sparse-replica-2-")
            for answer in found.values() if isinstance(answer, dict)
            for key, records in answer.items()
        ):
            held.set()
        return found

    monkeypatch.setattr(DaskCluster, "collect", half_of_them_late)
    model = SparseLogisticRegression(3000, 4, n_numeric=2)
    data = click_data(n=2000, n_rows=3000)
    workers = sorted(client.scheduler_info()["workers"])
    victim = workers[2]  # shards 0 and 1 are on workers 0 and 1; replica 2 alone on worker 2
    pid = client.run(os.getpid, workers=[victim])[victim]

    killer = kill_after_a_checkpoint(pid, tmp_path, shard=0, updates=750,  # ~1/3 of the run
                                     after=held if collected else None)
    fit = fit_sparse(model, data, client=client, n_replicas=3, n_shards=2, batch_size=16,
                     max_epochs=10_000, max_steps=1500, checkpoint_dir=tmp_path,
                     checkpoint_every=0.2, timeout=30, n_fetch=2, n_push=2)
    killer.join(timeout=130)
    try:
        events = fit.events
        assert events["kind"].tolist() == ["replica_failed", "replica_restarted"], events
        failed, restarted = events.iloc[0]["data"], events.iloc[1]["data"]
        assert failed["replica"] == 2  # (its task is cancelled: its scattered data was lost)
        assert restarted["replica"] == 2 and restarted["workers"] != [victim]
        step = restarted["step"]
        assert 0 < step < 1500 and step % 2 == 0  # after the pushes shard 0 accepted
        # every replica pushed each of its 750 pushes once (a push the kill cut between the
        # two shards reached only one of them: the restart goes on after it)
        for s in (0, 1):
            counted = fit.counters()[s]["accepted_by_replica"]
            assert counted[0] == counted[1] == 750 and counted[2] in (749, 750)
        pushes = fit.pushes[fit.pushes["shard"] == 0]
        for r in (0, 1):
            assert pushes[pushes["replica"] == r]["step"].tolist() == list(range(1, 1500, 2))
        # replica 2's log is complete too: its first incarnation's records (those made after
        # the driver's last collection rebuilt from the shards' memory of its pushes), then
        # the restarted one's from its step on, each push once per shard (but the one the kill
        # may have cut)
        for shard in (0, 1):
            mine = fit.pushes[(fit.pushes["shard"] == shard) & (fit.pushes["replica"] == 2)]
            steps = mine["step"].tolist()
            assert steps in (list(range(1, 1500, 2)),
                             [s for s in range(1, 1500, 2) if s != step - 1])
            assert mine["accepted"].all()  # (a record rebuilt with none collected: no transport)
            transports = set(mine["transport"] if collected else mine["transport"].dropna())
            assert transports <= {"local", "wire"}
        print(f"replica 2 restarted after step {step}")
        dense, (table,) = fit.state()
        assert np.isfinite(dense).all() and np.isfinite(table).all()
    finally:
        fit.close()
    read_sparse(tmp_path)  # every increment written is complete and readable
