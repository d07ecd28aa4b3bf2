"""A live progress bar for ``fit(..., callback=ProgressBar())``, drawn by tqdm.

Where the bar goes decides how it is drawn:

- in Jupyter (``tqdm.auto`` picks its notebook widget when ipywidgets is installed) and on a
  terminal, one bar redrawn in place, with the recent training loss, the latest test score and
  examples/s after it;
- in a file or a pipe (batch jobs, CI logs), where a redrawn bar would pile up carriage returns,
  the same text (tqdm's own formatting) as a new line at most every ``log_every`` seconds, and
  the final one, so logs stay short.

The bar is opened by the first snapshot and closed by the last one (phase ``"done"``), so one
``ProgressBar`` serves several fits one after the other (a grid search with ``verbose=1``).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm as auto_tqdm
from tqdm.autonotebook import tqdm as notebook_or_std_tqdm  # after tqdm.auto: no warning
from tqdm.std import tqdm as std_tqdm

from .log import Progress

#: tqdm's layout of the bar: percentage, bar, elapsed<remaining (seconds of the fit), numbers.
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"


def in_notebook() -> bool:
    """Whether ``tqdm.auto`` draws notebook widgets here (a Jupyter kernel with ipywidgets)."""
    return notebook_or_std_tqdm is not std_tqdm


class ProgressBar:
    """Show :class:`~downpour_dask.log.Progress` snapshots as a tqdm progress bar.

    Parameters
    ----------
    stream : file, optional
        Where the bar goes.  Default: a notebook widget in Jupyter, else ``sys.stderr``.
    log_every : float, default 5
        Seconds between lines when ``stream`` is neither a terminal nor a notebook.
    leave : bool, default True
        Keep the finished bar on screen (tqdm's ``leave``).
    disable : bool, default False
        Draw nothing (tqdm's ``disable``).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        log_every: float = 5.0,
        leave: bool = True,
        disable: bool = False,
    ):
        if not log_every > 0:
            raise ValueError(f"log_every must be a number of seconds > 0, got {log_every!r}")
        self.stream, self.log_every, self.leave, self.disable = stream, log_every, leave, disable
        self._bar: Any = None
        self._last_line = -math.inf

    @property
    def interactive(self) -> bool:
        """Whether the bar is redrawn in place (a notebook or a terminal), not written as lines."""
        if self.stream is None and in_notebook():
            return True
        stream = self.stream if self.stream is not None else sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, p: Progress) -> None:
        if self.disable:
            return
        if self.interactive:
            self._draw(p)
        elif p.phase == "done" or time.monotonic() - self._last_line >= self.log_every:
            stream = self.stream if self.stream is not None else sys.stderr
            stream.write(self.render(p) + "\n")
            stream.flush()
            self._last_line = time.monotonic()
        if p.phase == "done":
            self.close()

    def _draw(self, p: Progress) -> None:
        """Move the redrawn bar to snapshot ``p`` (opening it at the first one)."""
        if self._bar is None:
            self._bar = auto_tqdm(
                total=1.0, file=self.stream, bar_format=BAR_FORMAT, leave=self.leave,
                dynamic_ncols=True,
            )  # fmt: skip
            self._bar.start_t -= p.time  # elapsed counts from the start of fit, not of the bar
        bar = self._bar
        fraction = 1.0 if p.phase == "done" else p.fraction
        bar.set_description_str(self.description(p), refresh=False)
        bar.set_postfix_str(self.postfix(p), refresh=False)
        bar.update(fraction - bar.n)  # redraws at most every tqdm mininterval (0.1 s)

    def close(self) -> None:
        """Close the bar (done by the ``"done"`` snapshot; call it when a fit failed)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._last_line = -math.inf

    @staticmethod
    def description(p: Progress) -> str:
        """What goes before the bar: the phase, while one replica trains alone."""
        return "warmstart " if p.phase == "warmstart" else ""

    @staticmethod
    def postfix(p: Progress) -> str:
        """The numbers after the bar: recent training loss, latest test score, examples/s."""
        rate = p.examples / p.time if p.time > 0 else math.nan
        loss = f"{p.loss:.4f}" if math.isfinite(p.loss) else "-"
        score = f"{p.score:.3f}" if math.isfinite(p.score) else "-"
        speed = f"{rate:,.0f}" if math.isfinite(rate) else "-"
        return f"loss {loss}, test {p.metric} {score}, {speed} examples/s"

    def render(self, p: Progress) -> str:
        """The line for one snapshot, as tqdm formats it (the text of a file or pipe)."""
        fraction = 1.0 if p.phase == "done" else p.fraction
        return std_tqdm.format_meter(
            n=fraction, total=1.0, elapsed=p.time, prefix=self.description(p), ascii=True,
            bar_format=BAR_FORMAT.replace("{bar}", "{bar:20}"), postfix=self.postfix(p),
        )  # fmt: skip
