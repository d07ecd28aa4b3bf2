"""Guarded updates through a whole fit: a fit that diverges fails saying so, and
``max_grad_norm`` clips every push (on the session's two-worker cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from downpour_dask import DownpourSGD, datasets, models
from downpour_dask.downpour.divergence import DIVERGED_LOSS_RATIO, check_finite


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
    parameters stay finite -- but so large that the model's outputs overflow (or, in 3 of 195
    fits measured, with every hidden unit dead, give a finite loss of order 1e29).  That is not
    a trained model, and the fit must not pass for one."""
    train, test = digits
    est = _estimator(optimizer="sgd", learning_rate=1e30)
    diverged = "the fit diverged: .*(non-finite loss|times the .* it started from)"
    with pytest.raises(FloatingPointError, match=diverged):
        est.fit(train, eval_data=test, client=client)
    assert not hasattr(est, "params_")


def test_a_fit_ending_non_finite_or_far_above_its_start_is_diverged_and_others_are_not():
    """The three ways a fit ends diverged, each named in the error, and the fits that did not:
    a loss that rose, but not by orders of magnitude, and a run with no evaluations."""
    params = np.ones(5, np.float32)
    with pytest.raises(FloatingPointError, match="2 non-finite parameters .* of 5"):
        check_finite(np.array([1, np.nan, np.inf, 0, 0], np.float32), 1.0, 1.0)
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\)"):
        check_finite(params, float("nan"), 2.3)
    # all hidden units dead after a huge step: the logits are finite, and so is the loss
    with pytest.raises(FloatingPointError, match="a loss of 5.134e\\+29 .* the 2.48 it started"):
        check_finite(params, 5.134e29, 2.48)
    check_finite(params, 2.3 * DIVERGED_LOSS_RATIO, 2.3)  # up to the ratio, a noisy fit
    check_finite(params, 50.0, 0.0)  # a start of zero gives no ratio
    check_finite(params, 50.0, float("nan"))
    check_finite(params)


@pytest.mark.timeout(120)
def test_max_grad_norm_clips_every_push_and_is_checked(client, digits):
    train, test = digits
    with pytest.raises(ValueError, match="max_grad_norm"):
        _estimator(max_grad_norm=-1.0).fit(train, client=client)
    est = _estimator(max_grad_norm=1e-6).fit(train, eval_data=test, client=client)
    status = est.server_status_
    assert (status["clipped"] == status["accepted"]).all() and status["accepted"].min() > 0
    assert est.get_params()["max_grad_norm"] == 1e-6
