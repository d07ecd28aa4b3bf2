"""The ``downpour-dask`` command: parse arguments, delegate to :mod:`runs` and :mod:`report`.

::

    downpour-dask train                                   # MLP on mnist5k, embedded cluster
    downpour-dask train --config run.toml --learning-rate 0.02
    downpour-dask train --scheduler tcp://10.0.0.5:8786 --n-replicas 16
    downpour-dask report runs/a runs/b --target 0.9
    downpour-dask synthetic big/ --rows 10000000 --features 256 --classes 10
    downpour-dask watch mnist --scheduler tls://10.0.0.5:8786 --tls-ca-file ca.pem \
        --tls-cert client.pem --tls-key client.key         # a run fit(..., publish="mnist")

Every estimator argument has a flag (``n_replicas`` -> ``--n-replicas``), generated from the
estimator's signature so none can be missing.  ``--config FILE.toml`` sets any of them (and the
job settings) with the same names; flags given on the command line win.  Bad input ends the
command with one line on stderr and exit status 2; a run that fails on the cluster exits with 1.
Neither leaves a run directory behind.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from . import runs
from ._version import __version__

PROG = "downpour-dask"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit status 2)."""


#: Estimator arguments that deliberately have no flag of their own, and what sets them instead.
FLAGLESS_ARGUMENTS = {
    "security": "--tls (a TLS-only embedded cluster); --tls-ca-file/--tls-cert/--tls-key "
    "give a client's credentials for --scheduler",
}


# -- building the parser -------------------------------------------------------------------------


def _value_parser(annotation: str, name: str):
    """A converter for a flag from the annotation string of its estimator argument."""
    optional = "None" in annotation
    base = "bool" if "bool" in annotation else "float" if "float" in annotation else "int"
    if "str" in annotation:
        base = "str"

    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        try:
            if base == "int":
                return int(text)
            if base == "float":  # "2" stays an int: valid where a count is meant too
                return int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            kind = "an integer" if base == "int" else "a number"
            extra = " or 'none'" if optional else ""
            raise argparse.ArgumentTypeError(f"expected {kind}{extra}, got {text!r}") from None
        return text

    convert.__name__ = base
    return convert


def _parameter_help(cls: type) -> dict[str, str]:
    """First sentence of each parameter's description in a numpydoc ``Parameters`` section,
    with reST markup removed: the flags' help comes from the estimator's own documentation."""
    section = (inspect.getdoc(cls) or "").split("Parameters\n----------\n", 1)
    found: dict[str, str] = {}
    names: list[str] = []
    for line in section[-1].splitlines() if len(section) == 2 else []:
        if line.startswith("---"):  # the underline of the next section: this one is over
            break
        if line and not line[0].isspace():
            names = [name.strip() for name in line.split(" : ")[0].split(",")]
            found.update({name: "" for name in names})
        elif line.strip():
            for name in names:
                found[name] = f"{found[name]} {line.strip()}".strip()
    plain = {}
    for name, text in found.items():
        text = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).split(".")[-1], text)
        plain[name] = text.replace("``", "").split(". ")[0].rstrip(".")
    return plain


def _add_estimator_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "estimator arguments (as in the estimators' constructors; [algorithm] marks those of one "
        "algorithm only; defaults shown are the command's)"
    )
    flags: dict[str, dict[str, Any]] = {}  # argument -> {algorithm: (parameter, help)}
    for algorithm, cls in runs.ALGORITHMS.items():
        described = _parameter_help(cls)
        for name, parameter in runs.estimator_arguments(algorithm).items():
            if name in FLAGLESS_ARGUMENTS:  # not a scalar: set by other flags
                continue
            flags.setdefault(name, {})[algorithm] = (parameter, described.get(name, ""))
    for name, by_algorithm in flags.items():
        parameter, text = next(iter(by_algorithm.values()))
        defaults = {
            algorithm: runs.ALGORITHM_DEFAULTS[algorithm].get(name, p.default)
            for algorithm, (p, _) in by_algorithm.items()
        }
        if len(by_algorithm) < len(runs.ALGORITHMS):
            text = f"[{', '.join(by_algorithm)}] {text}"
        if len(set(map(repr, defaults.values()))) == 1:
            text += f" (default {next(iter(defaults.values()))})"
        else:
            text += " (default " + ", ".join(f"{a}: {d}" for a, d in defaults.items()) + ")"
        flag = "--" + name.replace("_", "-")
        annotation = str(parameter.annotation)
        if "bool" in annotation:
            group.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
            continue
        group.add_argument(
            *([flag, "--seed"] if name == "random_state" else [flag]),
            dest=name,
            type=_value_parser(annotation, name),
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=text,
        )


