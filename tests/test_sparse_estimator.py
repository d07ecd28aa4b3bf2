"""SparseDownpourClassifier: scikit-learn's estimator API over fit_sparse, on the cluster."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.metrics import log_loss

from downpour_dask import SparseDownpourClassifier


def clicks(n=1500, seed=0):
    """Three categorical columns whose categories carry the click rate, one numeric column."""
    rng = np.random.default_rng(seed)
    effect = {f: rng.normal(0, 1.5, 40) for f in ("site", "ad", "device")}
    cats = {f: rng.integers(0, 40, n) for f in effect}
    z = sum(effect[f][cats[f]] for f in effect)
    frame = pd.DataFrame({f: [f"{f}-{c}" for c in cats[f]] for f in effect})
    frame["hour"] = rng.normal(size=n)
    return frame, (rng.random(n) < 1 / (1 + np.exp(-z))).astype(int)


def estimator(**kw):
    args = dict(categorical=["site", "ad", "device"], numeric=["hour"], n_rows=4096,
                learning_rate=0.1, batch_size=32, max_epochs=3, timeout=60)
    return SparseDownpourClassifier(**{**args, **kw})


@pytest.mark.parametrize("model", ["logistic", "fm"])
def test_fit_learns_the_click_rates_and_predicts_locally(client, model):
    everything, labels = clicks(1800)
    X, y, X_held, y_held = everything[:1500], labels[:1500], everything[1500:], labels[1500:]
    clf = estimator(model=model, n_shards=2).fit(X, y, client=client, eval_data=(X_held, y_held))
    proba = clf.predict_proba(X)
    assert proba.shape == (len(X), 2) and np.allclose(proba.sum(axis=1), 1)
    baseline = log_loss(y, np.full(len(y), y.mean()))
    assert log_loss(y, proba[:, 1]) < 0.9 * baseline  # it learned the categories' effects
    assert clf.score(X, y) == np.mean(clf.predict(X) == y) > max(y.mean(), 1 - y.mean())
    assert set(clf.pushes_["shard"]) == {0, 1} and clf.lost_updates_ == [0, 0]
    assert clf.events_.empty
    # the last evaluation scored the final parameters on the held-out rows, on the shards
    last = clf.evaluations_.iloc[-1]
    assert last["loss"] == pytest.approx(log_loss(y_held, clf.predict_proba(X_held)[:, 1]),
                                         rel=1e-5)
    assert last["examples_seen"] == 3 * 1500 and last["auc"] > 0.7
    unseen = X.assign(site="never-seen-site")  # a new category hashes to some row: no error
    assert np.isfinite(clf.predict_proba(unseen)).all()


def test_params_clone_and_refusals_before_any_work(client):
    clf = estimator(model="embedding_mlp", model_options={"dim": 4, "hidden": [8]})
    assert clf.get_params()["model_options"] == {"dim": 4, "hidden": [8]}
    twin = clone(clf)
    assert twin.get_params() == clf.get_params() and not hasattr(twin, "dense_")
    with pytest.raises(NotFittedError):
        clf.predict(clicks(10)[0])
    X, y = clicks(50)
    with pytest.raises(TypeError, match="X must be a pandas DataFrame"):
        clf.fit(X.to_numpy(), y, client=client)
    with pytest.raises(ValueError, match=r"columns \['device'\] are missing"):
        clf.fit(X.drop(columns="device"), y, client=client)
    with pytest.raises(ValueError, match="y must be 50 labels of 0 and 1 only"):
        clf.fit(X, y + 1, client=client)
    with pytest.raises(TypeError, match=r"eval_data must be \(X, y\)"):
        clf.fit(X, y, client=client, eval_data=X)
    with pytest.raises(ValueError, match="model must be one of"):
        clone(clf).set_params(model="tree").fit(X, y, client=client)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['beta2'\] for optimizer"):
        clone(clf).set_params(optimizer="momentum:beta2=0.9").fit(X, y, client=client)
    with pytest.raises(ValueError, match="max_replicas must be >= 2, got 1"):
        clone(clf).set_params(n_replicas=2, max_replicas=1).fit(X, y)  # (no cluster started)
    assert not hasattr(clf, "dense_")


def test_a_finished_fit_lets_go_of_its_shards_without_the_cycle_collector(
    client, no_cycle_collector, cluster_keys
):
    """The shard actors (their tables' rows in the workers' memory) go when the fit returns,
    even though Dask's actor calls leave the driver's handles in reference cycles."""
    before = cluster_keys()
    X, y = clicks(600)
    clf = estimator(n_shards=2, max_epochs=1).fit(X, y, client=client)
    assert cluster_keys(beyond=before) == set()
    assert clf.predict_proba(X).shape == (600, 2)  # the fitted model lives on in the driver
