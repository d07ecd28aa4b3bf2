"""The Downpour simulator: its queueing, its determinism, its training mode against serial SGD,
its calibration on a real local-cluster run, and the ``simulate`` command."""

import numpy as np
import pytest

from downpour_dask import DownpourSGD, cli, models, optim
from downpour_dask.data.arrays import minibatches
from downpour_dask.data.shipped import load
from downpour_dask.log import Experiment
from downpour_dask.simulate import Setup, Timing, calibration, planning, predict, run, sweep
from downpour_dask.simulate.training import train


def test_same_seed_same_run_and_another_seed_another():
    setup = Setup(n_replicas=6, n_shards=2, steps=80)
    timing = Timing(step_seconds=1e-3, step_cv=0.5, push_fixed=1e-4, latency=2e-4)
    a, b, c = run(setup, timing, seed=1), run(setup, timing, seed=1), run(setup, timing, seed=2)
    assert np.array_equal(a.push_applied, b.push_applied)
    assert np.array_equal(a.push_staleness, b.push_staleness)
    assert not np.array_equal(a.push_applied, c.push_applied)
    assert len(a.push_applied) == 6 * 80  # every step of every replica pushed once


def test_single_shard_saturates_at_one_over_its_service_time():
    service = 2e-3
    timing = Timing(step_seconds=1e-3, push_fixed=service, latency=1e-4)
    busy = predict(Setup(n_replicas=40, steps=200), timing)
    assert busy.pushes_per_s == pytest.approx(1 / service, rel=0.01)
    assert busy.utilisation == pytest.approx(1.0, abs=0.01)
    # below saturation the replicas set the pace and the queue is short
    light = predict(Setup(n_replicas=1, steps=200), timing.with_(push_fixed=1e-5))
    assert light.pushes_per_s == pytest.approx(1 / 1e-3, rel=0.02)
    assert light.utilisation < 0.05
    assert busy.queue_wait > 100 * light.queue_wait


def test_more_shards_relieve_a_per_parameter_bottleneck_but_not_a_fixed_one():
    # 5 replicas want 5,000 pushes/s; one shard serves 2,000 parameters in 0.4 ms (2,500/s),
    # four shards a quarter each in 0.1 ms (10,000/s)
    per_param = Timing(step_seconds=1e-3, push_per_param=2e-7, latency=1e-4)
    setup = Setup(n_replicas=5, n_params=2000, steps=200)
    one, four = predict(setup, per_param), predict(setup.with_(n_shards=4), per_param)
    assert one.pushes_per_s == pytest.approx(2500, rel=0.02)
    assert four.pushes_per_s == pytest.approx(5000, rel=0.05)
    assert four.utilisation < 0.7 < 0.95 < one.utilisation
    assert four.staleness_mean < one.staleness_mean
    fixed = Timing(step_seconds=1e-3, push_fixed=4e-4, latency=1e-4)
    assert predict(setup.with_(n_shards=4), fixed).pushes_per_s == pytest.approx(
        predict(setup, fixed).pushes_per_s, rel=0.01
    )


def test_max_inflight_bounds_a_replica_by_its_round_trip():
    timing = Timing(step_seconds=1e-4, latency=5e-3)  # round trip 10 ms, steps 0.1 ms
    for inflight in (1, 4):
        got = predict(Setup(max_inflight=inflight, steps=300), timing)
        assert got.pushes_per_s <= inflight / 10e-3 * 1.01
        assert got.pushes_per_s >= inflight / 10e-3 * 0.8


def test_warmstart_holds_the_other_replicas_until_replica_0_pushed():
    setup = Setup(n_replicas=3, steps=50, warmstart_steps=10, n_push=2)
    trace = run(setup, Timing(step_seconds=1e-3, latency=1e-4))
    gate_time = trace.push_applied[4]  # replica 0's 5th push (10 steps / n_push 2)
    assert set(trace.push_replica[:5]) == {0}
    assert (trace.replica_start[1:] >= gate_time).all()


