"""Sandblaster L-BFGS: shard vector machine, coordinator, and the estimator on real clusters."""

import asyncio
import concurrent.futures
import gc
import os
import signal
import threading
import time

import numpy as np
import pandas as pd
import pytest
import scipy.optimize
from distributed import Client, LocalCluster

from downpour_dask import Experiment, datasets, models, optim
from downpour_dask.core.lbfgs import LBFGS
from downpour_dask.core.params import split_range
from downpour_dask.core.vectors import VectorStore, sum_replies, written
from downpour_dask.ps.protocol import ShardLostError
from downpour_dask.ps.server import ParameterServer
from downpour_dask.runtime.cluster import cluster_workers
from downpour_dask.sandblaster.coordinator import Coordinator
from downpour_dask.sandblaster.estimator import SandblasterLBFGS
from downpour_dask.sandblaster.portions import Portions
from downpour_dask.sandblaster.runners import RunnerCall, Runners
from downpour_dask.sandblaster.shard import Finish, SandblasterShard


@pytest.fixture(scope="module")
def digits_binary():
    train, test = datasets.load("digits")
    return (train.X, (train.y >= 5).astype(np.int64)), (test.X, (test.y >= 5).astype(np.int64))


def serial_objective(model, params, X, y):
    """The model's objective and gradient in float64 on the full data."""
    return model.loss_and_grad(np.asarray(params, np.float64), X.astype(np.float64), y)


def l2_mask(model):
    mask = np.zeros(model.layout.size)
    for name, shape in model.layout.shapes.items():
        if len(shape) == 2:
            lo, hi = model.layout.offsets[name]
            mask[lo:hi] = model.l2
    return mask


class InProcessSpace:
    """The coordinator's Space over K in-process VectorStores and a serial gradient: no Dask."""

    def __init__(self, model, X, y, x0, n_shards=3):
        self.ranges = split_range(len(x0), n_shards)
        self.stores = [VectorStore(hi - lo) for lo, hi in self.ranges]
        mask = l2_mask(model)
        for store, (lo, hi) in zip(self.stores, self.ranges):
            store.set("x", x0[lo:hi])
            store.set("l2mask", mask[lo:hi])
        self.model = models.from_config({**model.get_config(), "l2": 0.0})
        self.X, self.y = X.astype(np.float64), y

    def run(self, program):
        return self._on_shards(program)

    def _on_shards(self, program):
        return sum_replies([store.run(program) for store in self.stores])

    def evaluate(self, batch, prelude, finish):
        self._on_shards(prelude)
        xt = np.concatenate([store["xt"] for store in self.stores])
        loss, grad = self.model.loss_and_grad(xt, self.X, self.y)
        for store, (lo, hi) in zip(self.stores, self.ranges):
            store.set("acc", grad[lo:hi])  # the mean gradient, as the shards leave it
        n = len(self.X)
        return loss * n, n, self._on_shards(finish)


# -- the vector machine and the coordinator, in one process ---------------------------------------


def test_vector_store_commands_and_sharded_dot_products():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(10), rng.standard_normal(10)
    stores = [VectorStore(hi - lo) for lo, hi in split_range(10, 3)]
    for store, (lo, hi) in zip(stores, split_range(10, 3)):
        store.set("a", a[lo:hi])
        store.set("b", b[lo:hi])
    program = [
        ("copy", "a", "c"),
        ("axpy", 2.0, "b", "c"),  # c = a + 2b
        ("scale", "c", 0.5),  # c = a/2 + b
        ("mul", "a", "b", "e"),
        ("zero", "z"),
        ("dot", "c", "a"),
        ("dot", "e", "e"),
        ("dot", "z", "z"),
    ]
    dots = sum_replies([store.run(program) for store in stores])
    c = a / 2 + b
    np.testing.assert_allclose(dots, [c @ a, (a * b) @ (a * b), 0.0], rtol=1e-12)
    assert written(program) == {"c", "e", "z"}  # what a restore point must follow
    with pytest.raises(ValueError, match="unknown vector command"):
        stores[0].run([("frobnicate", "a")])
    with pytest.raises(KeyError, match="no vector named 'nope'"):
        stores[0].run([("dot", "a", "nope")])


def test_two_loop_direction_equals_the_dense_lbfgs_inverse_hessian():
    rng = np.random.default_rng(1)
    n, m = 12, 4
    space = InProcessSpace(models.LinearRegression(n - 1), np.zeros((1, n - 1)), None, np.zeros(n))
    opt = LBFGS(space, history=m)
    g = rng.standard_normal(n)
    pairs = []
    for _ in range(6):  # more pairs than the memory: only the newest m are used
        s = rng.standard_normal(n)
        y = s + 0.1 * rng.standard_normal(n)  # s'y > 0
        for store, (lo, hi) in zip(space.stores, space.ranges):
            store.set("d", s[lo:hi])
            store.set("acc", (y + g)[lo:hi])
            store.set("g", g[lo:hi])
            store.set("xt", np.zeros(hi - lo))
        opt._accept(1.0)  # s = 1 * d, y = acc - g, then g = acc
        pairs.append((s, y))
    assert len(opt.history) == m
    g = np.concatenate([store["g"] for store in space.stores])  # the last accepted gradient
    program, gd = opt.history.direction()  # from inner products only, no round trip
    space.run(program)
    d = np.concatenate([store["d"] for store in space.stores])
    s_new, y_new = pairs[-1]
    H = (s_new @ y_new) / (y_new @ y_new) * np.eye(n)
    for s, y in pairs[-m:]:  # the BFGS inverse-Hessian update, densely
        rho = 1.0 / (s @ y)
        V = np.eye(n) - rho * np.outer(y, s)
        H = V.T @ H @ V + rho * np.outer(s, s)
    np.testing.assert_allclose(d, -H @ g, rtol=1e-9, atol=1e-12)
    assert gd == pytest.approx(g @ d, rel=1e-12)


