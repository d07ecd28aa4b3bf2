"""Examples/s of Downpour SGD against a serial numpy SGD loop of the same model, in one process.

Model: MLP 784-256-10 (relu, softmax), batch 128, plain SGD, on the shipped mnist5k training set
(4,000 rows, cycled).  Downpour runs on a local cluster of 2 single-threaded worker processes with
2 shards, for 1, 2 and 4 replicas and n_fetch = n_push in {1, 4}, for 2 and 4 replicas pushing to
the other worker's shard one-sided (``transport="one-sided"``), and with 1 shard for 2 replicas
(on 2 workers one shard halves the messages: one replica calls it in-process), the last over
Dask actor messages too (``transport="dask"``) to show what the direct connections are worth.  A
further row runs the serial loop on both workers at once with no communication at all: the
ceiling any data-parallel trainer could reach on this machine, and each row's share of it.

Further rows per n_fetch = n_push are the least a parameter server must add to that ceiling:
the same loop on both workers, each also holding half the parameters as a shard, with no library
at all (``minimal_ps.py``).  The *minimal parameter server* moves the far half's arrays as
Downpour does between workers of one host, through shared memory, a 1-byte token on a raw TCP
connection waking the other worker's thread; a second row sends them over that TCP connection,
as between hosts.  What separates Downpour from the first row is the library; what separates
that row from the ceiling is the work any parameter server of that design adds to a step (the
accrual, the shard's update, the copies, the wake-ups), on the same two cores that compute the
gradients.  With ``--token-bound`` the same server runs once more with only the tokens: what is
left without moving the arrays at all.  With ``--one-sided`` a further row has no thread and no
message: each replica applies its push to the far shard's shared memory itself, under a lock
the two processes share, the bound of a design that wakes nothing on the other worker.

With ``--pinned yes`` every row on the cluster runs with each worker process pinned to a CPU of
its own (:func:`downpour_dask.pin_workers`); ``--pinned both`` runs them both ways in every
round, and a pinned row's shares are of the pinned ceiling and minimal server.

The script runs in rounds, each running every row once (the serial loop too), so that drift of
the machine falls on all rows alike; it reports each row's median over the rounds, ratios of
medians against the serial loop, and the range of the row's runs against that median.

    python benchmarks/bench_downpour.py [--seconds 4] [--repeats 3] [--token-bound]
                                        [--one-sided] [--no-downpour] [--pinned {no,yes,both}]
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker: the serial baseline is a single-thread loop.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from clusters import local_cluster  # noqa: E402
from distributed import Client  # noqa: E402
from minimal_ps import minimal_ps_examples_per_s, set_up_as_a_replica  # noqa: E402

from downpour_dask import DownpourSGD, datasets, models, pin_workers, unpin_workers  # noqa: E402
from downpour_dask.data.datasets import minibatches  # noqa: E402

BATCH = 128


def serial_examples_per_s(model, X, y, seconds: float, learning_rate: float = 0.01) -> float:
    """Single-threaded in-process SGD loop: gradient + update, no communication (also the
    baseline of ``bench_model_parallel.py``).  As lean as the model allows: the gradient comes
    out already times the learning rate, into a reused buffer, so the update is one pass."""
    params = model.init(np.random.default_rng(0))
    step = np.empty_like(params)
    rng = np.random.default_rng(0)
    examples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for Xb, yb in minibatches(X, y, BATCH, rng):
            model.loss_and_grad(params, Xb, yb, out=step, scale=learning_rate)
            params -= step
            examples += len(yb)
            if time.perf_counter() - start >= seconds:  # an epoch of a big model is long
                break
    return examples / (time.perf_counter() - start)


def _serial_on_worker(model, X, y, seconds: float) -> float:
    """The serial loop as a Dask task, set up as a replica sets itself up."""
    return serial_examples_per_s(model, *set_up_as_a_replica(X, y), seconds)


def no_communication_examples_per_s(client, model, X, y, seconds: float) -> float:
    """The ceiling for any data-parallel trainer here: the serial loop running on every worker
    at once, with no communication at all; the sum of their examples/s.

    On this 2-core VM it is well below 2x the serial loop and varies from run to run: two
    processes computing at once slow each other's gradients (shared memory bandwidth and L3).
    """
    workers = sorted(client.scheduler_info()["workers"])
    data = client.scatter([X, y], broadcast=True, hash=False)  # not inside every task
    futures = [
        client.submit(_serial_on_worker, model, *data, seconds, workers=[w], pure=False)
        for w in workers
    ]
    rate = sum(client.gather(futures))
    client.cancel(data)
    return rate


def downpour_examples_per_s(
    client, model, train, replicas: int, every: int, seconds: float, shards: int = 2, **extra
) -> float:
    """Examples/s of one Downpour fit; ``extra`` overrides further ``DownpourSGD`` settings."""
    pushes = downpour_fit(client, model, train, replicas, every, seconds, shards, **extra)
    # throughput while all replicas run: examples acknowledged in the window after the first second
    window = pushes[(pushes["time"] >= 1.0) & (pushes["time"] <= seconds)]
    return window["examples"].sum() / (seconds - 1.0)


def downpour_fit(
    client, model, train, replicas: int, every: int, seconds: float, shards: int = 2, **extra
):
    """One Downpour fit of ``seconds`` on this workload; its pushes (``experiment_.pushes``)."""
    settings = dict(
        n_replicas=replicas,
        n_shards=shards,
        optimizer="sgd",
        learning_rate=0.01,
        batch_size=BATCH,
        n_fetch=every,
        n_push=every,
        max_seconds=seconds,
        max_epochs=10_000,
        eval_every=1.0,
        random_state=0,
    )
    est = DownpourSGD(model, **{**settings, **extra}).fit(train, client=client)
    return est.experiment_.pushes


CONFIGURATIONS = [  # (replicas, shards, transport) for each n_fetch = n_push
    (1, 2, "auto"), (2, 2, "auto"), (4, 2, "auto"), (2, 2, "one-sided"), (4, 2, "one-sided"),
    (2, 1, "auto"), (2, 1, "dask"),
]  # fmt: skip


def one_round(
    client, model, train, seconds: float, token_bound: bool, label: str = "",
    one_sided: bool = False, downpour: bool = True,
):  # fmt: skip
    """Every row on the cluster once (the ceiling, the minimal server and each Downpour
    configuration, for n_fetch = n_push = 1 and 4): ``{(row name + label, every): examples/s}``."""
    X, y = train.X, train.y
    rates = {(CEILING + label, "-"): no_communication_examples_per_s(client, model, X, y, seconds)}
    for every in (1, 4):
        carries = {MINIMAL: "shared", MINIMAL_TCP: "socket"}
        if token_bound:
            carries[TOKENS] = "tokens"
        if one_sided:
            carries[ONE_SIDED] = "one-sided"
        for row, carry in carries.items():
            rates[(row + label, str(every))] = minimal_ps_examples_per_s(
                client, model, X, y, seconds, every, carry, BATCH
            )
        for replicas, shards, transport in CONFIGURATIONS if downpour else []:
            name = f"Downpour, {replicas} replica(s), {shards} shard(s)"
            name += {"dask": ", actor messages", "one-sided": ", one-sided"}.get(transport, "")
            rates[(name + label, str(every))] = downpour_examples_per_s(
                client, model, train, replicas, every, seconds, shards,
                transport=transport,
            )  # fmt: skip
    return rates


SERIAL = "serial numpy loop (1 thread, in process)"
CEILING = "serial loop on both workers at once, no communication"
MINIMAL = "minimal parameter server, shared memory, no library"
MINIMAL_TCP = "minimal parameter server, arrays over TCP"
TOKENS = "minimal parameter server, 1-byte tokens, no arrays"
ONE_SIDED = "minimal parameter server, one-sided, no thread woken"
PINNED = " (pinned)"
#: What each ``--pinned`` choice runs: unpinned, pinned, or both in every round.
PIN_STATES = {"no": [False], "yes": [True], "both": [False, True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--token-bound", action="store_true",
        help="also run the minimal server with only 1-byte tokens, no arrays",
    )  # fmt: skip
    parser.add_argument(
        "--one-sided", action="store_true",
        help="also run the one-sided minimal server: each replica updates the far shard's "
        "shared memory itself, under a lock, no thread woken",
    )  # fmt: skip
    parser.add_argument(
        "--no-downpour", action="store_true",
        help="only the serial loop, the ceiling and the minimal servers (no Downpour rows)",
    )  # fmt: skip
    parser.add_argument(
        "--pinned", choices=["no", "yes", "both"], default="no",
        help="run the cluster's rows with each worker pinned to a CPU of its own "
        "(downpour_dask.pin_workers), or both ways in every round",
    )  # fmt: skip
    args = parser.parse_args()
    train, _ = datasets.load("mnist5k")
    model = models.MLP(784, (256,), 10)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    states = PIN_STATES[args.pinned]
    runs: dict[tuple[str, str], list[float]] = {}
    with (
        local_cluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        # Rounds: every row once per round, so that the machine's drift falls on all rows alike.
        for _ in range(args.repeats):
            runs.setdefault((SERIAL, "-"), []).append(
                serial_examples_per_s(model, train.X, train.y, args.seconds)
            )
            for pinned in states:
                if pinned:
                    pin_workers(client)
                rates = one_round(
                    client, model, train, args.seconds, args.token_bound,
                    PINNED if pinned else "", args.one_sided, not args.no_downpour,
                )  # fmt: skip
                unpin_workers(client)
                for key, rate in rates.items():
                    runs.setdefault(key, []).append(rate)
    serial = statistics.median(runs[(SERIAL, "-")])
    print(
        f"\nMLP 784-256-10, batch {BATCH}, median of {args.repeats} rounds of {args.seconds:.0f} s "
        f"runs (each round runs every row once); a pinned row's shares are of the pinned ceiling "
        f"and minimal server"
    )
    print(
        f"{'configuration':64} {'n_fetch=n_push':>14} {'examples/s':>11} {'vs serial':>10} "
        f"{'of ceiling':>10} {'of minimal':>10}  {'runs, vs serial':>15}"
    )
    for (name, every), rates in runs.items():
        label = PINNED if name.endswith(PINNED) else ""
        rate = statistics.median(rates)
        ceiling = statistics.median(runs.get((CEILING + label, "-"), [float("nan")]))
        spread = f"{min(rates) / serial:.2f}-{max(rates) / serial:.2f}x"
        minimal = runs.get((MINIMAL + label, every))
        of_minimal = f"{rate / statistics.median(minimal):.0%}" if minimal else "-"
        print(
            f"{name:64} {every:>14} {rate:>11,.0f} {rate / serial:>9.2f}x {rate / ceiling:>9.0%}"
            f" {of_minimal:>10}  {spread:>15}"
        )


if __name__ == "__main__":
    main()
