"""Incremental checkpoints of sparse tables, restorable into any number of shards.

A sparse model's tables may hold billions of values of which a checkpoint interval changes a
few, so each checkpoint stores only the rows changed since the previous one
(:meth:`~downpour_dask.ps.table.SparseShard.export_changed`), plus the small dense part whole.
A checkpoint root holds numbered increments::

    <root>/sparse-000001/manifest.json   step, versions, layout, seed, sha256 of each shard file
    <root>/sparse-000001/shard-0.npz ... dense slice, its rule state, the changed rows per table
    <root>/sparse-000002/...

Each increment is written to a temporary directory, fsynced and renamed into place, so a
killed driver leaves only complete increments.  :func:`read_sparse` checks every file's
checksum, then replays the increments in order -- a later one's row overrides an earlier one's
-- on top of the tables' initial values, which the seed regenerates.  The rows are keyed by
table row id, not by shard, so :func:`restore_arguments` cuts them for any number of shards
(TensorFlow's sharded variables do the same for a changed partitioning).  Only JSON and
``.npz`` without pickles are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import CheckpointError
from ..ps.rows import SparseLayout

PREFIX = "sparse-"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_increment(
    root: str | os.PathLike[str], exports: list[dict[str, Any]], layout: SparseLayout,
    seed: int, step: int = 0,
) -> Path:
    """Write one increment from the shards' :meth:`export_changed` results; its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    done = sorted(p.name for p in root.glob(f"{PREFIX}*") if (p / "manifest.json").exists())
    number = int(done[-1][len(PREFIX):]) + 1 if done else 1
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    files = {}
    for s, export in enumerate(exports):
        arrays = {"dense": export["values"]}
        arrays.update({f"rule/{k}": v for k, v in export["rule_state"].items()})
        for t, rows in enumerate(export["tables"]):
            arrays.update({f"table{t}/{k}": v for k, v in rows.items()})
        path = tmp / f"shard-{s}.npz"
        with open(path, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        files[path.name] = _sha256(path)
    manifest = {
        "step": step, "seed": seed, "versions": [int(e["version"]) for e in exports],
        "dense": layout.dense, "tables": layout.tables, "specs": [list(s) for s in layout.specs],
        "files": files,
        # pushes each shard accepted per replica: a replica restarted with a shard restored
        # from here goes on after them (see sparse_replicas)
        "accepted_by_replica": [
            {str(r): int(n) for r, n in
             (e.get("counters") or {}).get("accepted_by_replica", {}).items()}
            for e in exports
        ],
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    final = root / f"{PREFIX}{number:06d}"
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def read_sparse(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Every increment of ``root`` replayed: ``dense`` (the whole vector), ``rule_state``
    (whole per-element arrays), ``tables`` (per table the merged rows: ids, values, versions,
    state), ``versions`` (the last increment's, per shard), ``seed``, ``specs``, ``increments``
    and ``accepted_by_replica`` (the last increment's, per shard; None in older checkpoints).

    Raises CheckpointError naming the file for a missing or corrupt one."""
    found = sorted(Path(root).glob(f"{PREFIX}*"))
    if not found:
        raise CheckpointError(f"no sparse checkpoint in {root} (no {PREFIX}NNNNNN directory)")
    merged: list[dict[int, dict[str, np.ndarray]]] = []
    for directory in found:
        manifest_path = directory / "manifest.json"
        if not manifest_path.exists():
            raise CheckpointError(f"{manifest_path} is missing: the increment is incomplete")
        manifest = json.loads(manifest_path.read_text())
        dense, rule = [], {}
        for name, digest in manifest["files"].items():
            path = directory / name
            if not path.exists() or _sha256(path) != digest:
                raise CheckpointError(f"{path} is missing or does not match its checksum")
        for s in range(len(manifest["dense"])):
            with np.load(directory / f"shard-{s}.npz", allow_pickle=False) as data:
                dense.append(data["dense"])
                for key in data.files:
                    if key.startswith("rule/"):
                        rule.setdefault(key[5:], []).append(data[key])
                    elif key.startswith("table"):
                        t, field = key[5:].split("/", 1)
                        while len(merged) <= int(t):
                            merged.append({})
                        merged[int(t)].setdefault(s, {})[field] = data[key]
        tables = [_collapse(parts) for parts in merged]
        merged = [{-1: table} for table in tables]  # carried, before the next increment's
    return {
        "dense": np.concatenate(dense),
        "rule_state": {k: np.concatenate(v) for k, v in rule.items()},
        "tables": tables, "versions": manifest["versions"], "seed": manifest["seed"],
        "specs": manifest["specs"], "increments": len(found), "step": manifest["step"],
        "accepted_by_replica": manifest.get("accepted_by_replica"),
    }


def _collapse(parts: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows from several sources (earlier first) as one set, a later row overriding."""
    chunks = [parts[k] for k in sorted(parts)]
    keys = chunks[0].keys()
    joined = {k: np.concatenate([c[k] for c in chunks]) for k in keys}
    ids = joined["ids"]
    # the last occurrence of each id wins: unique over the reversed order
    _, last = np.unique(ids[::-1], return_index=True)
    keep = len(ids) - 1 - last
    return {k: v[keep] for k, v in joined.items()}


def merge_exports(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """One shard's ``export_changed`` results taken one after the other as one: the newer
    dense part and version, the rows of both (a newer row overriding)."""
    tables = [_collapse({0: a, 1: b}) for a, b in zip(older["tables"], newer["tables"])]
    return {**newer, "tables": tables}


def restore_arguments(saved: dict[str, Any], layout: SparseLayout) -> list[dict[str, Any]]:
    """Per shard of ``layout`` (any number of shards): its dense slice and the ``restore``
    argument of :class:`~downpour_dask.ps.table.SparseShard` (rule state, the shard's version:
    the highest saved, and every saved row -- each shard keeps those in its range)."""
    version = max(saved["versions"])
    out = []
    for lo, hi in layout.dense:
        out.append({
            "values": saved["dense"][lo:hi],
            "restore": {
                "version": version,
                "rule_state": {k: v[lo:hi] for k, v in saved["rule_state"].items()},
                "tables": [[rows] for rows in saved["tables"]],
            },
        })
    return out