def test_a_replica_on_the_shards_worker_waits_for_its_calls_and_sees_no_staleness_alone():
    timing = Timing(step_seconds=1e-3, push_fixed=5e-4, latency=1e-3)
    remote = predict(Setup(steps=200), timing)
    local = predict(Setup(steps=200, local_replicas=1), timing)
    assert local.staleness_mean == 0 < remote.staleness_mean
    assert local.pushes_per_s == pytest.approx(1 / 1.5e-3, rel=0.02)  # step, then its push
    assert remote.pushes_per_s == pytest.approx(1 / 1e-3, rel=0.02)  # pushes overlap steps


def test_shards_wire_cpu_slows_crowded_cores_but_not_a_lone_replica():
    # 2 cores shared: a lone replica leaves a core to the shards' connection threads, 8 do not.
    timing = Timing(step_seconds=1e-3, push_fixed=1e-5, cores=2)
    wired = timing.with_(wire_per_param=2e-9)  # 0.2 ms per 100k-parameter message
    for replicas, slower in ((1, False), (8, True)):
        setup = Setup(n_replicas=replicas, n_shards=2, n_params=100_000, steps=200)
        plain, busy = predict(setup, timing), predict(setup, wired)
        assert (busy.examples_per_s < 0.9 * plain.examples_per_s) is slower, (replicas, busy)
    # 8 replicas: step stretched by the CPU balance, 8 * (1 + 0.4 ms shard CPU / 1 ms) / 2 cores
    setup = Setup(n_replicas=8, n_shards=2, n_params=100_000)
    assert wired.step_scale(setup) == pytest.approx(8 * (1 + 0.4 + 0.02) / 2)
    # an in-process link costs no wire CPU: one shard of two local halves it
    half = setup.with_(local_shards=1)
    assert wired.wire_cost(half) == pytest.approx(wired.wire_cost(setup) / 2)
    # ... on one machine; on machines of their own every link is a wire
    assert wired.with_(cores=None).wire_cost(half) == pytest.approx(wired.wire_cost(setup))
    assert wired.step_scale(setup.with_(local_replicas=8)) == pytest.approx(8 * 1.02 / 2)
    # crowding: 4 replicas per core cost 3 * crowding more on top of the CPU balance
    crowded = wired.with_(crowding=0.1)
    assert crowded.step_scale(setup) == pytest.approx(wired.step_scale(setup) * 1.3)
    assert crowded.step_scale(setup.with_(n_replicas=2)) == wired.step_scale(
        setup.with_(n_replicas=2)
    )


def test_wire_decoding_delays_its_own_requests_not_the_shards_in_process_callers():
    # One shard, a replica beside it and two over the wire whose requests take 2 ms each to
    # decode in their connection threads: the lock queue holds only the (tiny) update, so the
    # in-process caller keeps its own pace, and each wire replica's requests are decoded in
    # order, one every 2 ms, which caps it at 500 pushes/s (max_inflight then blocks it).
    timing = Timing(step_seconds=1e-3, push_fixed=1e-5, wire_fixed=2e-3)
    trace = run(Setup(n_replicas=3, steps=400, local_replicas=1), timing)
    busy = trace.replica_end - trace.replica_start
    rates = [np.sum(trace.push_replica == r) / busy[r] for r in range(3)]
    assert rates[0] == pytest.approx(1 / (1e-3 + 1e-5), rel=0.05)
    assert rates[1] == pytest.approx(500, rel=0.05) and rates[2] == pytest.approx(500, rel=0.05)
    assert np.all(trace.msg_start - trace.msg_arrival < 3e-5)  # nobody queued behind a decode


def test_one_shard_worker_shares_its_core_with_the_wire_replicas_connection_threads():
    # Two workers of one core, the shard on the first with replica 0; replica 1's requests cost
    # the shard's worker as much CPU as a step: replica 0 runs at half speed, replica 1 alone
    # on its worker at full speed (the pooled balance would stretch both by 1.5).
    timing = Timing(step_seconds=1e-3, wire_fixed=1e-3, cores=2)
    two = Setup(n_replicas=2, local_replicas=1)
    assert timing.scales(two) == pytest.approx((2.0, 1.0), rel=1e-6)
    assert timing.step_scale(two) == pytest.approx(1.5)
    # four wire replicas ask more than the core: each connection thread gets a replica's share
    many = Setup(n_replicas=8, local_replicas=4)
    near, far = timing.scales(many)
    assert far == pytest.approx(4.0) and near == pytest.approx(8.0, rel=1e-6)
    # shards spread over the workers, or every replica beside them: one balance for all
    for setup in (
        two.with_(local_replicas=0, n_shards=2, local_shards=1),
        two.with_(local_replicas=2),
    ):
        assert timing.scales(setup) == (timing.step_scale(setup),) * 2
    assert timing.with_(cores=None).scales(two) == (1.0, 1.0)  # machines of their own


