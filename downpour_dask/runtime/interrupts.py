"""Ctrl-C in a terminal stops the driver, not the workers of the cluster it started.

A terminal sends SIGINT to its whole foreground process group: to the driver (a
``downpour-dask train`` command, a script calling ``fit``) and, with it, to the worker
processes of the cluster the driver started (:func:`~downpour_dask.runtime.cluster.cluster_client`),
which are its children.  A worker that takes it dies mid-call, and a shard with it; the
driver's clean stop -- ask the shards to stop, keep the latest checkpoint, say how to resume --
then waits for shards that are gone, and fails after the fit's ``timeout``.  So the workers of
an embedded cluster ignore SIGINT (:class:`LeaveInterruptsToTheDriver`, a worker plugin, so
that a worker its nanny restarts ignores it too), and the driver stops them when it closes the
cluster.  A cluster the user brings is left as it is: its workers are not the driver's
children, and a terminal's Ctrl-C does not reach them.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

#: The plugin's name on the cluster.
PLUGIN_NAME = "downpour-dask-interrupts-to-the-driver"


class LeaveInterruptsToTheDriver(WorkerPlugin):
    """Dask worker plugin: the worker process ignores SIGINT (see the module docstring)."""

    name = PLUGIN_NAME

    def setup(self, worker: Any) -> None:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def ignores_interrupts() -> bool:
    """Whether this process ignores SIGINT (for the workers' answer to ``client.run``)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
