"""The estimators as scikit-learn and Dask users expect them: sklearn's estimator checks, model
selection, pipelines, labels of any kind, the current Dask client, Dask collections that stay on
the workers, ConvergenceWarning, warm starts and ``verbose``.

Everything runs on the shared two-worker cluster of ``conftest.py``: its client is the current
default client, which ``fit(client=None)`` uses (so these fits start no cluster of their own).
"""

from __future__ import annotations

import os
import urllib.request
import warnings

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.datasets import load_iris
from sklearn.exceptions import ConvergenceWarning, NotFittedError
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import check_estimator, parametrize_with_checks

from downpour_dask import DownpourSGD, SandblasterLBFGS, base, expected_failed_checks, models
from downpour_dask.data import targets
from downpour_dask.runtime import cluster as cluster_module

#: Small, quick settings: one replica and shard, enough epochs for sklearn's accuracy checks.
FAST_DOWNPOUR = dict(n_replicas=1, n_shards=1, max_epochs=20, batch_size=16, learning_rate=0.1,
                     random_state=0)  # fmt: skip
FAST_SANDBLASTER = dict(n_shards=1, max_iter=10, portions_per_batch=1, random_state=0)


@pytest.fixture(scope="module")
def iris():
    X, y = load_iris(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))  # every replica sees every class
    return StandardScaler().fit_transform(X[order]).astype(np.float32), y[order]


@parametrize_with_checks(
    [DownpourSGD(**FAST_DOWNPOUR), DownpourSGD("linear", **FAST_DOWNPOUR)]
)  # fmt: skip
def test_downpour_passes_sklearn_estimator_checks(estimator, check, client):
    """Every check of ``check_estimator``, as a classifier (default MLP) and a regressor, none
    skipped (sklearn itself skips ``check_pipeline_consistency`` for non-deterministic
    estimators: asynchronous replicas are)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        check(estimator)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sandblaster_passes_sklearn_estimator_checks(client):
    """The same checks for Sandblaster as a classifier (slow: each L-BFGS iteration is a
    distributed pass, and the checks make hundreds of them).  Its regressor side is the
    shared base class's, which Downpour's regressor checks above cover; the quick tests below
    run Sandblaster through model selection, a pipeline, warm starts and ConvergenceWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        # 3 iterations: the checks' time is proportional to them, and their accuracy checks
        # already pass after 2
        estimator = SandblasterLBFGS(None, **{**FAST_SANDBLASTER, "max_iter": 3})
        results = check_estimator(estimator, on_fail=None)
    failed = {r["check_name"]: r["exception"] for r in results if r["status"] == "failed"}
    assert not failed


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", [None, "linear"])
def test_default_downpour_fails_only_the_checks_it_lists(model, client):
    """With its defaults (4 asynchronous replicas, one epoch) Downpour fails exactly the checks
    :func:`expected_failed_checks` names, or fewer: a comparison of two asynchronous fits may
    happen to agree."""
    est = DownpourSGD(model)
    expected = expected_failed_checks(est)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        results = check_estimator(est, on_fail=None)
    failed = {r["check_name"] for r in results if r["status"] == "failed"}
    assert failed <= set(expected)
    assert model is None or "check_fit2d_1sample" in failed  # always fails for a regressor
    assert expected_failed_checks(DownpourSGD(model, n_replicas=1, max_epochs=20)) == {}


