"""``n_replicas="auto"``: one replica per worker, following the cluster (``downpour/
replica_count.py``), its validation and its ``train`` flag.  The fit runs on the session's
two-worker cluster."""

from __future__ import annotations

import pytest

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.cli.flags import value_parser
from downpour_dask.downpour.replica_count import check_replicas, resolve
from downpour_dask.simulate import calibration


@pytest.mark.parametrize(
    ("n", "most", "error", "message"),
    [
        (0, None, ValueError, "n_replicas must be an integer >= 1 or 'auto'.*got 0"),
        ("many", None, ValueError, "n_replicas must be an integer >= 1 or 'auto'"),
        (True, None, TypeError, "n_replicas must be an int, got True"),
        (4, 3, ValueError, "max_replicas must be >= 4, got 3"),
        ("auto", 0, ValueError, "max_replicas must be >= 1, got 0"),
        ("auto", "all", TypeError, "max_replicas must be an int or None, got 'all'"),
    ],
)
def test_bad_replica_counts_are_refused_with_what_is_allowed(n, most, error, message):
    with pytest.raises(error, match=message):
        check_replicas(n, most)
    with pytest.raises(error, match=message):  # by the estimator, before any cluster work
        DownpourSGD(models.SoftmaxRegression(4, 3), n_replicas=n, max_replicas=most).fit(
            [[0.0] * 4] * 8, [0, 1, 2, 0] * 2, client=object()
        )


def test_auto_is_one_replica_per_worker_up_to_max_replicas():
    assert resolve("auto", None, 5) == (5, None, True)  # every joined worker gets one
    assert resolve("auto", 3, 5) == (3, 3, False)
    assert resolve("auto", 8, 5) == (5, 8, False)  # then joins up to 8
    assert resolve("auto", None, 5, partitions=2) == (2, None, True)
    assert resolve("auto", None, 0) == (1, None, True)
    assert resolve(3, None, 5) == (3, None, False) and resolve(3, 6, 1) == (3, 6, False)


def test_a_fit_with_auto_replicas_starts_one_replica_per_worker(client):
    train, _ = datasets.load("digits")
    est = DownpourSGD(
        models.SoftmaxRegression(64, 10),
        n_replicas="auto",
        n_shards=1,
        max_epochs=1,
        random_state=0,
    ).fit(train, client=client)
    start = est.experiment_.events.query("kind == 'start'")["data"].iloc[0]
    assert start["n_replicas"] == 2 == start["n_workers"]
    assert set(est.experiment_.pushes["replica"]) == {0, 1}
    assert est.get_params()["n_replicas"] == "auto"  # the estimator keeps what it was given
    config = est.experiment_.config  # the log, the count it started with
    assert config["n_replicas"] == 2 and config["n_replicas_given"] == "auto"
    fitted = calibration.calibrate(est.experiment_)  # as `downpour-dask simulate --from` does
    assert fitted.setup.n_replicas == 2


def test_the_train_flag_takes_a_count_or_auto():
    convert = value_parser('int | Literal["auto"] | int')
    assert convert("auto") == "auto" and convert("3") == 3
    with pytest.raises(Exception, match="expected an integer or 'auto', got 'all'"):
        convert("all")
