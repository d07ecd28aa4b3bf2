"""The embedded cluster's workers leave a terminal's Ctrl-C to the driver (runtime/interrupts.py);
the command's own handling of it is tested in test_cli.py and test_cli_interrupts.py."""

import os
import signal
import threading

import pytest
from conftest import newcomer_after_sigkill

from downpour_dask.runtime import cluster as cluster_module
from downpour_dask.runtime.interrupts import LeaveInterruptsToTheDriver, ignores_interrupts


def test_the_plugin_makes_its_process_ignore_sigint_and_leaves_other_threads_alone():
    before = signal.getsignal(signal.SIGINT)
    try:
        errors = []
        thread = threading.Thread(
            target=lambda: errors.append(LeaveInterruptsToTheDriver().setup(None))
        )
        thread.start()
        thread.join(10)
        assert errors == [None] and not ignores_interrupts()  # no handler set off the main thread
        LeaveInterruptsToTheDriver().setup(None)
        assert ignores_interrupts()
        signal.raise_signal(signal.SIGINT)  # ignored: no KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow  # kills a worker process and waits for its nanny to start another
@pytest.mark.timeout(180)
def test_an_embedded_clusters_workers_outlive_sigint_and_a_restarted_one_ignores_it_too(
    monkeypatch,
):
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)  # not the suite's
    monkeypatch.setenv(cluster_module.PIN_VARIABLE, "0")
    with cluster_module.cluster_client(None) as client:
        assert set(client.run(ignores_interrupts).values()) == {True}
        pids = client.run(os.getpid)
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGINT)  # what a terminal's Ctrl-C sends it
        assert client.run(os.getpid, workers=[victim]) == {victim: pids[victim]}  # alive
        newcomer = newcomer_after_sigkill(client, pids, victim)
        assert client.run(ignores_interrupts, workers=[newcomer]) == {newcomer: True}
