"""The live plot of loss and accuracy: snapshots in-process, a real fit, a Jupyter kernel."""

import base64
import hashlib
import math
import warnings

import nbformat
import pytest
from nbclient import NotebookClient

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.liveplot import LivePlot
from downpour_dask.log import Progress


def snapshot(time, loss, score=math.nan, phase="training"):
    return Progress(
        time=time, examples=int(100 * time), pushes=int(10 * time), loss=loss, score=score,
        metric="accuracy", fraction=min(1.0, time / 4), phase=phase,
    )  # fmt: skip


def test_the_lines_grow_with_each_snapshot_and_the_file_is_replaced(tmp_path):
    path = tmp_path / "live.png"
    plot = LivePlot(every=0, path=path, title="mnist5k, 4 replicas")
    plot(snapshot(0.5, 2.0))
    loss_ax, score_ax = plot.figure.axes
    assert len(loss_ax.lines[0].get_xdata()) == 1 and len(score_ax.lines[0].get_xdata()) == 0
    first = path.read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    plot(snapshot(1.0, 1.0, score=0.6))
    plot(snapshot(2.0, 0.5, score=0.8))
    assert list(loss_ax.lines[0].get_ydata()) == [2.0, 1.0, 0.5]
    assert list(score_ax.lines[0].get_xdata()) == [1.0, 2.0]
    assert path.read_bytes() != first  # redrawn with the new points
    assert loss_ax.get_title() == "Training loss (recent pushes)"
    assert score_ax.get_title() == "Test accuracy"
    assert plot.figure.get_suptitle() == "mnist5k, 4 replicas"
    assert loss_ax.get_yscale() == "log"
    assert score_ax.get_ylim()[1] >= 0.8  # rescaled to the data
    assert not list(tmp_path.glob(".*partial"))
    plot(snapshot(0.1, 3.0))  # the time went back: a new fit, a new plot
    assert plot.times == [0.1]


def test_redraws_are_throttled_and_the_last_snapshot_is_always_drawn(tmp_path):
    path = tmp_path / "live.png"
    plot = LivePlot(every=3600, path=path)
    plot(snapshot(0.5, 2.0))
    drawn = path.read_bytes()
    plot(snapshot(1.0, 1.0, score=0.5))
    assert path.read_bytes() == drawn  # within `every`: kept, not drawn
    assert plot.scores == [0.5]
    plot(snapshot(2.0, 0.5, score=0.9, phase="done"))
    assert path.read_bytes() != drawn


def test_outside_jupyter_without_a_path_it_warns_once_and_keeps_the_data():
    plot = LivePlot(every=0)
    with pytest.warns(UserWarning, match="LivePlot draws in Jupyter"):
        plot(snapshot(0.5, 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(snapshot(1.0, 1.0, score=0.7, phase="done"))
    assert plot.scores == [0.7] and len(plot.figure.axes[0].lines[0].get_xdata()) == 2
    with pytest.raises(ValueError, match="every must be a number of seconds >= 0"):
        LivePlot(every=-1)


@pytest.mark.timeout(120)
def test_a_real_fit_draws_its_progress(client, tmp_path):
    train, test = datasets.load("digits")
    plot = LivePlot(every=0, path=tmp_path / "fit.png")
    est = DownpourSGD(
        models.SoftmaxRegression(64, 10), n_replicas=2, n_shards=1, max_epochs=3, eval_every=0.1,
        random_state=0,
    )  # fmt: skip
    est.fit(train, eval_data=test, client=client, callback=plot)
    assert len(plot.times) >= 1 and plot.scores[-1] == pytest.approx(est.score(test), abs=1e-6)
    assert (tmp_path / "fit.png").stat().st_size > 1000


NOTEBOOK_CELL = """
import hashlib
from downpour_dask.log import Progress
from downpour_dask.liveplot import LivePlot
from downpour_dask.progress import ProgressBar
plot, bar = LivePlot(every=0), ProgressBar()
for t in range(1, 6):
    p = Progress(time=t, examples=100 * t, pushes=t, loss=1 / t, score=0.1 * t,
                 metric="accuracy", fraction=t / 5, phase="done" if t == 5 else "training")
    plot(p)
    bar(p)
print(len(plot.times), hashlib.sha1(plot.png()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_in_a_jupyter_kernel_the_plot_is_one_output_replaced_in_place_and_the_bar_a_widget():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CELL)])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # one output, replaced by each redraw (not five appended)
    printed = next(o.text for o in outputs if o.output_type == "stream").split()
    assert printed[0] == "5"
    shown = hashlib.sha1(base64.b64decode(images[0].data["image/png"])).hexdigest()
    assert shown == printed[1]  # the output shows the last redraw, with all five snapshots
    widgets = [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert len(widgets) == 1  # tqdm.auto's notebook bar: one widget, redrawn, not stderr lines
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"]
