"""A Downpour replica's own work per step, in one process: its loop against the serial loop.

On a cluster a replica's step is the gradient plus its bookkeeping (the accrual, the local step,
the push, installing fetched values and re-applying its own pushes they lack) plus the traffic;
``bench_downpour.py`` measures all of it at once, and on a 2-core VM its rounds spread by
tens of points, too much to see a change worth a few percent.  This script runs the library's
``ReplicaLoop`` alone, on one thread, over two shards of this process whose calls complete as
they are made, and interleaves it with the serial loop (``bench_downpour.serial_examples_per_s``),
so what it reports is the loop's own cost against a baseline measured beside it.  Both shards'
updates run on the replica's thread here, the far one's too: on a 2 x 2 cluster each worker's
shard takes the other replica's pushes, so a worker does the same work per step, less the
transfers.

Rows (MLP 784-256-10, batch 128, plain SGD at 0.01, mnist5k, as ``bench_downpour.py``), each at
n_fetch = n_push of 1 and 4:

- *one shard in the process, one as if on another worker*: what a replica of a 2 x 2 fit does
  on its worker.  The second shard's calls also complete at once, but the loop treats them as
  remote: their fetch goes through a buffer, is installed and has the replica's missing pushes
  re-applied, and the local step covers that shard's slice.
- *both shards in the process*: a fit whose shards all sit beside the replica.
- *one shard in the process, one one-sided*: what a replica of a 2 x 2 fit with
  ``transport="one-sided"`` does on its worker.  The second shard is reached through a
  :class:`~downpour_dask.ps.one_sided.OneSidedShard` on its shared body, as a replica on another
  worker of the host reaches it: the replica applies its pushes under the shard's file lock and
  copies the values back itself.  Both shards take file locks, as they do once a replica of the
  other worker pushes to them.

``--model softmax`` runs the same rows with multinomial logistic regression (784 x 10, 7,850
parameters) instead of the MLP: a model whose gradient takes tens of microseconds, so a step is
mostly the loop's own work.  The last columns give each row's best step in microseconds and
what it takes beyond the serial loop's best step: the library's cost per step, pushes included.

``bench_code_ab.py --script bench_replica_step.py`` runs it with two versions of the library.

    python benchmarks/bench_replica_step.py [--repeats 9] [--steps 300] [--model softmax]
"""

from __future__ import annotations

import os

# One BLAS thread, as Dask's nanny gives every worker.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from bench_downpour import BATCH, serial_examples_per_s  # noqa: E402

from downpour_dask import datasets, models, optim  # noqa: E402
from downpour_dask.data.stream import ArraySource  # noqa: E402
from downpour_dask.downpour.replica_loop import ReplicaConfig, ReplicaLoop  # noqa: E402
from downpour_dask.ps.calls import Done, Half  # noqa: E402
from downpour_dask.ps.one_sided import OneSidedShard  # noqa: E402
from downpour_dask.ps.shard import ParameterServerShard  # noqa: E402

LEARNING_RATE = 0.01


class InstantChannel:
    """A ``ShardChannel`` to a shard of this process whose calls complete as they are made;
    with ``in_process=False`` the loop treats it as a shard on another worker."""

    transport, shared, key, session = "bench", False, "shard", "bench"

    def __init__(self, shard: ParameterServerShard, in_process: bool):
        self.shard_object, self.shard, self.in_process = shard, shard.shard_id, in_process
        self.buffers = [np.empty_like(shard.values) for _ in range(2)]  # as a wire's two

    def pull(self, avoid=None, into=None):
        if into is None or not self.in_process:
            into = self.buffers[1] if avoid is self.buffers[0] else self.buffers[0]
        return Done(self.shard_object.snapshot_into(into, 0, self.session))

    def push(self, grad, fetched_version, seq, examples, loss):
        kw = {"seq": seq, "session": self.session, "examples": examples, "loss": loss}
        return Done(self.shard_object.apply_push(grad, fetched_version, 0, **kw))

    def exchange(self, grad, fetched_version, seq, examples, loss, avoid=None, into=None):
        pushed = self.push(grad, fetched_version, seq, examples, loss)
        return pushed, self.pull(avoid, into)

    def poll_warmstart(self):
        return Done(self.shard_object.warmstart_state())

    def includes(self, reply, seq):
        return seq <= reply.applied_through or seq in reply.applied_ahead

    def replaced(self, key, sent):
        return False

    def wait(self, call, key, sent):
        return call.result()

    def switch(self, lost_key, error):
        return False

    def close(self):
        pass


class NoWire:
    """The wire a one-sided line falls back to, never used here (no call fails one-sided)."""

    _broken = False


