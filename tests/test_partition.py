"""The neuron split of an MLP (partition.py): same mathematics as the whole model."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from downpour_dask import models
from downpour_dask.core.partition import PartitionPlan
from downpour_dask.core.partition_part import MLPPart


class ThreadLink:
    """Partitions as threads of one process, messages through queues (one per sender/tag)."""

    def __init__(self, boxes: dict, me: int):
        self.boxes, self.me = boxes, me

    def send(self, to, tag, payload):
        self.boxes[(to, self.me, tag)].put(payload)

    def receive(self, sender, tag):
        return self.boxes[(self.me, sender, tag)].get(timeout=10)


class _Boxes(dict):
    def __missing__(self, key):
        return self.setdefault(key, queue.Queue())


def partitioned_loss_and_grad(plan, params, X, y, votes=None, scale=1.0, overlap=True):
    """Run every partition's loss_and_grad in its own thread (messages overlapped with the
    compute or not); return losses, joined gradient, agreed stop flags and values sent."""
    packed = plan.pack(params)
    boxes = _Boxes()
    parts = []
    for p in range(plan.partitions):
        vote = (lambda p=p: votes[p]) if votes is not None else None
        parts.append(MLPPart(plan, p, ThreadLink(boxes, p), vote=vote))
        parts[-1].overlap = overlap
    results = [None] * plan.partitions

    def work(p):
        lo, hi = plan.offsets[p]
        results[p] = parts[p].loss_and_grad(packed[lo:hi].copy(), X, y, scale=scale)

    threads = [threading.Thread(target=work, args=(p,)) for p in range(plan.partitions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    grad = plan.unpack(np.concatenate([g for _, g in results]))
    return [loss for loss, _ in results], grad, [part.agreed_stop for part in parts], parts


CASES = [
    dict(hidden=(12,), activation="relu", output="softmax", l2=0.0, P=2),
    dict(hidden=(9, 7), activation="tanh", output="softmax", l2=0.01, P=3),
    dict(hidden=(8, 6, 5), activation="relu", output="linear", l2=0.0, P=2),
    dict(hidden=(16, 16), activation="relu", output="softmax", l2=0.001, P=4),
    dict(hidden=(5, 4), activation="tanh", output="linear", l2=0.1, P=4),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['hidden']}-{c['output']}-P{c['P']}")
def test_partitions_compute_the_whole_models_loss_and_gradient(case, overlap):
    rng = np.random.default_rng(0)
    n_out = 1 if case["output"] == "linear" else 3
    model = models.MLP(
        6,
        case["hidden"],
        n_out,
        activation=case["activation"],
        output=case["output"],
        l2=case["l2"],
    )
    params = model.init(rng)
    params += rng.normal(0, 0.05, params.shape).astype(np.float32)  # non-zero biases too
    X = rng.normal(size=(11, 6)).astype(np.float32)
    y = rng.integers(0, 3, 11) if n_out > 1 else rng.normal(size=11).astype(np.float32)
    loss, grad = model.loss_and_grad(params, X, y)
    plan = PartitionPlan(model, case["P"])
    losses, joined, _, _ = partitioned_loss_and_grad(plan, params, X, y, overlap=overlap)
    for part_loss in losses:  # every partition reports the whole objective
        assert part_loss == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(joined, grad, rtol=1e-4, atol=1e-6)
    # scaled (as a replica asks for alpha * grad): every partition scales its part alike
    scaled_losses, scaled, _, _ = partitioned_loss_and_grad(
        plan, params, X, y, scale=0.05, overlap=overlap
    )
    assert scaled_losses == losses
    np.testing.assert_allclose(scaled, 0.05 * joined, rtol=1e-5, atol=1e-8)


def test_pack_and_unpack_are_inverse_and_partitions_tile_the_vector():
    model = models.MLP(5, (7, 4), 3)
    plan = PartitionPlan(model, 3)
    params = np.arange(model.layout.size, dtype=np.float32)
    packed = plan.pack(params)
    assert sorted(packed.tolist()) == params.tolist()  # a permutation: every weight once
    np.testing.assert_array_equal(plan.unpack(packed), params)
    assert plan.offsets[0][0] == 0 and plan.offsets[-1][1] == model.layout.size
    assert all(a[1] == b[0] for a, b in zip(plan.offsets, plan.offsets[1:]))
    # partition 1 owns units 3..5 of hidden layer 0: its W0 is those columns
    lo, hi = plan.offsets[1]
    W0 = model.layout.views(params)["W0"]
    np.testing.assert_array_equal(plan.layouts[1].views(packed[lo:hi])["W0"], W0[:, 3:5])


def test_shard_ranges_never_span_two_partitions():
    plan = PartitionPlan(models.MLP(5, (7, 4), 3), 2)
    ranges = plan.shard_ranges(5)
    assert len(ranges) == 5 and ranges[0][0] == 0 and ranges[-1][1] == plan.size
    for lo, hi in ranges:
        assert any(a <= lo and hi <= b for a, b in plan.offsets)
    assert plan.shards_per_partition(5) == [3, 2]
    with pytest.raises(ValueError, match="n_shards must be at least partitions=2"):
        plan.shard_ranges(1)


def test_stop_votes_are_agreed_by_every_partition():
    model = models.MLP(4, (6,), 2)
    plan = PartitionPlan(model, 3)
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 2, 5)
    _, _, agreed, _ = partitioned_loss_and_grad(plan, model.init(rng), X, y, [False, True, False])
    assert agreed == [True, True, True]
    _, _, agreed, _ = partitioned_loss_and_grad(plan, model.init(rng), X, y, [False] * 3)
    assert agreed == [False, False, False]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
def test_values_crossing_boundaries_match_the_plan(overlap):
    model = models.MLP(10, (8, 6, 4), 3)
    plan = PartitionPlan(model, 2)
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(7, 10)).astype(np.float32), rng.integers(0, 3, 7)
    _, _, _, parts = partitioned_loss_and_grad(plan, model.init(rng), X, y, overlap=overlap)
    sent = sum(part.values_sent for part in parts)
    assert sent == 7 * plan.boundary_values_per_example()
    # the last hidden layer (4 units) never travels: only layers 8 and 6 and the 3 logits
    assert plan.boundary_values_per_example() == 2 * (8 + 6) + 2 * 3


@pytest.mark.parametrize(
    ("model", "partitions", "error", "match"),
    [
        (models.SoftmaxRegression(4, 3), 2, TypeError, "SoftmaxRegression has no hidden layer"),
        (models.MLP(4, (), 3), 2, TypeError, "at least one hidden layer"),
        (models.MLP(4, (8, 3), 3), 4, ValueError, "between 1 and 3 .* got 4"),
        (models.MLP(4, (8,), 3), 0, ValueError, "between 1 and 8"),
        (models.MLP(4, (8,), 3), 2.0, TypeError, "partitions must be an int"),
    ],
)
def test_bad_plans_are_refused_with_what_is_allowed(model, partitions, error, match):
    with pytest.raises(error, match=match):
        PartitionPlan(model, partitions)
