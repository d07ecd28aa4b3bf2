"""What a sparse fit's driver does while its replicas train, besides supervising them: the
evaluation schedule and the published run's progress.

:func:`~.sparse_fit.fit_sparse` waits for its replicas in
:func:`~.sparse_recovery.supervise` (shard recovery, checkpoints).  A :class:`SparseMonitor`
runs beside it in a thread of the driver:

- every ``eval_every`` seconds it scores the shards' current parameters on the held-out data
  (:class:`~.sparse_eval.SparseEvaluator`: only the rows that data touches are pulled); an
  evaluation that fails because a shard is being replaced is skipped, the next one is on
  schedule; :meth:`SparseMonitor.finish` makes the final evaluation after the replicas are done;
- with ``publish=NAME`` (:class:`~.publication.Publication`, the dense fit's) it logs a
  :class:`~downpour_dask.log.Progress` snapshot about four times a second -- examples and pushes
  from the shards' counters (a few bytes each), the latest evaluation's accuracy, the fraction of
  the planned examples done -- and the ``done`` snapshot last, so ``downpour-dask watch NAME``
  and :func:`downpour_dask.live.attach` follow a sparse run as they follow a dense one.

:class:`SparseServerView` is the fit's shards as the publication sees a parameter server
(futures, actors, workers, dense ranges); it follows replacements made by shard recovery.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from distributed import Client

from .. import live
from ..core.sparse import SparseBatch
from ..log import Progress
from .publication import Publication
from .sparse_eval import SparseEvaluator, evaluation_batch, evaluation_frame


class SparseServerView:
    """A :class:`~.sparse_fit.SparseFit`'s shards as :func:`downpour_dask.live.publish` reads
    a server: ``futures``, ``shards`` (actors), ``workers`` and the dense ``ranges``."""

    def __init__(self, fit: Any):
        self.fit = fit

    @property
    def futures(self) -> list[Any]:
        return list(self.fit.futures)

    @property
    def shards(self) -> list[Any]:
        return list(self.fit.actors)

    @property
    def workers(self) -> list[str]:
        return list(self.fit.workers)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(self.fit.layout.dense)


def planned_examples(data: Any, n_replicas: int, batch_size: int, max_epochs: int,
                     max_steps: int | None) -> int | None:
    """How many examples the fit will train on (for the progress fraction): the batch's rows
    or the parquet files' (from their footers) times ``max_epochs``, at most
    ``max_steps * batch_size`` per replica; None when unknown (CSV files without ``max_steps``)."""
    total: int | None = None
    if isinstance(data, SparseBatch):
        total = len(data.y) * max_epochs
    else:
        paths = [Path(p) for p in data[0]]
        if all(p.suffix == ".parquet" for p in paths):
            total = sum(pq.ParquetFile(p).metadata.num_rows for p in paths) * max_epochs
    if max_steps is not None:
        cap = max_steps * batch_size * n_replicas
        total = cap if total is None else min(total, cap)
    return total


class SparseMonitor:
    """The evaluation schedule and progress reports of one sparse fit (module docstring).

    Made before any cluster work, it checks ``eval_data``, ``eval_every`` and the ``publish``
    name (TypeError/ValueError); :meth:`bind` gives it the fit once the shards run and returns
    what shard recovery calls after a replacement (the publication's republish)."""

    #: Seconds between two progress snapshots of a published run.
    REPORT_EVERY = 0.25

    def __init__(self, client: Client, model: Any, eval_data: Any, eval_every: float,
                 publish: str | None, callback: Callable[[Progress], Any] | None = None):
        if isinstance(eval_every, bool) or not (isinstance(eval_every, (int, float))
                                                and eval_every > 0):
            raise ValueError(f"eval_every must be a number of seconds > 0, got {eval_every!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self.callback, self._next_tick = callback, 0.0
        self.held_out = None if eval_data is None else evaluation_batch(model, eval_data)
        if publish is not None:
            live.check_name(publish)
            Publication.check_free(client, publish)
        self.client, self.model, self.eval_every, self.name = client, model, eval_every, publish
        self.fit: Any = None
        self.evaluator: SparseEvaluator | None = None
        self.publication: Publication | None = None
        self.planned: int | None = None
        self.t0 = time.time()
        self.skipped = 0  # evaluations that failed while a shard was lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bind(self, fit: Any, data: Any, n_replicas: int, batch_size: int, max_epochs: int,
             max_steps: int | None, t0: float) -> Callable[[], None] | None:
        """Follow ``fit`` (started at wall-clock ``t0``), training on ``data``; returns the
        callback for :class:`~.shard_recovery.ShardRecovery`'s ``on_replaced``."""
        self.fit, self.t0 = fit, t0
        self.planned = planned_examples(data, n_replicas, batch_size, max_epochs, max_steps)
        if self.held_out is not None:
            self.evaluator = SparseEvaluator(self.model, self.held_out, fit.layout, fit.timeout)
        if self.name is None:
            return None
        info = live_info(self.model, t0, n_replicas, fit.layout.n_shards, self.planned)
        self.publication = Publication(self.client, self.name, info)
        return functools.partial(self.publication.republish, SparseServerView(fit))

    def frame(self) -> pd.DataFrame:
        """The evaluation log (empty without ``eval_data``)."""
        return evaluation_frame([] if self.evaluator is None else self.evaluator.rows)

    def start(self) -> None:
        """Publish the run (with ``publish``) and start the thread (without evaluation data
        and publication there is nothing to do)."""
        if self.publication is not None:
            self.publication.publish(SparseServerView(self.fit))
        if self.evaluator is None and self.publication is None:
            return
        self._thread = threading.Thread(target=self._run, name="sparse-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (an evaluation in flight ends within the timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.fit.timeout + 5)
            self._thread = None

    def close(self) -> None:
        """Stop, and release the published name (however the fit ended)."""
        self.stop()
        if self.publication is not None:
            self.publication.unpublish()

    def _run(self) -> None:
        next_eval = next_report = time.monotonic()
        next_eval += self.eval_every
        while not self._stop.wait(min(self.REPORT_EVERY, self.eval_every)):
            if self.evaluator is not None and time.monotonic() >= next_eval:
                try:
                    self.evaluator.evaluate(list(self.fit.actors), time.time() - self.t0)
                except Exception:  # noqa: BLE001 - a shard being replaced: the next one counts
                    self.skipped += 1
                next_eval = time.monotonic() + self.eval_every
            if self.publication is not None and time.monotonic() >= next_report:
                self.report("training")
                next_report = time.monotonic() + self.REPORT_EVERY

    def finish(self) -> None:
        """After the replicas are done: the final evaluation and the ``done`` snapshot."""
        self.stop()
        if self.evaluator is not None:
            self.evaluator.evaluate(list(self.fit.actors), time.time() - self.t0)
        if self.publication is not None:
            self.report("done")
        if self.callback is not None:
            self.callback(self.snapshot("done"))

    def tick(self) -> None:
        """In the driver's supervising loop: a ``training`` snapshot to ``callback`` at most
        every :attr:`REPORT_EVERY` seconds.  What the callback raises propagates, so it ends the
        fit as the dense fit's callback does; a snapshot that cannot be read (a shard being
        replaced) is skipped."""
        if self.callback is None or time.monotonic() < self._next_tick:
            return
        self._next_tick = time.monotonic() + self.REPORT_EVERY
        progress = None
        with contextlib.suppress(Exception):
            progress = self.snapshot("training")
        if progress is not None:
            self.callback(progress)

    def snapshot(self, phase: str) -> Progress:
        """The fit's progress now: examples of the furthest shard, shard 0's pushes and recent
        loss, the last evaluation's accuracy and the fraction of the planned examples."""
        counters = self.fit.counters()
        examples = max(int(c["examples"]) for c in counters)
        score = math.nan
        if self.evaluator is not None and self.evaluator.rows:
            score = self.evaluator.rows[-1]["accuracy"]
        fraction = 0.0  # unknown plan: no estimate until the end
        if phase == "done":
            fraction = 1.0
        elif self.planned:
            fraction = float(np.clip(examples / self.planned, 0.0, 1.0))
        return Progress(time=time.time() - self.t0, examples=examples,
                        pushes=int(counters[0]["accepted"]),
                        loss=float(counters[0]["recent_loss"]), score=float(score),
                        metric="accuracy", fraction=fraction, phase=phase)

    def report(self, phase: str) -> None:
        """Log a progress snapshot on the published run's topic (best effort)."""
        assert self.publication is not None
        with contextlib.suppress(Exception):  # live metrics never fail the fit
            self.publication.report(self.snapshot(phase))


def live_info(model: Any, t0: float, n_replicas: int, n_shards: int,
              planned: int | None) -> dict[str, Any]:
    """What a published sparse run tells the processes that attach to it (JSON-able)."""
    return {
        "estimator": "fit_sparse", "sparse": True, "model": dict(model.get_config())
        if hasattr(model, "get_config") else {"type": type(model).__name__},
        "t0": t0, "n_replicas": n_replicas, "n_shards": n_shards, "n_rows": planned,
        "metric": "accuracy",
        "tables": [[int(t.n_rows), int(t.width)] for t in model.tables],
    }
