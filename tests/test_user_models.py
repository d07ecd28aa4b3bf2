"""A user's own numpy model, written against the model protocol only, trained by both
estimators on the shared local cluster: the reference test, Sandblaster, checkpoints and resume,
run directories; and the protocol's errors."""

import threading
import time

import numpy as np
import pytest
from distributed import Client
from sklearn.base import is_classifier, is_regressor

from downpour_dask import DownpourSGD, SandblasterLBFGS, attach, datasets, models
from downpour_dask.core import protocol
from downpour_dask.data.datasets import minibatches
from downpour_dask.runs import load_run, save_run
from downpour_dask.runs.specs import make_model


class Factorization:
    """A user's model: rating ~ mu + a_u + b_i + <U_u, V_i> for (user, item) rows, squared error
    plus ``0.5 * l2 * |params|^2``.  Nothing of downpour-dask is imported or inherited."""

    is_classifier, n_inputs, n_outputs = False, 2, 1  # X columns: user id, item id

    def __init__(self, n_users: int, n_items: int, rank: int = 2, l2: float = 1e-3):
        self.n_users, self.n_items, self.rank, self.l2 = n_users, n_items, rank, l2
        self.n_params = (n_users + n_items) * (rank + 1) + 1

    def init(self, rng):
        return (0.1 * np.random.default_rng(rng).standard_normal(self.n_params)).astype(np.float32)

    def _split(self, p):
        cut = self.n_users * (self.rank + 1)
        return p[:cut].reshape(self.n_users, -1), p[cut:-1].reshape(self.n_items, -1), p[-1:]

    def _forward(self, p, X):
        u, i = X[:, 0].astype(np.intp), X[:, 1].astype(np.intp)
        U, V, mu = self._split(p)
        return u, i, U, V, mu[0] + U[u, 0] + V[i, 0] + np.einsum("nk,nk->n", U[u, 1:], V[i, 1:])

    def loss_and_grad(self, p, X, y, out=None):
        u, i, U, V, pred = self._forward(p, X)
        r = (pred - y) / len(y)
        g = np.multiply(p, self.l2, out=out)  # the penalty's gradient, then the data's
        gU, gV, gmu = self._split(g)
        gmu += r.sum()
        np.add.at(gU, (u, 0), r)
        np.add.at(gV, (i, 0), r)
        np.add.at(gU[:, 1:], u, r[:, None] * V[i, 1:])
        np.add.at(gV[:, 1:], i, r[:, None] * U[u, 1:])
        return 0.5 * np.mean((pred - y) ** 2) + 0.5 * self.l2 * float(p @ p), g

    def predict(self, p, X):
        return self._forward(p, X)[-1].astype(np.float32)

    def score(self, p, X, y):
        return 1 - np.sum((self.predict(p, X) - y) ** 2) / np.sum((y - np.mean(y)) ** 2)


@pytest.fixture(scope="module")
def ratings():
    """Ratings of 30 users x 20 items from a rank-2 truth plus noise: (train, test) Datasets."""
    rng = np.random.default_rng(0)
    U, V = rng.standard_normal((30, 2)), rng.standard_normal((20, 2))
    users, items = rng.integers(30, size=2400), rng.integers(20, size=2400)
    y = 3 + np.einsum("nk,nk->n", U[users], V[items]) + 0.1 * rng.standard_normal(2400)
    X = np.column_stack([users, items]).astype(np.float32)
    return datasets.from_arrays(X[:2000], y[:2000]), datasets.from_arrays(X[2000:], y[2000:])


def test_the_user_model_satisfies_the_protocol_and_its_gradient_is_right(ratings):
    model = Factorization(30, 20)
    protocol.check_model(model)
    assert isinstance(model, models.TrainableModel)
    X, y = protocol.check_data(model, ratings[0].X[:50], ratings[0].y[:50])
    p = model.init(np.random.default_rng(1)).astype(np.float64)
    _, g = model.loss_and_grad(p, X, y)
    rng, eps = np.random.default_rng(2), 1e-6
    for k in rng.choice(model.n_params, 20, replace=False):
        e = np.zeros_like(p)
        e[k] = eps
        fd = (model.loss_and_grad(p + e, X, y)[0] - model.loss_and_grad(p - e, X, y)[0]) / 2 / eps
        assert g[k] == pytest.approx(fd, rel=1e-5, abs=1e-8)


