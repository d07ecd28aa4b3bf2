"""Checkpoint files: atomic writes, full validation on read, clear errors for damaged files."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from downpour_dask import checkpoint
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


def test_a_checkpoint_renamed_but_never_published_does_not_block_the_next(tmp_path):
    """A writer killed between renaming its checkpoint into place and naming it in LATEST
    leaves a complete, unpublished directory; a resumed run's next checkpoint goes past it
    (seen once in a full test run: the resumed run failed with 'Directory not empty')."""
    first = write_checkpoint(tmp_path, _states(), elapsed=1.0)
    unpublished = write_checkpoint(tmp_path / "elsewhere", _states(5.0), elapsed=1.5)
    orphan = tmp_path / f"ckpt-{int(first.name[5:]) + 1:06d}"
    os.replace(unpublished, orphan)
    assert read_checkpoint(tmp_path).elapsed == 1.0  # LATEST still names the first
    third = write_checkpoint(tmp_path, _states(10.0), elapsed=2.0)
    assert third.name > orphan.name and read_checkpoint(tmp_path).elapsed == 2.0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "elsewhere") == [
        "LATEST",
        third.name,
    ]


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
    elif damage == "shape":  # consistent checksums but arrays that do not match the ranges
        manifest = json.loads((path / "checkpoint.json").read_text())
        manifest["shards"][1]["stop"] = 6
        manifest["sha256"] = checkpoint._digest(manifest)  # re-sealed, as a tool would not
        (path / "checkpoint.json").write_text(json.dumps(manifest))
    name = "checkpoint.json" if damage == "manifest" else "shard-1.npz"
    with pytest.raises(CheckpointError, match=name):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["shards"][0].update(version=70),  # "resume as if more updates were in"
        lambda m: m["shards"][1]["counters"].update(examples=1),
        lambda m: m.update(elapsed=0.0),
        lambda m: m["meta"].update(evals=[]),
        lambda m: m.pop("sha256"),
    ],
    ids=["version", "counters", "elapsed", "meta", "no checksum"],
)
def test_an_edited_manifest_is_refused_naming_it(tmp_path, edit):
    """The shard files' checksums are in checkpoint.json; its own content is checksummed too,
    so a hand edit (or a damaged byte that still parses) is not resumed from."""
    path = write_checkpoint(tmp_path, _states(), elapsed=1.0, meta={"evals": [{"time": 1.0}]})
    manifest = json.loads((path / "checkpoint.json").read_text())
    edit(manifest)
    (path / "checkpoint.json").write_text(json.dumps(manifest, indent=1))
    with pytest.raises(CheckpointError, match=r"checkpoint\.json.*altered or damaged"):
        read_checkpoint(tmp_path)


def test_a_checkpoint_of_the_previous_format_is_refused_with_the_format_named(tmp_path):
    path = write_checkpoint(tmp_path, _states(), elapsed=1.0)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["format"] = 1
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="has format 1; this version reads format 2"):
        read_checkpoint(tmp_path)


def test_files_and_directories_are_fsynced_before_latest_names_them(tmp_path, monkeypatch):
    """Durability, in order: shard files and the manifest, the checkpoint directory, the root
    (its rename), the LATEST pointer, the root again (LATEST's rename)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = write_checkpoint(tmp_path, _states(), elapsed=1.0)
    root = str(tmp_path)
    names = [Path(p).name if p.startswith(root + "/") else p for p in synced]
    staged = [n for n in names if n.startswith("checkpoint.json") or n.startswith("shard-")]
    assert sorted(staged) == ["checkpoint.json", "shard-0.npz", "shard-1.npz"]
    tail = [n if n != root else "<root>" for n in names[3:]]
    assert tail[0].startswith(".ckpt-tmp-")  # the staging directory, before its rename
    assert tail[1:] == ["<root>", ".LATEST.tmp", "<root>"]
    assert (tmp_path / "LATEST").read_text() == path.name


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
