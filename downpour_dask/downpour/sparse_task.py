"""A sparse fit's replica task: what runs on a worker for one replica of
:func:`~.sparse_fit.fit_sparse`.

:func:`replica_task` draws the replica's minibatches (of its share of an in-memory batch, or of
its files of ``(paths, HashSpec)``, in an order fixed by the seed, so a restarted replica skips
the steps it pushed and goes on with the same batches; a replica that gave part of its share to
one that joined reads less from its next epoch, or file: :mod:`.shares`), opens a line to
every shard (in-process, the direct wire or actor messages:
:class:`~downpour_dask.ps.rows.RowsLink`) and runs :func:`~.sparse_loop.run_sparse_replica`
(:class:`~.sparse_accrual.AccruingReplica` for ``n_fetch``/``n_push`` other than 1).  A shard
lost mid-run is waited for (:func:`~..ps.replacement_lookups.await_replacement`) and the
replica goes on against its next generation.  Its push records are kept on the worker for the
driver as they are made (:func:`~.sparse_replicas.keep_records`) and returned whole at the end.
A task Dask cancelled (its driver let it go or is gone) stops at its next batch; on a worker that is
leaving the cluster the replica pauses before its next batch, to be restarted elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np
from distributed import secede

from ..core.sparse import SparseBatch
from ..data.hashing import minibatches, read_hashed
from ..ps.frames import WireError
from ..ps.protocol import ShardLostError
from ..ps.refs import ActorRef
from ..ps.replacement_lookups import await_replacement
from ..ps.rows import RowsLink, SparseLayout
from ..ps.rows_wire import RowsWireClient
from ..runtime.dask_connect import worker_client
from ..runtime.dask_internals import CancelWatch, task_cancelled
from .registry import assigned_share, is_leaving, keep_acked, replica_running, shard_variable
from .sparse_accrual import AccruingReplica
from .sparse_loop import run_sparse_replica
from .sparse_replicas import keep_records

#: Seconds between looks at whether the task was cancelled.
CANCEL_CHECK_EVERY = 0.25


def _batches(data: Any, replica: int, batch_size: int, epochs: int, seed: int,
             share: Callable[[], np.ndarray | None] = lambda: None) -> Iterator[SparseBatch]:
    """Replica ``replica``'s minibatches of its data -- an in-memory :class:`SparseBatch`, or
    ``(paths, HashSpec)`` --, for ``epochs`` epochs.  ``share()``: the positions (rows, or
    files) of its data it reads since a replica joined the fit (:mod:`.shares`), None while it
    reads all of it; asked at each epoch's start, and for files also before each file."""
    rng = np.random.default_rng([seed, replica])
    for _ in range(epochs):
        if isinstance(data, SparseBatch):
            positions = share()
            yield from minibatches(data if positions is None else data.take(positions),
                                   batch_size, rng)
        else:
            paths, spec = data

            def keeps(i: int) -> bool:
                positions = share()
                return positions is None or bool(np.isin(i, positions))

            yield from read_hashed(list(paths), spec, batch_size, rng, keeps=keeps)


def _until_cancelled(batches: Iterator[SparseBatch], run: str = "",
                     pause: float = 0.0) -> Iterator[SparseBatch]:
    """``batches`` until this task is cancelled -- its driver let it go, or died and Dask let
    go of its tasks (a running task cannot be interrupted) --, looked up every
    :data:`CANCEL_CHECK_EVERY` seconds.

    On a worker leaving fit ``run`` (:func:`~.registry.is_leaving`) the next batch waits:
    the driver restarts the replica elsewhere after the steps it pushed once the worker is
    gone, so none may be pushed here meanwhile.  A worker still there after ``pause``
    seconds did not leave after all: the replica trains on."""
    cancelled = CancelWatch(CANCEL_CHECK_EVERY)
    for batch in batches:
        if pause and run and is_leaving(run):
            deadline, pause = time.monotonic() + pause, 0.0  # (once: the mark stays)
            while time.monotonic() < deadline:
                if task_cancelled():
                    return
                time.sleep(CANCEL_CHECK_EVERY)
        if cancelled():
            return
        yield batch