def test_coordinator_in_process_matches_scipy(digits_binary):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-3)
    x0 = model.init(np.random.default_rng(0)).astype(np.float64)
    events = []
    result = LBFGS(
        InProcessSpace(model, X, y, x0), max_iter=300, tol=1e-12,
        log=lambda kind, detail, **data: events.append((kind, data)),
    ).minimize()  # fmt: skip
    ref = scipy.optimize.minimize(
        lambda w: serial_objective(model, w, X, y), x0, jac=True, method="L-BFGS-B",
        options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 2000},
    )  # fmt: skip
    assert result.reason == "converged"
    assert abs(result.objective - ref.fun) / ref.fun < 1e-8
    kind, data = events[-1]  # why it stopped, as data
    assert kind == "converged" and data["iteration"] == result.n_iter
    assert data["objective"] == result.objective and data["rule"]
    searches = [data for kind, data in events if kind == "line_search"]
    assert [d["iteration"] for d in searches] == list(range(1, result.n_iter + 1))


class CountingSpace(InProcessSpace):
    """Counts the coordinator's shard round trips (programs) and distributed passes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.programs = self.passes = 0

    def run(self, program):
        self.programs += 1
        return super().run(program)

    def evaluate(self, batch, prelude, finish):
        self.passes += 1  # the prelude and the finish travel with the pass
        return super().evaluate(batch, prelude, finish)


@pytest.mark.parametrize("history", [2, 10])
def test_shard_round_trips_per_iteration_do_not_grow_with_the_history(digits_binary, history):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-3)
    x0 = model.init(np.random.default_rng(0)).astype(np.float64)
    space = CountingSpace(model, X, y, x0)
    result = LBFGS(space, history=history, max_iter=25, tol=0.0).minimize()
    assert result.n_iter == 25
    # none after a pass (the gradient's scaling and the step's accept run with it): the first
    # gradient's, one per line search that expanded and went back to its best trial, one to undo
    # a last trial not taken; none per history pair, none of its own per accepted step
    assert space.programs <= 2 + result.n_iter // 2


def test_a_trial_the_line_search_does_not_take_is_undone_on_the_shards(digits_binary):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-3)
    x0 = model.init(np.random.default_rng(0)).astype(np.float64)
    space, events = CountingSpace(model, X, y, x0), []
    result = LBFGS(
        space, history=5, max_iter=30, tol=0.0,
        log=lambda kind, detail, **data: events.append((kind, data)),
    ).minimize()  # fmt: skip
    trials = [d["evaluations"] for kind, d in events if kind == "line_search"]
    assert max(trials) >= 2  # some trials were accepted speculatively and then undone
    assert space.programs == 1  # ... at no round trip of their own (the first gradient's)
    x = np.concatenate([store["x"] for store in space.stores])
    g = np.concatenate([store["g"] for store in space.stores])
    loss, grad = serial_objective(model, x, X, y)
    assert result.objective == pytest.approx(loss, rel=1e-10)  # x is the accepted iterate
    np.testing.assert_allclose(g, grad, rtol=1e-8, atol=1e-12)  # ... and g its gradient


def test_shard_counts_each_portion_once_and_discards_stale_copies():
    shard = SandblasterShard(0, 0, 3, np.zeros(3, np.float32), optim.sgd(1.0), l2mask=np.zeros(3))
    version, values = asyncio.run(shard.begin([("copy", "x", "xt")]))
    assert values is None  # sent only when asked
    grad = np.array([1.0, 2.0, 3.0], np.float32)
    assert asyncio.run(shard.accumulate(version, 7, grad, 10)) == (True, None)
    assert asyncio.run(shard.accumulate(version, 7, grad, 10)) == (False, None)  # a backup copy
    assert asyncio.run(shard.accumulate(version - 1, 8, grad, 10)) == (False, None)  # an older one
    np.testing.assert_array_equal(asyncio.run(shard.vector("acc")), 10 * grad)
    assert shard.duplicates == 2 and shard.examples == 10
    assert asyncio.run(shard.fetch(version - 1)) is None
    assert asyncio.run(shard.fetch(version)) is not None


def test_the_portion_completing_a_batch_runs_its_finish_on_the_shard_and_brings_the_result():
    shard = SandblasterShard(0, 0, 3, np.zeros(3, np.float32), optim.sgd(1.0), l2mask=np.zeros(3))
    program = [("dot", "acc", "acc"), ("copy", "acc", "x")]
    ending = Finish(frozenset({4, 5}), program, ("x",))
    version, _ = asyncio.run(shard.begin([("copy", "x", "xt")], "xt", False, ending))
    grad = np.array([1.0, 2.0, 3.0], np.float32)
    assert asyncio.run(shard.accumulate(version, 4, grad, 10)) == (True, None)
    assert asyncio.run(shard.finished(version)) is None  # portion 5 is still out
    accepted, done = asyncio.run(shard.accumulate(version, 5, 3 * grad, 30))
    mean = (10 * grad + 90 * grad) / 40  # acc is the mean gradient when the program runs
    assert accepted and done.dots == pytest.approx([mean @ mean])
    np.testing.assert_allclose(done.copies[0], mean)  # x as the program left it
    assert asyncio.run(shard.accumulate(version, 5, grad, 10)) == (False, None)  # runs once
    assert asyncio.run(shard.finished(version)) is done
    np.testing.assert_allclose(asyncio.run(shard.vector("acc")), mean)
    assert asyncio.run(shard.finished(version - 1)) is None  # only the current batch's
    shard.RETURNED_COPY_BYTES = 8  # a large model's iterate stays on the shard until asked
    version, _ = asyncio.run(shard.begin([], "xt", False, Finish(frozenset({0}), program, ("x",))))
    accepted, done = asyncio.run(shard.accumulate(version, 0, grad, 1))
    assert accepted and done.copies == [] and done.dots == pytest.approx([grad @ grad])
    np.testing.assert_allclose(asyncio.run(shard.finished(version)).copies[0], grad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"history": 0}, "history must be >= 1, got 0"),
        ({"max_iter": -1}, "max_iter must be >= 0, got -1"),
        ({"batch_size": 2.5}, "batch_size must be an int or None"),
        ({"portions_per_batch": 0}, "portions_per_batch must be >= 1"),
        ({"tol": -1.0}, "tol must be a finite number >= 0"),
        ({"backup_tasks": "yes"}, "backup_tasks must be True or False"),
        ({"c1": 0.95}, "0 < c1 < c2 < 1"),
        ({"n_shards": 10_000}, "n_shards must be between 1 and 65, got 10000"),
        ({"eval_every_iter": 0}, "eval_every_iter must be >= 1, got 0"),
        ({"eval_every_iter": 0.5}, "eval_every_iter must be an int"),
    ],
)
def test_bad_arguments_raise_before_any_cluster_work(kwargs, message, digits_binary):
    (X, y), _ = digits_binary
    est = SandblasterLBFGS(models.LogisticRegression(64), **kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        est.fit(X, y, client=object())  # never used: the check comes first


def test_files_as_eval_data_are_refused_not_gathered_into_the_driver(tmp_path):
    train, _ = datasets.load("digits")
    frame = pd.DataFrame(train.X, columns=[f"x{i}" for i in range(64)]).assign(label=train.y)
    frame.to_parquet(tmp_path / "part-0.parquet")
    files = datasets.from_parquet(str(tmp_path / "part-0.parquet"), label="label")
    est = SandblasterLBFGS(models.SoftmaxRegression(64, 10))
    with pytest.raises(TypeError, match=r"eval_data is a \w+ .*gather it whole") as error:
        est.fit(train, eval_data=files, client=object())  # refused before any cluster work
    assert "eval_data.to_dataset()" in str(error.value)
    in_memory = files.to_dataset()  # the explicit way, for data that fits in memory
    assert in_memory.n_rows == train.n_rows


# -- the estimator on the session's 2-worker cluster ----------------------------------------------


@pytest.mark.timeout(120)
def test_final_objective_matches_scipy_lbfgsb(client, digits_binary):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-3)
    est = SandblasterLBFGS(model, portions_per_batch=4, max_iter=100, tol=1e-9, random_state=0).fit(
        X, y, client=client
    )
    x0 = model.init(np.random.default_rng(0)).astype(np.float64)
    ref = scipy.optimize.minimize(
        lambda w: serial_objective(model, w, X, y), x0, jac=True, method="L-BFGS-B",
        options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 2000},
    )  # fmt: skip
    ours = serial_objective(model, est.params_, X, y)[0]
    print(f"objective: sandblaster {ours:.8f}, scipy {ref.fun:.8f}, {est.n_iter_} iterations")
    assert abs(ours - ref.fun) / ref.fun <= 1e-4
    assert est.objective_ == pytest.approx(ours, rel=1e-5)
    run = est.experiment_
    assert len(run.evals) == est.n_iter_ + 1 and run.evals["objective"].is_monotonic_decreasing
    kinds = set(run.events["kind"])
    assert {"start", "batch_start", "batch_done", "line_search", "stop"} <= kinds
    assert run.events["kind"].iloc[0] == "start" and run.events["kind"].iloc[-1] == "stop"
    data = dict(zip(run.events["kind"], run.events["data"]))  # the last of each kind
    assert data["stop"] == {"reason": est.experiment_.config["reason"], "iterations": est.n_iter_}
    assert data["start"]["portions"] == 4 and data["start"]["batches"] == 1
    batches = run.events.loc[run.events["kind"] == "batch_done", "data"]
    assert all(d["portions"] == 4 for d in batches)
    if "converged" in kinds:
        assert data["converged"]["iteration"] == est.n_iter_
    # every counted portion is one pushes row; each batch covers the data exactly once
    per_batch = run.pushes.groupby("version")["examples"].sum()
    assert (per_batch == len(X)).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backup_tasks", [True, False])
def test_accumulated_gradient_equals_the_serial_full_data_gradient(client, backup_tasks):
    train, _ = datasets.load("digits")
    model = models.MLP(64, (16,), 10, l2=1e-2)
    est = SandblasterLBFGS(
        model, n_shards=3, portions_per_batch=13, max_iter=0, backup_tasks=backup_tasks,
        random_state=3,
    ).fit(train, client=client)  # fmt: skip
    params = model.init(np.random.default_rng(3))
    np.testing.assert_array_equal(est.params_, params)
    loss, grad = serial_objective(model, params, train.X, train.y)
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)
    assert est.experiment_.pushes["examples"].sum() == train.n_rows


@pytest.mark.timeout(120)
def test_a_pass_ends_on_the_shards_with_no_call_of_the_coordinator_after_it(
    client, digits_binary, monkeypatch
):
    """The gradient's scaling, the step's accept and their dot products run on each shard once
    its batch is complete, and come back with the portion that completed it."""
    (X, y), _ = digits_binary
    calls, call_all = [], ParameterServer.call_all

    def counting(self, method, *args, **kwargs):
        calls.append(method.__name__)
        return call_all(self, method, *args, **kwargs)

    monkeypatch.setattr(ParameterServer, "call_all", counting)
    model = models.LogisticRegression(64, l2=1e-2)
    fit = SandblasterLBFGS(model, max_iter=8, tol=0.0, random_state=0).fit
    est = fit(X, y, client=client)
    passes = calls.count("begin")
    assert passes >= 8
    programs = calls.count("run") + calls.count("run_and_copy")
    assert programs <= 2 + passes // 2  # the first gradient's, and expansions gone back on
    loss, grad = serial_objective(model, est.params_, X, y)
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)
    calls.clear()
    client.run(_copies_stay_on_the_shards, 0)  # as a large model's iterate would
    try:
        large = fit(X, y, client=client)
    finally:
        client.run(_copies_stay_on_the_shards, SandblasterShard.RETURNED_COPY_BYTES)
    # the iterate fetched after each pass that moved it: all but the first gradient's
    assert calls.count("finished") == calls.count("begin") - 1
    np.testing.assert_array_equal(large.params_, est.params_)  # the same fit either way


@pytest.mark.timeout(120)
def test_a_pass_is_not_held_back_by_the_last_ones_releases_and_its_score_adds_no_round_trip(
    client, digits_binary, monkeypatch
):
    """A Dask client sends the scheduler at most one batch of messages per 10 ms: a release
    sent a few ms before a pass's submissions would hold those back.  So a batch's portions and
    a finished score are released only after a later batch was submitted (the last ones at the
    end of the fit); a score is submitted with the next pass's portions, and its snapshot of the
    iterate leads that pass's prelude on the shards instead of a program of its own.  (Every
    portion goes as a task here: one whose block is in memory would go to a runner, through
    no scheduler; a block that must move still goes as a task.)"""
    (X, y), test = digits_binary
    monkeypatch.setattr(Portions, "RUNNERS", False)
    recorded, send = [], client._send_to_scheduler
    programs, call_all = [], ParameterServer.call_all

    def recording(msg):
        for key in map(str, msg.get("keys", ())):
            if key.startswith("portion-"):  # (a batch's portions by their batch)
                recorded.append((msg["op"], int(key.split("-")[2][1:]), key))
            elif key.startswith("evaluate_task-"):
                recorded.append((msg["op"], key, key))
        return send(msg)

    def sent() -> list[tuple]:  # this fit's: not an earlier fit's releases
        ours = {key for op, _, key in recorded if op == "update-graph"}
        return [(op, what) for op, what, key in list(recorded) if key in ours]

    def counting(self, method, *args, **kwargs):
        programs.append(method.__name__ in ("run", "run_and_copy"))
        return call_all(self, method, *args, **kwargs)

    monkeypatch.setattr(client, "_send_to_scheduler", recording)
    monkeypatch.setattr(ParameterServer, "call_all", counting)
    fit = SandblasterLBFGS(
        models.LogisticRegression(64, l2=1e-2), max_iter=6, tol=0.0, random_state=0
    ).fit  # fmt: skip
    scored = fit(X, y, eval_data=test, client=client)
    with_scores, programs[:] = sum(programs), []
    assert scored.experiment_.evals["accuracy"].notna().all()  # every iteration was scored
    batches = [v for op, v in sent() if op == "update-graph" and isinstance(v, int)]
    last = max(batches)
    scores = [k for op, k in sent() if op == "update-graph" and k not in batches]
    assert last >= 6 and len(scores) == len(scored.experiment_.evals)

    went_with, waiting = {}, []  # the batch each score was submitted with
    for op, what in sent():
        if op == "update-graph" and isinstance(what, int):
            went_with.update((score, what) for score in waiting)
            waiting = []
        elif op == "update-graph":
            waiting.append(what)
    assert waiting == scores[-1:]  # each went with a batch, but the final score
    # A dropped future is released from the client's event loop: wait for the releases due
    # in the fit.  A pass whose wait for its portions timed out leaves a reference cycle
    # (through the TimeoutError's traceback) that holds its futures until Python's cycle
    # collector runs, so run it; a release it brings comes late, never early.
    due = set(range(2, last)) | {k for k, batch in went_with.items() if batch < last}
    deadline = time.monotonic() + 30
    while not due <= {what for op, what in sent() if op == "client-releases-keys"}:
        assert time.monotonic() < deadline, (due, sent())
        gc.collect()
        time.sleep(0.01)
    submitted = 0  # the newest batch submitted so far
    for op, what in sent():
        if op == "update-graph" and isinstance(what, int):
            submitted = max(submitted, what)
        elif op == "client-releases-keys" and isinstance(what, int):  # a batch's portion
            assert what < submitted or what == last, (what, submitted)
        elif op == "client-releases-keys" and what in went_with:  # a score: after a batch
            batch = went_with[what]  # after its own (the last batch's: at the end)
            assert submitted > batch or batch == last, (what, batch, submitted)
    fit(X, y, client=client)  # the same fit without eval_data
    assert with_scores <= sum(programs) + 1  # one: the final score's snapshot (no pass left)


def test_scores_go_to_the_runner_holding_the_evaluation_data_and_fall_back_to_tasks(
    client, digits_binary, monkeypatch
):
    """Each iteration's score goes straight to the runner of the worker holding the evaluation
    data, not through the scheduler; a runner that does not hold it (its worker was replaced,
    say) answers so, and the scores go as Dask tasks from then on, none missing."""
    (X, y), test = digits_binary
    submitted, scored, score = [], [], Runners.score
    submit = client.submit

    def recording_submit(func, *args, **kwargs):
        submitted.append(getattr(func, "__name__", ""))
        return submit(func, *args, **kwargs)

    def recording_score(self, worker, data_key, *args):
        scored.append(worker)
        return score(self, worker, data_key, *args)

    monkeypatch.setattr(client, "submit", recording_submit)
    monkeypatch.setattr(Runners, "score", recording_score)
    fit = SandblasterLBFGS(
        models.LogisticRegression(64, l2=1e-2), max_iter=4, tol=0.0, random_state=0
    ).fit  # fmt: skip
    est = fit(X, y, eval_data=test, client=client)
    assert est.experiment_.evals["accuracy"].notna().all()
    assert len(scored) == len(est.experiment_.evals) and "evaluate_task" not in submitted

    def not_there(self, worker, data_key, *args):  # as a replaced worker would answer
        reply: concurrent.futures.Future = concurrent.futures.Future()
        reply.set_result(("ok", None))
        scored.append(worker)
        return RunnerCall(reply)

    scored.clear()
    monkeypatch.setattr(Runners, "score", not_there)
    est = fit(X, y, eval_data=test, client=client)
    assert est.experiment_.evals["accuracy"].notna().all()
    assert len(scored) == 1  # asked once; every score after it went as a task
    assert submitted.count("evaluate_task") == len(est.experiment_.evals)


def _copies_stay_on_the_shards(limit: int) -> None:
    SandblasterShard.RETURNED_COPY_BYTES = limit


def _count_accumulate_messages(dask_worker) -> None:
    """Count the ``accumulate`` actor messages this worker receives."""
    received = dask_worker.handlers["actor_execute"]
    dask_worker.accumulate_messages = 0

    async def counting(**message):
        dask_worker.accumulate_messages += message.get("function") == "accumulate"
        return await received(**message)

    dask_worker.handlers["actor_execute"] = counting


def _stop_counting(dask_worker) -> int:
    dask_worker.handlers["actor_execute"] = dask_worker.actor_execute
    return dask_worker.accumulate_messages


@pytest.mark.timeout(120)
def test_a_portion_adds_to_a_shard_in_its_own_process_without_an_actor_message(
    client, digits_binary
):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-2)
    client.run(_count_accumulate_messages)
    try:
        est = SandblasterLBFGS(
            model, n_shards=2, portions_per_batch=4, max_iter=2, backup_tasks=False,
            random_state=0,
        ).fit(X, y, client=client)  # fmt: skip
    finally:
        messages = sum(client.run(_stop_counting).values())
    calls = 2 * len(est.experiment_.pushes)  # every counted portion called both shards
    assert messages < calls  # the calls to a shard on the portion's own worker were direct
    loss, grad = serial_objective(model, est.params_, X, y)  # ... and counted exactly once
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)


def _fail_fetches(dask_worker) -> None:
    """Make every Sandblaster shard on this worker fail a fetch of the published point."""

    async def fetch(self, version):
        raise RuntimeError("a portion task fetched the point")

    dask_worker.real_fetch = SandblasterShard.fetch
    SandblasterShard.fetch = fetch


def _mend_fetches(dask_worker) -> None:
    SandblasterShard.fetch = dask_worker.real_fetch


@pytest.mark.timeout(120)
def test_a_small_models_point_travels_with_its_tasks_and_a_large_ones_is_fetched(
    client, digits_binary, monkeypatch
):
    (X, y), _ = digits_binary
    fit = SandblasterLBFGS(
        models.LogisticRegression(X.shape[1], l2=1e-3), max_iter=3, random_state=0, timeout=30
    ).fit  # fmt: skip
    client.run(_fail_fetches)
    try:
        inline = fit(X, y, client=client)  # no task fetched anything
        monkeypatch.setattr(Portions, "INLINE_POINT_BYTES", 0)  # every model is large now
        with pytest.raises(RuntimeError, match="fetched the point"):
            fit(X, y, client=client)
    finally:
        client.run(_mend_fetches)
    fetched = fit(X, y, client=client)
    np.testing.assert_array_equal(fetched.params_, inline.params_)  # the same point either way


def _running(dask_worker) -> list[str]:
    return [str(key) for key in dask_worker.active_threads.values()]


def _wait_idle(client: Client, workers: list[str] | None = None, timeout: float = 90) -> None:
    """Until no task runs in the workers' threads (a condition, not a guessed sleep)."""
    deadline = time.monotonic() + timeout
    while any(client.run(_running, workers=workers).values()):
        assert time.monotonic() < deadline, "the workers never became idle"
        time.sleep(0.05)


