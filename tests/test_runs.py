"""Training jobs from settings: data and model names, checks before any work, run directories."""

import json

import numpy as np
import pytest

from downpour_dask import models, runs
from downpour_dask.log import Experiment


@pytest.mark.parametrize(
    "spec, kind, hidden",
    [("mlp:128,64", models.MLP, (128, 64)), ("mlp", models.MLP, (128,)),
     ("softmax", models.SoftmaxRegression, None)],
)  # fmt: skip
def test_model_specs(spec, kind, hidden):
    model = runs.make_model(spec, 64, 10)
    assert isinstance(model, kind)
    if hidden:
        assert model.get_config()["hidden"] == list(hidden)
    assert isinstance(runs.make_model("logistic", 5, 2), models.LogisticRegression)
    assert isinstance(runs.make_model("linear", 5, None), models.LinearRegression)


@pytest.mark.parametrize(
    "spec, n_classes, message",
    [
        ("mlp:0", 10, "hidden widths must be >= 1"),
        ("softmax:3", 10, "only mlp takes arguments"),
        ("logistic", 10, "needs labels 0/1"),
        ("softmax", None, "is a classifier"),
        ("resnet", 10, "unknown model 'resnet'"),
    ],
)
def test_bad_model_specs_say_what_is_allowed(spec, n_classes, message):
    with pytest.raises(ValueError, match=message):
        runs.make_model(spec, 64, n_classes)


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"n_replica": 2}, ValueError, "unknown setting.*n_replica.*allowed:.*n_replicas"),
        ({"algorithm": "hogwild"}, ValueError, "algorithm must be one of"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"name": "../escape"}, ValueError, "plain directory name"),
        ({"dataset": "nowhere/*.parquet"}, (ValueError, FileNotFoundError), "nowhere"),
        (
            {"algorithm": "sandblaster", "eval_every": 2},
            ValueError,
            "eval_every is downpour's evaluation interval.*use eval_every_iter",
        ),
    ],
)
def test_prepare_rejects_bad_settings_before_writing_anything(tmp_path, settings, error, message):
    with pytest.raises(error, match=message):
        runs.prepare({"dataset": "digits", "out": str(tmp_path / "runs"), **settings})
    assert not (tmp_path / "runs").exists()


def test_prepare_refuses_an_existing_run_directory(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text('{"model": {}}')  # a run's directory
    with pytest.raises(FileExistsError, match="taken"):
        runs.prepare({"dataset": "digits", "out": str(tmp_path), "name": "taken"})
    job = runs.prepare(
        {"dataset": "digits", "out": str(tmp_path), "name": "taken", "overwrite": True}
    )
    assert job.target == tmp_path / "taken"


@pytest.mark.parametrize("config", [None, "not json", "[1, 2]"])
def test_overwrite_never_replaces_a_directory_that_is_not_a_run(tmp_path, config):
    """A user's directory that happens to have the run's name keeps everything in it; only a
    directory with a run's config.json (a JSON object) is a run directory."""
    mine = tmp_path / "taken"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    if config is not None:
        (mine / "config.json").write_text(config)
    settings = {"dataset": "digits", "out": str(tmp_path), "name": "taken", "overwrite": True}
    with pytest.raises(FileExistsError, match="not a run directory.*nothing was deleted"):
        runs.prepare(settings)
    with pytest.raises(FileExistsError, match="not a run directory"):
        runs.save_run(mine, Experiment(), np.zeros(3), overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no staging left either


def test_overwrite_replaces_a_run_directory(tmp_path):
    first = runs.save_run(tmp_path / "run", Experiment(config={"n": 1}), np.zeros(3))
    with pytest.raises(FileExistsError, match="exists"):
        runs.save_run(first, Experiment(config={"n": 2}), np.ones(3))
    runs.save_run(first, Experiment(config={"n": 2}), np.ones(3), overwrite=True)
    assert json.loads((first / "config.json").read_text())["n"] == 2
    with np.load(first / "params.npz") as saved:
        np.testing.assert_array_equal(saved["params"], np.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.timeout(120)
def test_a_failed_fit_leaves_no_run_directory(tmp_path, client):
    job = runs.prepare(
        {"dataset": "digits", "model": "softmax", "out": str(tmp_path), "name": "failed",
         "max_epochs": 1, "timeout": 10}
    )  # fmt: skip  # a replica the interrupt leaves behind gives up on its shards within 10 s

    def interrupt(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runs.run(job, client, callback=interrupt)
    assert list(tmp_path.iterdir()) == []
    result = runs.run(job, client)
    experiment, model, params = runs.load_run(result.path)
    np.testing.assert_array_equal(params, result.estimator.params_)
    assert model.get_config() == result.estimator.model.get_config()
    assert experiment.config["dataset"] == "digits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed"]  # no staging leftovers