def _link(ref: ActorRef, s: int, replica: int, timeout: float, n_tables: int,
          secret: bytes | None, first_step: int | None = None) -> RowsLink:
    """A line to shard ``s``: in-process if it is on this worker, else over the direct wire
    when ``secret`` is given and the shard offers an endpoint, else actor messages.
    ``first_step``: the task's first links say the step their pushes are numbered from."""
    shard = ref.open() if isinstance(ref, ActorRef) else ref  # (a replacement's handle)
    link = RowsLink(shard, s, replica, timeout, first_step=first_step)
    if link.local or secret is None:
        return link
    try:
        endpoint = link.shard.open_wire().result(timeout=timeout)
        if endpoint is not None:
            link.wire = RowsWireClient(endpoint, n_tables, min(10.0, timeout), secret)
    except (OSError, WireError):
        link.wire = None  # actor messages, then
    return link


def replica_task(model: Any, refs: list[Any], layout: SparseLayout, data: Any,
                 replica: int, batch_size: int, epochs: int,
                 max_steps: int | None, seed: int, timeout: float,
                 started: float, secret: bytes | None = None,
                 run: str = "", n_fetch: int = 1, n_push: int = 1, alpha: float = 0.0,
                 start_step: int = 0, key: str = "") -> list[dict[str, Any]]:
    """One replica's whole run, as a Dask task (see :func:`fit_sparse`), from step
    ``start_step`` (a restarted replica skips the batches before it).  When a shard is lost it
    waits for the driver to announce the shard's next generation
    (:func:`~..ps.replacement_lookups.await_replacement`), opens fresh links to every shard and
    goes on (the push in flight when the shard was lost is lost on it).  ``key``: the task's key,
    under which its records are kept on the worker for the driver (:mod:`.sparse_replicas`)."""
    secede()  # it runs for the whole fit: it must not hold one of the worker's task slots
    with replica_running(run):  # a lost driver's cleanup waits for it (.driver_loss)
        refs, records, generations = list(refs), [], [0] * len(refs)
        if run and key:
            keep_records(run, key, records)
        batches = _until_cancelled(islice(
            _batches(data, replica, batch_size, epochs, seed,
                     lambda: assigned_share(run, replica)), start_step, None),
            run, timeout)
        accruing = None
        if (n_fetch, n_push) != (1, 1):
            accruing = AccruingReplica(model, layout, batches, replica, n_fetch, n_push, alpha,
                                       start_step, max_steps, started, records)
        start, first_seq = start_step, (0 if start_step else None)
        first_step: int | None = start_step  # (a later session's numbering starts mid-accrual)
        while True:
            links = [_link(ref, s, replica, timeout, len(layout.specs), secret, first_step)
                     for s, ref in enumerate(refs)]
            first_step = None
            for link, generation in zip(links, generations):
                link.generation = generation
            keys = [ref.key for ref in refs]

            def acked(s: int, version: int, keys: list[str] = keys) -> None:
                keep_acked(run, s, keys[s], version)

            try:
                if accruing is not None:
                    accruing.acked = acked
                    accruing.run(links)
                    break
                left = None if max_steps is None else max(0, max_steps - start)
                run_sparse_replica(model, links, layout, batches, replica, left, started,
                                   start_step=start, records=records, first_seq=first_seq,
                                   acked=acked)
                break
            except ShardLostError as err:
                if not run:
                    raise
                if task_cancelled():  # a lost driver's shards go too (.driver_loss)
                    break
                generations[err.shard] = links[err.shard].generation
                actor = await_replacement(worker_client(), shard_variable(run, err.shard),
                                          err.shard, generations[err.shard], timeout)
                generations[err.shard] += 1
                refs[err.shard] = actor
                start = max((r["step"] for r in records), default=start - 1) + 1
                first_seq = 0  # fresh links: fresh push sessions
            finally:
                for link in links:
                    link.close()
                    record_transport(records, link)
        return records


def record_transport(records: list[dict[str, Any]], link: RowsLink) -> None:
    """Name the transport of each of ``link``'s shard's records not yet named."""
    for record in records:
        if record["shard"] == link.index and "transport" not in record:
            record["transport"] = link.transport