def test_one_replica_one_shard_equals_the_serial_loop_with_a_user_model(client, ratings):
    """The reference test: the user's model has no ``scale=``, so the replica scales the
    gradient itself, and Downpour still equals plain serial SGD on the same data order."""
    train, test = ratings
    model = Factorization(30, 20)
    est = DownpourSGD(
        model, n_replicas=1, n_shards=1, optimizer="sgd", learning_rate=1.0, batch_size=32,
        n_fetch=1, n_push=1, max_epochs=3, random_state=5,
    ).fit(train, eval_data=test, client=client)  # fmt: skip
    params = model.init(np.random.default_rng(5))
    order = np.random.default_rng([5, 0])  # replica 0's data order
    X, y = protocol.check_data(model, train.X, train.y)
    for _ in range(3):
        for Xb, yb in minibatches(X, y, 32, order):
            _, g = model.loss_and_grad(params, Xb, yb)
            params -= np.float32(1.0) * g
    np.testing.assert_allclose(est.params_, params, rtol=0, atol=2e-5)
    assert est.score(test) > 0.5  # it learned, and score/predict go through the user's model
    assert est.experiment_.evals["r2"].notna().all() and len(est.experiment_.evals) >= 1
    assert est.experiment_.config["model"] == {
        "type": "custom", "class": f"{__name__}.Factorization", "n_params": model.n_params,
    }  # fmt: skip


def test_sandblaster_minimises_a_smooth_user_model(client, ratings):
    train, test = ratings
    model = Factorization(30, 20)
    est = SandblasterLBFGS(
        model, n_shards=2, max_iter=12, portions_per_batch=4, random_state=0, timeout=60
    )
    est.fit(train, eval_data=test, client=client)
    first = est.experiment_.evals["objective"].iloc[0]
    assert est.objective_ < 0.1 * first
    assert est.score(test) > 0.9  # the rank-2 truth is recovered up to the noise


def test_checkpoint_resume_and_run_directory_with_a_user_model(client, ratings, tmp_path):
    train, test = ratings
    settings = dict(n_replicas=2, n_shards=2, learning_rate=0.5, batch_size=32, timeout=60)
    checkpoints = tmp_path / "checkpoints"
    first = DownpourSGD(Factorization(30, 20), max_epochs=1, checkpoint_dir=checkpoints, **settings)
    first.fit(train, eval_data=test, client=client)
    est = DownpourSGD(Factorization(30, 20), max_epochs=2, **settings)
    est.fit(train, eval_data=test, client=client, resume_from=checkpoints)
    kinds = list(est.experiment_.events["kind"])
    assert "resumed" in kinds and kinds.count("start") == 2
    assert min(est.server_status_["version"]) > max(first.server_status_["version"])
    assert est.score(test) > 0.5

    class OtherModel(Factorization):
        pass

    with pytest.raises(ValueError, match="checkpoint was written for model"):
        DownpourSGD(OtherModel(30, 20), max_epochs=1, **settings).fit(
            train, client=client, resume_from=checkpoints
        )  # another model of the same size: refused, naming both

    run_dir = save_run(tmp_path / "run", est.experiment_, est.params_)
    with pytest.raises(ValueError, match=r"load_run\(path, model=\.\.\.\)"):
        load_run(run_dir)
    _, model, params = load_run(run_dir, model=Factorization(30, 20))
    np.testing.assert_array_equal(params, est.params_)
    X, y = protocol.check_data(model, test.X, test.y)
    assert model.score(params, X, y) == pytest.approx(est.score(test))
    with pytest.raises(ValueError, match="n_params=126"):
        load_run(run_dir, model=Factorization(20, 5, rank=4))


