"""The one place that splits data among replicas (downpour_dask.data.assignment), in-process.

In-memory rows, file shards and Dask partitions held by workers: every row goes to exactly one
replica, replicas get contiguous ranges balanced to one row, and too little data is refused with
an error naming ``n_replicas``.
"""

from __future__ import annotations

import numpy as np
import pytest

from downpour_dask.data.assignment import (
    assign_partitions,
    assign_shards,
    replica_quotas,
    split_rows,
)
from downpour_dask.data.schema import Shard


@pytest.mark.parametrize("n_rows,n_replicas", [(10, 3), (7, 7), (1000, 6), (5, 1)])
def test_row_split_is_contiguous_balanced_and_covers_every_row_once(n_rows, n_replicas):
    ranges = split_rows(n_rows, n_replicas)
    assert len(ranges) == n_replicas
    assert ranges[0][0] == 0 and ranges[-1][1] == n_rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_too_few_rows_for_the_replicas_is_an_error_naming_n_replicas():
    with pytest.raises(ValueError, match=r"each of 4 replicas .* only 3 rows; use n_replicas <= 3"):
        split_rows(3, 4)
    with pytest.raises(ValueError, match=r"only 2 rows; use n_replicas <= 2"):
        assign_shards([Shard("parquet", "a", 0, 1), Shard("parquet", "b", 0, 1)], 3)
    with pytest.raises(ValueError, match=r"Dask collection has only 5 rows; use n_replicas <= 5"):
        assign_partitions([Shard("frame", "p0", 0, 5, part=0)], {0: "w"}, 6)
    with pytest.raises(ValueError, match="n_replicas must be >= 1, got 0"):
        split_rows(3, 0)


@pytest.mark.parametrize(
    "sizes,n_replicas",
    [([300], 4), ([40, 40, 40, 40, 40], 2), ([500, 7, 60, 3, 130], 3), ([5, 5], 10)],
    ids=["fewer-files", "more-files", "uneven", "tiny-files"],
)
def test_assignment_balances_rows_and_covers_every_row_once(sizes, n_replicas):
    shards = [Shard("parquet", f"f{i}", 0, n) for i, n in enumerate(sizes)]
    plan = assign_shards(shards, n_replicas)
    per_replica = [sum(s.rows for s in mine) for mine in plan]
    assert max(per_replica) - min(per_replica) <= 1
    covered = {i: np.zeros(n, int) for i, n in enumerate(sizes)}
    for mine in plan:
        for s in mine:
            covered[int(s.path[1:])][s.start : s.stop] += 1
    assert all((c == 1).all() for c in covered.values())
    assert sum(len(mine) for mine in plan) <= len(sizes) + n_replicas - 1  # few splits
    with pytest.raises(ValueError, match=f"only {sum(sizes)} rows"):
        assign_shards(shards, sum(sizes) + 1)


def test_shard_assignment_keeps_row_ranges_inside_a_file_and_its_order():
    shards = [Shard("npy", "X0.npy", 100, 160, y_path="y0.npy"), Shard("npy", "X1.npy", 0, 40)]
    plan = assign_shards(shards, 2)
    assert plan == [
        [Shard("npy", "X0.npy", 100, 150, y_path="y0.npy")],
        [Shard("npy", "X0.npy", 150, 160, y_path="y0.npy"), Shard("npy", "X1.npy", 0, 40)],
    ]


def test_replica_quotas_follow_the_rows_each_worker_holds():
    assert replica_quotas({"a": 600, "b": 300, "c": 100}, 10) == {"a": 6, "b": 3, "c": 1}
    assert replica_quotas({"a": 50, "b": 50}, 3) in ({"a": 2, "b": 1}, {"a": 1, "b": 2})
    quotas = replica_quotas({"a": 1, "b": 99}, 3)
    assert quotas == {"a": 0, "b": 3}  # never more replicas than rows; few rows may get none
    for rows, n in [({"a": 7, "b": 3, "c": 5}, 4), ({"a": 2, "b": 2}, 4)]:
        quotas = replica_quotas(rows, n)
        assert sum(quotas.values()) == n and all(quotas[w] <= rows[w] for w in rows)


def _partitions(sizes: list[int]) -> list[Shard]:
    return [Shard("frame", f"p{i}", 0, n, part=i) for i, n in enumerate(sizes)]


def _rows_seen(shares, shards: list[Shard]) -> dict[int, np.ndarray]:
    """How often each row of each partition is read, from the replicas' local part indices."""
    seen = {s.part: np.zeros(s.rows, int) for s in shards}
    for share in shares:
        for s in share.shards:
            seen[share.parts[s.part]][s.start : s.stop] += 1
    return seen


@pytest.mark.parametrize(
    "sizes,holders,n_replicas",
    [
        ([100, 100, 100, 100], ["a", "b", "a", "b"], 4),
        ([250, 50, 120, 80], ["a", "a", "b", "b"], 3),
        ([10, 990], ["a", "b"], 5),  # a holds too little for a replica of its own
        ([33, 33, 34], ["a", "b", "c"], 7),
    ],
)
def test_partitions_are_split_among_replicas_on_the_workers_holding_them(
    sizes, holders, n_replicas
):
    shards = _partitions(sizes)
    held = dict(enumerate(holders))
    shares = assign_partitions(shards, held, n_replicas)
    assert len(shares) == n_replicas
    assert all((c == 1).all() for c in _rows_seen(shares, shards).values())  # each row once
    for share in shares:
        assert list(share.parts) == sorted(set(share.parts))
        assert {s.part for s in share.shards} == set(range(len(share.parts)))  # local indices
    by_worker: dict[str, list[int]] = {}
    for share in shares:
        by_worker.setdefault(share.worker, []).append(sum(s.rows for s in share.shards))
    assert all(max(r) - min(r) <= 1 for r in by_worker.values())  # balanced on each worker
    quotas = replica_quotas(
        {w: sum(n for n, h in zip(sizes, holders) if h == w) for w in dict.fromkeys(holders)},
        n_replicas,
    )
    assert {w: len(r) for w, r in by_worker.items()} == {w: q for w, q in quotas.items() if q}
    for share in shares:  # a replica reads where its data is, unless its worker has no replica
        local = [p for p in share.parts if held[p] == share.worker]
        assert local or quotas[held[share.parts[0]]] == 0


def test_a_workers_partitions_without_a_replica_go_to_the_least_loaded_worker():
    shards = _partitions([2, 600, 290])
    shares = assign_partitions(shards, {0: "small", 1: "big", 2: "mid"}, 3)
    assert sorted(s.worker for s in shares) == ["big", "big", "mid"]
    (mid,) = [s for s in shares if s.worker == "mid"]
    assert list(mid.parts) == [0, 2]  # mid's one replica had 290 rows, big's two 300 each
    assert sum(s.rows for s in mid.shards) == 292
