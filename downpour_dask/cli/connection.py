"""How a command reaches an existing cluster: ``--scheduler``, ``--connect-timeout`` and the
``--tls-*`` credentials, turned into a :class:`distributed.Client`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from distributed import Client, Security
from distributed.comm import connect as comm_connect

from ..runtime.dask_connect import connect_client
from .errors import Unreachable, UsageError, one_line

#: The --tls-* flags, by the :class:`distributed.Security` argument each one gives.
TLS_FLAGS = {
    "tls_ca_file": "--tls-ca-file",
    "tls_client_cert": "--tls-cert",
    "tls_client_key": "--tls-key",
}


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--connect-timeout`` and the TLS credentials to a command that takes --scheduler."""
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


def tls_credentials_given(args: argparse.Namespace) -> bool:
    """Whether any of --tls-ca-file, --tls-cert, --tls-key was given."""
    return any(f is not None for f in (args.tls_ca_file, args.tls_cert, args.tls_key))


def client_security(args: argparse.Namespace) -> Security | None:
    """A ``distributed.Security`` from the --tls-* flags (``None`` if none was given).

    Raises
    ------
    UsageError
        If a file given does not exist, or the CA file or the certificate is missing.
    """
    given = {
        "tls_ca_file": args.tls_ca_file,
        "tls_client_cert": args.tls_cert,
        "tls_client_key": args.tls_key,
    }
    if all(v is None for v in given.values()):
        return None
    for key, path in given.items():
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{TLS_FLAGS[key]} {path!r} is not a file")
    if args.tls_ca_file is None or args.tls_cert is None:
        raise UsageError("give --tls-ca-file and --tls-cert (and --tls-key unless in the cert)")
    return Security(require_encryption=True, **{k: v for k, v in given.items() if v is not None})


def connect(scheduler: str, args: argparse.Namespace, quiet: bool = False) -> Client:
    """A client of the scheduler at ``scheduler``, with the --tls-* credentials if given.

    Says on stderr where it connects (unless ``quiet``): Dask keeps trying for
    ``--connect-timeout`` seconds, silently.

    Raises
    ------
    Unreachable
        If the scheduler cannot be reached within ``--connect-timeout`` seconds, or what answers
        at ``scheduler`` is not a Dask scheduler (exit status 2).
    """
    security = client_security(args)
    if not args.connect_timeout > 0:
        raise UsageError(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout:g}")
    if not quiet:
        print(f"connecting to {scheduler} (timeout {args.connect_timeout:g} s)", file=sys.stderr)
    try:
        asyncio.run(_answers_as_dask(scheduler, args.connect_timeout, security))
        return connect_client(scheduler, args.connect_timeout, security=security)
    except (OSError, TimeoutError, ValueError, TypeError) as err:  # TypeError: TLS, no creds
        raise Unreachable(
            f"cannot reach the Dask scheduler at {scheduler!r} within "
            f"{args.connect_timeout:g} s ({one_line(err)})"
        ) from None


async def _answers_as_dask(address: str, timeout: float, security: Security | None) -> None:
    """Ask ``address`` for its identity, as a Dask client's first message, within ``timeout``
    seconds.  ``Client(address, timeout=)`` bounds only reaching the port: a port that accepts
    but never answers (a web server) would hold it for ever, and one that speaks first (an SSH
    server) fails it deep in Dask's frame reader.  Raises ``TimeoutError`` or ``OSError``."""

    async def ask() -> None:
        args = (security or Security()).get_connection_args("client")
        comm = await comm_connect(address, timeout=timeout, **args)
        try:
            await comm.write({"op": "identity"})
            await comm.read()
        finally:
            comm.abort()

    try:
        await asyncio.wait_for(ask(), timeout)
    except (TimeoutError, asyncio.TimeoutError) as err:  # (wait_for's own has no message)
        raise TimeoutError(str(err) or "no answer as a Dask scheduler") from None
    except (OSError, ValueError, TypeError):
        raise
    except Exception as err:  # what a non-Dask peer's bytes make of Dask's frame reader
        raise OSError(f"what answers there is not a Dask scheduler: {one_line(err)}") from None
