"""Ctrl-C in a training command: raised at once before the fit reports, then deferred to the
fit's next progress report (a point between cluster calls), and at once again the second time."""

from __future__ import annotations

import signal

import pytest

from downpour_dask.cli.interrupts import DeferredInterrupt
from downpour_dask.log import Progress

SNAPSHOT = Progress(time=1.0, examples=10, pushes=1, loss=0.5, score=float("nan"),
                    metric="accuracy", fraction=0.1, phase="training")


def test_before_the_first_report_ctrl_c_interrupts_at_once():
    with DeferredInterrupt() as callback, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert not callback.pending


def test_once_reporting_ctrl_c_waits_for_the_next_report_and_a_second_one_does_not():
    seen = []
    with DeferredInterrupt(seen.append) as callback:
        callback(SNAPSHOT)
        signal.raise_signal(signal.SIGINT)  # noted, nothing raised here (mid-call)
        assert callback.pending
        with pytest.raises(KeyboardInterrupt):
            callback(SNAPSHOT)  # the fit's next report raises it
        assert seen == [SNAPSHOT, SNAPSHOT]  # the bar still got the snapshot
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: at once


def test_the_previous_handler_is_back_afterwards():
    before = signal.getsignal(signal.SIGINT)
    with DeferredInterrupt() as callback:
        assert signal.getsignal(signal.SIGINT) == callback._on_sigint
    assert signal.getsignal(signal.SIGINT) is before
