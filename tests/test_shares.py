"""Re-splitting a running fit's data when a replica joins (``downpour/shares.py``), in-process:
every row (every file) is read once per epoch across the replicas after the re-split.

The "driver" here is a :class:`DataShares` and a dict standing for the workers' registries; the
replicas are the real batch sources a replica task iterates over.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from downpour_dask import datasets
from downpour_dask.data.stream import ArraySource, ShardStream, replica_spec
from downpour_dask.downpour import registry
from downpour_dask.downpour.shares import DataShares, SharedSource, shared_source


def _ids(source, seed: int = 0) -> list[int]:
    """Row ids (column 0) of one epoch of ``source``."""
    rng = np.random.default_rng(seed)
    return [int(v) for X, _ in source.epoch(rng) for v in X[:, 0]]


def _subsets(sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """In-memory subsets whose first feature is a global row id."""
    out, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n, dtype=np.float32)
        out.append((np.stack([ids, np.ones(n, np.float32)], axis=1), np.zeros(n, np.int64)))
        start += n
    return out


def test_in_memory_each_row_is_read_once_per_epoch_across_replicas_after_joins():
    subsets = _subsets([37, 41])
    shares = DataShares(list(subsets), seed=5)
    assigned: dict[int, np.ndarray] = {}  # what the driver sent each replica's worker
    sources = {r: SharedSource(ArraySource(X, y, 4), lambda r=r: assigned.get(r))
               for r, (X, y) in enumerate(subsets)}  # fmt: skip
    before = Counter(i for s in sources.values() for i in _ids(s))
    assert set(before.values()) == {1} and len(before) == 78  # two replicas, each its own rows

    for new, sharing in ((2, [0, 1]), (3, [0, 1, 2])):  # two workers join, one after the other
        data, changed = shares.add(new, sharing)
        assigned.update(changed)
        sources[new] = SharedSource(ArraySource(*data, 4), lambda r=new: assigned.get(r))
        seen = Counter(i for s in sources.values() for i in _ids(s, seed=new))
        assert set(seen.values()) == {1} and len(seen) == 78, "a row read twice or not at all"
        counts = [shares.rows(r) for r in sources]
        assert sum(counts) == 78 and max(counts) - min(counts) <= 3  # fair shares
    assert shares.positions(3) is None and len(shares.positions(0)) < 37


def test_a_replica_reads_its_smaller_share_from_its_next_epoch_not_in_the_middle_of_one():
    (X, y), = _subsets([40])  # fmt: skip
    registry.forget_run("t-shares")
    source = shared_source(ArraySource(X, y, 5), "t-shares", 0)
    batches = source.epoch(np.random.default_rng(0))
    first = next(batches)[0][:, 0].copy()
    registry.assign_share("t-shares", 0, np.arange(10))  # the driver re-splits mid-epoch
    rest = [int(v) for Xb, _ in batches for v in Xb[:, 0]]
    assert len(first) + len(rest) == 40  # the epoch under way finishes on all its rows
    assert sorted(_ids(source)) == list(range(10))  # the next one reads the share only
    registry.forget_run("t-shares")
    assert registry.assigned_share("t-shares", 0) is None


def test_streamed_files_not_yet_read_go_to_the_joined_replica_only(tmp_path):
    paths, start, rows = [], 0, 400
    # six files of 400 rows, ids 0..2399: a replica reads ahead less than a file (its shuffle
    # buffer of 20 rows and up to 32 batches of 5)
    for i in range(6):
        frame = pd.DataFrame({"rid": np.arange(start, start + rows, dtype=np.float32), "f": 1.0})
        frame["label"] = 0
        paths.append(str(tmp_path / f"part-{i}.csv"))
        frame.to_csv(paths[-1], index=False)
        start += rows
    data = datasets.from_csv(paths, shuffle_buffer=20)
    specs = [replica_spec(data, data.shards[:3], 5, 2), replica_spec(data, data.shards[3:], 5, 2)]
    shares = DataShares(specs, seed=1)
    assigned: dict[int, np.ndarray] = {}
    old = {r: SharedSource(ShardStream(spec), lambda r=r: assigned.get(r))
           for r, spec in enumerate(specs)}  # fmt: skip
    # replica 0 is in the middle of its epoch: it read its first batch (of its first file)
    batches = old[0].epoch(np.random.default_rng(3))
    read = [int(v) for v in next(batches)[0][:, 0]]
    spec, changed = shares.add(2, [0, 1])
    assigned.update(changed)
    assert len(spec.shards) == 2 and {len(v) for v in changed.values()} == {2}
    read += [int(v) for Xb, _ in batches for v in Xb[:, 0]]
    read += _ids(old[1]) + _ids(SharedSource(ShardStream(spec), lambda: None))
    files = Counter(i // rows for i in read)
    # the file replica 0 had opened is read by it, whole, and by the new replica if it got it;
    # every other file exactly once
    opened = read[0] // rows
    twice = {f for f, n in files.items() if n == 2 * rows}
    assert set(files) == set(range(6)) and twice <= {opened}
    assert all(n == rows for f, n in files.items() if f != opened)


def test_a_replica_whose_data_is_not_shared_reads_all_of_it():
    """A fit on a Dask collection shares nothing (``shareable`` is empty: a replica cannot hand
    partitions over); moving one of its replicas asks for its share all the same.  That used to
    raise a bare KeyError and end the fit when a replica's worker retired."""
    shares = DataShares([], seed=0)
    assert shares.positions(0) is None and shares.positions(3) is None
    shares = DataShares(_subsets([4, 4]), seed=0)
    assert shares.positions(1) is None and shares.positions(2) is None  # (2: not in the record)
