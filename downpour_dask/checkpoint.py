"""Checkpoints of the parameter server: every shard's values, update-rule state and version.

A checkpoint root directory holds numbered checkpoints and a ``LATEST`` file naming the newest
complete one::

    <root>/LATEST                 "ckpt-000007" (replaced atomically: temp file + rename)
    <root>/ckpt-000007/
        checkpoint.json           versions, ranges, counters, time, sha256 of every shard file,
                                  the experiment log so far (evaluations and events), and the
                                  sha256 of all that (so an edited manifest is refused too)
        shard-0.npz ...           values and update-rule state arrays (allow_pickle=False)

A new checkpoint is written to a temporary directory, renamed to its numbered name and only then
published by replacing ``LATEST``; the previous one is deleted afterwards.  Every file is
fsynced before it is renamed, and every directory after an entry in it was created or renamed,
so a power loss cannot publish a checkpoint whose files did not reach the disk.  A driver killed
at any moment therefore leaves the previous complete checkpoint readable.  :func:`read_checkpoint`
checks everything (files present, checksums, shapes, dtypes, contiguous ranges) before it returns
anything, so a corrupt or truncated checkpoint is an error naming the file, never loaded halfway.
Only JSON and ``.npz`` files without pickles are read: loading a checkpoint never executes code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 2  # 2: checkpoint.json carries its own sha256
LATEST = "LATEST"
MANIFEST = "checkpoint.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt (the message names the file)."""