@pytest.mark.slow  # seconds of training (or processes): out of the quick loop
@pytest.mark.timeout(120)
def test_backup_tasks_beat_a_straggler_and_the_gradient_stays_exact(client, digits_binary):
    (X, y), _ = digits_binary
    slow = sorted(cluster_workers(client))[1]
    model = models.LogisticRegression(64, l2=1e-2)
    reference = None
    straggler_portions = {}
    for backup in (False, True):
        # The straggler's copies race the healthy worker's: 2 s leaves a busy machine's worker
        # time to finish the copies (0.5 s did not once, in a loaded test run).  Without backups
        # every batch waits for the straggler: 0.5 s keeps that run short.
        est = SandblasterLBFGS(
            model, portions_per_batch=10, max_iter=2, backup_tasks=backup, random_state=0
        ).fit(X, y, client=client, portion_delay={slow: 2.0 if backup else 0.5})
        events = est.experiment_.events
        kinds = events["kind"]
        pushed_by = est.experiment_.config["push_workers"]  # a push row's replica -> worker
        counted = [pushed_by[r] for r in est.experiment_.pushes["replica"]]
        straggler_portions[backup] = counted.count(slow)
        for data in events.loc[kinds == "backup_launched", "data"]:  # off the straggler
            assert data["straggler"] == slow and data["worker"] != slow
        for data in events.loc[kinds == "portion_reassigned", "data"]:  # not started there
            assert data["holders"] == [slow] and data["worker"] != slow
        loss, grad = serial_objective(model, est.params_, X, y)
        np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
        assert est.objective_ == pytest.approx(loss, rel=1e-6)
        assert ("backup_launched" in set(kinds)) == backup
        if reference is None:
            reference = est.params_
        else:  # backup copies change the timing, never the result
            np.testing.assert_allclose(est.params_, reference, rtol=1e-5, atol=1e-6)
        _wait_idle(client)  # the straggler's leftover copies drain before the next run
    print(f"portions counted from the straggler: {straggler_portions}")
    assert straggler_portions[False] > 0  # without backups, its portions count: batches wait
    # With backups no batch waits for the straggler: its portions not started yet go to the
    # healthy worker, the ones it started are copied there, and those copies finish long
    # before its own (each sleeps 2 s), even with 10 portions for 2 slots of 4 (when the
    # portions it had not started waited for it, its first copy counted in a batch it held up).
    # The speed-up itself is measured by benchmarks/bench_backup_tasks.py.
    assert straggler_portions[True] == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_straggler_outliving_its_fit_does_not_call_the_released_shards(digits_binary, capfd):
    """A straggler's copies still sleep when its fit ends (backups finished the batch); once
    they wake they must stop, not call shards that are gone: Dask would log a KeyError
    traceback on the worker for every such call."""
    (X, y), _ = digits_binary
    with (  # its own cluster: the workers write to this test's captured stderr
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        slow = sorted(cluster_workers(client))[1]
        est = SandblasterLBFGS(
            models.LogisticRegression(64, l2=1e-2), portions_per_batch=4, max_iter=2,
            random_state=0,
        ).fit(X, y, client=client, portion_delay={slow: 0.5})  # fmt: skip
        assert "backup_launched" in set(est.experiment_.events["kind"])
        _wait_idle(client)  # the straggler's copies woke up and finished
    err = capfd.readouterr().err
    assert "KeyError: 'sandblastershard" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_killed_mid_batch_loses_nothing(digits_binary, three_workers, kill_during_fit):
    (X, y), _ = digits_binary
    model = models.LogisticRegression(64, l2=1e-2)
    client = three_workers
    workers = sorted(cluster_workers(client))
    victim = workers[2]  # shards go to workers[0] and workers[1]
    est = SandblasterLBFGS(model, portions_per_batch=24, max_iter=0, random_state=0)
    delay = {w: 0.25 for w in workers}  # a batch takes ~2 s: the kill lands inside it
    done = kill_during_fit(
        client, victim, lambda: est.fit(X, y, client=client, portion_delay=delay)
    )
    assert "est" in done, done.get("error")
    params = model.init(np.random.default_rng(0))
    np.testing.assert_array_equal(est.params_, params)
    loss, grad = serial_objective(model, params, X, y)
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)
    pushes = est.experiment_.pushes
    assert pushes["examples"].sum() == len(X) and len(pushes) == 24
    events = est.experiment_.events
    assert {"worker_lost", "data_restored"} <= set(events["kind"])  # the kill hit the batch
    lost = events.loc[events["kind"] == "worker_lost", "data"]
    assert {d["worker"] for d in lost} == {victim}


