"""The ``kvfsm`` command line: the subcommands by name, each one's flags, and the call into what
runs it.

``kvfsm demo`` (:mod:`kvfsm.demo`) is the main job: a prefill process and a decode process found
through the bootstrap registry, moving real KV over NIXL. ``kvfsm run``
(:mod:`kvfsm.workload.peer_run`) is the data path alone, into a passive decode process; both
take the workload flags of :func:`~kvfsm.workload.options.add_workload_flags`. ``kvfsm chaos``,
``kvfsm bootstrap`` and ``kvfsm diagram`` bring their own parsers. The operator's tools:
``kvfsm rooms`` reads a running rank's status server (its rooms, one room's story, recent
failures), ``kvfsm top`` (:mod:`kvfsm.top`) shows one or more of them live, and ``kvfsm explain``
(:mod:`kvfsm.explain`) reads failed-room log lines and ``kill -USR1`` dumps and says what ended
each room and what to check first.

Each subcommand is registered by name with its one-line help; the modules that define its flags
and run it are imported only once it is chosen, so ``kvfsm --help`` (and a typo) costs an
interpreter start, not NIXL, aiohttp and numpy. The workload commands (run, demo, chaos) run in
:func:`~kvfsm.workload.command.run_command`, which gives them the same exit statuses: 2 on a
bad flag, 130 on Ctrl-C, 1 on an error or a summary that is not clean, 0 otherwise.
``bootstrap`` exits 2 on a bad argument and 1 if it cannot bind; ``rooms`` 1 if the status server
cannot be read; argparse exits 2 on an unknown subcommand or flag. Also ``python -m kvfsm``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["SUBCOMMANDS", "Subcommand", "main"]

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: Adds a subcommand's parser to ``kvfsm``'s subparsers (under the subcommand's name).
AddParser: TypeAlias = Callable[[Subparsers], argparse.ArgumentParser]
#: Runs a parsed subcommand; returns the exit status.
Run: TypeAlias = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Subcommand:
    """A subcommand as ``kvfsm --help`` lists it, and how to load it once chosen."""

    name: str
    #: Shown by ``kvfsm --help``; the same text the subcommand's own ``add_parser`` gives.
    help: str
    #: Imports what the subcommand needs; returns its parser-adder and its runner.
    load: Callable[[], tuple[AddParser, Run]]


# -- run and demo: the workload commands defined here -------------------------------------------


def _add_run(sub: Subparsers) -> argparse.ArgumentParser:
    from kvfsm.workload import peer_run  # noqa: PLC0415 - only once chosen (module doc)
    from kvfsm.workload.options import RunOptions, add_workload_flags  # noqa: PLC0415

    d = RunOptions()
    run = sub.add_parser("run", help=_RUN_HELP, description=peer_run.DESCRIPTION)
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
    return run


def _run_run(args: argparse.Namespace) -> int:
    """``kvfsm run``: prefill rooms here, the passive decode process there."""
    from kvfsm.workload import peer_run  # noqa: PLC0415 - only once chosen (module doc)
    from kvfsm.workload.command import run_command  # noqa: PLC0415
    from kvfsm.workload.options import RunOptions, workload_arguments  # noqa: PLC0415

    opts = RunOptions(rooms=args.rooms, **workload_arguments(args))
    return run_command(
        "run",
        opts.validate,
        lambda: peer_run.run_job(opts),
        peer_run.print_text,
        peer_run.ok,
        as_json=args.json,
    )


def _add_demo(sub: Subparsers) -> argparse.ArgumentParser:
    from kvfsm import demo  # noqa: PLC0415 - only once chosen (module doc)
    from kvfsm.workload.options import DemoOptions, add_workload_flags  # noqa: PLC0415

    d = DemoOptions()
    p = sub.add_parser("demo", help=_DEMO_HELP, description=(demo.__doc__ or "").split("\n\n")[0])
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
    return p


def _run_demo(args: argparse.Namespace) -> int:
    """``kvfsm demo``: on this machine, or across two network namespaces (``--two-hosts``)."""
    from kvfsm import demo  # noqa: PLC0415 - only once chosen (module doc)
    from kvfsm.workload import demo_report  # noqa: PLC0415
    from kvfsm.workload.command import run_command  # noqa: PLC0415
    from kvfsm.workload.options import DemoOptions, workload_arguments  # noqa: PLC0415
    from kvfsm.workload.report import describe_layout  # noqa: PLC0415

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


# -- rooms: a GET from a rank's status server ---------------------------------------------------


def _add_rooms(sub: Subparsers) -> argparse.ArgumentParser:
    rooms = sub.add_parser("rooms", help=_ROOMS_HELP)
    rooms.add_argument("--url", required=True, help="the rank's status server, http://host:port")
    which = rooms.add_mutually_exclusive_group()
    which.add_argument(
        "--room", type=int, help="one room's story: state, reason, peer and timeline"
    )
    which.add_argument(
        "--failed", action="store_true", help="the last failed rooms, grouped by reason kind"
    )
    rooms.add_argument("--json", action="store_true", help="print the rows as JSON")
    return rooms


def _run_rooms(args: argparse.Namespace) -> int:
    if args.room is not None:
        return _show_story(args.url, args.room, as_json=args.json)
    if args.failed:
        return _show_failures(args.url, as_json=args.json)
    return _show_rooms(args.url, as_json=args.json)


def _get_json(url: str, path: str) -> Any:
    """One GET from a status server; raises OSError (HTTP errors included)."""
    import urllib.request  # noqa: PLC0415 - only the rooms subcommand needs it

    if "://" not in url:  # host:port, as a Prometheus target's instance names a rank
        url = f"http://{url}"
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=5) as response:
        return json.loads(response.read())


def _read(url: str, path: str, *, missing: str | None = None) -> Any:
    """``_get_json``, or None once the error is printed: ``missing`` (on stdout) for a 404 where
    the caller gave one, else why the status server could not be read (on stderr)."""
    try:
        return _get_json(url, path)
    except OSError as exc:  # an HTTPError too
        if missing is not None and getattr(exc, "code", None) == 404:
            print(f"kvfsm rooms: {missing}")
        else:
            print(f"kvfsm rooms: cannot read {url}{path}: {exc}", file=sys.stderr)
        return None


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    table = [[str("" if row.get(c) is None else row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _show_rooms(url: str, *, as_json: bool) -> int:
    """``kvfsm rooms``: one GET of ``/rooms`` from a rank's status server, as a table."""
    rows: list[dict[str, Any]] | None = _read(url, "/rooms")
    if rows is None:
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
    _print_table(rows, columns)
    print(f"{len(rows)} live rooms")
    return 0


