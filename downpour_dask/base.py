"""What every downpour-dask estimator shares: scikit-learn's parameter contract, predict/score on
the learned parameter vector, argument checks, and the embedded local cluster used when no Dask
client is given.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Client, LocalCluster, Security

from .data import Dataset, as_dataset
from .models import Model


class ParamServerEstimator:
    """Base class: ``__init__`` stores arguments only; ``fit`` sets ``params_``, ``experiment_``."""

    model: Model
    params_: np.ndarray

    # -- scikit-learn parameter contract ---------------------------------------------------------
    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return [p for p in signature.parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments, as scikit-learn's ``get_params``."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> ParamServerEstimator:
        """Set constructor arguments, as scikit-learn's ``set_params``; returns ``self``."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(
                    f"invalid parameter {name!r} for {type(self).__name__}; "
                    f"valid parameters: {', '.join(valid)}"
                )
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -- using the learned parameters ------------------------------------------------------------
    def _fitted_params(self) -> np.ndarray:
        if not hasattr(self, "params_"):
            raise AttributeError(
                f"this {type(self).__name__} is not fitted yet; call fit before predict or score"
            )
        return self.params_

    def predict(self, X: np.ndarray | Dataset) -> np.ndarray:
        """Class labels (classifiers) or predicted values (regression) for ``X``."""
        params = self._fitted_params()
        if isinstance(X, Dataset):
            X = X.X
        X, _ = self.model.check_data(X)
        return self.model.predict(params, X)

    def score(self, data: np.ndarray | Dataset | tuple, y: np.ndarray | None = None) -> float:
        """Accuracy (classifiers) or R^2 (regression) on a Dataset, an ``(X, y)`` pair, or X, y."""
        params = self._fitted_params()
        dataset = as_dataset(data, y, what="data")
        X, y = self.model.check_data(dataset.X, dataset.y)
        return self.model.score(params, X, y)


# -- argument checks (scikit-learn style messages) ------------------------------------------------


def check_int(
    name: str, value: Any, low: int, high: int | None = None, allow_none: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is an int in ``[low, high]`` (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_positive(
    name: str, value: Any, allow_none: bool = False, allow_zero: bool = False
) -> None:
    """Raise TypeError/ValueError unless ``value`` is a finite number > 0 (>= 0 if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    bad = not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


# -- the cluster ---------------------------------------------------------------------------------


def check_security(value: Any) -> None:
    """Raise TypeError unless ``value`` is None, True or a ``distributed.Security``, and a clear
    error if ``True`` cannot work because ``cryptography`` (the ``tls`` extra) is missing."""
    if value is True and importlib.util.find_spec("cryptography") is None:
        raise ValueError(
            "security=True makes temporary TLS certificates, which needs the cryptography "
            "package: pip install 'downpour-dask[tls]'"
        )
    if value is None or value is True or isinstance(value, Security):
        return
    raise TypeError(
        f"security must be None, True (a TLS-only embedded cluster with temporary certificates) "
        f"or a distributed.Security, got {value!r} ({type(value).__name__})"
    )


@contextlib.contextmanager
def cluster_client(
    client: Client | None, security: Security | bool | None = None
) -> Iterator[Client]:
    """Yield ``client``, or start an embedded local cluster (worker processes) and close it after.

    The embedded cluster has one single-threaded worker process per core (at least two), so
    parameter-server shards and replicas run in separate processes as they would on a real cluster.
    With ``security`` (``True`` for ``Security.temporary()``, or a ``distributed.Security`` with
    certificates for every role) it listens on TLS only and refuses clients without credentials.

    Raises
    ------
    ValueError
        If both ``client`` and ``security`` are given: a client brings its own security.
    """
    check_security(security)
    if client is not None:
        if security is not None:
            raise ValueError(
                "security= configures the embedded cluster, started only when client is None; "
                "the client given already has its own security (Client(..., security=...))"
            )
        yield client
        return
    n_workers = max(2, min(os.cpu_count() or 2, 8))
    tls: dict[str, Any] = {}
    if security is not None:
        tls = {
            "security": Security.temporary() if security is True else security,
            "protocol": "tls://",
        }
    with (
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            **tls,
        ) as cluster,
        Client(cluster, security=cluster.security) as embedded,
    ):
        yield embedded