def _fault_under_a_runner(client: Client, data, fault) -> tuple[SandblasterLBFGS, str]:
    """One pass over ``data`` (24 portions, each sleeping 0.25 s first) on a three-worker
    cluster, with ``fault(victim)`` done to the worker holding no shard once its runner computes
    a portion; checks that the pass gave the exact gradient, counting every portion once."""
    X, y = data
    model = models.LogisticRegression(64, l2=1e-2)
    workers = sorted(cluster_workers(client))
    victim = workers[2]  # shards go to workers[0] and workers[1]
    est = SandblasterLBFGS(model, portions_per_batch=24, max_iter=0, random_state=0)
    done: dict = {}

    def run_fit() -> None:
        try:
            done["est"] = est.fit(X, y, client=client, portion_delay={w: 0.25 for w in workers})
        except Exception as err:  # shown by the assertions below, not lost in the thread
            done["error"] = err

    thread = threading.Thread(target=run_fit)
    thread.start()
    deadline = time.monotonic() + 90
    running = lambda: client.run(_running, workers=[victim])[victim]  # noqa: E731
    while not any(key.endswith("-runner") for key in running()):
        assert thread.is_alive() and time.monotonic() < deadline, done.get("error")
        time.sleep(0.02)
    fault(victim)
    thread.join(timeout=150)
    assert not thread.is_alive() and "est" in done, done.get("error")
    loss, grad = serial_objective(model, model.init(np.random.default_rng(0)), X, y)
    np.testing.assert_allclose(est.gradient_, grad, rtol=0, atol=1e-6 * np.abs(grad).max())
    assert est.objective_ == pytest.approx(loss, rel=1e-6)
    pushes = est.experiment_.pushes
    assert pushes["examples"].sum() == len(X) and len(pushes) == 24
    return est, victim


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_stopped_under_its_runners_portions_costs_time_not_counts(
    digits_binary, three_workers
):
    """SIGSTOP of a worker holding no shard while its runner computes portions, SIGCONT 2 s
    later: its runner's answers come late, or not before copies elsewhere, and the pass counts
    every portion once, with the exact gradient."""
    client = three_workers

    def stop_for_two_seconds(victim: str) -> None:
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)  # the fault's length, not a wait for a result
        finally:
            os.kill(pid, signal.SIGCONT)

    _fault_under_a_runner(client, digits_binary[0], stop_for_two_seconds)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_retired_mid_batch_is_let_go_and_loses_nothing(digits_binary, three_workers):
    """``retire_workers`` on a worker holding no shard, while its portions run: Dask retires
    it (a fit holds no actor there: its portions came by message, not through an actor, which
    Dask would refuse to retire), its blocks move, and the pass counts every portion once."""
    client = three_workers
    retired: dict = {}
    _, victim = _fault_under_a_runner(
        client,
        digits_binary[0],
        lambda victim: retired.update(client.retire_workers([victim], close_workers=True)),
    )
    assert victim in retired and victim not in cluster_workers(client)


