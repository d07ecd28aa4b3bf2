"""Ctrl-C during a training command: stop at the fit's next progress report, not mid-call.

Python raises :class:`KeyboardInterrupt` wherever the main thread happens to be, which in a
driver is often inside a Dask client call (an actor call, a checkpoint's export, a status
poll); what the client was doing is then left half done, and the clean stop that follows (ask
the shards to stop, release them, close the cluster) may wait on it.  :class:`DeferredInterrupt`
instead, once the fit has reported progress, only notes the first Ctrl-C and raises it from the
fit's own progress callback -- a point where the driver is between calls, about four times a
second -- so the fit stops the way a failing callback stops it.  Before the first report (the
cluster starting, the data loading) and for a second Ctrl-C it raises at once, as Python would.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ..log import Progress


class DeferredInterrupt:
    """A fit callback and SIGINT handler (module docstring); use it as a context manager.

    Parameters
    ----------
    then : callable, optional
        The callback each progress snapshot goes on to (a progress bar), if any.
    """

    def __init__(self, then: Callable[[Progress], Any] | None = None):
        self.then = then
        self.reporting = False  # the fit has called back: Ctrl-C can wait for the next report
        self.pending = False  # a Ctrl-C is waiting for that report
        self._previous: Any = None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():  # only it handles signals
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self.reporting or self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __call__(self, progress: Progress) -> None:
        self.reporting = True
        if self.then is not None:
            self.then(progress)
        if self.pending:
            raise KeyboardInterrupt
