"""The driver's evaluations run in one BLAS thread, and the user's BLAS limit comes back after."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from downpour_dask import DownpourSGD, models
from downpour_dask.core import protocol
from downpour_dask.core.blas import one_blas_thread

pytestmark = pytest.mark.skipif(
    not any(lib["user_api"] == "blas" for lib in threadpool_info()),
    reason="no BLAS library whose threads threadpoolctl can set",
)


def blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_one_thread_inside_and_the_earlier_limit_after_an_error_too():
    with threadpool_limits(2, user_api="blas"):
        with one_blas_thread():
            assert blas_threads() == {1}
        assert blas_threads() == {2}
        with pytest.raises(RuntimeError, match="failed evaluation"), one_blas_thread():
            raise RuntimeError("a failed evaluation")
        assert blas_threads() == {2}


ANOTHER_THREAD = """
import threading
from threadpoolctl import threadpool_info
from downpour_dask.core.blas import one_blas_thread

def blas_threads():
    return sorted({lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"})

seen = {"before": blas_threads()}

def evaluate():
    with one_blas_thread():
        seen["inside"] = blas_threads()

thread = threading.Thread(target=evaluate)
thread.start()
thread.join(30)
seen["after"] = blas_threads()
print(seen)
"""


def test_in_another_thread_the_process_limit_is_left_alone():
    # A fresh process, whose main thread never set a limit: there a limit set by another
    # thread would take (and might never be lifted once the main thread sets one).
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", ANOTHER_THREAD], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout  # fmt: skip
    assert out.strip() == "{'before': [2], 'inside': [2], 'after': [2]}"


def test_a_fits_evaluations_run_in_one_blas_thread(client, monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((600, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    during = []
    original = protocol.loss_and_score

    def recording(model, params, X, y):
        during.append(blas_threads())
        return original(model, params, X, y)

    monkeypatch.setattr(protocol, "loss_and_score", recording)
    with threadpool_limits(2, user_api="blas"):
        est = DownpourSGD(models.MLP(8, (16,), 2), n_replicas=2, max_steps=20, batch_size=32,
                          eval_every=0.05, random_state=0, timeout=60)  # fmt: skip
        est.fit(X, y, eval_data=(X[:200], y[:200]), client=client)
        assert blas_threads() == {2}  # the user's limit, back after the fit
    assert during and all(threads == {1} for threads in during)
    assert len(est.experiment_.evals) == len(during)
