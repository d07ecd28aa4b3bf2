"""Sparse tables on the shards, in-process: the reference test, refusals, exports."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from downpour_dask.core import optim
from downpour_dask.core.sparse import SparseBatch, table_rows
from downpour_dask.core.sparse_models import EmbeddingMLP, FactorizationMachine
from downpour_dask.core.sparse_serial import serial_train
from downpour_dask.downpour.sparse_checkpoints import merge_exports
from downpour_dask.downpour.sparse_loop import run_sparse_replica
from downpour_dask.ps.protocol import FencedError
from downpour_dask.ps.rows import RowsLink, SparseLayout
from downpour_dask.ps.table import SparseShard


def click_batches(n_batches=40, n=32, n_rows=300, fields=4, numeric=2, seed=0):
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1.5, n_rows)
    out = []
    for _ in range(n_batches):
        ids = rng.integers(0, n_rows, (n, fields))
        p = 1 / (1 + np.exp(-effect[ids].sum(axis=1)))
        x = rng.normal(size=(n, numeric)).astype(np.float32)
        out.append(SparseBatch(x, ids, (rng.random(n) < p).astype(np.int64)))
    return out


def shards_for(model, n_shards, rule, seed=0):
    layout = SparseLayout.build(model.n_dense, model.tables, n_shards)
    dense = model.init_dense(np.random.default_rng(seed))
    shards = [
        SparseShard(s, lo, hi, dense[lo:hi], rule, tables=layout.shard_tables(s), seed=seed)
        for s, (lo, hi) in enumerate(layout.dense)
    ]
    return layout, shards


def table_of(shards, t=0):
    return np.concatenate([s.blocks[t].values for s in shards])


@pytest.mark.parametrize("n_shards", [1, 3])
@pytest.mark.parametrize("rule", ["adagrad", "staleness_aware_sgd"])
def test_one_replica_equals_the_serial_loop(n_shards, rule):
    model = EmbeddingMLP(300, 4, n_numeric=2, dim=3, hidden=(6,))
    batches = click_batches()
    state, losses = serial_train(model, batches, optim.make(rule, 0.05), seed=1)
    layout, shards = shards_for(model, n_shards, optim.make(rule, 0.05), seed=1)
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    records = run_sparse_replica(model, links, layout, batches)
    assert [r["loss"] for r in records if r["shard"] == 0] == pytest.approx(losses, rel=1e-5)
    dense = np.concatenate([s.values for s in shards])
    assert np.allclose(dense, state.dense, rtol=1e-5, atol=1e-6)
    assert np.allclose(table_of(shards), state.tables[0].values, rtol=1e-5, atol=1e-6)
    assert all(r["staleness"] == 0 and r["accepted"] for r in records)
    assert [s.version for s in shards] == [len(batches)] * n_shards
    touched = np.unique(np.concatenate([b.ids.ravel() for b in batches]))
    versions = np.concatenate([s.blocks[0].versions for s in shards])
    counts = np.zeros(300, np.int64)
    for b in batches:
        counts[np.unique(b.ids)] += 1
    assert np.array_equal(versions, counts)  # a row's version counts its own updates
    untouched = np.setdiff1d(np.arange(300), touched)
    assert np.array_equal(table_of(shards)[untouched],
                          table_rows(model.tables[0], 0, 0, 300, 1)[untouched])


def test_pushes_carry_only_the_touched_rows():
    model = FactorizationMachine(10_000, 4, n_factors=4, n_numeric=2)
    layout, shards = shards_for(model, 2, optim.sgd(0.1))
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    batches = click_batches(5, n=16, n_rows=10_000)
    records = run_sparse_replica(model, links, layout, batches)
    for step, b in enumerate(batches):
        mine = [r for r in records if r["step"] == step]
        assert sum(r["rows"] for r in mine) == len(np.unique(b.ids))
        # ids (8 B) and a row (5 floats) each way, and the 3 dense values each way
        assert sum(r["bytes"] for r in mine) == len(np.unique(b.ids)) * (8 + 20) * 2 + 2 * 12


def test_a_push_out_of_range_is_refused_and_changes_nothing():
    model = FactorizationMachine(100, 4, n_factors=2)
    layout, shards = shards_for(model, 2, optim.adagrad(0.1))
    shard = shards[1]  # rows [50, 100)
    before = (shard.values.copy(), shard.blocks[0].values.copy(),
              shard.blocks[0].state["sum_sq"].copy(), shard.version)
    grads = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"shard 1, table 0: 1 row id\(s\) out of this block's "
                                         r"range \[50, 100\): \[100\]"):
        shard.apply_rows(np.zeros(1, np.float32), [(np.array([60, 100]), grads)], 0, 0)
    with pytest.raises(ValueError, match=r"out of this block's range \[50, 100\): \[3\]"):
        shard.apply_rows(np.zeros(1, np.float32), [(np.array([3, 60]), grads)], 0, 0)
    with pytest.raises(ValueError, match="must be unique"):
        shard.apply_rows(np.zeros(1, np.float32), [(np.array([60, 60]), grads)], 0, 0)
    nan = grads.copy()
    nan[0, 0] = np.nan
    reply = shard.apply_rows(np.zeros(1, np.float32), [(np.array([60, 61]), nan)], 0, 0)
    assert not reply.accepted and shard.rows_refused == 1
    huge = np.full((2, 3), 1e30, np.float32)  # finite, but Adagrad's sum of squares overflows
    reply = shard.apply_rows(np.zeros(1, np.float32), [(np.array([60, 61]), huge)], 0, 0)
    assert not reply.accepted and shard.rows_refused == 2
    assert "non-finite" in asyncio.run(shard.events())[-1][3]["reason"]
    after = (shard.values, shard.blocks[0].values, shard.blocks[0].state["sum_sq"], shard.version)
    assert all(np.array_equal(a, b) for a, b in zip(before[:3], after[:3]))
    assert after[3] == before[3]
    with pytest.raises(ValueError, match=r"out of this block's range"):
        shard.rows_into([np.array([10])])


def test_exports_are_incremental_and_restore_into_other_row_ranges():
    model = FactorizationMachine(200, 4, n_factors=2, n_numeric=2)
    batches = click_batches(12, n_rows=200)
    layout, shards = shards_for(model, 4, optim.adagrad(0.1))
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    run_sparse_replica(model, links, layout, batches[:6])
    first = [asyncio.run(s.export_changed()) for s in shards]
    run_sparse_replica(model, links, layout, batches[6:], start_step=6)
    second = [asyncio.run(s.export_changed()) for s in shards]
    late = np.unique(np.concatenate([b.ids.ravel() for b in batches[6:]]))
    assert np.array_equal(np.concatenate([e["tables"][0]["ids"] for e in second]), late)
    assert all(len(e["tables"][0]["ids"]) == 0 for e in
               [asyncio.run(s.export_changed()) for s in shards])  # nothing changed since
    # restore the two increments (in order) into 3 shards: the same parameters and state
    dense = np.concatenate([s.values for s in shards])
    parts = [[e["tables"][0] for e in first] + [e["tables"][0] for e in second]]
    new_layout = SparseLayout.build(model.n_dense, model.tables, 3)
    restored = [
        SparseShard(s, lo, hi, dense[lo:hi], optim.adagrad(0.1),
                    tables=new_layout.shard_tables(s), seed=0, restore={"tables": parts})
        for s, (lo, hi) in enumerate(new_layout.dense)
    ]
    assert np.array_equal(table_of(restored), table_of(shards))
    assert np.array_equal(np.concatenate([s.blocks[0].state["sum_sq"] for s in restored]),
                          np.concatenate([s.blocks[0].state["sum_sq"] for s in shards]))
    assert np.array_equal(np.concatenate([s.blocks[0].versions for s in restored]),
                          np.concatenate([s.blocks[0].versions for s in shards]))


def test_a_retired_sparse_shard_is_fenced_and_its_final_state_carries_the_rows():
    model = FactorizationMachine(100, 4, n_factors=2)
    layout, (shard,) = shards_for(model, 1, optim.adagrad(0.1))
    link = RowsLink(shard, 0, 0, 10.0)
    run_sparse_replica(model, [link], layout, click_batches(3, n_rows=100, numeric=0))
    final = asyncio.run(shard.retire(1))
    rows = final["state"]["tables"][0]
    assert np.array_equal(rows["ids"], np.flatnonzero(shard.blocks[0].versions))
    with pytest.raises(FencedError, match="retired"):
        link.wait(link.pull([np.array([1])]))
    with pytest.raises(FencedError, match="retired"):
        shard.apply_rows(np.zeros(1, np.float32), [(np.array([1]), np.ones((1, 3), np.float32))],
                         0, 0)
    # a replacement restored from the retired shard's final state has the same table
    again = SparseShard(0, 0, 1, final["state"]["values"], optim.adagrad(0.1),
                        tables=layout.shard_tables(0), seed=0, generation=1,
                        restore=final["state"])
    assert np.array_equal(again.blocks[0].values, shard.blocks[0].values)
    assert again.version == shard.version


def test_a_restored_shard_saves_its_restored_rows_and_merged_exports_keep_every_row():
    model = FactorizationMachine(200, 4, n_factors=2, n_numeric=2)
    batches = click_batches(12, n_rows=200)
    layout, (shard,) = shards_for(model, 1, optim.adagrad(0.1))
    links = [RowsLink(shard, 0, 0, 10.0)]
    run_sparse_replica(model, links, layout, batches[:6])
    first = asyncio.run(shard.export_changed())  # (a checkpoint that then failed elsewhere)
    run_sparse_replica(model, links, layout, batches[6:], start_step=6)
    merged = merge_exports(first, asyncio.run(shard.export_changed()))
    state = asyncio.run(shard.export_state())  # every row ever updated
    assert np.array_equal(merged["tables"][0]["ids"], state["tables"][0]["ids"])
    for key in ("values", "versions", "state/sum_sq"):
        assert np.array_equal(merged["tables"][0][key], state["tables"][0][key])
    assert merged["version"] == shard.version == 12
    # a replacement started from a state saves the rows it was given in its first increment
    lo, hi = layout.dense[0]
    twin = SparseShard(0, lo, hi, state["values"], optim.adagrad(0.1),
                       tables=layout.shard_tables(0), seed=0, restore=state, generation=1)
    again = asyncio.run(twin.export_changed())
    assert np.array_equal(again["tables"][0]["values"], state["tables"][0]["values"])
    assert again["version"] == 12
