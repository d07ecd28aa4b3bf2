"""The live progress line."""

import io
import math

from downpour_dask.log import Progress
from downpour_dask.progress import ProgressBar


def snapshot(fraction=0.5, phase="training", loss=0.25, score=0.875, time=2.0):
    return Progress(
        time=time, examples=12345, pushes=100, loss=loss, score=score, metric="accuracy",
        fraction=fraction, phase=phase,
    )  # fmt: skip


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_shows_the_numbers_a_user_watches():
    line = ProgressBar(io.StringIO(), width=10).render(snapshot())
    assert line.startswith("[#####-----]  50%")
    for part in ("examples 12,345", "loss 0.2500", "test accuracy 0.875", "pushes/s 50"):
        assert part in line
    early = ProgressBar(io.StringIO()).render(
        snapshot(0.0, "warmstart", loss=math.nan, score=math.nan, time=0.0)
    )
    assert "loss -" in early and "test accuracy -" in early and "(warmstart)" in early


def test_a_terminal_gets_one_line_redrawn_in_place():
    out = Terminal()
    bar = ProgressBar(out)
    for f in (0.1, 0.5):
        bar(snapshot(f))
    bar(snapshot(1.0, "done"))
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")


def test_a_log_file_gets_a_line_every_few_seconds_and_the_final_one():
    out = io.StringIO()
    bar = ProgressBar(out, log_every=3600)
    for f in (0.1, 0.2, 0.3):
        bar(snapshot(f))
    bar(snapshot(1.0, "done"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "100%" in lines[1] and "\r" not in out.getvalue()
