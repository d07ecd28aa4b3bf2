"""One model's gradient, in one process on one thread: microseconds per batch of the numpy models
the other benchmarks train, and the update rules a shard applies.

Every Downpour replica, every Sandblaster portion and every serial baseline spends most of its
time in ``Model.loss_and_grad``; a shard spends its own in ``UpdateRule.update``.  This script
times them alone (no cluster, no communication; BLAS pinned to one thread as in a Dask worker),
so a change to the numerics can be measured apart from the machine's noise of a distributed run
(and a fit's evaluation on the driver, both ways it can be computed):
``bench_code_ab.py --script bench_gradient.py`` alternates two versions of the code.  Each row is
the median of ``--repeats`` timings, each the mean over enough calls to fill about 0.2 s, the
rows interleaved (every repeat runs every row once) so that drift falls on all rows alike.

    python benchmarks/bench_gradient.py [--repeats 9]
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402

import numpy as np  # noqa: E402

from downpour_dask import models, optim  # noqa: E402
from downpour_dask.core import protocol  # noqa: E402
from downpour_dask.core.guard import sum_of_squares  # noqa: E402

#: (name, model, rows per batch): the models of bench_downpour.py, bench_large.py,
#: bench_model_parallel.py (the whole model; a partition computes half of it) and Sandblaster's
#: portions (a 500,000-row portion of bench_sandblaster.py's 10^6 x 100 problem).
GRADIENTS = [
    ("MLP 784-256-10 (bench_downpour)", models.MLP(784, (256,), 10), 128),
    ("MLP 64-64-2 (bench_large)", models.MLP(64, (64,), 2), 256),
    ("MLP 784-256-10, tanh", models.MLP(784, (256,), 10, activation="tanh"), 128),
    ("MLP 1024-4096-4096-10 (bench_model_parallel)", models.MLP(1024, (4096, 4096), 10), 128),
    ("LogisticRegression 100 (bench_sandblaster)", models.LogisticRegression(100), 500_000),
]
#: (rule, parameters): a shard of bench_downpour.py's model, and a partition's shard of
#: bench_model_parallel.py's.
UPDATES = [(name, size) for name in ("sgd", "adagrad", "adam") for size in (101_765, 10_510_341)]
#: The norm a shard takes of every pushed gradient (``guard.sum_of_squares``), on a shard of
#: bench_downpour.py's model: alone, and while another thread of the process runs Python, as a
#: worker's wire and event-loop threads do (a call that lets go of the GIL may wait that long
#: to get it back).
NORM_SIZE = 101_765
#: A fit's evaluation (every ``eval_every`` seconds, on the driver): bench_large.py's MLP on its
#: 20,000 test rows, as the loss and the score computed apart and from one forward pass.
EVALUATION = ("MLP 64-64-2 (bench_large)", models.MLP(64, (64,), 2), 20_000)


def gradient_call(model, rows: int, seed: int = 0) -> Callable[[], None]:
    """A call of ``model``'s gradient on a fixed batch of ``rows`` random rows."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, model.n_inputs), dtype=np.float32)
    y = rng.integers(0, model.n_classes, rows)
    params = model.init(rng)
    out = np.empty_like(params)
    return lambda: model.loss_and_grad(params, X, y, out=out)


def update_call(name: str, size: int, seed: int = 0) -> Callable[[], None]:
    """A call of update rule ``name`` on a slice of ``size`` parameters."""
    rng = np.random.default_rng(seed)
    rule = optim.make(name, 1e-3)
    params, state = rng.standard_normal(size, dtype=np.float32), rule.init(size)
    grad = rng.standard_normal(size, dtype=np.float32)
    return lambda: rule.update(params, grad, state)


def norm_call(size: int, seed: int = 0) -> Callable[[], None]:
    """A call of the guard's gradient norm on ``size`` float32 values."""
    grad = np.random.default_rng(seed).standard_normal(size, dtype=np.float32)
    return lambda: sum_of_squares(grad)


def evaluation_call(model, rows: int, together: bool, seed: int = 0) -> Callable[[], None]:
    """A call of the evaluation a fit makes on ``rows`` random rows: ``loss_and_score`` (one
    forward pass) if ``together``, else ``protocol.loss`` and ``score`` (a pass each)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, model.n_inputs), dtype=np.float32)
    y = rng.integers(0, model.n_classes, rows)
    params = model.init(rng)
    if together:
        return lambda: model.loss_and_score(params, X, y)
    return lambda: (protocol.loss(model, params, X, y), model.score(params, X, y))


def timed_beside_python(call: Callable[[], None]) -> float:
    """``timed(call)`` while another thread of this process runs Python the whole time."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        return timed(call)
    finally:
        stop.set()
        spinner.join(timeout=60)


def timed(call: Callable[[], None], budget: float = 0.2) -> float:
    """Microseconds per call: the mean of as many calls as fill ``budget`` seconds (3 at least)."""
    call()  # first-call allocations (workspaces, scratch) do not count
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < budget:
        call()
        calls += 1
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    # (label, a measurement in microseconds per call, rows per call or None)
    rows = [
        (f"gradient: {name}, batch {batch:,}", partial(timed, gradient_call(m, batch)), batch)
        for name, m, batch in GRADIENTS
    ]
    rows += [
        (f"update: {name}, {size:,} parameters", partial(timed, update_call(name, size)), None)
        for name, size in UPDATES
    ]
    norm = norm_call(NORM_SIZE)
    rows += [
        (f"gradient norm (guard), {NORM_SIZE:,} parameters", partial(timed, norm), None),
        (f"gradient norm (guard), {NORM_SIZE:,}, beside a thread running Python",
         partial(timed_beside_python, norm), None),
    ]  # fmt: skip
    name, model, n = EVALUATION
    rows += [
        (f"evaluation: {name}, {n:,} rows, {how}", partial(timed, evaluation_call(model, n, t)), n)
        for how, t in (("loss and score apart", False), ("loss_and_score", True))
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    for _ in range(args.repeats):
        for label, measure, _ in rows:
            times[label].append(measure())
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}; one BLAS thread"
    )
    print(f"median of {args.repeats} interleaved timings")
    print(f"{'what':70} {'us per call':>12} {'range':>19} {'examples/s':>11}")
    for label, _, batch in rows:
        median = statistics.median(times[label])
        spread = f"{min(times[label]):,.0f}-{max(times[label]):,.0f}"
        rate = "-" if batch is None else f"{1e6 * batch / median:,.0f}"
        print(f"{label:70} {median:12,.1f} {spread:>19} {rate:>11}")


if __name__ == "__main__":
    main()
