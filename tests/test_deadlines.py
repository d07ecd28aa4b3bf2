"""A fit's waits on the cluster before it trains: bounded by the estimator's ``timeout``, and a
timeout names the step that did not finish (runtime/deadlines.py)."""

import asyncio
import os
import signal
import threading

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import while_stopped
from distributed import futures_of, wait

from downpour_dask import DownpourSGD, SandblasterLBFGS, datasets, models
from downpour_dask.runtime.deadlines import waiting_for
from downpour_dask.runtime.profiler import warn_if_profiler_can_deadlock

HINT = "A worker it needs may be stopped, overloaded or gone"


@pytest.mark.parametrize("dask_timeout", [TimeoutError(), asyncio.TimeoutError("timed out")])
def test_a_timeout_names_the_step_the_limit_and_keeps_dasks_error_as_its_cause(dask_timeout):
    with pytest.raises(TimeoutError) as caught, waiting_for("counting the rows", 2.5):
        raise dask_timeout
    assert str(caught.value).startswith("counting the rows did not finish within timeout=2.5 s.")
    assert HINT in str(caught.value) and "larger timeout" in str(caught.value)
    assert caught.value.__cause__ is dask_timeout


def test_other_errors_and_a_finished_block_pass_through_unchanged():
    failure = ValueError("bad partition")
    with pytest.raises(ValueError) as caught, waiting_for("counting the rows", 1.0):
        raise failure
    assert caught.value is failure
    with waiting_for("counting the rows", 1.0):
        done = True
    assert done


def _persisted_frame(client):
    """A persisted 4-partition Dask DataFrame of 400 rows, with a regression and a class label,
    and the worker processes holding its partitions."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame(rng.standard_normal((400, 4)), columns=list("abcd")).astype("float32")
    df["target"] = (2 * df.a - df.b).astype("float32")
    df["label"] = (df.target > 0).astype("int64")
    frame = client.persist(dd.from_pandas(df, npartitions=4))
    wait(futures_of(frame), timeout=60)
    holders = {w for ws in client.who_has(futures_of(frame)).values() for w in ws}
    return frame, holders


def _fit_with_a_worker_stopped(client, victim: str, fit) -> BaseException | None:
    """Run ``fit`` while ``victim``'s process is stopped (SIGSTOP); its error, or None if it
    finished.  The worker is let go on (SIGCONT) whatever happens; a fit still running after
    60 s fails the test.  The fit's once-per-cluster look at the workers' profiler is taken
    first, while every worker answers, as a user's earlier fit on the cluster would have: it
    is advice, and waits 10 s for a stopped worker before going without."""
    warn_if_profiler_can_deadlock(client)
    outcome = while_stopped(client.run(os.getpid, workers=[victim])[victim], fit, 60)
    assert outcome["finished"], "the fit was still waiting on the stopped worker after 60 s"
    return outcome.get("error")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_worker_ends_a_fit_on_persisted_dask_arrays_with_a_named_timeout(two_workers):
    """Arrays of unknown chunk sizes that the user persisted: persisting them again is a no-op,
    and their rows are counted on the workers holding them.  With one of those stopped the
    count used to wait for it for ever; now the fit fails within its timeout, naming it."""
    client = two_workers
    frame, holders = _persisted_frame(client)
    X, y = frame[list("abcd")].to_dask_array(), frame.target.to_dask_array()
    X, y = client.persist([X, y])
    wait(futures_of(X) + futures_of(y), timeout=60)
    assert np.isnan(X.chunks[0]).all()  # the rows must be counted
    est = DownpourSGD(models.LinearRegression(4), n_replicas=2, n_shards=1, max_epochs=1, timeout=3)
    error = _fit_with_a_worker_stopped(
        client, sorted(holders)[0], lambda: est.fit(X, y, client=client)
    )
    assert isinstance(error, TimeoutError)
    assert str(error).startswith("counting the rows of the 4 partitions did not finish within")
    assert "timeout=3 s" in str(error) and HINT in str(error)
    est.fit(X, y, client=client)  # the worker is back: the same fit goes through
    assert est.experiment_.pushes["examples"].sum() > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_worker_ends_a_classifiers_label_scan_with_a_named_timeout(two_workers):
    client = two_workers
    frame, holders = _persisted_frame(client)
    data = datasets.from_dask(frame[["a", "b", "c", "d", "label"]], label="label")
    est = DownpourSGD(
        models.SoftmaxRegression(4, 2), n_replicas=2, n_shards=1, max_epochs=1, timeout=3
    )
    error = _fit_with_a_worker_stopped(
        client, sorted(holders)[0], lambda: est.fit(data, client=client)
    )
    assert isinstance(error, TimeoutError)
    assert str(error).startswith("the label scan of the Dask collection")
    assert "timeout=3 s" in str(error) and HINT in str(error)
    assert not hasattr(est, "classes_")  # nothing of the failed fit was kept


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["downpour", "sandblaster"])
def test_a_stopped_worker_ends_a_fit_on_in_memory_data_with_a_named_timeout(two_workers, algorithm):
    """In-memory data goes to the workers before the clock starts: a Downpour replica's rows to
    its worker, which used to wait for a stopped one for ever; Sandblaster's shards start
    first, and their wait now says so."""
    client = two_workers
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    victim = sorted(client.run(os.getpid))[0]
    model = models.SoftmaxRegression(4, 2)
    if algorithm == "downpour":
        est = DownpourSGD(model, n_replicas=2, n_shards=2, max_epochs=1, timeout=3)
        expected = "sending replica 0's 200 rows to worker " + victim
    else:
        est = SandblasterLBFGS(model, n_shards=2, max_iter=100, timeout=3)
        expected = "starting the 2 parameter-server shard(s)"
    error = _fit_with_a_worker_stopped(client, victim, lambda: est.fit(X, y, client=client))
    assert isinstance(error, TimeoutError)
    assert str(error).startswith(expected + " did not finish within timeout=3 s.")
    est.fit(X, y, client=client)  # the worker is back: the same fit goes through
    assert est.experiment_.pushes["examples"].sum() > 0 and hasattr(est, "params_")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_stopped_mid_fit_ends_a_sandblaster_fit_while_it_is_still_stopped(two_workers):
    """Stopped (SIGSTOP) at the first progress report, a worker holding data blocks but no shard:
    the pass fails at its timeout, and the fit's end no longer waits for the stopped worker to
    drop the fit's records (``client.run`` of every worker waited for it until it came back)."""
    client = two_workers
    rng = np.random.default_rng(0)
    X = rng.standard_normal((20_000, 20)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    pids = client.run(os.getpid)
    victim = sorted(pids)[-1]  # shard 0 goes to the first worker
    stopped = threading.Event()

    def stop_the_victim(progress) -> None:
        if not stopped.is_set():
            os.kill(pids[victim], signal.SIGSTOP)
            stopped.set()

    est = SandblasterLBFGS(models.SoftmaxRegression(20, 2), n_shards=1, max_iter=300, timeout=3)
    fit = lambda: est.fit(X, y, client=client, callback=stop_the_victim)  # noqa: E731
    outcome = while_stopped(pids[victim], fit, 60, stop_first=False)
    assert stopped.is_set()
    assert outcome["finished"], "the fit was still waiting on the stopped worker after 60 s"
    assert isinstance(outcome.get("error"), RuntimeError)
    assert "did not finish within timeout=3 s" in str(outcome["error"])