def build_parser() -> argparse.ArgumentParser:
    """The ``downpour-dask`` argument parser with its ``train`` and ``report`` commands."""
    parser = _Parser(prog=PROG, description="Downpour SGD on Dask: train and compare runs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser(
        "train",
        help="train a model and write a run directory",
        description="Train a model with Downpour SGD (or Sandblaster L-BFGS) and write "
        "runs/<name>/. With no argument: an MLP on the shipped mnist5k, 4 replicas, 2 shards, "
        "Adagrad, on an embedded local cluster.",
    )
    job = train.add_argument_group("job")
    job.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    job.add_argument(
        "--algorithm",
        choices=list(runs.ALGORITHMS),
        default=argparse.SUPPRESS,
        help="downpour (Downpour SGD) or sandblaster (Sandblaster L-BFGS); default downpour",
    )
    job.add_argument(
        "--dataset",
        default=argparse.SUPPRESS,
        metavar="NAME|PATH",
        help="a shipped dataset (digits, mnist5k) or parquet/CSV file(s) with a 'label' column "
        "(default mnist5k)",
    )
    job.add_argument(
        "--eval-dataset",
        default=argparse.SUPPRESS,
        metavar="NAME|PATH",
        help="evaluation data (default: the shipped dataset's test split)",
    )
    job.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="SPEC",
        help="mlp:128,64 | mlp | softmax | logistic | linear (default mlp:128)",
    )
    job.add_argument("--out", default=argparse.SUPPRESS, help="parent of run directories (runs)")
    job.add_argument("--name", default=argparse.SUPPRESS, help="run directory name")
    job.add_argument(
        "--overwrite",
        action="store_true",
        default=argparse.SUPPRESS,
        help="replace an existing run directory of the same name",
    )
    job.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="train on an existing Dask cluster (e.g. tcp://host:8786) instead of an embedded one",
    )
    job.add_argument(
        "--publish", default=argparse.SUPPRESS, metavar="NAME",
        help="publish the running job on the cluster as NAME, for downpour-dask watch NAME and "
        "downpour_dask.attach (downpour only)",
    )  # fmt: skip
    job.add_argument("--quiet", action="store_true", help="no progress line")
    job.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the interrupted job that was writing RUN_DIR from its latest checkpoint "
        "(with that job's settings: give no other settings)",
    )
    job.add_argument(
        "--tls",
        action="store_true",
        help="run the embedded cluster on TLS only, with temporary self-signed certificates",
    )
    _add_connection_flags(train)
    _add_estimator_flags(train)
    train.set_defaults(handler=_train)

    watch = commands.add_parser(
        "watch",
        help="follow a running fit published on a cluster",
        description="Print progress lines of the run a fit(..., publish=NAME) published on the "
        "cluster, until it ends (exit 0 when it finished, 1 if it failed).",
    )
    watch.add_argument("name", metavar="NAME", help="the name given to fit(..., publish=)")
    watch.add_argument(
        "--scheduler",
        required=True,
        metavar="ADDRESS",
        help="the Dask scheduler of the run's cluster (e.g. tcp://host:8786)",
    )
    watch.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between progress lines when the output is not a terminal (default 2)",
    )
    _add_connection_flags(watch)
    watch.set_defaults(handler=_watch)

    synthetic = commands.add_parser(
        "synthetic",
        help="write a large learnable classification dataset as parquet files",
        description="Write ROWS rows of FEATURES float32 features, labelled by a fixed random "
        "teacher network, as parquet files in PATH (streamed: memory stays bounded).",
    )
    synthetic.add_argument("path", metavar="PATH", help="directory to create")
    synthetic.add_argument("--rows", type=int, required=True)
    synthetic.add_argument("--features", type=int, required=True)
    synthetic.add_argument("--classes", type=int, default=10)
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--files", type=int, default=None, help="number of parquet files")
    synthetic.set_defaults(handler=_synthetic)

    report = commands.add_parser(
        "report",
        help="summarise and plot finished runs",
        description="Print one summary row per run and write summary.csv and comparison "
        "plots (accuracy and loss against time, staleness histogram).",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default="report", help="directory for the table and plots")
    report.add_argument(
        "--target",
        type=float,
        default=None,
        help="score for the time-to-target column (default: 0.9 for classifiers)",
    )
    report.set_defaults(handler=_report)
    return parser


