"""``runtime/xla_threads.py``: a worker's JAX computes in the worker's threads (the effect on a
JAX fit is pinned in ``test_jax_models.py``)."""

from __future__ import annotations

import os

import pytest

from downpour_dask.runtime.xla_threads import VARIABLE, size_xla_pools


def test_the_drivers_process_is_left_as_the_user_set_it(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert size_xla_pools() is None  # not a worker: the user's own process
    assert VARIABLE not in os.environ


def _sized(preset: str | None) -> tuple[str | None, str | None]:
    """Task: size_xla_pools() in this worker with ``PJRT_NPROC`` at ``preset`` (unset: None);
    the worker's environment is put back as it was afterwards."""
    before = os.environ.pop(VARIABLE, None)
    try:
        if preset is not None:
            os.environ[VARIABLE] = preset
        return size_xla_pools(), os.environ.get(VARIABLE)
    finally:
        os.environ.pop(VARIABLE, None)
        if before is not None:
            os.environ[VARIABLE] = before


@pytest.mark.timeout(60)
def test_a_worker_gets_its_thread_count_unless_its_environment_names_one(client):
    threads = {w: info["nthreads"] for w, info in client.scheduler_info()["workers"].items()}
    worker, nthreads = sorted(threads.items())[0]
    unset = client.submit(_sized, None, workers=[worker], pure=False).result(timeout=30)
    assert unset == (str(nthreads), str(nthreads))
    preset = client.submit(_sized, "3", workers=[worker], pure=False).result(timeout=30)
    assert preset == ("3", "3")  # the user's (or the cluster's) choice stands
