"""A live plot of training loss and test accuracy for ``fit(..., callback=LivePlot())``.

In Jupyter the plot is one output of the cell, replaced in place (IPython's ``display`` with a
``display_id``) at most every ``every`` seconds while ``fit`` runs, and a last time when it ends.
Elsewhere (a script, a terminal) there is nothing to draw into: give ``path=`` and the plot is
written to that PNG file instead, replaced atomically on each update (open it in an image viewer
that reloads); without ``path`` a warning says so once and the snapshots are still collected, so
``plot.figure`` can be saved afterwards.

The figure is a :class:`matplotlib.figure.Figure` rendered to PNG by this module, never through
``pyplot``: it needs no display and does not add a second, static copy to the notebook.
"""

from __future__ import annotations

import io
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .log import Progress


def in_jupyter() -> bool:
    """Whether this process is a Jupyter kernel that can show and replace rich outputs."""
    ipython = sys.modules.get("IPython")
    if "ipykernel.zmqshell" not in sys.modules or ipython is None:
        return False
    return ipython.get_ipython() is not None and "IPython.display" in sys.modules


class LivePlot:
    """Plot :class:`~downpour_dask.log.Progress` snapshots as they arrive: training loss and the
    test score against seconds since fit started.

    Parameters
    ----------
    every : float, default 1
        Seconds between redraws (rendering a PNG costs ~50 ms; snapshots come a few times a
        second).  The last snapshot of a fit is always drawn.
    path : str or path, optional
        Write the plot to this PNG file on every redraw (outside Jupyter, or as well as in it).
    title : str, optional
        Title above both panels (e.g. the run's name).
    figsize : (float, float), default (9, 3.4)
        Size of the figure in inches.

    Attributes
    ----------
    times, losses, score_times, scores : list of float
        What has been plotted: training loss at each snapshot, and the test score at each
        snapshot that had one.
    """

    def __init__(
        self,
        every: float = 1.0,
        path: str | os.PathLike[str] | None = None,
        title: str | None = None,
        figsize: tuple[float, float] = (9.0, 3.4),
    ):
        if not every >= 0:
            raise ValueError(f"every must be a number of seconds >= 0, got {every!r}")
        self.every, self.title, self.figsize = every, title, figsize
        self.path = Path(path) if path is not None else None
        self.times: list[float] = []
        self.losses: list[float] = []
        self.score_times: list[float] = []
        self.scores: list[float] = []
        self.metric = "accuracy"
        self._figure: Any = None
        self._lines: dict[str, Any] = {}
        self._handle: Any = None
        self._last_draw = -math.inf
        self._warned = False

    def __call__(self, p: Progress) -> None:
        if p.time < (self.times[-1] if self.times else -math.inf):  # a new fit: start over
            self.clear()
        self.metric = p.metric
        self.times.append(p.time)
        self.losses.append(p.loss)
        if math.isfinite(p.score):
            self.score_times.append(p.time)
            self.scores.append(p.score)
        done = p.phase == "done"
        if done or time.monotonic() - self._last_draw >= self.every:
            self.draw()

    def clear(self) -> None:
        """Forget the snapshots (a new fit draws a new plot, in a new output)."""
        for values in (self.times, self.losses, self.score_times, self.scores):
            values.clear()
        self._handle = None

    @property
    def figure(self) -> Any:
        """The :class:`matplotlib.figure.Figure`, with the snapshots so far."""
        if self._figure is None:
            self._figure = self._new_figure()
        loss, score = self._lines["loss"], self._lines["score"]
        loss.set_data(self.times, self.losses)
        score.set_data(self.score_times, self.scores)
        score.axes.set_ylabel(f"test {self.metric}")
        score.axes.set_title(f"Test {self.metric}")
        for line in (loss, score):
            line.axes.relim()
            line.axes.autoscale_view()
        positive = [v for v in self.losses if math.isfinite(v)]
        loss.axes.set_yscale("log" if positive and min(positive) > 0 else "linear")
        return self._figure

    def _new_figure(self) -> Any:
        from matplotlib.figure import Figure  # optional dependency: the ``plot`` extra

        fig = Figure(figsize=self.figsize, layout="constrained")
        loss_ax, score_ax = fig.subplots(1, 2)
        (self._lines["loss"],) = loss_ax.plot([], [], color="C0", label="training loss")
        (self._lines["score"],) = score_ax.plot([], [], color="C1", marker=".", label="test")
        loss_ax.set_title("Training loss (recent pushes)")
        loss_ax.set_ylabel("loss")
        for ax in (loss_ax, score_ax):
            ax.set_xlabel("seconds since fit started")
            ax.grid(alpha=0.3)
        if self.title:
            fig.suptitle(self.title)
        return fig

    def png(self) -> bytes:
        """The plot as PNG bytes."""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=90)
        return buffer.getvalue()

    def draw(self) -> None:
        """Redraw now: replace the notebook output and/or the ``path`` file."""
        self._last_draw = time.monotonic()
        jupyter = in_jupyter()
        if not jupyter and self.path is None:
            if not self._warned:
                warnings.warn(
                    "LivePlot draws in Jupyter; outside it pass LivePlot(path='live.png') to "
                    "write the plot to a file (the snapshots are kept: LivePlot.figure)",
                    UserWarning,
                    stacklevel=3,
                )
                self._warned = True
            return
        image = self.png()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.partial")
            partial.write_bytes(image)
            os.replace(partial, self.path)  # a viewer never reads a half-written file
        if jupyter:
            display = sys.modules["IPython.display"]
            shown = display.Image(data=image, format="png")
            if self._handle is None:
                self._handle = display.display(shown, display_id=True)
            else:
                self._handle.update(shown)