# -- commands ------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Job settings: the config file's, overridden by the flags given."""
    settings: dict[str, Any] = {}
    if args.config is not None:
        try:
            with open(args.config, "rb") as f:
                loaded = tomllib.load(f)
        except OSError as err:
            raise UsageError(f"cannot read --config {str(args.config)!r}: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise UsageError(f"--config {str(args.config)!r} is not valid TOML: {err}") from None
        for key, value in loaded.items():
            if isinstance(value, dict):
                raise UsageError(
                    f"--config {str(args.config)!r}: tables ([{key}]) are not supported; "
                    f"write settings as top-level keys"
                )
            settings[key.replace("-", "_")] = value
    scheduler = settings.pop("scheduler", None)
    internal = {"config", "command", "handler", "quiet", "scheduler", "connect_timeout"}
    internal |= {"tls", "tls_ca_file", "tls_cert", "tls_key"}
    internal |= {"resume"}
    flags = {k: v for k, v in vars(args).items() if k not in internal}
    settings.update(flags)
    if args.scheduler is not None:
        scheduler = args.scheduler
    settings["__scheduler__"] = scheduler
    return settings


def _train(args: argparse.Namespace) -> int:
    settings = _settings(args)
    scheduler = settings.pop("__scheduler__")
    if args.resume is not None:
        if settings:
            raise UsageError(
                f"--resume continues a job with its own settings; do not also give "
                f"{', '.join(sorted(settings))}"
            )
        job = runs.resume(args.resume)  # a bad checkpoint is an error here, before any cluster
    else:
        job = runs.prepare(settings)  # all input errors surface here, before any cluster work
    callback = None
    if not args.quiet:
        from .progress import ProgressBar

        callback = ProgressBar(sys.stderr)
    if scheduler is None:
        if any(f is not None for f in (args.tls_ca_file, args.tls_cert, args.tls_key)):
            raise UsageError(
                "--tls-ca-file/--tls-cert/--tls-key are a client's credentials for --scheduler; "
                "for a TLS-only embedded cluster use --tls"
            )
        if args.tls:
            job.estimator.set_params(security=True)
        result = runs.run(job, None, callback)
    else:
        if args.tls:
            raise UsageError(
                "--tls starts a TLS-only embedded cluster; with --scheduler give "
                "--tls-ca-file/--tls-cert/--tls-key (or Dask's distributed.comm.tls settings)"
            )
        with _connect(scheduler, args) as client:
            result = runs.run(job, client, callback)
    s = result.summary
    metric = result.estimator.experiment_.metric
    score = s.get(f"final_{metric}")
    print(f"run directory: {result.path}")
    if score is not None:
        print(f"test {metric}: {score:.4f} (best {s[f'best_{metric}']:.4f})")
    if hasattr(result.estimator, "objective_"):  # Sandblaster L-BFGS
        est = result.estimator
        print(
            f"{s['duration']:.2f} s, {s['examples_per_s']:,.0f} examples/s, {est.n_iter_} "
            f"L-BFGS iterations, objective {est.objective_:.6g}, {int(s['failures'])} failures"
        )
    else:
        print(
            f"{s['duration']:.2f} s, {s['examples_per_s']:,.0f} examples/s, "
            f"{s['pushes_per_s']:,.0f} pushes/s, staleness mean {s['staleness_mean']:.1f} "
            f"p95 {s['staleness_p95']:.0f}, {int(s['refused_pushes'])} refused pushes, "
            f"{int(s['failures'])} failures"
        )
    return 0


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """``--connect-timeout`` and the TLS credentials: how a command reaches ``--scheduler``."""
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to try reaching --scheduler (default 30)",
    )
    group = parser.add_argument_group(
        "TLS credentials for --scheduler (default: Dask's distributed.comm.tls configuration)"
    )
    group.add_argument("--tls-ca-file", metavar="PEM", help="certificate authority to trust")
    group.add_argument("--tls-cert", metavar="PEM", help="this client's certificate")
    group.add_argument("--tls-key", metavar="PEM", help="this client's private key")


