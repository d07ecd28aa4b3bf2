"""Checkpoint files: atomic writes, full validation on read, clear errors for damaged files."""

import json

import numpy as np
import pytest

from downpour_dask.base import RunRecorder
from downpour_dask.checkpoint import (
    CheckpointError,
    ShardState,
    has_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from downpour_dask.log import PushRow


def _states(offset: float = 0.0) -> list[ShardState]:
    return [
        ShardState(
            0, 0, 3, np.arange(3, dtype=np.float32) + offset, {"sum_sq": np.ones(3, np.float32)}, 7
        ),
        ShardState(
            1,
            3,
            5,
            np.arange(3, 5, dtype=np.float32) + offset,
            {"sum_sq": np.full(2, 2, np.float32)},
            9,
            {"examples": 640, "accepted_by_replica": {"0": 9}},
        ),
    ]


def test_round_trip_keeps_values_rule_state_versions_and_metadata(tmp_path):
    write_checkpoint(tmp_path, _states(), elapsed=12.5, meta={"evals": [{"time": 1.0}]})
    ck = read_checkpoint(tmp_path)
    assert ck.versions == [7, 9] and ck.elapsed == 12.5 and ck.meta == {"evals": [{"time": 1.0}]}
    np.testing.assert_array_equal(ck.shards[1].values, [3, 4])
    np.testing.assert_array_equal(ck.shards[1].rule_state["sum_sq"], [2, 2])
    assert ck.shards[1].counters["accepted_by_replica"] == {"0": 9}


def test_a_new_checkpoint_replaces_the_previous_one_only_when_complete(tmp_path):
    first = write_checkpoint(tmp_path, _states(), elapsed=1.0)
    second = write_checkpoint(tmp_path, _states(10.0), elapsed=2.0)
    assert first != second and not first.exists()
    assert read_checkpoint(tmp_path).elapsed == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", second.name]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    assert not has_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest", "shape"])
def test_a_corrupt_or_truncated_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    path = write_checkpoint(tmp_path, _states(), elapsed=1.0)
    shard = path / "shard-1.npz"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:50])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    elif damage == "manifest":
        text = (path / "checkpoint.json").read_text()
        (path / "checkpoint.json").write_text(text[: len(text) // 2])
    elif damage == "shape":  # a consistent checksum but arrays that do not match the ranges
        manifest = json.loads((path / "checkpoint.json").read_text())
        manifest["shards"][1]["stop"] = 6
        (path / "checkpoint.json").write_text(json.dumps(manifest))
    name = "checkpoint.json" if damage == "manifest" else "shard-1.npz"
    with pytest.raises(CheckpointError, match=name):
        read_checkpoint(tmp_path)


def test_the_run_log_a_checkpoint_keeps_restores_rows_of_this_and_the_previous_release(tmp_path):
    recorder = RunRecorder("accuracy")
    recorder.event("start", "2 replicas, 2 shards on 2 workers", n_replicas=2)
    recorder.push(PushRow(0.5, 0, 0, 2.3, 16, 0, 1, True))
    recorder.evaluation(version=1, examples_seen=16, loss=2.3, accuracy=0.1)
    meta = recorder.to_json()
    meta["events"].append([1.0, "checkpoint", "versions [1, 1]"])  # the previous release's rows
    meta["pushes"].append([0.6, 1, 0, 2.2, 16, 1, 2, True])  # 8 fields: before partitions
    write_checkpoint(tmp_path, _states(), elapsed=3.0, meta=meta)

    later = RunRecorder("accuracy")
    later.restore(read_checkpoint(tmp_path).meta, elapsed=3.0)
    assert later.elapsed() >= 3.0  # the time axis goes on
    run = later.experiment({})
    assert list(run.events["kind"]) == ["start", "checkpoint"]
    assert list(run.events["data"]) == [{"n_replicas": 2}, {}]
    assert run.pushes["replica"].tolist() == [0, 1] and run.pushes["partition"].tolist() == [0, 0]
    assert run.evals["accuracy"].tolist() == [0.1]
