"""A sparse fit that adds a replica on a worker that joins (``downpour/sparse_growth.py``), in
process: the new replica's share of the data, the smaller shares of the others and the epochs
they read, with fakes for the cluster and the shards; ``n_replicas="auto"`` on the shared
cluster.  ``tests/test_elastic_cluster.py`` runs a join on a real cluster that grows."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd
import pytest

from downpour_dask.core.sparse import SparseBatch
from downpour_dask.core.sparse_models import SparseLogisticRegression
from downpour_dask.data.hashing import HashSpec, count_rows
from downpour_dask.downpour import registry
from downpour_dask.downpour.sparse_fit import fit_sparse
from downpour_dask.downpour.sparse_growth import SparseGrowth
from downpour_dask.downpour.sparse_replicas import SparseTasks
from downpour_dask.downpour.sparse_task import _batches

RUN = "t-sparse-growth"


def _rows(start: int, n: int) -> SparseBatch:
    """Rows whose first (and only) id is a global row number."""
    ids = np.arange(start, start + n, dtype=np.int64)[:, None]
    return SparseBatch(np.zeros((n, 0), np.float32), ids, np.zeros(n, np.int64))


def _read(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch.ids[:, 0]]


class FakeTask:
    def __init__(self, key: str):
        self.key, self.status = key, "pending"


class FakeCluster:
    run = RUN

    def __init__(self):
        self.assigned: list[tuple[str, int, np.ndarray]] = []
        self.scattered: list[str] = []

    def assign_share(self, worker: str, replica: int, positions: np.ndarray) -> None:
        self.assigned.append((worker, replica, positions))
        registry.assign_share(RUN, replica, positions)  # (this process is every "worker")

    def scatter(self, values: list[Any], worker: str) -> list[Any]:
        self.scattered.append(worker)
        return [values[0]]


class FakeServer:
    def __init__(self, examples: int, accepted: int):
        self.status = {"examples": examples, "accepted": accepted}

    def shard_status(self, shard: int, timeout: float) -> dict[str, Any]:
        return dict(self.status)


def _growth(data: list[Any], in_memory: bool, examples: int = 0, accepted: int = 0, **limits):
    cluster, submitted = FakeCluster(), []

    def start(replica, part, step, worker, key):
        submitted.append((replica, part, step, worker))
        return FakeTask(key)

    replicas = SparseTasks(cluster, start, list(data), list(data) if in_memory else None,
                           ["w0", "w1"], n_shards=1)
    settings = dict(n_rows=0, max_epochs=4, max_steps=None, n_push=1, timeout=1.0)
    settings.update(limits)
    growth = SparseGrowth(cluster, FakeServer(examples, accepted), replicas, data, 0, **settings)
    return growth, replicas, cluster, submitted


def test_a_joined_replica_gets_a_third_of_each_share_and_the_rest_of_the_epochs():
    registry.forget_run(RUN)
    data = [_rows(0, 30), _rows(30, 30)]
    growth, replicas, cluster, submitted = _growth(data, True, examples=90, n_rows=60)
    assert growth.add(2, "w2", 3) == 20
    replica, part, step, worker = submitted[-1]
    assert (replica, step, worker) == (2, 0, "w2") and cluster.scattered[-1] == "w2"
    assert replicas.slots[-1] == (2, 0) and replicas.workers[-1] == "w2"
    # 1.5 epochs done of 4: the newcomer trains the 3 the others have begun or have left
    assert growth.limits_of(2) == (3, None) and growth.limits_of(0) == (4, None)
    assert [(w, r) for w, r, _ in cluster.assigned] == [("w0", 0), ("w1", 1)]
    # from their next epoch every row is read once an epoch across the three replicas
    old = [_read(_batches(d, r, 7, 1, 0, lambda r=r: registry.assigned_share(RUN, r)))
           for r, d in enumerate(data)]
    new = _read(_batches(part, 2, 7, 1, 0))
    assert Counter(old[0] + old[1] + new) == Counter(range(60)) and len(new) == 20
    registry.forget_run(RUN)


def test_a_replica_restarted_elsewhere_takes_its_smaller_share_along():
    registry.forget_run(RUN)
    growth, replicas, cluster, submitted = _growth([_rows(0, 30), _rows(30, 30)], True,
                                                   n_rows=60)
    growth.add(2, "w2", 3)
    kept = dict((r, positions) for _, r, positions in cluster.assigned)
    cluster.assigned.clear()
    replicas.resume_replica(0, ["w3"], 12)  # its worker died: the supervisor moves it
    [(worker, replica, positions)] = cluster.assigned
    assert (worker, replica) == ("w3", 0) and list(positions) == list(kept[0])
    assert submitted[-1][0] == 0 and submitted[-1][2:] == (12, "w3")
    registry.forget_run(RUN)


def test_an_added_replica_whose_worker_died_restarts_elsewhere_with_its_own_rows():
    growth, replicas, cluster, submitted = _growth([_rows(0, 30), _rows(30, 30)], True,
                                                   n_rows=60)
    growth.add(2, "w2", 3)
    given = submitted[-1][1]
    replicas.resume_replica(2, ["w0"], 7)  # the supervisor's crash path
    replica, part, step, worker = submitted[-1]
    assert (replica, step, worker) == (2, 7, "w0") and cluster.scattered[-1] == "w0"
    assert list(part.ids[:, 0]) == list(given.ids[:, 0])  # its 20 rows, sent again


def test_the_others_read_their_smaller_share_from_their_next_epoch():
    registry.forget_run(RUN)
    batches = _batches(_rows(0, 20), 0, 5, 2, 0, lambda: registry.assigned_share(RUN, 0))
    first = _read([next(batches)])
    registry.assign_share(RUN, 0, np.arange(8))  # the driver re-splits mid-epoch
    read = first + _read(batches)
    assert sorted(read[:20]) == list(range(20))  # the epoch under way reads all its rows
    assert sorted(read[20:]) == list(range(8))  # the next one its share only
    registry.forget_run(RUN)


def test_a_replica_streaming_files_skips_the_files_it_gave_away_not_yet_opened(tmp_path):
    registry.forget_run(RUN)
    spec = HashSpec(numeric=[], categorical=["c"], n_rows=50, label="label")
    paths = []
    for i in range(4):
        frame = pd.DataFrame({"c": [f"f{i}-{j}" for j in range(10)], "label": 0})
        paths.append(str(tmp_path / f"part-{i}.parquet"))
        frame.to_parquet(paths[-1])
    assert count_rows(paths, spec) == 40
    batches = _batches((paths, spec), 0, 10, 1, 0, lambda: registry.assigned_share(RUN, 0))
    first = next(batches)  # a file of 10 rows: one batch each
    opened = _file_of(first, paths, spec)
    kept = next(i for i in range(4) if i != opened)
    registry.assign_share(RUN, 0, np.array([opened, kept]))  # the driver re-splits
    assert [_file_of(batch, paths, spec) for batch in batches] == [kept]
    registry.forget_run(RUN)


def _file_of(batch: SparseBatch, paths: list[str], spec: HashSpec) -> int:
    """Which of ``paths`` the rows of ``batch`` came from (each file hashes to its own ids)."""
    for i, path in enumerate(paths):
        whole = next(_batches(([path], spec), 0, 100, 1, 0))
        if set(whole.ids[:, 0]) >= set(batch.ids[:, 0]):
            return i
    raise AssertionError("the batch came from no file")


def test_with_one_file_per_replica_no_replica_is_added(tmp_path):
    spec = HashSpec(numeric=[], categorical=["c"], n_rows=50, label="label")
    data = [([str(tmp_path / "a.parquet")], spec), ([str(tmp_path / "b.parquet")], spec)]
    growth, replicas, cluster, submitted = _growth(data, False)
    assert growth.add(2, "w2", 3) is None
    assert len(replicas.tasks) == 2 and len(submitted) == 2 and cluster.assigned == []


def test_a_streaming_newcomer_gets_files_and_the_steps_the_others_have_left(tmp_path):
    spec = HashSpec(numeric=[], categorical=["c"], n_rows=50, label="label")
    paths = []
    for i in range(6):
        paths.append(str(tmp_path / f"part-{i}.parquet"))
        pd.DataFrame({"c": [str(j) for j in range(5)], "label": 0}).to_parquet(paths[-1])
    data = [(paths[0::2], spec), (paths[1::2], spec)]
    growth, replicas, cluster, submitted = _growth(data, False, accepted=40, max_epochs=None,
                                                   max_steps=50)
    assert growth.add(2, "w2", 3) == 10  # a file of each (5 rows each)
    files, given = submitted[-1][1]
    assert given is spec and len(files) == 2 and cluster.scattered == []
    kept = [p for _, r, positions in cluster.assigned for p in np.array(data[r][0])[positions]]
    assert sorted(files + kept) == sorted(paths)  # every file read by one replica
    assert growth.limits_of(2) == (None, 30)  # 40 pushes of 2 replicas: 20 steps each done


def test_max_replicas_below_n_replicas_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="max_replicas must be >= 3, got 2"):
        fit_sparse(object(), _rows(0, 4), client=None, n_replicas=3, max_replicas=2)


def test_auto_starts_a_replica_per_worker_and_at_most_one_per_file(
    client, tmp_path, no_cycle_collector
):
    """The shared cluster has two workers: ``"auto"`` starts two replicas on in-memory data,
    one on a single file.  The replicas' tasks and data go when the fit returns, not only
    when the cycle collector runs (a fit that can grow once held them in a reference cycle,
    and with them the data on the workers)."""
    model = SparseLogisticRegression(64, 1)
    fit = fit_sparse(model, _rows(0, 64), client=client, n_replicas="auto", batch_size=16,
                     timeout=60)
    fit.close()
    assert fit.n_replicas == 2 and set(fit.pushes["replica"]) == {0, 1}
    assert not [o for o in gc.get_objects() if isinstance(o, (SparseTasks, SparseGrowth))]
    spec = HashSpec(numeric=[], categorical=["c"], n_rows=64, label="label")
    path = str(tmp_path / "one.parquet")
    pd.DataFrame({"c": [str(j) for j in range(40)], "label": [0, 1] * 20}).to_parquet(path)
    fit = fit_sparse(model, ([path], spec), client=client, n_replicas="auto", batch_size=16,
                     timeout=60)
    fit.close()
    assert fit.n_replicas == 1 and set(fit.pushes["replica"]) == {0}


def test_n_replicas_is_a_count_or_auto():
    with pytest.raises(ValueError, match="n_replicas must be an integer >= 1 or 'auto'"):
        fit_sparse(object(), _rows(0, 4), client=None, n_replicas="all")
