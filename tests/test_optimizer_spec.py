"""An estimator's ``optimizer`` as a name, a spec with hyperparameters, or a rule
(core/optimizer_spec.py): what each builds, the errors a bad one gets, and a spec's rule applied
by the shards of a real fit."""

from __future__ import annotations

import numpy as np
import pytest

from downpour_dask import DownpourSGD, datasets, models, optim
from downpour_dask.checkpoint import read_checkpoint
from downpour_dask.core.compensation import DelayCompensated
from downpour_dask.core.optimizer_spec import build, parse, resolve
from downpour_dask.data.arrays import minibatches
from downpour_dask.simulate.calibration import rule_of


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def test_a_spec_is_a_name_and_its_options():
    assert parse("adam") == ("adam", {})
    assert parse("adam:beta2=0.95") == ("adam", {"beta2": 0.95})
    spaced = parse(" dc_adam : beta1 = 0.5 , beta2=0.99 ")
    assert spaced == ("dc_adam", {"beta1": 0.5, "beta2": 0.99})


@pytest.mark.parametrize(
    "spec,message",
    [
        ("adam:beta2", r"'beta2' is not option=value; name or name:option=value"),
        ("adam:=0.9", r"'=0.9' is not option=value"),
        ("adam:", r"'' is not option=value"),
        ("adam:beta2=0.9,beta2=0.99", r"gives 'beta2' twice"),
        ("adam:beta2=high", r"beta2='high' is not a number; .*e.g. 'adam:beta2=0.95'"),
    ],
)
def test_a_malformed_spec_is_refused_with_the_form_it_takes(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve(spec, 0.01)


def test_names_and_specs_build_the_rules_they_name():
    assert resolve("adam", 0.01) == optim.adam(0.01)
    assert resolve("adam:beta2=0.95", 0.01) == optim.adam(0.01, beta2=0.95)
    assert resolve("momentum:momentum=0.5", 0.1) == optim.momentum(0.1, 0.5)
    aware = resolve("staleness_aware_adam:beta1=0.5", 0.01)
    assert aware.get_config() == optim.staleness_aware(optim.adam(0.01, beta1=0.5)).get_config()
    compensated = resolve("dc_adam:beta2=0.99", 0.01)
    assert isinstance(compensated, DelayCompensated)
    assert compensated.rule == optim.adam(0.01, beta2=0.99)
    rule = optim.adagrad(0.1)
    assert resolve(rule, 0.1) is rule


def test_build_takes_names_and_specs_but_no_compensation():
    """What sparse fits take: ``fit_sparse`` has no delay compensation."""
    assert build("momentum:momentum=0.5", 0.1) == optim.momentum(0.1, 0.5)
    assert build("adagrad", 0.1) == optim.adagrad(0.1)
    with pytest.raises(ValueError, match="optimizer name must be one of"):
        build("dc_sgd", 0.1)


def test_dc_names_build_compensated_rules_and_bad_ones_are_named():
    rule = resolve("dc_adagrad", 0.1)
    assert isinstance(rule, DelayCompensated) and rule.rule == optim.adagrad(0.1)
    assert rule.get_config() == {"name": "dc_adagrad", "learning_rate": 0.1, "eps": 1e-8,
                                 "lam": 0.04}  # fmt: skip
    assert set(rule.init(4)) == {"sum_sq"}
    with pytest.raises(ValueError, match="delay-compensated optimizer is one of dc_sgd"):
        resolve("dc_rmsprop", 0.1)


@pytest.mark.parametrize(
    "optimizer,error,message",
    [
        ("adam:momentum=0.9", TypeError, r"unknown option.*'momentum'.*allowed: beta1, beta2, eps"),
        ("sgd:eps=0.1", TypeError, r"unknown option.*'eps'.*allowed: none"),
        ("adam:beta2=1.5", ValueError, r"beta2"),
        ("rmsprop:rho=0.9", ValueError, r"optimizer name must be one of sgd"),
        (3, TypeError, r"optimizer must be one of .* or an UpdateRule, got int"),
    ],
)
def test_a_spec_the_rule_cannot_take_names_what_it_can(optimizer, error, message):
    with pytest.raises(error, match=message):
        resolve(optimizer, 0.01)


def test_a_bad_spec_fails_the_fit_before_any_cluster_work(digits):
    """No client is given: a check that passed would start a local cluster."""
    train, _ = digits
    est = DownpourSGD(models.SoftmaxRegression(64, 10), optimizer="adam:beta3=0.9",
                      learning_rate=0.01)  # fmt: skip
    with pytest.raises(TypeError, match=r"unknown option.*'beta3'.*allowed: beta1, beta2, eps"):
        est.fit(train)


def test_the_shards_of_a_fit_apply_the_rule_its_spec_names(client, digits, tmp_path):
    """One replica, one push: the checkpointed Adam moments are exactly those of beta1 = 0.5 and
    beta2 = 0.95 after one step on the first batch's gradient (0.5 g and 0.05 g**2)."""
    train, _ = digits
    model = models.MLP(64, (16,), 10)
    est = DownpourSGD(
        model, n_replicas=1, n_shards=1, optimizer="adam:beta1=0.5,beta2=0.95",
        learning_rate=0.01, batch_size=32, n_push=1, max_steps=1, random_state=3,
        checkpoint_dir=tmp_path,
    ).fit(train, client=client)  # fmt: skip
    params = model.init(np.random.default_rng(3))
    Xb, yb = next(minibatches(train.X, train.y, 32, np.random.default_rng([3, 0])))
    _, g = model.loss_and_grad(params, Xb, yb)
    (saved,) = read_checkpoint(tmp_path).shards
    assert int(saved.rule_state["t"]) == 1
    np.testing.assert_allclose(saved.rule_state["m"], 0.5 * g, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(saved.rule_state["v"], 0.05 * g * g, rtol=1e-4, atol=1e-12)
    assert est.experiment_.config["optimizer"] == "adam:beta1=0.5,beta2=0.95"


def test_the_simulator_calibrates_from_a_run_whose_optimizer_is_a_spec():
    """``downpour-dask simulate --from RUN_DIR`` rebuilds the run's rule from its config."""
    rule = rule_of({"optimizer": "dc_adam:beta2=0.95", "learning_rate": 0.01})
    assert isinstance(rule, DelayCompensated) and rule.rule == optim.adam(0.01, beta2=0.95)
    assert rule_of({"optimizer": optim.adam(0.02).get_config(), "learning_rate": 0.02}) == (
        optim.adam(0.02)
    )
    assert rule_of({"learning_rate": 0.05}) == optim.adagrad(0.05)  # the estimator's default
    compensated = resolve("dc_adam:beta2=0.9", 0.01)  # a rule given as an object: its config
    rebuilt = rule_of({"optimizer": compensated.get_config(), "learning_rate": 0.01})
    assert isinstance(rebuilt, DelayCompensated)
    assert rebuilt.get_config() == compensated.get_config()