def _client_security(args: argparse.Namespace) -> Any:
    """A ``distributed.Security`` from the --tls-* flags (``None`` if none was given)."""
    given = {
        "tls_ca_file": args.tls_ca_file,
        "tls_client_cert": args.tls_cert,
        "tls_client_key": args.tls_key,
    }
    if all(v is None for v in given.values()):
        return None
    flags = {"tls_ca_file": "--tls-ca-file", "tls_client_cert": "--tls-cert"}
    flags["tls_client_key"] = "--tls-key"
    for key, path in given.items():
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flags[key]} {path!r} is not a file")
    if args.tls_ca_file is None or args.tls_cert is None:
        raise UsageError("give --tls-ca-file and --tls-cert (and --tls-key unless in the cert)")
    from distributed import Security

    return Security(require_encryption=True, **{k: v for k, v in given.items() if v is not None})


def _connect(scheduler: str, args: argparse.Namespace) -> Any:
    """A client of the scheduler at ``scheduler``, with the --tls-* credentials if given."""
    from distributed import Client

    security = _client_security(args)
    try:
        return Client(scheduler, timeout=args.connect_timeout, security=security)
    except (OSError, TimeoutError, ValueError, TypeError) as err:  # TypeError: TLS, no creds
        raise ConnectionError(
            f"cannot reach the Dask scheduler at {scheduler!r} within "
            f"{args.connect_timeout:g} s ({_one_line(err)})"
        ) from None


def _watch(args: argparse.Namespace) -> int:
    from . import live

    live.check_name(args.name)
    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0, got {args.interval:g}")
    with _connect(args.scheduler, args) as client:
        view = live.attach(args.name, client)  # ValueError naming the published runs if absent
        info = view.info
        print(
            f"watching {args.name!r}: {info.get('estimator')}, {info.get('n_replicas')} "
            f"replicas, {info.get('n_shards')} shards on {args.scheduler}",
            flush=True,
        )
        del view  # watching needs only the event topic; do not hold the run's actors
        finished = live.follow(client, args.name, sys.stdout, args.interval)
    if not finished:
        raise RuntimeError(f"run {args.name!r} ended without finishing (its fit failed)")
    print(f"run {args.name!r} finished", flush=True)
    return 0


def _synthetic(args: argparse.Namespace) -> int:
    from .data import datasets as data

    dataset = data.synthetic(
        args.path, args.rows, args.features, args.classes, seed=args.seed, n_files=args.files
    )
    print(f"wrote {dataset!r} to {args.path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from . import report

    for path in args.run_dirs:
        if not Path(path).is_dir():
            raise UsageError(f"RUN_DIR {path!r} is not a directory")
    table, target, written = report.report(args.run_dirs, args.out, args.target)
    if target is not None:
        print(f"time_to_target: seconds from the start of fit until test score >= {target:g}")
    print(report.format_table(table))
    for path in written:
        print(f"wrote {path}")
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``downpour-dask`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        return args.handler(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as err:
        print(f"{where}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted; no run directory was written", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, TimeoutError) as err:
        print(f"{where}: failed: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
