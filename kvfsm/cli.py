"""The ``kvfsm`` command line: the flags of every subcommand, and the call into what runs it.

``kvfsm run`` (:mod:`kvfsm.workload.peer_run`) and ``kvfsm demo`` (:mod:`kvfsm.demo`) take the
workload flags of :func:`~kvfsm.workload.options.add_workload_flags`; ``kvfsm chaos``,
``kvfsm bootstrap`` and ``kvfsm diagram`` bring their own parsers. The jobs run in
:func:`~kvfsm.workload.command.run_command`, which gives them the same exit statuses: 2 on a bad
flag, 130 on Ctrl-C, 1 on an error or a summary that is not clean, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

# NIXL binds its log handler to sys.stdout when first imported, and logs there at once if
# NIXL_LOG_LEVEL is set; stdout is the summary's (--json), so bind it to stderr instead.
with contextlib.redirect_stdout(sys.stderr):
    from kvfsm import demo
    from kvfsm import diagram as diagram_cli
    from kvfsm._child import dump_stacks_on_sigusr1
    from kvfsm.chaos import _cli as chaos_cli
    from kvfsm.registry import _cli as bootstrap_cli
    from kvfsm.workload import demo_report, peer_run
    from kvfsm.workload.command import run_command
    from kvfsm.workload.options import (
        DemoOptions,
        RunOptions,
        add_workload_flags,
        workload_arguments,
    )
    from kvfsm.workload.report import describe_layout

__all__ = ["main"]


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = RunOptions()
    run = sub.add_parser(
        "run",
        help="the main job: many rooms moving real KV over NIXL (DRAM) into a decode process, "
        "every byte checked",
        description=peer_run.DESCRIPTION,
    )
    run.add_argument("--rooms", type=int, default=d.rooms, help="rooms to run (%(default)s)")
    add_workload_flags(
        run,
        d,
        page_bytes=True,
        abort_help="probability that a room is aborted at a random point (%(default)s)",
        idle_help="seconds the caller thread naps when an iteration did nothing (%(default)s)",
    )
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    # Also after ``run``; SUPPRESS keeps a count given before ``run`` from being reset.
    run.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging"
    )


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = DemoOptions()
    p = sub.add_parser(
        "demo",
        help="a prefill process and a decode process, both with rooms, moving real KV over "
        "NIXL (DRAM), found through the bootstrap registry, every byte checked",
        description=(demo.__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--requests", type=int, default=d.requests, help="requests to run (%(default)s)")
    add_workload_flags(
        p,
        d,
        page_bytes=False,
        abort_help="probability that a request is aborted, by either side (%(default)s)",
        idle_help="seconds a rank's scheduler naps when an iteration did nothing (%(default)s)",
    )
    p.add_argument(
        "--two-hosts",
        action="store_true",
        help="run prefill and decode in two network namespaces joined by a veth pair, NIXL on "
        "UCX TCP over it (needs root and iproute2)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfsm",
        description="kvfsm: KV-cache transfer for prefill-decode disaggregation, "
        "one typed state machine per room, over NIXL.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    bootstrap_cli.add_parser(sub)
    diagram_cli.add_parser(sub)
    rooms = sub.add_parser(
        "rooms", help="show a running rank's live rooms (state, age, deadline, reason)"
    )
    rooms.add_argument("--url", required=True, help="the rank's status server, http://host:port")
    rooms.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_demo(sub)
    chaos_cli.add_parser(sub)
    _add_run(sub)
    return parser


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else 10
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    # NIXL's Python logger prints INFO lines to stdout; keep stdout for the summary.
    nixl = logging.getLogger("nixl")
    nixl.setLevel(level)
    for handler in nixl.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def _show_rooms(url: str, *, as_json: bool) -> int:
    """``kvfsm rooms``: one GET of ``/rooms`` from a rank's status server, as a table."""
    import urllib.request  # noqa: PLC0415 - only this subcommand needs it

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/rooms", timeout=5) as response:
            rows: list[dict[str, Any]] = json.loads(response.read())
    except OSError as exc:
        print(f"kvfsm rooms: cannot read {url}/rooms: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(rows))
        return 0
    columns = (
        "room",
        "generation",
        "role",
        "state",
        "age_s",
        "deadline_in_s",
        "in_flight",
        "settled",
        "reason",
    )
    table = [[str("" if row.get(c) is None else row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"{len(rows)} live rooms")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    """``kvfsm demo``: on this machine, or across two network namespaces (``--two-hosts``)."""
    opts = DemoOptions(
        requests=args.requests, progress=not args.no_progress, **workload_arguments(args)
    )
    try:
        opts.validate()
    except ValueError:
        pass  # run_command reports it and exits 2
    else:
        if not args.json:
            print(f"kvfsm demo: layout: {describe_layout(opts)}", file=sys.stderr)
    go: Callable[[], dict[str, Any]] = lambda: demo.run_demo(opts)  # noqa: E731
    if args.two_hosts:
        from kvfsm.chaos import run_demo_two_hosts  # noqa: PLC0415 - only then

        go = lambda: run_demo_two_hosts(opts)  # noqa: E731
    return run_command(
        "demo", opts.validate, go, demo_report.print_text, demo_report.ok, as_json=args.json
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dump_stacks_on_sigusr1()
    _configure_logging(args.verbose)
    if args.command == "bootstrap":
        return bootstrap_cli.run(args)
    if args.command == "diagram":
        return diagram_cli.run(args)
    if args.command == "rooms":
        return _show_rooms(args.url, as_json=args.json)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "chaos":
        return chaos_cli.run(args)
    if args.command != "run":  # pragma: no cover - argparse enforces the choices
        return 2
    opts = RunOptions(rooms=args.rooms, **workload_arguments(args))
    return run_command(
        "run",
        opts.validate,
        lambda: peer_run.run_job(opts),
        peer_run.print_text,
        peer_run.ok,
        as_json=args.json,
    )


if __name__ == "__main__":
    raise SystemExit(main())