def test_kind_follows_the_model():
    assert is_classifier(DownpourSGD()) and is_classifier(SandblasterLBFGS())
    assert is_classifier(DownpourSGD(models.LogisticRegression(3)))
    assert is_regressor(DownpourSGD("linear")) and is_regressor(SandblasterLBFGS("linear"))
    assert is_regressor(SandblasterLBFGS(models.MLP(3, (4,), 1, output="linear")))
    assert not hasattr(DownpourSGD("linear"), "predict_proba")
    assert hasattr(DownpourSGD("softmax"), "predict_proba")
    est = DownpourSGD("mlp:8", n_replicas=3, warm_start=True)
    copy = clone(est)
    assert copy is not est and copy.get_params() == est.get_params()
    with pytest.raises(NotFittedError):
        est.predict(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        DownpourSGD("resnet").fit(np.zeros((4, 2)), [0, 1, 0, 1])


def test_model_selection_and_pipeline(iris, client):
    X, y = iris
    labels = np.array(["setosa", "versicolor", "virginica"])[y]
    est = DownpourSGD("softmax", n_replicas=2, n_shards=1, max_epochs=10, batch_size=16,
                      random_state=0)  # fmt: skip
    scores = cross_val_score(est, X, labels, cv=3)
    assert scores.shape == (3,) and scores.min() > 0.6
    search = GridSearchCV(est, {"learning_rate": [0.01, 0.2]}, cv=2).fit(X, labels)
    assert search.best_params_["learning_rate"] in (0.01, 0.2)
    assert list(search.best_estimator_.classes_) == ["setosa", "versicolor", "virginica"]
    pipe = make_pipeline(StandardScaler(), SandblasterLBFGS(**FAST_SANDBLASTER))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        pipe.fit(X, labels)
    assert pipe.score(X, labels) > 0.9
    proba = pipe.predict_proba(X[:5])
    assert proba.shape == (5, 3) and np.allclose(proba.sum(axis=1), 1)
    assert list(pipe.predict(X[:1])) == [labels[0]]


def test_labels_of_any_kind_and_fitted_attributes(iris, client):
    X, y = iris
    binary = np.where(y == 0, -1, 1)
    est = DownpourSGD("logistic", **FAST_DOWNPOUR).fit(X, binary)
    assert list(est.classes_) == [-1, 1] and set(est.predict(X)) <= {-1, 1}
    assert est.score(X, binary) > 0.9 and est.n_features_in_ == 4
    assert est.predict_proba(X).shape == (len(X), 2)
    frame = pd.DataFrame(X, columns=["a", "b", "c", "d"])
    est = SandblasterLBFGS(**FAST_SANDBLASTER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(frame, y + 10)
    assert list(est.feature_names_in_) == ["a", "b", "c", "d"]
    assert list(est.classes_) == [10, 11, 12] and est.score(frame, y + 10) > 0.9
    # a model given ready-built keeps its own classes 0..K-1, also when one is missing
    est = DownpourSGD(models.SoftmaxRegression(4, 5), **FAST_DOWNPOUR).fit(X, y)
    assert list(est.classes_) == [0, 1, 2, 3, 4] and est.predict_proba(X).shape == (len(X), 5)
    with pytest.raises(ValueError, match="the model has 5 classes"):
        DownpourSGD(models.SoftmaxRegression(4, 5), **FAST_DOWNPOUR).fit(X, y - 1)


@pytest.mark.parametrize(
    "labels",
    [
        np.array([1, 0, 1, 1, 0]),
        np.array([5, -3, 2, 5, -3, 0]),  # negative, with gaps
        np.array([7, 3, 3, 9], np.uint8),
        np.array([True, False, True]),
        np.array([10**12, 3, 10**12]),  # a range too wide to count: sorted
        np.array([2**64 - 1, 2**64 - 2], np.uint64),  # beyond int64: sorted
        np.array([2.0, 0.0, 2.0]),  # floats: sorted
        np.array(["b", "a", "b"]),
    ],
)
def test_the_classes_and_codes_of_labels_are_np_uniques(labels):
    """Integer labels over a small range are counted rather than sorted; the result is the
    same: ``classes_`` (with the labels' dtype) and each label's index in it."""
    classes, codes = targets.fit_classes(labels)
    expected, inverse = np.unique(labels, return_inverse=True)
    assert classes.dtype == expected.dtype and np.array_equal(classes, expected)
    assert codes.dtype == np.int64 and np.array_equal(codes, inverse.reshape(-1))


def test_no_client_uses_the_current_one(iris, client, monkeypatch):
    """``client=None`` runs on the current default client, starting no cluster."""

    def no_cluster(*args, **kwargs):
        raise AssertionError("an embedded cluster was started although a client exists")

    monkeypatch.setattr(cluster_module, "LocalCluster", no_cluster)
    with client.as_current():
        est = DownpourSGD("softmax", **FAST_DOWNPOUR).fit(*iris)
    assert sorted(est.experiment_.config["workers"]) == sorted(client.scheduler_info()["workers"])


def test_embedded_cluster_prints_a_working_dashboard_link(monkeypatch, capsys):
    """With no current client an embedded cluster starts; verbose names its dashboard, which
    serves pages (bokeh comes with the notebooks and test extras)."""
    monkeypatch.setattr(cluster_module, "current_client", lambda: None)
    with cluster_module.cluster_client(None, announce=True) as embedded:
        line = capsys.readouterr().err.strip()
        assert line.count("\n") == 0 and "dashboard at http" in line
        link = line.split("dashboard at ")[1]
        with urllib.request.urlopen(link, timeout=30) as page:
            assert page.status == 200
        assert embedded.status == "running"


def _on_a_worker(block: np.ndarray, driver: int) -> np.ndarray:
    """Identity, except that computing it in the driver's process fails: so a test sees any
    materialisation of the collection on the driver."""
    if os.getpid() == driver:
        raise RuntimeError("the Dask collection was computed on the driver")
    return block


def test_dask_collections_stay_on_the_workers(iris, client):
    X, y = iris
    pid = os.getpid()
    with pytest.raises(RuntimeError, match="on the driver"):  # the guard works
        da.from_array(X, chunks=50).map_blocks(_on_a_worker, pid, meta=X[:0]).compute(
            scheduler="sync"
        )
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    dX = da.from_array(X, chunks=(50, 4)).map_blocks(_on_a_worker, pid, meta=X[:0])
    dy = da.from_array(names, chunks=50).map_blocks(_on_a_worker, pid, meta=names[:0])
    est = DownpourSGD("softmax", **{**FAST_DOWNPOUR, "n_replicas": 2}).fit(dX, dy)
    assert list(est.classes_) == ["setosa", "versicolor", "virginica"]
    assert est.experiment_.config["data"]["kind"] == "array" and est.score(X, names) > 0.8
    frame = dd.from_pandas(pd.DataFrame(X, columns=list("abcd")).assign(t=y * 2), npartitions=3)
    frame = frame.map_partitions(_on_a_worker, pid, meta=frame._meta)
    est = DownpourSGD("softmax", **{**FAST_DOWNPOUR, "n_replicas": 2}).fit(frame[list("abcd")],
                                                                         frame["t"])  # fmt: skip
    assert list(est.classes_) == [0, 2, 4] and list(est.feature_names_in_) == list("abcd")
    assert est.score(pd.DataFrame(X, columns=list("abcd")), y * 2) > 0.8
    lazy = est.predict(frame[list("abcd")])  # Dask in, Dask out: computed on the workers
    in_memory = est.predict(pd.DataFrame(X, columns=list("abcd")))
    assert hasattr(lazy, "dask") and list(lazy.compute()) == list(in_memory)
    proba = est.predict_proba(dX).compute()
    assert proba.shape == (len(X), 3) and np.allclose(proba.sum(axis=1), 1)
    with pytest.raises(TypeError, match="never gathered implicitly"):
        est.fit(dX, dy, eval_data=(dX, dy))


def test_a_fit_cut_short_warns(iris, client):
    X, y = iris
    with pytest.warns(ConvergenceWarning, match="applied no update: max_seconds=1e-09"):
        est = SandblasterLBFGS(max_seconds=1e-9, **FAST_SANDBLASTER).fit(X, y)
    assert est.n_iter_ == 0
    with pytest.warns(ConvergenceWarning, match="max_seconds=1e-09"):
        DownpourSGD(**{**FAST_DOWNPOUR, "max_epochs": 1000, "max_seconds": 1e-9}).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)  # epochs done: nothing to warn of
        DownpourSGD(**{**FAST_DOWNPOUR, "max_epochs": 1}).fit(X, y)


def test_warm_start_continues_from_params(iris, client):
    X, y = iris
    est = DownpourSGD("softmax", **{**FAST_DOWNPOUR, "optimizer": "sgd"}).fit(X, y)
    first = est.params_.copy()
    est.set_params(warm_start=True, learning_rate=1e-9, local_learning_rate=1e-9)
    est.fit(X, y)  # a tiny step from where the last fit ended
    assert np.allclose(est.params_, first, atol=1e-5)
    cold = clone(est).set_params(warm_start=False).fit(X, y)  # a tiny step from the start
    assert not np.allclose(cold.params_, first, atol=1e-2)
    with pytest.raises(ValueError, match="labels the estimator was not fitted with"):
        est.fit(X, y + 1)
    with pytest.raises(ValueError, match="X has 3 features"):
        est.fit(X[:, :3], y)


def test_verbose_shows_a_progress_bar(iris, client, monkeypatch):
    seen = []

    class Recorder:
        def __call__(self, progress):
            seen.append(progress)

    monkeypatch.setattr(base, "ProgressBar", Recorder)
    DownpourSGD("softmax", verbose=1, **FAST_DOWNPOUR).fit(*iris)
    assert seen and seen[-1].fraction == pytest.approx(1.0)
    seen.clear()
    DownpourSGD("softmax", **FAST_DOWNPOUR).fit(*iris)  # verbose=0: silent
    assert not seen
