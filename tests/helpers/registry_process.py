"""A bootstrap registry in its own process, with a low file-descriptor limit, for the
exhaustion tests: the child lowers its soft ``RLIMIT_NOFILE`` (1024 unless told otherwise) so
that a test can run it out of descriptors without running the machine out of them.

    python tests/helpers/registry_process.py --nofile 1024 [--max-connections N]
        [--idle-timeout S] [--request-timeout S] [--expected-ranks N] [--uvloop]

Once serving it prints one JSON line, ``{"port": P, "nofile": [soft, hard]}``. Then it reads
commands from stdin, one a line, and answers each with a JSON line:

``hog``      open ``/dev/null`` until the limit refuses more (fds spent outside the listener,
             as an embedding process might spend them): ``{"hogged": n}``
``release``  close what ``hog`` opened: ``{"released": n}``
``stats``    the server's connection counters (``BootstrapServer.stats``), if it has them

End of stdin stops the server; the process then exits 0. The limits options are passed only when
given, so the same child also runs a server that does not know them (to measure old code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import sys
from typing import Any

from kvfsm.registry import BootstrapServer


def _lower_nofile(soft: int) -> tuple[int, int]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Only the soft limit: it is the one accept() meets, and the child never needs it back.
    want = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hog() -> list[int]:
    fds: list[int] = []
    while True:
        try:
            fds.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return fds


async def _main(args: argparse.Namespace) -> None:
    limits: dict[str, Any] = {}
    if args.max_connections is not None:
        limits["max_connections"] = args.max_connections
    if args.idle_timeout is not None:
        limits["idle_timeout_s"] = args.idle_timeout
    if args.request_timeout is not None:
        limits["request_timeout_s"] = args.request_timeout
    server = BootstrapServer(expected_ranks=args.expected_ranks, **limits)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()
    # A reader thread, not a pipe transport: it needs no descriptor of the loop's, so "hog" can
    # take every one and the child still hears "release".
    stdin = sys.stdin

    def read_stdin() -> None:
        for line in stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.strip())
        loop.call_soon_threadsafe(lines.put_nowait, "")

    hogged: list[int] = []
    async with server:
        _say({"port": server.port, "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE))})
        reader = loop.run_in_executor(None, read_stdin)
        while command := await lines.get():
            if command == "hog":
                hogged = _hog()
                _say({"hogged": len(hogged)})
            elif command == "release":
                for fd in hogged:
                    os.close(fd)
                _say({"released": len(hogged)})
                hogged = []
            elif command == "stats":
                stats = getattr(server, "stats", None)
                _say({"stats": None if stats is None else _as_dict(stats)})
            else:
                _say({"error": f"unknown command {command!r}"})
        await reader


def _as_dict(stats: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--expected-ranks", type=int, default=1)
    parser.add_argument("--max-connections", type=int, default=None)
    parser.add_argument("--idle-timeout", type=float, default=None)
    parser.add_argument("--request-timeout", type=float, default=None)
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop's event loop")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    _lower_nofile(args.nofile)
    if args.uvloop:
        import uvloop

        uvloop.run(_main(args))
    else:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
