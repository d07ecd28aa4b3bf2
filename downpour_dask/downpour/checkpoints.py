"""What the driver saves of the shards: in memory always, on disk with a checkpoint directory.

Every ``checkpoint_every`` seconds :class:`Checkpoints` copies every shard's state (values,
update-rule state, version, counters) to the driver -- the copy a lost shard is restored from
(:mod:`.shard_recovery`) -- and, given a directory, writes it with the run's log so far through
:func:`~downpour_dask.checkpoint.write_checkpoint` (atomic, checksummed).  It also keeps the
newest version the driver has seen of each shard, so a restore can say how many updates it lost.

A fit resumed from a checkpoint (:func:`read_resumable`) starts its shards from the saved
states and its replicas after the steps they had pushed (:func:`steps_pushed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import RunRecorder
from ..checkpoint import Checkpoint, ShardState, read_checkpoint, write_checkpoint
from ..core.optim import UpdateRule
from ..core.protocol import TrainableModel, config
from .protocols import Server


def check_path(name: str, value: Any, allow_none: bool = False) -> None:
    """Raise TypeError unless ``value`` is a path (str or os.PathLike), or None if allowed."""
    if not (isinstance(value, (str, os.PathLike)) or (value is None and allow_none)):
        allowed = "a path (str or os.PathLike)" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")


def read_resumable(
    path: str | os.PathLike[str],
    ranges: list[tuple[int, int]],
    partitions: int,
    model: TrainableModel,
    rule: UpdateRule,
) -> Checkpoint:
    """The latest checkpoint in ``path``, checked to fit a fit with these shard ``ranges``,
    ``partitions``, ``model`` and update ``rule`` (before any cluster work).

    Raises
    ------
    TypeError
        If ``path`` is not a path.
    ValueError
        If the checkpoint is damaged (:class:`~downpour_dask.checkpoint.CheckpointError`, naming
        the file) or was written by a fit with other shards, partitions or model, or holds
        update-rule state ``rule`` does not keep (another optimizer, or ``ema_decay``'s average).
    """
    check_path("resume_from", path)
    checkpoint = read_checkpoint(path)
    found = [(s.start, s.stop) for s in checkpoint.shards]
    saved_partitions = int(checkpoint.meta.get("partitions", 1))
    if found != [tuple(r) for r in ranges] or saved_partitions != partitions:
        raise ValueError(
            f"resume_from={str(path)!r}: the checkpoint holds {len(found)} shard(s) covering "
            f"{found[-1][1]} parameters of a model in {saved_partitions} partition(s), but "
            f"this estimator has n_shards={len(ranges)}, partitions={partitions} and a model "
            f"of {model.n_params} parameters; use the interrupted run's settings"
        )
    saved_model = checkpoint.meta.get("model")
    if saved_model is not None and saved_model != config(model):
        raise ValueError(
            f"resume_from={str(path)!r}: the checkpoint was written for model {saved_model}, "
            f"not {config(model)}"
        )
    kept = set(rule.init(0))
    saved = set().union(*(s.rule_state for s in checkpoint.shards))
    if not saved <= kept:
        raise ValueError(
            f"resume_from={str(path)!r}: the checkpoint holds update-rule state "
            f"{sorted(saved)}, which {rule!r} does not keep ({sorted(kept)}); give the "
            f"optimizer and ema_decay of the fit that saved it"
        )
    return checkpoint


def initial_states(
    ranges: list[tuple[int, int]],
    initial: np.ndarray,
    rule: UpdateRule,
    restore: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each shard's starting state, the first in-memory checkpoint: ``initial``'s slice, and the
    update rule's fresh state at version 0 or the state ``restore`` continues."""
    states = []
    for i, (lo, hi) in enumerate(ranges):
        state = (
            restore[i]
            if restore is not None
            else {"rule_state": rule.init(hi - lo), "version": 0, "counters": {}}
        )
        states.append({**state, "values": initial[lo:hi].copy()})
    return states


def restore_args(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """What each shard's constructor needs to continue from ``checkpoint``."""
    return [
        {"rule_state": s.rule_state, "version": s.version, "counters": s.counters}
        for s in checkpoint.shards
    ]


def steps_pushed(
    restore: list[dict[str, Any]] | None, first_shards: list[int], n_push: int
) -> dict[int, int]:
    """Steps each replica had pushed before a resume, from the counters of each partition's
    first shard (the shard that counts the partition's pushes); empty for a fresh start."""
    if restore is None:
        return {}
    done: dict[int, int] = {}
    for i in first_shards:
        by_replica = restore[i].get("counters", {}).get("accepted_by_replica", {})
        for r, n in by_replica.items():
            done[int(r)] = max(done.get(int(r), 0), int(n) * n_push)
    return done


class Checkpoints:
    """The shards' saved states and the checkpoints of one fit.

    Parameters
    ----------
    server : Server
        The shards to copy.
    states : list of dict
        Each shard's state at the start (:func:`initial_states`).
    recorder : RunRecorder
        The run's log: its clock times checkpoints, and a checkpoint written to disk keeps it.
    every : float
        Seconds between checkpoints.
    timeout : float
        Seconds the shards may take to hand over their state.
    directory : str or path, optional
        Where to write checkpoints; None keeps them in memory only.
    meta : dict, optional
        What every checkpoint file records besides the log (the model, its partitions).
    before_write : callable, optional
        Called before a checkpoint is written, to bring the log up to date (the push rows
        still on the workers).
    """

    def __init__(
        self,
        server: Server,
        states: list[dict[str, Any]],
        recorder: RunRecorder,
        every: float,
        timeout: float,
        directory: str | os.PathLike[str] | None = None,
        meta: dict[str, Any] | None = None,
        before_write: Callable[[], None] | None = None,
    ):
        self.server, self.recorder = server, recorder
        self.every, self.timeout, self.directory = every, timeout, directory
        self.meta = dict(meta or {})
        self.before_write = before_write
        self.saved = list(states)
        #: The newest version of each shard the driver has seen (restores count lost updates).
        self.known_versions = [int(s["version"]) for s in states]
        self.last = recorder.elapsed()

    def observe(self, versions: list[int]) -> None:
        """Note versions the shards reported."""
        self.known_versions = [max(k, int(v)) for k, v in zip(self.known_versions, versions)]

    def maybe_save(self, force: bool = False) -> None:
        """Every ``every`` seconds (or now, with ``force``): copy every shard's state and, with a
        directory, write a checkpoint with the log so far."""
        if not force and self.recorder.elapsed() - self.last < self.every:
            return
        states = self.server.export_state(self.timeout)
        self.last = self.recorder.elapsed()
        self.saved = states
        self.observe([s["version"] for s in states])
        if self.directory is None:
            return
        elapsed = self.recorder.elapsed()
        shards = [
            ShardState(i, lo, hi, st["values"], st["rule_state"], st["version"], st["counters"])
            for i, ((lo, hi), st) in enumerate(zip(self.server.ranges, states))
        ]
        versions = [s.version for s in shards]
        self.recorder.event("checkpoint", f"versions {versions}", versions=versions)
        if self.before_write is not None:
            self.before_write()
        write_checkpoint(self.directory, shards, elapsed, {**self.meta, **self.recorder.to_json()})

    def replaced(self, shard: int, state: dict[str, Any]) -> None:
        """Shard ``shard`` was restored from ``state`` (with ``values``): it is the saved state
        now, and its version the newest known."""
        self.saved[shard] = state
        self.known_versions[shard] = int(state["version"])