@pytest.mark.slow  # seconds of training (or processes): out of the quick loop
@pytest.mark.timeout(120)
def test_mlp_reaches_useful_accuracy_on_mnist5k(client, tmp_path):
    train, test = datasets.load("mnist5k")
    est = SandblasterLBFGS(
        models.MLP(784, (64,), 10, l2=1e-4), portions_per_batch=4, max_iter=60, eval_every_iter=10,
        random_state=0, timeout=45,  # a stalled batch fails with its details before the test
    ).fit(train, eval_data=test, client=client)  # fmt: skip
    accuracy = est.score(test)
    print(f"mnist5k test accuracy after {est.n_iter_} L-BFGS iterations: {accuracy:.3f}")
    assert accuracy >= 0.85
    run = est.experiment_
    scored = run.evals.dropna(subset=["accuracy"])
    assert len(scored) >= 2 and scored["accuracy"].iloc[-1] == pytest.approx(accuracy)
    assert est.predict(test.X[:5]).shape == (5,)
    assert est.get_params()["history"] == 10 and est.set_params(history=5).history == 5
    loaded = Experiment.load(run.save(tmp_path / "run"))
    assert len(loaded.evals) == len(run.evals) and loaded.config["estimator"] == "SandblasterLBFGS"


@pytest.mark.timeout(120)
def test_minibatch_lbfgs_cycles_batches_and_decreases_the_objective(client, digits_binary):
    (X, y), (X_test, y_test) = digits_binary
    model = models.LogisticRegression(64, l2=1e-3)
    est = SandblasterLBFGS(
        model, batch_size=500, portions_per_batch=3, max_iter=8, tol=0.0, random_state=1
    ).fit(X, y, client=client)
    run = est.experiment_
    assert est.n_iter_ == 8
    sizes = {hi - lo for lo, hi in split_range(len(X), -(-len(X) // 500))}
    assert run.pushes.groupby("version")["examples"].sum().isin(sizes).all()
    start = serial_objective(model, model.init(np.random.default_rng(1)), X, y)[0]
    assert serial_objective(model, est.params_, X, y)[0] < 0.5 * start
    assert est.score(X_test, y_test) > 0.8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_embedded_cluster_and_max_seconds(digits_binary):
    """The callback takes 0.1 s an iteration, so that the second ends the fit on any machine:
    with ``tol=0`` a fast one converged to float precision within it (``converged``)."""
    (X, y), _ = digits_binary
    est = SandblasterLBFGS(
        models.LogisticRegression(64, l2=1e-3), max_iter=1000, tol=0.0, max_seconds=1.0
    ).fit(X, y, callback=lambda progress: time.sleep(0.1))  # client=None: an embedded cluster
    run = est.experiment_
    # On a busy machine the first pass may take the whole second: 0 iterations is a correct
    # outcome of a time limit too, so the test counts what the log says, not how much was done.
    assert run.config["reason"] == "max_seconds" and 0 <= est.n_iter_ < 1000
    assert len(run.evals) == est.n_iter_ + 1  # the start, then one row per iteration
    assert run.events["kind"].iloc[-1] == "stop" and run.events["time"].iloc[-1] >= 1.0


def test_callback_gets_a_snapshot_per_iteration_and_a_final_one(client, digits_binary):
    (X, y), test = digits_binary
    snapshots = []
    est = SandblasterLBFGS(
        models.LogisticRegression(64, l2=1e-3), max_iter=5, tol=0, random_state=0
    ).fit(X, y, eval_data=test, client=client, callback=snapshots.append)
    assert [s.phase for s in snapshots] == ["training"] * (len(snapshots) - 1) + ["done"]
    assert len(snapshots) == est.n_iter_ + 2  # iteration 0 (the start), each step, the end
    objectives = [s.loss for s in snapshots]
    assert objectives[-1] < objectives[0]
    assert snapshots[-1].fraction == 1.0 and snapshots[-1].score > 0.8
    assert [s.examples for s in snapshots] == sorted(s.examples for s in snapshots)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_shard_worker_is_restored_from_the_last_iteration_or_named(
    digits_binary, monkeypatch
):
    """SIGKILL, from the callback after iteration 2 (so the kill lands mid-fit without timing),
    of the worker holding the evaluation data; with 3 shards on 3 workers it holds a shard too.
    The fit restores the shards at iteration 2's point, scatters the evaluation data again and
    finishes every iteration, each one scored, the objective still decreasing; with restores
    disabled the error names the lost shard (it used to stall for ``timeout`` and blame
    portions).  Before the evaluation data was restored, the fit failed with the evaluation
    cancelled for lost dependencies."""
    (X, y), test = digits_binary
    model = models.LogisticRegression(64, l2=1e-2)
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        outcomes, victims = [], []
        for restores in (3, 0):
            client.wait_for_workers(3, timeout=60)
            workers = sorted(cluster_workers(client))  # shard i goes to worker i
            pids = client.run(os.getpid, workers=workers)
            seen = []

            def kill_eval_holder(progress, workers=workers, pids=pids, seen=seen):
                seen.append(progress)
                if len(seen) == 3:  # iterations 0, 1, 2 are done
                    [holder] = [
                        ws[0] for key, ws in client.who_has().items()
                        if str(key).startswith("sandblaster-eval-")
                    ]  # fmt: skip
                    victims.append(workers.index(holder))
                    os.kill(pids[holder], signal.SIGKILL)

            monkeypatch.setattr(Coordinator, "MAX_RESTORES", restores)
            est = SandblasterLBFGS(model, n_shards=3, max_iter=8, tol=0.0, random_state=0,
                                   timeout=60)  # fmt: skip
            try:
                outcomes.append(
                    est.fit(X, y, eval_data=test, client=client, callback=kill_eval_holder)
                )
            except ShardLostError as err:
                outcomes.append(err)
    restored, named = outcomes
    assert isinstance(restored, SandblasterLBFGS), restored
    events = restored.experiment_.events
    [event] = events.loc[events["kind"] == "shard_restored", "data"]
    assert event["shard"] == victims[0] and event["iteration"] == 2 and event["restores"] == 1
    assert any(d.get("evaluation") for d in events.loc[events["kind"] == "data_restored", "data"])
    evals = restored.experiment_.evals
    assert evals["version"].tolist() == list(range(9)) and restored.n_iter_ == 8
    assert evals["accuracy"].notna().all()  # iteration 2's evaluation, lost, was run again
    assert (np.diff(evals["objective"]) < 0).all()  # still descending across the restore
    loss, grad = serial_objective(model, restored.params_, X, y)
    assert restored.objective_ == pytest.approx(loss, rel=1e-5)  # the result is consistent
    assert isinstance(named, ShardLostError) and named.shard == victims[1]
    assert f"shard {victims[1]}" in str(named) and "lost" in str(named)
    assert "portion" not in str(named)