def test_a_lone_replicas_requests_reach_its_idle_workers_shards_without_the_latency():
    # On one machine the latency is a message's wait for its receiving process: a lone
    # replica's wire shard sits on a worker running no replica, so only the reply waits.
    timing = Timing(step_seconds=1e-3, latency=2e-3, cores=2)
    lone = Setup(n_replicas=1, n_shards=2, local_shards=1, steps=20)
    two = lone.with_(n_replicas=2)

    def first_round_trip(setup: Setup, timing: Timing) -> float:
        trace = run(setup, timing)
        return float((trace.push_acked - trace.push_sent)[0])

    assert first_round_trip(lone, timing) == pytest.approx(2e-3)
    assert first_round_trip(two, timing) == pytest.approx(4e-3)  # both workers run a replica
    assert first_round_trip(lone, timing.with_(cores=None)) == pytest.approx(4e-3)


def test_every_step_takes_its_floor_and_the_pauses_keep_the_spread():
    timing = Timing(step_seconds=1e-3, step_cv=1.0, step_floor=0.5)
    alone = Setup(steps=4000, local_replicas=1)  # in-process calls of no cost: sends = steps
    steps = np.diff(run(alone, timing).push_sent)
    assert steps.min() >= 0.5e-3 * (1 - 1e-9)
    assert steps.mean() == pytest.approx(1e-3, rel=0.1)
    assert steps.std() / steps.mean() == pytest.approx(1.0, rel=0.25)
    plain = np.diff(run(alone, timing.with_(step_floor=0.0)).push_sent)
    assert np.mean(plain < 0.5e-3) > 0.3  # a plain gamma of that spread: 39% of steps
    with pytest.raises(ValueError, match="step_floor"):
        Timing(step_floor=1.0)


def test_fit_costs_recovers_the_costs_that_made_the_runs():
    # Runs "measured" from known costs: the fit on the corners predicts the runs in between.
    truth = Timing(
        step_seconds=3e-4, message_seconds=4e-4, wire_fixed=2e-4, push_fixed=1e-5, cores=2
    ).with_(crowding=0.1)
    model_only = Timing(step_seconds=2e-4, push_fixed=1e-5, cores=2)

    def shape(replicas, shards):  # replicas and shards alternate between two workers
        local = replicas if shards == 1 else 0
        return Setup(n_replicas=replicas, n_shards=shards, n_params=100_000).with_(
            local_replicas=(local + 1) // 2, local_shards=shards // 2 if shards > 1 else 0
        )

    corners = [shape(r, s) for r, s in ((1, 1), (1, 4), (2, 2), (8, 2))]
    fitted = calibration.fit_costs(
        [(s, calibration.simulated_step(s, truth)) for s in corners], model_only
    )
    for r, s in ((2, 1), (4, 4), (8, 4)):
        expected = calibration.simulated_step(shape(r, s), truth)
        assert calibration.simulated_step(shape(r, s), fitted) == pytest.approx(expected, rel=0.05)
    assert fitted.message_seconds == pytest.approx(4e-4, rel=0.2)
    assert fitted.crowding == pytest.approx(0.1, abs=0.03)
    # one run cannot separate the replica's side of a wire request from the shard's: the
    # prior splits it evenly, and the run's own step comes back
    one = calibration.fit_costs([(corners[2], 9e-4)], model_only)
    assert calibration.simulated_step(corners[2], one) == pytest.approx(9e-4, rel=0.01)
    assert one.message_seconds == pytest.approx(one.wire_fixed, rel=0.1)
    assert one.crowding < 0.01
    # a one-shard run alone: the prior keeps the wire costs within what the run needs instead
    # of letting the replica beside the shard take all the throughput
    lone = calibration.fit_costs([(shape(2, 1), 9e-4)], model_only)
    assert calibration.simulated_step(shape(2, 1), lone) == pytest.approx(9e-4, rel=0.05)
    assert lone.message_seconds < 9e-4 and lone.wire_fixed < 9e-4


