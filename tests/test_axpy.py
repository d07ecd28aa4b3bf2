"""core/axpy.py: ``y += a * x`` in place for every layout, in one BLAS pass that lets other
threads run (two shards of one worker, or a shard and its replica, update side by side)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from downpour_dask.core import axpy as axpy_module
from downpour_dask.core.axpy import axpy

TIMEOUT = 60.0


@pytest.mark.parametrize(
    "layout", ["float32", "float64", "strided", "2-d", "empty", "float64 x, float32 y", "int64"]
)
def test_axpy_adds_in_place_for_every_layout(layout):
    rng = np.random.default_rng(0)
    dtype = {"float64": np.float64, "int64": np.int64}.get(layout, np.float32)
    n = 0 if layout == "empty" else 30
    y = (rng.standard_normal(n) * 10).astype(dtype)
    x = (rng.standard_normal(n) * 10).astype(np.float64 if layout.startswith("float64") else dtype)
    if layout == "strided":
        y, x = y[::3], x[::3]
    elif layout == "2-d":
        y, x = y.reshape(5, 6), x.reshape(5, 6)
    a = 3 if dtype == np.int64 else -0.25
    expected = y + (a * x).astype(dtype)
    before = y  # the same array object, changed in place (a view changes its base)
    axpy(a, x, y)
    assert y is before and y.dtype == dtype
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


def test_a_view_of_a_bigger_vector_changes_only_its_elements():
    base = np.zeros(10, np.float32)
    axpy(2.0, np.ones(5, np.float32), base[::2])
    np.testing.assert_array_equal(base, [2, 0] * 5)


def test_mismatched_shapes_are_refused_before_any_write():
    y = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"same shape, got \(5,\) and \(4,\)"):
        axpy(1.0, np.ones(5, np.float32), y)
    assert not y.any()


def test_this_scipy_gives_the_routines_that_release_the_gil():
    """The fast path depends on scipy's Cython BLAS table; if a scipy release changes it, this
    says so (axpy still works, through scipy's wrapper, holding the GIL)."""
    assert all(routine is not None for routine, _, _ in axpy_module._ROUTINES.values())


def test_other_threads_run_while_axpy_works():
    """With the interpreter told not to switch threads on its own, the main thread can only run
    while the worker thread has released the GIL: it sees the worker's calls unfinished only
    if axpy releases it (scipy's own wrapper does not: then it sees all of them done)."""
    x = np.ones(20_000_000, np.float32)
    y = np.zeros_like(x)
    calls, finished = 5, []
    started = threading.Event()

    def work() -> None:
        started.set()
        for _ in range(calls):
            axpy(1.0, x, y)
            finished.append(True)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        assert started.wait(TIMEOUT)
        seen = len(finished)  # runs when the worker lets go of the GIL
        thread.join(TIMEOUT)
    finally:
        sys.setswitchinterval(interval)
    assert not thread.is_alive()
    assert seen < calls, "axpy held the GIL through every call"
    assert y[0] == calls and y[-1] == calls
