"""Guarded updates through a whole fit: a fit that diverges fails saying so, and
``max_grad_norm`` clips every push (on the session's two-worker cluster)."""

from __future__ import annotations

import pytest

from downpour_dask import DownpourSGD, datasets, models


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def _estimator(**kw) -> DownpourSGD:
    settings = dict(n_replicas=2, n_shards=2, max_epochs=2, random_state=0, eval_every=0.1)
    settings.update(kw)
    return DownpourSGD(models.MLP(64, (16,), 10), **settings)


@pytest.mark.timeout(120)
def test_a_fit_that_diverges_fails_with_an_error_that_says_so(client, digits):
    """learning_rate=1e30 with SGD: the shards refuse the updates that would overflow, so the
    parameters stay finite -- but so large that the model's outputs overflow.  That is not a
    trained model, and the fit must not pass for one."""
    train, test = digits
    est = _estimator(optimizer="sgd", learning_rate=1e30)
    with pytest.raises(FloatingPointError, match="the fit diverged: .*non-finite loss"):
        est.fit(train, eval_data=test, client=client)
    assert not hasattr(est, "params_")


@pytest.mark.timeout(120)
def test_max_grad_norm_clips_every_push_and_is_checked(client, digits):
    train, test = digits
    with pytest.raises(ValueError, match="max_grad_norm"):
        _estimator(max_grad_norm=-1.0).fit(train, client=client)
    est = _estimator(max_grad_norm=1e-6).fit(train, eval_data=test, client=client)
    status = est.server_status_
    assert (status["clipped"] == status["accepted"]).all() and status["accepted"].min() > 0
    assert est.get_params()["max_grad_norm"] == 1e-6
