"""What the driver does while the replicas train: the supervision loop of a Downpour fit.

:class:`SupervisionLoop` watches replica 0 train alone through the warmstart, then, until every
replica has finished, repeatedly: waits for the replicas (at most until the next evaluation or
progress report is due), lets the :class:`~.supervisor.Supervisor` restart or restore what
failed, evaluates the current parameters every ``eval_every`` seconds, reports progress, takes
checkpoints, collects push-log rows and, once ``max_seconds`` have passed, asks the replicas to
stop -- once.  A shard found lost on the way is restored and the loop goes on.  It talks to the
cluster and the shards only through :mod:`.protocols`, and reads time from its
:class:`~downpour_dask.base.RunRecorder`, so it is unit-tested in-process with fakes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..base import RunRecorder
from ..log import Progress
from ..ps.protocol import SHARD_ERRORS
from .checkpoints import Checkpoints
from .elastic import Elastic
from .protocols import Cluster, Server
from .supervisor import Supervisor
from .tasks import ReplicaTasks


@dataclass(frozen=True)
class Limits:
    """When a fit evaluates, reports and ends (see :class:`~downpour_dask.DownpourSGD`)."""

    eval_every: float  # seconds between evaluations
    timeout: float
    max_seconds: float | None = None
    max_epochs: int | None = None  # each replica's, for the progress estimate
    max_steps: int | None = None
    n_rows: int | None = None  # training rows over all replicas
    n_replicas: int = 1
    n_push: int = 1


def take_rows(cluster: Cluster, recorder: RunRecorder, last: bool = False) -> None:
    """Move the push-log rows the replicas left on their workers into ``recorder`` (``last``:
    the fit's final reading, see :meth:`~.protocols.Cluster.drain_rows`)."""
    for row in cluster.drain_rows(last):
        recorder.push(row)


class SupervisionLoop:
    """The driver's loop of one fit (see the module docstring).

    Parameters
    ----------
    cluster, server : Cluster, Server
        The workers, and the parameter server.
    tasks : ReplicaTasks
        The replicas' tasks.
    supervisor : Supervisor
        Restarts replicas and restores shards that were lost.
    checkpoints : Checkpoints
        Saves the shards' states.
    recorder : RunRecorder
        The run's log and clock.
    limits : Limits
        Evaluation interval, time budget, and what the progress estimate needs.
    score : callable, optional
        ``score(params)`` -> ``{"loss": ..., metric: ...}`` on the evaluation data; None: no
        evaluations.
    report : callable, optional
        Receives a :class:`Progress` snapshot every :attr:`REPORT_EVERY` seconds and after
        every evaluation.
    elastic : Elastic, optional
        Follows workers that join and leave (:mod:`.elastic`); None: the workers of the start.
    """

    #: Seconds between progress reports.
    REPORT_EVERY = 0.25
    SUPERVISE_EVERY = 1.0  # the longest the loop waits between looks, whatever eval_every is
    #: Seconds between collections of the replicas' push-log rows.
    COLLECT_EVERY = 0.5

    def __init__(
        self,
        cluster: Cluster,
        server: Server,
        tasks: ReplicaTasks,
        supervisor: Supervisor,
        checkpoints: Checkpoints,
        recorder: RunRecorder,
        limits: Limits,
        score: Callable[[np.ndarray], dict[str, float]] | None = None,
        report: Callable[[Progress], None] | None = None,
        elastic: Elastic | None = None,
    ):
        self.cluster, self.server, self.tasks = cluster, server, tasks
        self.supervisor, self.checkpoints, self.recorder = supervisor, checkpoints, recorder
        self.limits, self.score, self.report_to = limits, score, report
        self.elastic = elastic
        self.phase = "training"
        self.stop_sent = False
        self.last_report = -math.inf
        self.last_collect = recorder.elapsed()
        self.next_evaluation = 0.0  # on the run's clock; see _schedule_next_evaluation

    # -- phases ----------------------------------------------------------------------------------
    def warmstart(self, target: int, steps: int) -> None:
        """Watch replica 0 make ``target`` pushes (``steps`` steps) alone.

        The other replicas wait for that on the shards themselves; the loop records the end
        (``warmstart_done`` ``{steps}``) and releases them, also if replica 0 finishes without
        reaching it.
        """
        self.phase = "warmstart"
        while not self.tasks.tasks[0].done():
            self.supervisor.check()
            first = self.tasks.tasks[0]  # replica 0 may have been restarted
            try:
                if self.tick() >= target:
                    break
            except SHARD_ERRORS as err:  # a shard was lost: restore it, then go on
                self.supervisor.recover_lost_shards(err)
            self.cluster.wait([first], timeout=min(self.limits.eval_every, 0.05))
        for attempt in range(2):
            try:
                self.server.release_warmstart(self.limits.timeout)
                break
            except SHARD_ERRORS as err:  # restore the lost shard, then release the new one
                if attempt:
                    raise
                self.supervisor.recover_lost_shards(err)
        self.phase = "training"
        self.recorder.event(
            "warmstart_done", f"replica 0 trained alone for {steps} steps", steps=steps
        )

    def run(self) -> None:
        """Supervise, evaluate, checkpoint and enforce ``max_seconds`` until every replica has
        finished and its result is in hand."""
        limits = self.limits
        while True:
            self.cluster.wait(self.tasks.tasks, timeout=self.until_next_tick())
            if self.elastic is not None:  # workers that joined or are leaving (first: an added
                self.elastic.check()  # replica that left with its worker ends, not restarted)
            self.supervisor.check()  # restarts replicas and shards lost with their workers
            if self.tasks.all_gathered() and (self.elastic is None or self.elastic.settled()):
                return
            try:
                self.tick()
                self.checkpoints.maybe_save()
                self.collect_rows()
                if (
                    not self.stop_sent
                    and limits.max_seconds is not None
                    and self.recorder.elapsed() >= limits.max_seconds
                ):
                    self.server.request_stop(limits.timeout)
                    self.recorder.event(
                        "stop_requested",
                        f"max_seconds={limits.max_seconds} reached",
                        max_seconds=limits.max_seconds,
                    )
                    self.stop_sent = True
            except SHARD_ERRORS as err:  # a shard was lost: restore it, then go on
                self.supervisor.recover_lost_shards(err)

    def finish(self) -> tuple[np.ndarray, list[int]]:
        """After the replicas finished: the final parameters, evaluation, progress report and
        checkpoint.  A shard lost now (the result still lives on the shards) is restored like
        one lost mid-run.  The caller records ``stop`` (:meth:`record_stop`) once its own last
        calls to the shards are done, so that the event stays the log's last."""
        recovering = self.supervisor.recovering
        params, versions = recovering(self.pull)
        recovering(self.evaluate, params, versions)
        if self.report_to is not None:
            self.phase = "done"
            self.report(recovering(self.progress))
        if self.checkpoints.directory is not None:  # the end is a checkpoint too: resume there
            recovering(self.checkpoints.maybe_save, True)
        return params, versions

    def record_stop(self, versions: list[int]) -> None:
        """Event ``stop`` ``{versions}``: the run is over, at these shard versions."""
        self.recorder.event("stop", f"versions {versions}", versions=list(versions))

    # -- one tick --------------------------------------------------------------------------------
    def until_next_tick(self) -> float:
        """How long the loop may wait: until the next evaluation is due (so that evaluations
        keep to multiples of ``eval_every`` instead of drifting late), the next report, or
        ``max_seconds``; and at most :attr:`SUPERVISE_EVERY`, so that checkpoints and workers
        that joined or left are seen in time however long ``eval_every`` is."""
        limits, elapsed = self.limits, self.recorder.elapsed()
        interval = min(limits.eval_every, self.SUPERVISE_EVERY)
        if self.report_to is not None:
            interval = min(interval, self.REPORT_EVERY)
        if self.score is not None:
            interval = min(interval, self.next_evaluation - elapsed)
        if limits.max_seconds is not None and not self.stop_sent:
            interval = min(interval, limits.max_seconds - elapsed)
        return max(0.002, interval)

    def _schedule_next_evaluation(self) -> None:
        """Make the next evaluation due at the first multiple of ``eval_every`` (on the run's
        clock) still ahead: a late wake-up and an evaluation's own time then delay only that
        evaluation instead of adding up over the later ones, and scoring slower than
        ``eval_every`` skips a multiple instead of evaluating back to back."""
        every, now = self.limits.eval_every, self.recorder.elapsed()
        self.next_evaluation += every * (math.floor((now - self.next_evaluation) / every) + 1)

    def tick(self) -> int:
        """Evaluate if the next multiple of ``eval_every`` has come, report progress if due or
        a new score is in; return the lowest shard version."""
        elapsed = self.recorder.elapsed()
        evaluation_due = self.score is not None and elapsed >= self.next_evaluation
        if evaluation_due:
            params, versions = self.pull()
            self.evaluate(params, versions)
            self._schedule_next_evaluation()
        else:
            versions = self.server.versions(self.limits.timeout)  # a few bytes, not the vector
        self.checkpoints.observe(versions)
        # A new score is reported at once: with ``eval_every`` near REPORT_EVERY, waiting for
        # the report to be due skipped every other evaluation's score for a whole interval.
        due = evaluation_due or elapsed - self.last_report >= self.REPORT_EVERY
        if self.report_to is not None and due:
            self.report(self.progress())
        return min(versions)

    def pull(self) -> tuple[np.ndarray, list[int]]:
        """The model's current parameters, and each shard's version."""
        return self.server.pull(self.limits.timeout)

    def evaluate(self, params: np.ndarray, versions: list[int]) -> None:
        """Score ``params`` on the evaluation data and record it (nothing without data)."""
        if self.score is None:
            return
        now = self.recorder.elapsed()
        examples = int(self.server.shard_status(0, self.limits.timeout)["examples"])
        self.recorder.evaluation(
            time=now, version=min(versions), examples_seen=examples, **self.score(params)
        )

    def progress(self) -> Progress:
        """A snapshot from shard 0's counters, with an estimate of how much of the run is
        done: whichever of ``max_epochs``, ``max_steps``, ``max_seconds`` is nearest its end."""
        limits = self.limits
        status = self.server.shard_status(0, limits.timeout)
        elapsed = self.recorder.elapsed()
        examples = int(status["examples"])
        fractions = []
        if limits.max_epochs is not None and limits.n_rows:
            fractions.append(examples / (limits.max_epochs * limits.n_rows))
        if limits.max_steps is not None:
            total_steps = limits.max_steps * limits.n_replicas
            fractions.append(status["accepted"] * limits.n_push / total_steps)
        if limits.max_seconds is not None:
            fractions.append(elapsed / limits.max_seconds)
        return self.recorder.progress(
            time=elapsed,
            examples=examples,
            pushes=int(status["accepted"]),
            loss=float(status["recent_loss"]),
            fraction=min(1.0, max(fractions, default=0.0)),
            phase=self.phase,
        )

    def report(self, progress: Progress) -> None:
        """Hand a snapshot to whoever watches the run."""
        self.last_report = self.recorder.elapsed()
        if self.report_to is not None:
            self.report_to(progress)

    def collect_rows(self, force: bool = False, last: bool = False) -> None:
        """Take in the push-log rows replicas made since the last collection (every
        :attr:`COLLECT_EVERY` seconds): a worker that dies loses only its newest rows.
        ``last``: the fit's final collection, before the workers forget the run."""
        if not (force or last) and (
                self.recorder.elapsed() - self.last_collect < self.COLLECT_EVERY):
            return
        self.last_collect = self.recorder.elapsed()
        take_rows(self.cluster, self.recorder, last)
