"""What a new worker process pays to load the library's worker side: two versions of the code.

A Dask worker imports the module of the first task or actor it runs when it unpickles it; a
user's workers are spawned (Dask's default), so every new worker pays this, and so does every
worker a nanny restarts.  This script exports a git revision (``git archive``, default ``HEAD``)
into a temporary directory and, alternating with the working tree, times in fresh processes the
import of each worker-side entry module after ``distributed`` (which the worker process has
already imported): CPU seconds (``time.process_time``), and whether scikit-learn and SciPy came
with it.  Medians over the rounds; the ratio is the working tree's over the base's.

    python benchmarks/bench_worker_imports.py [--base HEAD] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_code_ab import ROOT, export

#: The modules whose functions and actors the fits send to workers (tests/test_layers.py keeps
#: them free of scikit-learn).
MODULES = (
    "downpour_dask.downpour.tasks",
    "downpour_dask.downpour.sparse_task",
    "downpour_dask.ps.shard",
    "downpour_dask.sandblaster.tasks",
)

PROBE = """
import json, sys, time
import distributed
start = time.process_time()
import {module}
print(json.dumps({{"cpu": time.process_time() - start,
                   "sklearn": "sklearn" in sys.modules, "scipy": "scipy" in sys.modules}}))
"""


def measure(tree: Path, module: str) -> dict:
    """One fresh process importing ``module`` from the project in ``tree``."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)], cwd=tree, capture_output=True,
        text=True, timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base = export(args.base, Path(scratch) / "base")
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.rounds):
            for module in MODULES:
                for name, tree in (("base", base), ("new", ROOT)):
                    runs.setdefault((name, module), []).append(measure(tree, module))
    print(f"import after distributed, CPU seconds, median of {args.rounds} fresh processes "
          f"(base: {args.base}, new: the working tree)")
    print(f"{'module':40} {'base':>6} {'new':>6} {'new/base':>8}  sklearn/scipy (base -> new)")
    for module in MODULES:
        old, new = runs[("base", module)], runs[("new", module)]
        old_cpu = statistics.median(r["cpu"] for r in old)
        new_cpu = statistics.median(r["cpu"] for r in new)

        def loaded(rs: list[dict]) -> str:
            return "/".join("yes" if rs[0][k] else "no" for k in ("sklearn", "scipy"))

        print(f"{module:40} {old_cpu:6.2f} {new_cpu:6.2f} {new_cpu / old_cpu:8.2f}  "
              f"{loaded(old)} -> {loaded(new)}")


if __name__ == "__main__":
    main()