def test_a_published_run_of_a_user_model_is_attached_with_the_model(cluster, client, ratings):
    """Its config only describes the model: the view pulls parameters without it, and evaluates
    with the model given to attach."""
    train, test = ratings
    est = DownpourSGD(Factorization(30, 20), n_replicas=2, n_shards=2, learning_rate=0.5,
                      max_seconds=3.0, max_epochs=1000, random_state=0, timeout=60)  # fmt: skip
    fit = threading.Thread(target=est.fit, args=(train,), kwargs=dict(client=client,
                           publish="user-model"), daemon=True)  # fmt: skip
    fit.start()
    with Client(cluster, timeout=30) as other:
        deadline = time.monotonic() + 60
        while "user-model" not in other.list_datasets():
            assert time.monotonic() < deadline and fit.is_alive()
            time.sleep(0.05)
        bare = attach("user-model", other)
        assert bare.model is None and bare.params().shape == (Factorization(30, 20).n_params,)
        with pytest.raises(ValueError, match=r"attach\(name, client, model=\.\.\.\)"):
            bare.evaluate(test)
        view = attach("user-model", other, model=Factorization(30, 20))
        assert set(view.evaluate(test)) == {"version", "loss", "r2"}
    fit.join(timeout=60)
    assert not fit.is_alive() and hasattr(est, "params_")


class NotAModel:
    n_params = 3

    def init(self, rng):
        return np.zeros(3, np.float32)

    predict = "not a method"


def test_a_user_model_sets_the_estimators_kind_and_what_it_offers():
    est = DownpourSGD(Factorization(3, 2))
    assert is_regressor(est) and not hasattr(est, "predict_proba")  # it has no probabilities
    assert is_classifier(DownpourSGD("cnn")) and hasattr(DownpourSGD("cnn"), "predict_proba")


def test_an_object_that_is_not_a_model_is_refused_naming_what_is_missing(ratings):
    with pytest.raises(TypeError) as err:
        DownpourSGD(NotAModel()).fit(ratings[0])
    message = str(err.value)
    for member in ("n_inputs", "is_classifier", "loss_and_grad", "score", "predict (not callable)"):
        assert member in message
    assert "init" not in message.split("missing or invalid")[1].split(".")[0]
    with pytest.raises(TypeError, match="n_outputs"):
        protocol.check_model(type("Regressor", (Factorization,), {"n_outputs": 0})(3, 2))
    with pytest.raises(TypeError, match="does not satisfy the model protocol"):
        SandblasterLBFGS(object()).fit(ratings[0])


class LaxFactorization(Factorization):
    """The same model with a ``check_data`` of its own that converts and looks for nothing."""

    def check_data(self, X, y=None):
        return np.asarray(X, np.float32), None if y is None else np.asarray(y, np.float32)


@pytest.mark.parametrize("estimator", [DownpourSGD, SandblasterLBFGS])
def test_nan_features_are_refused_before_any_work_whatever_check_the_model_has(ratings, estimator):
    X, y = ratings[0].X.copy(), ratings[0].y
    X[5, 1] = np.nan
    assert protocol.checks_finite_features(Factorization(30, 20))  # the default check looks
    assert not protocol.checks_finite_features(LaxFactorization(30, 20))  # its own may not
    assert protocol.checks_finite_features(models.LogisticRegression(2))
    for model in (Factorization(30, 20), LaxFactorization(30, 20)):
        with pytest.raises(ValueError, match="NaN"):
            estimator(model).fit(X, y, client=object())  # never reaches the "client"


def test_model_parallelism_with_a_user_model_is_refused_before_any_work(ratings):
    est = DownpourSGD(Factorization(30, 20), partitions=2, n_shards=2)
    with pytest.raises(TypeError, match="only for models.MLP.*Factorization is not"):
        est.fit(ratings[0], client=object())  # never reaches the "client"


def make_factorization(n_features, n_classes):
    """A ``--model`` factory: ``downpour-dask train --model test_user_models:make_factorization``
    (with this directory on PYTHONPATH)."""
    assert n_features == 2 and n_classes is None
    return Factorization(30, 20)


def make_not_a_model(n_features, n_classes):
    return NotAModel()


def test_the_cli_model_spec_imports_a_factory_and_says_what_is_wrong():
    model = make_model(f"{__name__}:make_factorization", 2, None)
    assert isinstance(model, Factorization)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        make_model("no_such_module:f", 2, None)
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        make_model(f"{__name__}:nothing", 2, None)
    with pytest.raises(TypeError, match="the model from .*:make_not_a_model.*n_inputs"):
        make_model(f"{__name__}:make_not_a_model", 2, None)
    assert make_model("mlp:8", 4, 3) == models.MLP(4, (8,), 3)  # built-in specs stay
