"""What the guarded update costs a shard: one push through ``ParameterServerShard.apply_push``
(NaN check, undo copies, finiteness check of parameters and update-rule state, counters)
against the bare ``UpdateRule.update`` on the same slice, in this process.

    python benchmarks/bench_guard.py
"""

from __future__ import annotations

import time

import numpy as np

from downpour_dask import optim
from downpour_dask.ps.shard import ParameterServerShard


def median_ms(step, repeats: int = 7, inner: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            step()
        times.append((time.perf_counter() - start) / inner)
    return 1e3 * sorted(times)[repeats // 2]


def main() -> None:
    print(
        f"{'parameters':>10} {'rule':<8}{'rule.update ms':>15}{'guarded push ms':>16}{'ratio':>7}"
    )
    for n in (50_000, 1_000_000):
        for name in ("sgd", "adagrad", "adam"):
            rule = optim.make(name, 0.01)
            shard = ParameterServerShard(0, 0, n, np.zeros(n, np.float32), rule)
            grad = np.random.default_rng(0).normal(size=n).astype(np.float32)
            values, state = np.zeros(n, np.float32), rule.init(n)
            bare = median_ms(lambda: rule.update(values, grad, state))  # noqa: B023
            guarded = median_ms(lambda: shard.apply_push(grad, shard.version, 0))  # noqa: B023
            print(f"{n:>10,} {name:<8}{bare:>15.3f}{guarded:>16.3f}{guarded / bare:>7.2f}")


if __name__ == "__main__":
    main()