@dataclass
class ShardState:
    """Everything needed to recreate one parameter-server shard.

    Attributes
    ----------
    shard, start, stop : int
        Shard index and the element range ``[start, stop)`` it owns.
    values : ndarray
        float32 values of that range.
    rule_state : dict of str to ndarray
        The update rule's state (e.g. Adagrad's ``sum_sq``), as made by ``rule.init``.
    version : int
        Updates the shard had applied.
    counters : dict
        JSON-serialisable counters (examples, accepted pushes per replica, ...).
    """

    shard: int
    start: int
    stop: int
    values: np.ndarray
    rule_state: dict[str, np.ndarray]
    version: int
    counters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A checkpoint read back: shard states, seconds since the run started, and metadata."""

    path: Path
    shards: list[ShardState]
    elapsed: float
    meta: dict[str, Any]

    @property
    def versions(self) -> list[int]:
        """Each shard's version."""
        return [s.version for s in self.shards]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's content (without its ``sha256`` entry), as canonical JSON."""
    content = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    root: str | os.PathLike[str],
    shards: list[ShardState],
    elapsed: float,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write a new checkpoint under ``root`` atomically and return its directory.

    Parameters
    ----------
    root : path
        The checkpoint root (created if needed).
    shards : list of ShardState
        One per shard, in shard order.
    elapsed : float
        Seconds since the run started (a resumed run continues its time axis from here).
    meta : dict, optional
        JSON-serialisable extras (configuration, the experiment log so far).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    previous = _latest_name(root)
    # past every numbered directory: one renamed into place but never published (its writer
    # was killed before LATEST named it) keeps its number until the next publish removes it
    numbers = [int(p.name[5:]) for p in root.glob("ckpt-*") if p.name[5:].isdigit()]
    number = max([int(previous.split("-")[1]) if previous else -1, *numbers]) + 1
    name = f"ckpt-{number:06d}"
    staging = Path(tempfile.mkdtemp(prefix=".ckpt-tmp-", dir=root))
    try:
        entries = []
        for s in shards:
            file = f"shard-{s.shard}.npz"
            arrays = {"values": np.ascontiguousarray(s.values, dtype=np.float32)}
            arrays.update({f"state.{k}": np.asarray(v) for k, v in s.rule_state.items()})
            with open(staging / file, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            entries.append(
                {
                    "shard": int(s.shard),
                    "start": int(s.start),
                    "stop": int(s.stop),
                    "version": int(s.version),
                    "file": file,
                    "sha256": _sha256(staging / file),
                    "state": {
                        k: [str(np.asarray(v).dtype), list(np.shape(v))]
                        for k, v in s.rule_state.items()
                    },
                    "counters": s.counters,
                }
            )
        manifest = {
            "format": FORMAT,
            "written": time.time(),
            "elapsed": float(elapsed),
            "shards": entries,
            "meta": meta or {},
        }
        # as it will read back (numpy scalars, tuples and int keys become JSON's), then sealed
        manifest = json.loads(json.dumps(manifest, default=_json_default))
        manifest["sha256"] = _digest(manifest)
        _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_directory(staging)
        os.replace(staging, root / name)
        _fsync_directory(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    pointer = root / f".{LATEST}.tmp"
    _write_durably(pointer, name)
    os.replace(pointer, root / LATEST)  # the new checkpoint is published only now
    _fsync_directory(root)
    for old in root.glob("ckpt-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return root / name


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not name.startswith("ckpt-") or not name[5:].isdigit():
        raise CheckpointError(f"{str(root / LATEST)!r} does not name a checkpoint: {name[:40]!r}")
    return name


def has_checkpoint(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds a published checkpoint (not checking that it is intact)."""
    return (Path(root) / LATEST).is_file()


def read_checkpoint(root: str | os.PathLike[str]) -> Checkpoint:
    """Read and fully validate the latest checkpoint under ``root``.

    Raises
    ------
    CheckpointError
        If there is no checkpoint, or a file is missing, truncated, altered (checksum) or holds
        arrays of the wrong shape or dtype; the message names the file.
    """
    root = Path(root)
    name = _latest_name(root)
    if name is None:
        raise CheckpointError(f"no checkpoint in {str(root)!r} (no {LATEST} file)")
    directory = root / name
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"cannot read checkpoint manifest {str(manifest_path)!r}: {err}"
        ) from None
    try:
        if manifest["format"] != FORMAT:
            raise CheckpointError(
                f"{str(manifest_path)!r} has format {manifest['format']!r}; this version reads "
                f"format {FORMAT}"
            )
        if manifest.get("sha256") != _digest(manifest):
            raise CheckpointError(
                f"{str(manifest_path)!r} was altered or damaged after it was written (its content "
                f"does not match its sha256); refusing to resume from it"
            )
        entries = manifest["shards"]
        elapsed = float(manifest["elapsed"])
        meta = dict(manifest.get("meta") or {})
        shards = [_read_shard(directory, entry) for entry in entries]
    except (KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{str(manifest_path)!r} is incomplete or malformed: {err!r}"
        ) from None
    if not shards:
        raise CheckpointError(f"{str(manifest_path)!r} lists no shards")
    expected = 0
    for i, s in enumerate(shards):
        if s.shard != i or s.start != expected or s.stop <= s.start:
            raise CheckpointError(
                f"{str(manifest_path)!r}: shard ranges are not contiguous at shard {i}"
            )
        expected = s.stop
    return Checkpoint(directory, shards, elapsed, meta)


def _read_shard(directory: Path, entry: dict[str, Any]) -> ShardState:
    path = directory / entry["file"]
    if Path(entry["file"]).name != entry["file"]:
        raise CheckpointError(f"checkpoint names a file outside its directory: {entry['file']!r}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is corrupt or truncated (sha256 mismatch)"
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {err}") from None
    size = int(entry["stop"]) - int(entry["start"])
    values = arrays.get("values")
    if values is None or values.dtype != np.float32 or values.shape != (size,):
        got = None if values is None else f"{values.dtype}{values.shape}"
        raise CheckpointError(
            f"checkpoint file {str(path)!r}: values must be float32 of shape ({size},), got {got}"
        )
    rule_state = {}
    for key, (dtype, shape) in entry["state"].items():
        arr = arrays.get(f"state.{key}")
        if arr is None or str(arr.dtype) != dtype or list(arr.shape) != list(shape):
            raise CheckpointError(
                f"checkpoint file {str(path)!r}: update-rule state {key!r} is missing or has the "
                f"wrong shape/dtype"
            )
        rule_state[key] = arr
    return ShardState(
        int(entry["shard"]),
        int(entry["start"]),
        int(entry["stop"]),
        values,
        rule_state,
        int(entry["version"]),
        dict(entry.get("counters") or {}),
    )


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"checkpoint metadata of type {type(obj).__name__} is not JSON-serialisable")
