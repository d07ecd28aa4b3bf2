"""The live progress bar (tqdm): redrawn on a terminal, short lines in a file or pipe."""

import io
import math

import pytest

from downpour_dask.log import Progress
from downpour_dask.progress import ProgressBar


def snapshot(fraction=0.5, phase="training", loss=0.25, score=0.875, time=2.0, examples=12345):
    return Progress(
        time=time, examples=examples, pushes=100, loss=loss, score=score, metric="accuracy",
        fraction=fraction, phase=phase,
    )  # fmt: skip


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_shows_the_numbers_a_user_watches():
    line = ProgressBar(io.StringIO()).render(snapshot())
    assert line.startswith(" 50%|##########          | 00:02<00:02")  # elapsed < remaining
    for part in ("loss 0.2500", "test accuracy 0.875", "6,172 examples/s"):
        assert part in line
    early = ProgressBar().render(
        snapshot(0.0, "warmstart", loss=math.nan, score=math.nan, time=0.0)
    )
    assert early.startswith("warmstart   0%")
    assert "loss -" in early and "test accuracy -" in early and "- examples/s" in early
    assert "100%" in ProgressBar().render(snapshot(0.97, "done"))  # the run is over


def test_a_terminal_gets_one_bar_redrawn_in_place_and_closed_at_the_end():
    out = Terminal()
    bar = ProgressBar(out)
    assert bar.interactive
    for f in (0.1, 0.5):
        bar(snapshot(f))
    bar(snapshot(0.98, "done", score=0.9))
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, left on screen
    assert text.count("\r") >= 2  # redrawn in place
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("100%") and "test accuracy 0.900" in last
    bar(snapshot(0.2))  # a second fit opens a new bar
    bar(snapshot(1.0, "done"))
    assert out.getvalue().count("\n") == 2


def test_a_log_file_gets_a_line_every_few_seconds_and_the_final_one():
    out = io.StringIO()
    bar = ProgressBar(out, log_every=3600)
    assert not bar.interactive
    for f in (0.1, 0.2, 0.3):
        bar(snapshot(f))
    bar(snapshot(1.0, "done"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "100%" in lines[1] and "\r" not in out.getvalue()


def test_no_argument_is_needed_and_stderr_is_the_default(capsys):
    bar = ProgressBar()  # what verbose=1 uses
    bar(snapshot(0.5))
    bar(snapshot(1.0, "done"))
    err = capsys.readouterr().err  # a captured stderr is not a terminal: lines
    assert err.count("\n") == 2 and "100%" in err.splitlines()[-1]
    quiet = ProgressBar(disable=True)
    quiet(snapshot(1.0, "done"))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="log_every must be a number of seconds > 0"):
        ProgressBar(log_every=0)
