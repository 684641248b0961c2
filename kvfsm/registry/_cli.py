"""``kvfsm bootstrap``: run the bootstrap registry until Ctrl-C (or SIGTERM), then exit 0.

    kvfsm bootstrap --host 127.0.0.1 --port 8998 --expected-ranks N --ttl 30 [--secret-file PATH]
        [--max-connections 512] [--idle-timeout 5] [--request-timeout 10]

It binds 127.0.0.1 unless told otherwise: give ``--host 0.0.0.0`` (or an interface address) to
serve other machines, and then a ``--secret-file`` so that only holders of the secret can register
or remove ranks. The file holds the secret (at least 16 bytes; surrounding whitespace is ignored),
e.g. ``python -c "import secrets; print(secrets.token_hex(32))" > secret``. The secret is never
taken on the command line, where other users could read it in the process list.

``--max-connections``, ``--idle-timeout`` and ``--request-timeout`` bound what clients can hold
open and for how long (kvfsm/registry/_connections.py, "Connections").

One log line per registration, replacement, removal and expiry goes to stderr (heartbeats only
with ``-v``). Exit status: 0 after Ctrl-C/SIGTERM, 2 for a bad argument or secret file, 1 if the
address cannot be bound.

Also runnable as ``python -m kvfsm.registry._cli``. ``kvfsm.cli`` wires it in with
``add_parser(subparsers)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfsm.link import check_secret
from kvfsm.registry._connections import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from kvfsm.registry._server import DEFAULT_PORT, REQUEST_TIMEOUT_S, BootstrapServer

__all__ = ["add_parser", "main", "run"]

_log = logging.getLogger("kvfsm.registry")


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (%(default)s: this machine only; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port to bind, 0 for any (%(default)s)"
    )
    parser.add_argument(
        "--expected-ranks",
        type=int,
        required=True,
        metavar="N",
        help="ranks per engine; lookups answer 503 until all N are registered",
    )
    parser.add_argument(
        "--ttl",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="an entry expires this long after its last registration (%(default)s)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="file holding the shared secret; with it, writes must be HMAC-signed",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help="connections held at once; beyond, the one idle the longest is closed (%(default)s)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection with no request in progress after this long (%(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT_S,
        metavar="SECONDS",
        help="a request must be read and answered within this long (%(default)s)",
    )
    # Also after ``bootstrap``; SUPPRESS keeps a count given before it from being reset.
    parser.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log heartbeats too"
    )
    return parser


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``bootstrap`` subcommand to ``kvfsm``'s subparsers and return its parser."""
    doc = __doc__ or ""
    parser = subparsers.add_parser(
        "bootstrap",
        help="run the bootstrap registry where prefill ranks register and decode ranks look up",
        description=doc.split("\n\n")[0],
    )
    return _configure(parser)


def _read_secret(path: Path) -> bytes:
    return check_secret(path.read_bytes().strip())


async def _serve(server: BootstrapServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        async with server:
            await stop.wait()
            _log.info("bootstrap registry stopping")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    """Run the registry described by ``args`` (from ``add_parser``) until Ctrl-C or SIGTERM."""
    verbose: int = getattr(args, "verbose", 0)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    # INFO for our own lines whatever the root level is; -v adds the heartbeat (DEBUG) lines.
    _log.setLevel(logging.DEBUG if verbose else logging.INFO)
    try:
        secret = None if args.secret_file is None else _read_secret(args.secret_file)
        server = BootstrapServer(
            args.host,
            args.port,
            expected_ranks=args.expected_ranks,
            ttl_s=args.ttl,
            secret=secret,
            max_connections=args.max_connections,
            idle_timeout_s=args.idle_timeout,
            request_timeout_s=args.request_timeout,
        )
    except (OSError, ValueError, TypeError) as exc:
        print(f"kvfsm bootstrap: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(server))
    except OSError as exc:
        print(f"kvfsm bootstrap: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # where no signal handler could be installed (Windows)
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfsm.registry._cli", description=(__doc__ or "").split("\n\n")[0]
    )
    return run(_configure(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
