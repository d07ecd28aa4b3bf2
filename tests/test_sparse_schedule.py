"""Sparse replicas that fetch every n_fetch steps and push every n_push steps, in-process."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_sparse_ps import click_batches, shards_for, table_of

from downpour_dask import SparseDownpourClassifier
from downpour_dask.core import optim
from downpour_dask.core.sparse import SparseBatch
from downpour_dask.core.sparse_models import EmbeddingMLP, FactorizationMachine
from downpour_dask.core.sparse_serial import SparseState
from downpour_dask.data.hashing import minibatches
from downpour_dask.downpour.sparse_accrual import AccruingReplica
from downpour_dask.downpour.sparse_fit import fit_sparse
from downpour_dask.ps.calls import Done
from downpour_dask.ps.protocol import ShardLostError
from downpour_dask.ps.rows import RowsLink


def reference(model, batches, rule, alpha, k, seed):
    """One replica, one shard, n_fetch = n_push = k, written out: per group of k batches, copy
    the server's dense vector and the group's rows, train the group on the copy (plain SGD at
    ``alpha``, gradients summed), then the server applies the summed gradient once."""
    server = SparseState(model, rule, seed)
    losses = []
    for first in range(0, len(batches), k):
        group = batches[first : first + k]
        ids = np.unique(np.concatenate([model.touched(b)[0] for b in group]))
        dense, rows = server.dense.copy(), server.tables[0].gather(ids).copy()
        summed, summed_rows, group_loss = np.zeros_like(dense), np.zeros_like(rows), 0.0
        for b in group:
            (touched,) = model.touched(b)
            at = np.searchsorted(ids, touched)
            loss, grad, ((_, row_grad),) = model.loss_and_grad(dense, [(touched, rows[at])], b)
            summed += grad
            summed_rows[at] += row_grad
            dense -= np.float32(alpha) * grad
            rows[at] -= np.float32(alpha) * row_grad
            group_loss += loss
        rule.update(server.dense, summed, server.dense_state)
        server.tables[0].apply(ids, summed_rows)
        losses.append(group_loss / len(group))
    return server, losses


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("rule", ["adagrad", "staleness_aware_sgd"])
def test_n_fetch_and_n_push_k_equal_the_serial_reference(k, rule):
    model = EmbeddingMLP(300, 4, n_numeric=2, dim=3, hidden=(6,))
    batches = click_batches(20)  # 20 = 6 * 3 + 2: the last group is short for k = 3
    server, losses = reference(model, batches, optim.make(rule, 0.05), 0.03, k, seed=1)
    layout, shards = shards_for(model, 1, optim.make(rule, 0.05), seed=1)
    replica = AccruingReplica(model, layout, iter(batches), 0, n_fetch=k, n_push=k, alpha=0.03)
    records = replica.run([RowsLink(shards[0], 0, 0, 10.0)])
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    assert [r["step"] for r in records] == [min(s + k, 20) - 1 for s in range(0, 20, k)]
    assert all(r["staleness"] == 0 and r["accepted"] for r in records)
    assert np.allclose(shards[0].values, server.dense, rtol=1e-5, atol=1e-6)
    assert np.allclose(table_of(shards), server.tables[0].values, rtol=1e-5, atol=1e-6)
    assert shards[0].version == len(losses)  # one update per push, not per step
    assert np.array_equal(shards[0].blocks[0].versions, server.tables[0].versions)


def test_a_fetch_pulls_the_union_of_the_next_k_batches_and_a_push_each_touched_row_once():
    model = FactorizationMachine(2000, 4, n_factors=2, n_numeric=2)
    batches = click_batches(11, n=16, n_rows=60)  # few rows: the batches share many
    layout, shards = shards_for(model, 3, optim.adagrad(0.1))
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    replica = AccruingReplica(model, layout, iter(batches), 0, n_fetch=4, n_push=4, alpha=0.1)
    records = replica.run(links)
    groups = [batches[i : i + 4] for i in range(0, 11, 4)]
    unions = [len(np.unique(np.concatenate([b.ids.ravel() for b in g]))) for g in groups]
    assert replica.fetched_rows == unions  # each row once per fetch
    assert unions[0] < sum(len(np.unique(b.ids)) for b in groups[0])  # (rows were shared)
    for step, union in zip((3, 7, 10), unions):
        mine = [r for r in records if r["step"] == step]
        assert len(mine) == 3 and sum(r["rows"] for r in mine) == union
    # every row's version counts the pushes that touched it: once per group, not per batch
    counts = np.zeros(2000, np.int64)
    for g in groups:
        counts[np.unique(np.concatenate([b.ids.ravel() for b in g]))] += 1
    assert np.array_equal(np.concatenate([s.blocks[0].versions for s in shards]), counts)
    assert [s.version for s in shards] == [3, 3, 3]


@pytest.mark.parametrize(("n_fetch", "n_push"), [(3, 2), (1, 4), (4, 1), (2, 5)])
def test_any_schedule_with_plain_sgd_at_the_local_rate_ends_where_serial_sgd_does(n_fetch, n_push):
    # every update is the same whoever applies it, so the shards end where one serial SGD pass
    # ends only if a fetch re-applies the gradient not pushed yet and each row is pushed once
    model = FactorizationMachine(200, 4, n_factors=2, n_numeric=2)
    batches = click_batches(12, n_rows=200)
    layout, shards = shards_for(model, 2, optim.sgd(0.1))
    links = [RowsLink(s, i, 0, 10.0) for i, s in enumerate(shards)]
    replica = AccruingReplica(model, layout, iter(batches), 0, n_fetch=n_fetch, n_push=n_push,
                              alpha=0.1)
    records = replica.run(links)
    serial = SparseState(model, optim.sgd(0.1))
    for b in batches:
        serial.step(b)
    assert np.allclose(np.concatenate([s.values for s in shards]), serial.dense, atol=1e-5)
    assert np.allclose(table_of(shards), serial.tables[0].values, atol=1e-5)
    assert len(replica.fetched_rows) == -(-12 // n_fetch)
    pushed = sorted({r["step"] for r in records})
    assert pushed == sorted({*range(n_push - 1, 12, n_push), 11})
    if (n_fetch, n_push) == (3, 2):  # fetches before steps 0, 3, 6, 9; pushes after 1, 3, 5...
        # a push counts as staleness the replica's own push since the fetch its accrual
        # started from, as the dense loop's does
        staleness = {r["step"]: r["staleness"] for r in records if r["shard"] == 0}
        assert staleness == {1: 0, 3: 1, 5: 1, 7: 0, 9: 1, 11: 1}


def test_max_steps_stops_the_look_ahead_and_a_restart_goes_on_from_its_step():
    model = FactorizationMachine(200, 4, n_factors=2)
    batches = click_batches(10, n_rows=200, numeric=0)
    layout, shards = shards_for(model, 1, optim.adagrad(0.1))
    replica = AccruingReplica(model, layout, iter(batches), 0, n_fetch=4, n_push=2, alpha=0.0,
                              max_steps=5)
    records = replica.run([RowsLink(shards[0], 0, 0, 10.0)])
    assert [r["step"] for r in records] == [1, 3, 4] and replica.fetched_rows[1] == len(
        np.unique(batches[4].ids))  # the second fetch looked ahead one batch only
    again = AccruingReplica(model, layout, iter(batches[5:]), 0, n_fetch=4, n_push=2,
                            alpha=0.0, start_step=5)
    more = again.run([RowsLink(shards[0], 0, 0, 10.0)])
    assert [r["step"] for r in more] == [6, 8, 9] and shards[0].version == 6


@pytest.mark.parametrize("name", ["n_fetch", "n_push"])
@pytest.mark.parametrize(("value", "error", "match"), [
    (0, ValueError, "must be >= 1, got 0"),
    (1.5, TypeError, r"must be an int, got 1.5"),
])
def test_bad_n_fetch_or_n_push_is_refused_before_any_work(name, value, error, match):
    model = FactorizationMachine(200, 4, n_factors=2)
    data = click_batches(1, n_rows=200, numeric=0)[0]
    with pytest.raises(error, match=f"{name} {match}"):
        fit_sparse(model, data, client=None, **{name: value})
    with pytest.raises(ValueError, match="local_learning_rate must be a finite number >= 0"):
        fit_sparse(model, data, client=None, local_learning_rate=-1.0)
    frame = pd.DataFrame({"c": ["a", "b"]})
    with pytest.raises(error, match=f"{name} {match}"):
        SparseDownpourClassifier(categorical=["c"], **{name: value}).fit(frame, [0, 1])


def test_on_the_cluster_n_fetch_and_n_push_3_equal_the_reference(client):
    model = EmbeddingMLP(300, 4, n_numeric=2, dim=3, hidden=(6,))
    data = SparseBatch(*(np.concatenate(parts) for parts in zip(*click_batches(10))))
    fit = fit_sparse(model, data, client=client, learning_rate=0.05, batch_size=32, seed=2,
                     n_fetch=3, n_push=3, local_learning_rate=0.02, timeout=60)
    try:
        batches = list(minibatches(data, 32, np.random.default_rng([2, 0])))
        server, losses = reference(model, batches, optim.adagrad(0.05), 0.02, 3, seed=2)
        assert fit.pushes["loss"].tolist() == pytest.approx(losses, rel=1e-5)
        dense, (table,) = fit.state()
        assert np.allclose(dense, server.dense, rtol=1e-5, atol=1e-6)
        assert np.allclose(table, server.tables[0].values, rtol=1e-5, atol=1e-6)
        assert fit.events.empty  # nothing failed
    finally:
        fit.close()


class LosingLink(RowsLink):
    """A link whose ``lose_at``-th push finds its shard lost (the push never arrives)."""

    def __init__(self, *args, lose_at):
        super().__init__(*args)
        self.lose_at, self.pushes = lose_at, 0

    def push(self, *args, **kw):
        self.pushes += 1
        if self.pushes == self.lose_at:
            return Done(error=OSError("connection to the shard's worker lost"))
        return super().push(*args, **kw)


def test_after_a_lost_shard_the_replica_goes_on_with_the_batches_it_had_not_pushed():
    model = FactorizationMachine(200, 4, n_factors=2)
    batches = click_batches(9, n_rows=200, numeric=0)
    layout, shards = shards_for(model, 1, optim.adagrad(0.1))
    replica = AccruingReplica(model, layout, iter(batches), 0, n_fetch=3, n_push=3, alpha=0.1)
    with pytest.raises(ShardLostError, match="shard 0 was lost"):
        replica.run([LosingLink(shards[0], 0, 0, 10.0, lose_at=2)])
    assert replica.step == 6 and shards[0].version == 1  # the second push was lost
    records = replica.run([RowsLink(shards[0], 0, 0, 10.0)])  # (the shard's replacement)
    assert [r["step"] for r in records] == [2, 8] and shards[0].version == 2
    assert replica.fetched_rows[-1] == len(np.unique(np.concatenate(
        [b.ids.ravel() for b in batches[6:]])))  # the third fetch: nothing skipped or repeated
