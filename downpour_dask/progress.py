"""A one-line live progress display for ``fit(..., callback=ProgressBar())``.

On a terminal the line is redrawn in place; when the output is a file or a pipe (batch jobs,
CI logs) a new line is written at most every ``log_every`` seconds, so logs stay short.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from .log import Progress


class ProgressBar:
    """Render :class:`~downpour_dask.log.Progress` snapshots as a progress line.

    Parameters
    ----------
    stream : file, default sys.stderr
    width : int, default 24
        Characters of the bar itself.
    log_every : float, default 5
        Seconds between lines when ``stream`` is not a terminal.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 24, log_every: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.log_every = log_every
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_line = -math.inf
        self._drawn = 0

    def __call__(self, p: Progress) -> None:
        line = self.render(p)
        if self.interactive:
            pad = max(0, self._drawn - len(line))
            self.stream.write("\r" + line + " " * pad + ("\n" if p.phase == "done" else ""))
            self._drawn = len(line)
        elif p.phase == "done" or time.monotonic() - self._last_line >= self.log_every:
            self.stream.write(line + "\n")
            self._last_line = time.monotonic()
        self.stream.flush()

    def render(self, p: Progress) -> str:
        """The progress line for one snapshot."""
        filled = int(round(p.fraction * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        parts = [
            f"[{bar}] {p.fraction:4.0%}",
            f"{p.time:6.1f} s",
            f"examples {p.examples:,}",
            f"loss {p.loss:.4f}" if math.isfinite(p.loss) else "loss -",
            f"test {p.metric} {p.score:.3f}" if math.isfinite(p.score) else f"test {p.metric} -",
            f"pushes/s {p.pushes_per_s:,.0f}" if math.isfinite(p.pushes_per_s) else "pushes/s -",
        ]
        if p.phase == "warmstart":
            parts.append("(warmstart)")
        return "  ".join(parts)