def test_every_request_to_a_shard_costs_the_replica_its_message_time():
    timing = Timing(step_seconds=1e-3, message_seconds=2.5e-4)
    one = predict(Setup(steps=200), timing)
    four = predict(Setup(steps=200, n_shards=4), timing)
    assert one.pushes_per_s == pytest.approx(1 / 1.25e-3, rel=0.02)
    assert four.pushes_per_s == pytest.approx(1 / 2e-3, rel=0.02)


def test_fetching_less_often_makes_pushes_staler():
    timing = Timing(step_seconds=1e-3, push_fixed=1e-4, latency=1e-4)
    every = predict(Setup(n_replicas=8, steps=200), timing)
    rarely = predict(Setup(n_replicas=8, steps=200, n_fetch=10), timing)
    assert rarely.staleness_mean > every.staleness_mean


def test_bad_setup_names_the_field():
    with pytest.raises(ValueError, match="n_replicas"):
        Setup(n_replicas=0)
    with pytest.raises(ValueError, match="latency"):
        Timing(latency=-1.0)


def test_sweep_covers_the_grid():
    table = sweep(Setup(), Timing(step_seconds=1e-3, push_fixed=1e-4), [10, 100], [1, 4])
    assert sorted(zip(table.n_replicas, table.n_shards)) == [(10, 1), (10, 4), (100, 1), (100, 4)]
    # 100 replicas of 1,000 pushes/s each saturate a 10,000 pushes/s shard
    saturated = table[table.n_replicas == 100].iloc[0]
    assert saturated.utilisation > 0.95


