"""Sandblaster's scoring of ``eval_data``: snapshots of the iterate, scored on a worker while the
coordinator iterates on.

The coordinator asks for a score after an iteration (:meth:`Scoring.submit`).  The shards copy
``x`` to ``xe`` first thing in their next program, the next pass's prelude (no round trip of its
own), and the score is sent just before that pass's portions: to the runner of the worker holding
the evaluation data (:mod:`~downpour_dask.sandblaster.runners`), one message straight there and
back, so that it runs before the portions queued behind it; or, where there is no runner, as a
Dask task in one batch of messages with the pass's tasks (a Dask client sends at most one batch
per 10 ms, and a task submitted on its own a few ms before the portions held them back by the
rest of that interval).  The score pulls ``xe`` from the shards and scores it on the evaluation
data, which lives on one worker (scattered again from the driver's copy if that worker died).
The coordinator waits for the score when the next one is due (:meth:`Scoring.finish`), or at the
end of the fit, which then launches a score no pass came to carry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
from distributed import Client, Future

from ..core.protocol import TrainableModel
from ..ps.protocol import ShardLostError
from ..ps.server import ParameterServer
from ..runtime.cluster import send_to_workers
from .portions import Portions
from .runners import RunnerCall, Runners
from .tasks import evaluate_task


class Scoring:
    """Scores of the iterate on ``evaluation`` data, filled into the fit's evaluation rows.

    Parameters
    ----------
    client : distributed.Client
    model : TrainableModel
        The fit's model (with its L2 term: the score's loss is the model's).
    evaluation : (X, y)
        The evaluation data, in the driver's memory.
    metric : str
        The row's score column (``accuracy`` or ``r2``).
    timeout : float
        Seconds a scatter or a score may take.
    workers : callable
        The workers the evaluation data may go to (the coordinator's survivors).
    event : callable
        Records an event of the fit (``data_restored`` when the data is scattered again).
    """

    def __init__(
        self,
        client: Client,
        model: TrainableModel,
        evaluation: tuple[np.ndarray, np.ndarray],
        metric: str,
        timeout: float,
        workers: Callable[[], list[str]],
        event: Callable[..., Any],
    ):
        self.client, self.model, self.evaluation = client, model, evaluation
        self.metric, self.timeout, self.workers, self.event = metric, timeout, workers, event
        self.data: Future | None = None  # the evaluation data on its worker
        self.home: str | None = None  # ... that worker
        self.task_only = False  # after a runner did not have the data: Dask tasks from then on
        # the row awaiting its score, and its call or task (None until it is sent)
        self.pending: tuple[dict[str, Any], Future | RunnerCall | None] | None = None
        self.place(restored=False)

    def place(self, restored: bool) -> None:
        """Send the evaluation data to one of the workers, under a readable key."""
        key = f"sandblaster-eval-{uuid.uuid4().hex[:12]}"
        evaluation = {key: self.evaluation}
        sent = send_to_workers(self.client, evaluation, self.workers(), timeout=self.timeout)
        self.data = sent[key]
        self.home = min(self.client.who_has([self.data]).get(key, ()), default=None)
        if restored:
            self.event("data_restored", "the evaluation data scattered again", evaluation=True)

    def submit(
        self, row: dict[str, Any], portions: Portions, server: ParameterServer, token: str
    ) -> None:
        """Score the iterate ``x`` as it is now into ``row``: the snapshot leads the shards'
        next program and the task goes with the next batch's portions (see the module
        docstring)."""
        portions.lead([("copy", "x", "xe")])  # the next iterations may move x
        self.pending = (row, None)
        portions.before_next_submit(
            lambda: self._launch_if_waiting(row, server, token, portions.runners)
        )

    def _launch_if_waiting(
        self, row: dict[str, Any], server: ParameterServer, token: str, runners: Runners
    ) -> None:
        """Send the score of ``row`` unless it was sent or given up already."""
        if self.pending is not None and self.pending[0] is row and self.pending[1] is None:
            self._launch(row, server, token, runners)

    def _launch(
        self, row: dict[str, Any], server: ParameterServer, token: str, runners: Runners
    ) -> Future | RunnerCall:
        """Send the score of ``row`` to the data's runner, else as a Dask task (placing the
        data again first if its worker died)."""
        if self.data is None or self.data.status != "finished":
            self.place(restored=True)
        args = (server.portable(), self.model, self.timeout, token)
        future = None
        if self.home is not None and not self.task_only:
            future = runners.score(self.home, self.data.key, *args)
        if future is None:
            future = self.client.submit(
                evaluate_task, args[0], self.model, self.data, self.timeout, token, pure=False
            )
        self.pending = (row, future)
        return future

    def finish(self, portions: Portions, server: ParameterServer, token: str) -> None:
        """Wait for the pending score, if any, and fill in its row; launch it first if no pass
        has carried it yet (the fit ended).  Its future is let go of with the next batch's
        submissions (:attr:`Portions.retired`).

        If it failed, a lost shard is the usual reason (raised as :class:`ShardLostError`, so
        the fit restores it); else, if its data died with a worker, it runs once more on data
        scattered again (the snapshot ``xe`` on the shards is unchanged until the next one).
        """
        for again in (True, False):
            if self.pending is None:
                return
            row, future = self.pending
            if future is None:
                portions.run([])  # the snapshot, if it still leads
                future = self._launch(row, server, token, portions.runners)
            try:
                scored = future.result(timeout=self.timeout)
                if scored is None:  # a runner's worker left, or did not hold the data
                    self.task_only = True
                    raise CancelledError("the evaluation data was not where it was sent")
                row["loss"], row[self.metric] = scored
                portions.retired.append(future)
                self.pending = None
                return
            except Exception as err:
                lost = server.lost_shards(timeout=min(5.0, self.timeout))
                if lost:
                    i = lost[0]
                    raise ShardLostError(
                        f"Sandblaster shard {i} (on worker {server.workers[i]}) was lost "
                        f"during an evaluation ({type(err).__name__})", i,
                    ) from err  # fmt: skip
                if not (again and isinstance(err, CancelledError)):
                    raise
                self._launch(row, server, token, portions.runners)

    def drop(self) -> None:
        """Give up the pending score (its shards were lost)."""
        if self.pending is not None and self.pending[1] is not None:
            self.pending[1].release()
        self.pending = None

    def futures(self) -> list[Future]:
        """What the fit holds on the cluster for scoring (to cancel at its end)."""
        return [] if self.data is None else [self.data]