def _peer_text(peer: dict[str, Any] | None) -> str:
    if not peer:
        return "unknown"
    return " ".join(f"{k}={v}" for k, v in peer.items())


def _show_story(url: str, room: int, *, as_json: bool) -> int:
    """``kvfsm rooms --room ID``: every room of that id the rank knows, with its timeline."""
    missing = f"{url} knows no live or recently finished room {room}"
    rows: list[dict[str, Any]] | None = _read(url, f"/rooms/{room}", missing=missing)
    if rows is None:
        return 1
    if as_json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        live = "live" if row.get("live") else "finished"
        print(
            f"room {row['room']} generation {row['generation']}: {row['role']}, "
            f"{row['state']} ({live}, settled: {row.get('settled')})"
        )
        if row.get("reason"):
            print(f"  reason: {row['reason']}")
        print(f"  peer: {_peer_text(row.get('peer'))}")
        if row.get("dropped"):
            print(f"  ({row['dropped']} timeline entries were not kept)")
        timeline = row.get("timeline")
        if timeline is None:
            print("  (no timeline: this rank runs without the flight recorder)")
            continue
        for entry in timeline:
            extra = " ".join(
                f"{k}={entry[k]}"
                for k in ("chunk", "pages", "bytes", "fence", "rank", "reason")
                if k in entry
            )
            print(f"  {entry['t_ms']:>10.3f} ms  {entry['kind']:<14} {entry['what']}  {extra}")
    return 0


def _show_failures(url: str, *, as_json: bool) -> int:
    """``kvfsm rooms --failed``: the last failed rooms, grouped by reason kind (biggest first)."""
    rows: list[dict[str, Any]] | None = _read(url, "/failures")
    if rows is None:
        return 1
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("reason_kind") or "unknown", []).append(row)
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    if as_json:
        print(json.dumps({kind: members for kind, members in ordered}))
        return 0
    for kind, members in ordered:
        print(f"{kind}: {len(members)}")
        _print_table(members[:10], ("room", "generation", "role", "duration_s", "reason"))
        if len(members) > 10:
            print(f"  ... and {len(members) - 10} more")
        print()
    print(f"{len(rows)} failed rooms remembered")
    return 0


# -- the table -----------------------------------------------------------------------------------