class OneSidedChannel(InstantChannel):
    """A ``ShardChannel`` to a shard of this process through a one-sided line on its shared
    body, as a replica on another worker of the host has (``ps/one_sided.py``)."""

    transport = "one-sided"

    def __init__(self, shard: ParameterServerShard):
        super().__init__(shard, in_process=False)
        offer = asyncio.run(shard.open_one_sided(0, self.session))
        self.line = OneSidedShard.open(offer, NoWire())  # every call here is one-sided
        if self.line is None:
            raise RuntimeError("the shard offered no one-sided line")

    def _into(self, avoid):
        return self.buffers[1] if avoid is self.buffers[0] else self.buffers[0]

    def pull(self, avoid=None, into=None):
        return self.line.pull(0, self.session, self._into(avoid))

    def push(self, grad, fetched_version, seq, examples, loss):
        kw = {"seq": seq, "session": self.session, "examples": examples, "loss": loss}
        return self.line.push(grad, fetched_version, 0, **kw)

    def exchange(self, grad, fetched_version, seq, examples, loss, avoid=None, into=None):
        kw = {"seq": seq, "session": self.session, "examples": examples, "loss": loss}
        call = self.line.exchange(grad, fetched_version, 0, out=self._into(avoid), **kw)
        return Half(call, 0), Half(call, 1)

    def close(self):
        self.line.close()


class NoSink:
    """A ``ReplicaSink`` that keeps nothing: no driver reads it here."""

    def keep_row(self, row):
        pass

    def keep_fetched(self, shard, key, version, values):
        return False

    def keep_acked(self, shard, key, version):
        pass

    def abandoned(self):
        return False


def replica_examples_per_s(
    model, source, initial, every: int, local: int, steps: int, one_sided: bool = False
) -> float:
    """Examples/s of ``steps`` steps of one ``ReplicaLoop`` over two shards, the first ``local``
    of them in its process (the others as if on another worker; with ``one_sided``, reached
    one-sided, and the in-process one with a one-sided line open too, as on a 2 x 2 fit)."""
    bounds = [0, initial.size // 2, initial.size]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    shards = [
        ParameterServerShard(i, lo, hi, initial[lo:hi], optim.sgd(LEARNING_RATE))
        for i, (lo, hi) in enumerate(ranges)
    ]
    if one_sided:
        idle = OneSidedChannel(shards[0])  # shard 0 shared, as another worker's replica has it
        channels = [InstantChannel(shards[0], True), OneSidedChannel(shards[1])]
    else:
        channels = [InstantChannel(shard, i < local) for i, shard in enumerate(shards)]
    config = ReplicaConfig(
        replica=0, batch_size=BATCH, n_fetch=every, n_push=every,
        local_learning_rate=LEARNING_RATE, seed=0, t0=time.time(), max_steps=steps,
    )  # fmt: skip
    loop = ReplicaLoop(channels, ranges, model, config, NoSink())
    start = time.perf_counter()
    result = loop.run(source)
    elapsed = time.perf_counter() - start
    if one_sided:
        for channel in (idle, channels[1]):
            channel.close()
    return result["steps"] * BATCH / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300, help="steps per replica measurement")
    parser.add_argument("--model", choices=["mlp", "softmax"], default="mlp")
    args = parser.parse_args()
    train, _ = datasets.load("mnist5k")
    if args.model == "mlp":
        model = models.MLP(784, (256,), 10)
    else:
        model = models.SoftmaxRegression(784, 10)
    source = ArraySource(train.X, train.y, BATCH)
    initial = model.init(np.random.default_rng(0))
    rows = {
        (f"replica, {local} of 2 shards in the process", every): (every, local, False)
        for local in (1, 2)
        for every in (1, 4)
    }
    for every in (1, 4):
        rows[("replica, 1 in the process, 1 one-sided", every)] = (every, 1, True)
    serial: list[float] = []
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    replica_examples_per_s(model, source, initial, 1, 1, 20)  # first calls, workspaces
    for _ in range(args.repeats):
        serial.append(serial_examples_per_s(model, source.X, source.y, 1.0, LEARNING_RATE))
        for key, (every, local, one_sided) in rows.items():
            rates[key].append(
                replica_examples_per_s(model, source, initial, every, local, args.steps, one_sided)
            )
    base, best = statistics.median(serial), max(serial)
    step_us = BATCH / best * 1e6  # the serial loop's best step
    print(
        f"{platform.processor() or platform.machine()}, numpy {np.__version__}; "
        f"{model.n_params:,} parameters; {args.repeats} repeats, rows interleaved; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'row':44s} {'n':>2s} {'examples/s':>11s} {'of serial':>10s} {'range':>12s} "
        f"{'best':>8s} {'best/best':>10s} {'us/step':>8s} {'beyond':>7s}"
    )
    print(
        f"{'serial loop (gradient and SGD step only)':44s} {'-':>2s} {base:11,.0f} {1:10.2f} "
        f"{'':12s} {best:8,.0f} {1:10.2f} {step_us:8.1f} {'-':>7s}"
    )
    for (name, every), values in rates.items():
        shares = [v / s for v, s in zip(values, serial)]
        low, high = min(shares), max(shares)
        row_us = BATCH / max(values) * 1e6
        print(
            f"{name:44s} {every:2d} {statistics.median(values):11,.0f} "
            f"{statistics.median(shares):10.2f} {low:5.2f}-{high:.2f} "
            f"{max(values):8,.0f} {max(values) / best:10.2f} {row_us:8.1f} {row_us - step_us:7.1f}"
        )


if __name__ == "__main__":
    main()
