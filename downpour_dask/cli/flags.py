"""Estimator arguments as ``train`` flags, generated from the estimators' signatures and docs.

Every constructor argument of every algorithm in :data:`downpour_dask.runs.ALGORITHMS` gets a
flag (``n_replicas`` -> ``--n-replicas``), so none can be missing; its help is the first sentence
of the argument's numpydoc description and its type comes from the annotation.  An argument of
one algorithm only is marked ``[algorithm]``; one both take but describe differently is shown
with each algorithm's own description, so the help never states one algorithm's meaning for the
other.  Arguments that are not scalars (``security``) are set by other flags instead
(:data:`FLAGLESS_ARGUMENTS`).
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable
from typing import Any

from ..runs import ALGORITHM_DEFAULTS, ALGORITHMS, estimator_arguments

#: Estimator arguments that deliberately have no flag of their own, and what sets them instead.
FLAGLESS_ARGUMENTS = {
    "security": "--tls (a TLS-only embedded cluster); --tls-ca-file/--tls-cert/--tls-key "
    "give a client's credentials for --scheduler",
}

#: Extra spellings of some flags.
ALIASES = {"random_state": ("--seed",)}

#: The help of flags whose estimator arguments share one numpydoc entry
#: (``max_epochs, max_steps : int``): one line per flag, each saying what it alone does.
OWN_HELP = {
    "n_fetch": "[downpour] A replica fetches fresh parameters from the shards every n_fetch "
    "steps (the paper's experiments used 1) (default 1)",
    "n_push": "[downpour] A replica pushes its accrued gradient to the shards every n_push "
    "steps (the paper's experiments used 1) (default 1)",
    "max_epochs": "[downpour] Each replica stops after this many passes over its own data "
    "(default 3 unless --max-steps or --max-seconds is given, then none)",
    "max_steps": "[downpour] Each replica stops after this many steps (minibatches) "
    "(default None)",
}


def flag(name: str) -> str:
    """The command-line spelling of an estimator argument or job setting: ``--n-replicas``."""
    return "--" + name.replace("_", "-")


def value_parser(annotation: str) -> Callable[[str], Any]:
    """A converter for a flag from the annotation string(s) of its estimator argument.

    ``int`` and ``float`` arguments get numbers ("2" stays an int, valid where a count is meant
    too), an optional one (``... | None``) also accepts ``none``, one with ``Literal[...]``
    words (``n_replicas``: a count or "auto") those words; anything else is a string.
    """
    literals = "".join(re.findall(r"Literal\[([^\]]*)\]", annotation))
    words = re.findall(r"['\"](\w+)['\"]", literals)
    optional = "None" in annotation
    base = "float" if "float" in annotation else "int"
    if "str" in annotation:
        base = "str"

    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if text in words:
            return text
        try:
            if base == "int":
                return int(text)
            if base == "float":
                return int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            kind = "an integer" if base == "int" else "a number"
            extra = "".join(f" or {w!r}" for w in [*words, *(["none"] if optional else [])])
            raise argparse.ArgumentTypeError(f"expected {kind}{extra}, got {text!r}") from None
        return text

    convert.__name__ = base  # argparse names the type in its messages
    return convert


def parameter_help(cls: type) -> dict[str, str]:
    """First sentence of each parameter's description in ``cls``'s numpydoc ``Parameters``
    section, with reST markup removed: the flags' help comes from the estimator's own docs."""
    section = (inspect.getdoc(cls) or "").split("Parameters\n----------\n", 1)
    lines = section[1].splitlines() if len(section) == 2 else []
    found: dict[str, str] = {}
    names: list[str] = []
    for line, underline in zip(lines, [*lines[1:], ""]):
        if underline.startswith("---"):  # the heading of the next section: this one is over
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


def _described(name: str, by_algorithm: dict[str, tuple[inspect.Parameter, str]]) -> str:
    """The help of one flag: each algorithm's description and the command's default."""
    defaults = {
        algorithm: ALGORITHM_DEFAULTS[algorithm].get(name, parameter.default)
        for algorithm, (parameter, _) in by_algorithm.items()
    }
    texts = {algorithm: text for algorithm, (_, text) in by_algorithm.items()}
    if len(set(texts.values())) > 1:  # each algorithm means its own thing by it
        return " ".join(f"[{a}] {texts[a]} (default {defaults[a]})." for a in by_algorithm)
    text = next(iter(texts.values()))
    if len(by_algorithm) < len(ALGORITHMS):
        text = f"[{', '.join(by_algorithm)}] {text}"
    if len(set(map(repr, defaults.values()))) == 1:
        return f"{text} (default {next(iter(defaults.values()))})"
    return f"{text} (default " + ", ".join(f"{a}: {d}" for a, d in defaults.items()) + ")"


def estimator_flags() -> dict[str, dict[str, tuple[inspect.Parameter, str]]]:
    """Every flagged estimator argument -> {algorithm: (its parameter, its description)}."""
    flags: dict[str, dict[str, tuple[inspect.Parameter, str]]] = {}
    for algorithm, cls in ALGORITHMS.items():
        described = parameter_help(cls)
        for name, parameter in estimator_arguments(algorithm).items():
            if name not in FLAGLESS_ARGUMENTS:  # not a scalar: set by other flags
                flags.setdefault(name, {})[algorithm] = (parameter, described.get(name, ""))
    return flags


def add_estimator_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every estimator argument to ``parser`` (the ``train`` command)."""
    group = parser.add_argument_group(
        "estimator arguments (as in the estimators' constructors; [algorithm] marks those of one "
        "algorithm only; defaults shown are the command's)"
    )
    for name, by_algorithm in estimator_flags().items():
        annotation = " | ".join(str(p.annotation) for p, _ in by_algorithm.values())
        spellings = [flag(name), *ALIASES.get(name, ())]
        described = OWN_HELP.get(name) or _described(name, by_algorithm)
        if "bool" in annotation:
            group.add_argument(
                *spellings,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=described,
            )
        else:
            group.add_argument(
                *spellings,
                dest=name,
                type=value_parser(annotation),
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=described,
            )
