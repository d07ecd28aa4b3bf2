"""The update rule an estimator's ``optimizer`` argument names: a rule, a name, or a spec.

A *spec* is a rule's name with its hyperparameters after a colon, as a model spec
(``"mlp:128"``) gives a model's hidden layers::

    "adam"                           Adam at its defaults
    "adam:beta2=0.95"                Adam with beta2 = 0.95
    "dc_adam:beta1=0.5,beta2=0.99"   delay-compensated Adam (DC-ASGD) with both set
    "staleness_aware_momentum:momentum=0.5"

So every rule the Python API builds with :func:`~downpour_dask.core.optim.make` can also be
named where only a string fits: ``downpour-dask train --optimizer adam:beta2=0.95``, a job's
config file, and the run directory's record of the fit.  Why it matters: with ``n_push`` > 1 a
shard applies one Adam step per push, so Adam's default ``beta2`` (0.999) averages the second
moment over more pushes than a short fit makes (``benchmarks/README.md``, ``bench_large.py``).

Names are those of :data:`~downpour_dask.core.optim.OPTIMIZERS`, each also with the ``"dc_"``
prefix (:mod:`~downpour_dask.core.compensation`); options are those :func:`~.optim.make` takes
for the rule (``beta1``, ``beta2`` and ``eps`` for Adam, ``momentum`` for momentum, ``eps`` for
Adagrad).  A rule passed as an object is recorded as its ``get_config()``; :func:`from_config`
rebuilds it, delay-compensated ones included (the simulator reads a run's record so).
Numpy only.
"""

from __future__ import annotations

from typing import Any

from . import optim
from .compensation import DEFAULT_LAMBDA, PREFIX, DelayCompensated
from .optim import UpdateRule

#: How a spec reads, for error messages.
FORM = "name or name:option=value[,option=value] (e.g. 'adam:beta2=0.95')"


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """``"adam:beta2=0.95"`` -> ``("adam", {"beta2": 0.95})``; a bare name has no options.

    Raises
    ------
    ValueError
        An option without ``=``, without a name, given twice, or whose value is not a number;
        the message quotes the spec and shows the form.
    """
    name, colon, rest = spec.partition(":")
    options: dict[str, float] = {}
    if not colon:
        return name.strip(), options
    for item in rest.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise ValueError(f"optimizer {spec!r}: {item.strip()!r} is not option=value; {FORM}")
        if key in options:
            raise ValueError(f"optimizer {spec!r} gives {key!r} twice")
        try:
            options[key] = float(value)
        except ValueError:
            raise ValueError(
                f"optimizer {spec!r}: {key}={value!r} is not a number; {FORM}"
            ) from None
    return name.strip(), options


def build(spec: str, learning_rate: float) -> UpdateRule:
    """The rule a name or spec names, without the ``"dc_"`` prefix: what a sparse fit takes
    (:func:`~downpour_dask.downpour.sparse_fit.fit_sparse` has no delay compensation).

    Raises
    ------
    ValueError, TypeError
        As :func:`resolve`.
    """
    name, options = parse(spec)
    return optim.make(name, learning_rate, **options)


def resolve(optimizer: Any, learning_rate: float) -> UpdateRule:
    """The rule an estimator's ``optimizer`` and ``learning_rate`` arguments name.

    ``optimizer`` is an :class:`~.optim.UpdateRule` (whose rate must be ``learning_rate``, see
    :func:`~.optim.resolve`), or a name or spec (module docstring): ``"dc_<spec>"`` is the rule
    of ``<spec>`` delay-compensated with the default ``lam``.

    Raises
    ------
    ValueError
        An unknown name, a malformed spec, or a value out of the rule's range.
    TypeError
        An option the rule does not take (the message lists those it does), or an
        ``optimizer`` that is neither a string nor a rule.
    """
    if not isinstance(optimizer, str):
        return optim.resolve(optimizer, learning_rate)
    name, options = parse(optimizer)
    base = name.removeprefix(PREFIX)
    if base == name:
        return optim.make(name, learning_rate, **options)
    if base not in optim.OPTIMIZERS:
        names = ", ".join(PREFIX + rule for rule in optim.OPTIMIZERS)
        raise ValueError(f"a delay-compensated optimizer is one of {names}; got {name!r}")
    return DelayCompensated(optim.make(base, learning_rate, **options))


def from_config(config: dict[str, Any]) -> UpdateRule:
    """Rebuild a rule from its ``get_config()``, DC-ASGD's (``"dc_<name>"`` and ``lam``)
    included, which :func:`~.optim.from_config` does not know."""
    name = str(config.get("name", ""))
    base = name.removeprefix(PREFIX)
    if base == name:
        return optim.from_config(config)
    options = {key: value for key, value in config.items() if key != "lam"}
    rule = optim.from_config({**options, "name": base})
    return DelayCompensated(rule, config.get("lam", DEFAULT_LAMBDA))