def test_planner_picks_the_fewest_shards_under_the_limit():
    timing = Timing(step_seconds=1e-3, push_per_param=1e-7, latency=1e-4)
    setup = Setup(n_params=10_000)  # one shard serves a push in 1 ms: 1 replica keeps it busy
    advice = planning.recommend(setup, timing, 8, max_utilisation=0.7)
    assert advice.n_shards is not None and advice.prediction.utilisation <= 0.7
    if advice.n_shards > 1:
        fewer = setup.with_(n_replicas=8, n_shards=advice.n_shards // 2, steps=400)
        assert predict(fewer, timing).utilisation > 0.7
    stuck = planning.recommend(setup, Timing(step_seconds=1e-3, push_fixed=1e-3), 8)
    assert stuck.n_shards is None  # a fixed per-message cost is not split by more shards


def test_training_mode_with_one_replica_no_latency_is_serial_sgd_exactly():
    train_set, test_set = load("digits")
    model = models.SoftmaxRegression(64, 10)
    rule = optim.sgd(0.1)
    result = train(
        Setup(steps=120, batch_size=16), Timing(), model, rule, train_set, test_set, seed=3
    )
    params, state = model.init(np.random.default_rng(3)), rule.init(model.n_params)
    rng, done = np.random.default_rng([3, 0]), 0
    while done < 120:
        for X, y in minibatches(train_set.X, train_set.y, 16, rng):
            if done == 120:
                break
            _, g = model.loss_and_grad(params, X, y)
            rule.update(params, g, state)
            done += 1
    assert np.array_equal(result.params, params)
    assert result.curve["score"].iloc[-1] > result.curve["score"].iloc[0]


def test_training_mode_feeds_the_rule_the_simulated_staleness():
    train_set, test_set = load("digits")
    model = models.SoftmaxRegression(64, 10)
    setup = Setup(n_replicas=4, n_shards=2, steps=60, batch_size=16)
    timing = Timing(step_seconds=1e-3, step_cv=0.3, push_fixed=2e-4, latency=2e-4)
    plain = train(setup, timing, model, optim.sgd(0.1), train_set, test_set, seed=0)
    aware = train(
        setup, timing, model, optim.make("staleness_aware_sgd", 0.1), train_set, test_set, seed=0
    )
    assert plain.trace.push_staleness.max() > 1
    assert np.array_equal(plain.trace.push_staleness, aware.trace.push_staleness)
    assert not np.array_equal(plain.params, aware.params)  # the staleness reached the rule
    again = train(setup, timing, model, optim.sgd(0.1), train_set, test_set, seed=0)
    assert np.array_equal(plain.params, again.params)


def _fit(client, n_replicas):
    train_set, _ = load("mnist5k")
    est = DownpourSGD(
        model="mlp:32",
        n_replicas=n_replicas,
        n_shards=1,
        batch_size=32,
        max_epochs=30,  # a steady window of some seconds: shorter runs measure noise
        optimizer="adagrad",
        eval_every=3600.0,
        random_state=0,
    )
    est.fit(train_set.X, train_set.y, client=client)
    return est.experiment_


#: How many times a calibration run the machine stalled is fitted again (once was not enough in
#: a CI run of 2026-11-29 on a loaded 2-vCPU VM: both runs stalled, and the prediction was 0.31x).
STALLED_RUNS_REFITTED = 3


@pytest.mark.slow  # two fits of 30 epochs (seconds of training): out of the quick loop
def test_calibrated_on_two_replicas_predicts_four_on_the_local_cluster(client, tmp_path):
    # Calibrated on a run with replicas on both workers: one reaches the shard over the wire.
    two, four = _fit(client, 2), _fit(client, 4)
    for _ in range(STALLED_RUNS_REFITTED):
        if calibration.measured(two)["step_cv"] < calibration.STEP_CV_CAP:
            break
        # Intervals between pushes spread this wide mean the machine stalled the run (the other
        # test process starting a cluster, say): not a run to calibrate from, so fit again.
        two, four = _fit(client, 2), _fit(client, 4)
    fitted = calibration.calibrate(two, cores=2, repeats=5)
    fitted.save(tmp_path)
    again = calibration.load(tmp_path)
    assert again.timing == fitted.timing and again.setup == fitted.setup
    # the wire replica's requests cost it and the shard CPU (one run: split evenly)
    assert fitted.timing.message_seconds > 0 and fitted.timing.wire_fixed > 0
    assert 0 < fitted.timing.step_floor < 1  # the model's gradient: part of every step
    seen = calibration.measured(four)
    predicted = predict(calibration.setup_of(four), again.timing)
    # Generous: the machine is shared and busy (see benchmarks/README.md for measured errors).
    ratio = predicted.examples_per_s / seen["examples_per_s"]
    print(f"calibration run's step spread {fitted.fit['measured']['step_cv']:.2f}")
    print(f"throughput ratio {ratio:.2f}; staleness {predicted.staleness_mean:.2f} (predicted)")
    print(f"vs {seen['staleness_mean']:.2f} (real)")
    assert 0.33 < ratio < 3, (fitted.timing, fitted.fit)
    stale = (predicted.staleness_mean + 1) / (seen["staleness_mean"] + 1)
    assert 0.33 < stale < 3, (fitted.timing, fitted.fit)


@pytest.mark.slow  # seconds of training (or processes): out of the quick loop
def test_simulate_command_prints_the_table_and_the_plan(client, tmp_path, capsys):
    run_dir = tmp_path / "run"
    _fit(client, 2).save(run_dir)
    argv = ["simulate", "--from", str(run_dir), "--replicas", "10,100", "--shards", "1,4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert (run_dir / calibration.FILENAME).is_file()
    assert "utilisation" in out and "100 replicas:" in out
    assert cli.main(argv) == 0  # the second time from simulation.json, not recalibrated
    assert "calibrated from" not in capsys.readouterr().out
    Experiment.load(run_dir)  # the run directory is still a loadable run
    assert cli.main(["simulate", "--from", str(tmp_path), "--replicas", "x"]) == 2
    also = ["simulate", "--from", str(run_dir), "--replicas", "10", "--shards", "1"]
    assert cli.main([*also, "--also", str(tmp_path / "missing")]) == 2
    assert cli.main([*also, "--also", str(run_dir)]) == 0  # calibrated on both, written again
    assert "calibrated from 2 run log(s)" in capsys.readouterr().out
    too_many = ["simulate", "--from", str(run_dir), "--replicas", "10000000"]
    assert cli.main(too_many) == 2  # refused at once, not simulated for minutes
    assert "--replicas takes at most 100,000, got 10,000,000" in capsys.readouterr().err
    n_params = models.MLP(784, (32,), 10).n_params  # the fit's "mlp:32" on mnist5k
    assert cli.main(["simulate", "--from", str(run_dir), "--shards", "1000000"]) == 2
    error = capsys.readouterr().err
    assert f"--shards takes at most the model's {n_params:,} parameters" in error
