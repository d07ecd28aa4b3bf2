"""How long a ``downpour-dask`` command takes to start: two versions of the code.

Every command line is a new Python process, which imports what the command needs before it does
anything.  This script exports a git revision (``git archive``, default ``HEAD``) into a
temporary directory and, alternating with the working tree, runs each command line below in
fresh processes up to the point where the command would start its work (``--help``: the parser
is built and its help printed), and times it: wall seconds from the interpreter's start and CPU
seconds (``time.process_time``), and whether scikit-learn was imported.  Medians over the
rounds; the ratio is the working tree's over the base's.

    python benchmarks/bench_cli_start.py [--base HEAD] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_code_ab import ROOT, export

#: The command lines timed (each with ``--help``, so that none does its work).
COMMAND_LINES = (
    ["--help"],
    ["watch", "--help"],
    ["report", "--help"],
    ["synthetic", "--help"],
    ["train", "--help"],
)

PROBE = """
import contextlib, io, json, sys, time
from downpour_dask.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main({argv!r})
    except SystemExit:
        pass
print(json.dumps({{"cpu": time.process_time(), "sklearn": "sklearn" in sys.modules}}))
"""


def measure(tree: Path, argv: list[str]) -> dict:
    """One fresh process running ``argv`` with the project in ``tree``."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], cwd=tree, capture_output=True,
        text=True, timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    return {**json.loads(done.stdout.splitlines()[-1]), "wall": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cli-start-") as scratch:
        base = export(args.base, Path(scratch) / "base")
        for _ in range(args.rounds):
            for argv in COMMAND_LINES:
                for name, tree in (("base", base), ("new", ROOT)):
                    runs.setdefault((name, " ".join(argv)), []).append(measure(tree, argv))
    print(f"downpour-dask ... started in a fresh process, median of {args.rounds} "
          f"(base: {args.base}, new: the working tree); load {os.getloadavg()[0]:.1f}")
    print(f"{'command line':22} {'wall base':>9} {'new':>6} {'new/base':>8} {'CPU base':>9} "
          f"{'new':>6} {'new/base':>8}  scikit-learn (base -> new)")
    for argv in COMMAND_LINES:
        line = " ".join(argv)
        old, new = runs[("base", line)], runs[("new", line)]
        row = []
        for key in ("wall", "cpu"):
            before, after = (statistics.median(r[key] for r in rs) for rs in (old, new))
            row.append(f"{before:9.2f} {after:6.2f} {after / before:8.2f}")

        def loaded(rs: list[dict]) -> str:
            return "yes" if rs[0]["sklearn"] else "no"

        print(f"{line:22} {row[0]} {row[1]}  {loaded(old)} -> {loaded(new)}")


if __name__ == "__main__":
    main()