def _load_bootstrap() -> tuple[AddParser, Run]:
    from kvfsm.registry import add_bootstrap_parser, run_bootstrap  # noqa: PLC0415

    return add_bootstrap_parser, run_bootstrap


def _load_diagram() -> tuple[AddParser, Run]:
    from kvfsm import diagram  # noqa: PLC0415 - only once chosen (module doc)

    return diagram.add_parser, diagram.run


def _load_top() -> tuple[AddParser, Run]:
    from kvfsm import top  # noqa: PLC0415 - only once chosen (module doc)

    return top.add_parser, top.run


def _load_explain() -> tuple[AddParser, Run]:
    from kvfsm import explain  # noqa: PLC0415 - only once chosen (module doc)

    return explain.add_parser, explain.run


def _load_chaos() -> tuple[AddParser, Run]:
    from kvfsm.chaos import add_chaos_parser, run_chaos  # noqa: PLC0415 - only once chosen

    return add_chaos_parser, run_chaos


_RUN_HELP = (
    "the data path alone: many rooms moving real KV over NIXL (DRAM) into a passive decode "
    "process, every byte checked"
)
_DEMO_HELP = (
    "the main job: a prefill process and a decode process, both with rooms, moving real KV "
    "over NIXL (DRAM), found through the bootstrap registry, every byte checked"
)
_ROOMS_HELP = (
    "show a running rank's live rooms (state, age, deadline, reason), one room's story "
    "(--room), or its recent failures (--failed)"
)

#: Every subcommand, in the order ``kvfsm --help`` lists them.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "bootstrap",
        "run the bootstrap registry where prefill ranks register and decode ranks look up",
        _load_bootstrap,
    ),
    Subcommand(
        "diagram",
        "print the room state diagrams (Mermaid), generated from kvfsm.states",
        _load_diagram,
    ),
    Subcommand("rooms", _ROOMS_HELP, lambda: (_add_rooms, _run_rooms)),
    Subcommand(
        "top",
        "a live view of running ranks' status servers: rooms by state, the oldest rooms and "
        "their deadlines, peer links, GB/s, rooms/s and failures by kind",
        _load_top,
    ),
    Subcommand(
        "explain",
        "explain failed rooms (their JSON log lines) and a kill -USR1 dump: which law or "
        "timeout ended each room, on which peer, and what to check first",
        _load_explain,
    ),
    Subcommand("demo", _DEMO_HELP, lambda: (_add_demo, _run_demo)),
    Subcommand(
        "chaos",
        "fault campaign: real prefill and decode processes under transfer faults, control "
        "frame faults, hostile frames, aborts, SIGSTOP/SIGKILL (and freezes of either rank past "
        "decode's settle bound), room id reuse, oversized calls and registry restarts",
        _load_chaos,
    ),
    Subcommand("run", _RUN_HELP, lambda: (_add_run, _run_run)),
)


def _chosen(argv: Sequence[str]) -> Subcommand | None:
    """The subcommand ``argv`` names: its first word that is not a flag (``kvfsm``'s own flags,
    ``-v`` and ``-h``, take no value), if that word is a subcommand's name."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return next((s for s in SUBCOMMANDS if s.name == word), None)
    return None


def _parser(chosen: Subcommand | None) -> tuple[argparse.ArgumentParser, Run | None]:
    """``kvfsm``'s parser, with the full parser of ``chosen`` only (loaded here) and a stub for
    every other subcommand (its name and help, for ``kvfsm --help`` and argparse's choices)."""
    parser = argparse.ArgumentParser(
        prog="kvfsm",
        description="kvfsm: KV-cache transfer for prefill-decode disaggregation, "
        "one typed state machine per room, over NIXL.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run: Run | None = None
    for command in SUBCOMMANDS:
        if command is chosen:
            add, run = command.load()
            add(sub)
        else:
            sub.add_parser(command.name, help=command.help)
    return parser, run


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


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(words)
    # NIXL binds its log handler to sys.stdout when first imported, and logs there at once if
    # NIXL_LOG_LEVEL is set; stdout is the summary's (--json), so bind it to stderr instead.
    # Only the loading is redirected: argparse prints --help to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        parser, run = _parser(chosen)
    args = parser.parse_args(words)
    if run is None:  # pragma: no cover - argparse refuses a missing or unknown subcommand
        return 2
    from kvfsm._child import dump_stacks_on_sigusr1  # noqa: PLC0415 - not for --help

    dump_stacks_on_sigusr1()
    _configure_logging(args.verbose)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
