"""``downpour-dask simulate``: predict a finished run at other scales, and plan its shards.

It reads the run directory's ``simulation.json`` (the calibrated timings, see
:mod:`downpour_dask.simulate.calibration`) or, the first time (or with ``--also``, runs to
calibrate on together with it), calibrates from the run's log and writes it there; then
prints the timing mode's prediction for every replica x shard count and, for each replica
count, the fewest shards that keep every shard at most ``--max-utilisation`` busy.  Replicas
are assumed to have machines of their own (``Timing.cores`` None, no replica calling a shard
in-process), unlike the local run they were calibrated on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..log import Experiment
from ..simulate import calibration, planning, sweep
from .errors import UsageError

COLUMNS = {
    "n_replicas": 0,
    "n_shards": 0,
    "examples_per_s": 0,
    "pushes_per_s": 0,
    "utilisation": 2,
    "queue_wait": 6,
    "staleness_mean": 1,
    "staleness_p95": 1,
}


#: The most replicas a simulated configuration may have: the simulator's events, time and
#: memory grow with them.
MAX_REPLICAS = 100_000


def counts(text: str, flag: str) -> list[int]:
    """``"10,100,1000"`` as ints >= 1, or a UsageError naming ``flag``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes comma-separated integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``simulate`` arguments: the run to calibrate on and the scales to predict."""
    parser.add_argument(
        "--from",
        dest="run_dir",
        required=True,
        metavar="RUN_DIR",
        help="a Downpour run directory (runs/NAME)",
    )
    parser.add_argument(
        "--replicas", default="10,100,1000", help="replica counts (default 10,100,1000)"
    )
    parser.add_argument("--shards", default="1,4,16", help="shard counts (default 1,4,16)")
    parser.add_argument(
        "--max-utilisation",
        type=float,
        default=0.7,
        help="the planner's limit on a shard's busy fraction (default 0.7)",
    )
    parser.add_argument(
        "--also",
        default="",
        metavar="RUN_DIRS",
        help="comma-separated runs of the same model with other replica or shard counts, "
        "calibrated on together with --from (separates the replicas' CPU from the shards')",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="fit the timings again even if simulation.json exists",
    )


def simulate(args: argparse.Namespace) -> int:
    """Print the predicted table and the shard plan for ``args.run_dir``."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise UsageError(f"--from {args.run_dir!r} is not a run directory (no config.json)")
    replicas = counts(args.replicas, "--replicas")
    shards = counts(args.shards, "--shards")
    if max(replicas) > MAX_REPLICAS:  # its events grow with the replicas: time and memory
        raise UsageError(f"--replicas takes at most {MAX_REPLICAS:,}, got {max(replicas):,}")
    if not 0 < args.max_utilisation <= 1:
        raise UsageError(f"--max-utilisation must be in (0, 1], got {args.max_utilisation}")
    others = [Path(part) for part in args.also.split(",") if part.strip()]
    for other in others:
        if not (other / "config.json").is_file():
            raise UsageError(f"--also {str(other)!r} is not a run directory (no config.json)")
    if args.recalibrate or others or not (run_dir / calibration.FILENAME).is_file():
        try:
            fitted = calibration.calibrate(
                Experiment.load(run_dir), also=[Experiment.load(o) for o in others]
            )
        except (ValueError, KeyError) as err:
            raise UsageError(f"cannot calibrate from {run_dir}: {err}") from err
        print(f"calibrated from {1 + len(others)} run log(s); wrote {fitted.save(run_dir)}")
    else:
        fitted = calibration.load(run_dir)
    if max(shards) > fitted.setup.n_params:
        raise UsageError(
            f"--shards takes at most the model's {fitted.setup.n_params:,} parameters (a shard "
            f"holds at least one), got {max(shards):,}"
        )
    timing = fitted.timing.with_(cores=None)
    setup = fitted.setup.with_(local_replicas=0)  # every replica on a machine of its own
    print(f"timing: {timing}")
    table = sweep(setup, timing, replicas, shards)
    print(_format(table))
    advice = planning.plan(setup, timing, replicas, args.max_utilisation)
    print(f"\nfewest shards keeping each below {args.max_utilisation:.0%} utilisation:")
    for _, row in advice.iterrows():
        n = row["recommended_shards"]
        verdict = f"{int(n)} shards" if n == n and n is not None else "none of 1..256 suffices"
        print(
            f"  {int(row['n_replicas'])} replicas: {verdict} "
            f"(utilisation {row['utilisation']:.0%}, {row['examples_per_s']:,.0f} examples/s)"
        )
    return 0


def _format(table) -> str:
    shown = table[list(COLUMNS)].copy()
    for column, digits in COLUMNS.items():
        shown[column] = shown[column].round(digits)
    return shown.to_string(index=False)
