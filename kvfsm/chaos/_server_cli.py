"""``kvfsm chaos servers``: the parser and the command (the campaign is
:mod:`._server_campaign`)."""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
from pathlib import Path

from kvfsm.chaos._server_plan import ALL_FAULTS, Action, PlanOptions

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    d = PlanOptions()
    p = subparsers.add_parser(
        "servers",
        help="fault campaign against real SGLang servers (prefill, decode, router) using kvfsm",
        description="Start a reference SGLang server, one or two kvfsm prefill and decode "
        "servers and SGLang's router on this host (dummy weights, CPU), send a seeded load "
        "and inject one fault of each kind under it: SIGKILL of a scheduler or a whole "
        "server, SIGSTOP for 1 s, past the write lease and long, client disconnects, "
        "/abort_request, a router-to-decode request reset (the decode half never arrives), a "
        "prefill and a router restarted behind the same port, and the link between prefill "
        "and decode cut (down, and a black hole; prefill and decode then run in two network "
        "namespaces, which needs root and iproute2). Every request must end within its bound, "
        "completed ones equal the reference's, and every kvfsm server drains to 0 rooms, "
        "pages and NIXL handles after each fault. Exit status 1 on any violation.",
    )
    a = p.add_argument
    a("--seed", type=int, default=None, help="campaign seed (default: random; printed)")
    a("--requests", type=int, default=d.requests, help="requests per fault (%(default)s)")
    a("--concurrency", type=int, default=d.concurrency, help="sent at once (%(default)s)")
    a("--max-prompt", type=int, default=d.max_prompt, help="longest prompt (%(default)s)")
    a("--stream-rate", type=float, default=d.stream_rate, help="streamed share (%(default)s)")
    a(
        "--long-stop-s",
        type=float,
        default=d.long_stop_s,
        help="the long SIGSTOP's length (%(default)s)",
    )
    a(
        "--unclaimed-s",
        type=float,
        default=8.0,
        help="KVFSM_UNCLAIMED_S of the prefill server (%(default)s)",
    )
    a(
        "--faults",
        nargs="+",
        metavar="KIND",
        default=None,
        help="only these fault kinds (an action such as sigstop, or a full kind); kinds: "
        + ", ".join(ALL_FAULTS),
    )
    a(
        "--cut-s",
        type=float,
        default=d.cut_s,
        help="how long a link cut lasts (%(default)s)",
    )
    a("--prefills", type=int, choices=(1, 2), default=1, help="kvfsm prefill servers (1)")
    a("--decodes", type=int, choices=(1, 2), default=1, help="kvfsm decode servers (1)")
    a(
        "--one-host",
        action="store_true",
        help="run every server on this host's loopback (no network namespaces, no link cuts)",
    )
    a("--minutes", type=float, default=None, help="soak: repeat the plan for N minutes")
    a("--sample-s", type=float, default=60.0, help="soak sample period (%(default)s)")
    a("--log-dir", type=Path, default=None, help="servers' logs (default: a temporary dir)")
    a("--shim", type=Path, default=None, help="SGLang's CPU shim (default: tests/e2e/shim)")
    a("--json", action="store_true", help="print the report as one JSON object")
    a("--png", type=Path, default=None, help="write a timeline PNG here (matplotlib)")
    return p


def _kinds(given: list[str] | None) -> list[str] | None:
    if given is None:
        return None
    actions = {a.value for a in Action}
    unknown = [k for k in given if k not in ALL_FAULTS and k not in actions]
    if unknown:
        raise SystemExit(f"kvfsm chaos servers: unknown fault kind(s) {unknown}")
    return given


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    from kvfsm.chaos import _server_report as report  # noqa: PLC0415 - aiohttp, matplotlib
    from kvfsm.chaos._server_campaign import (  # noqa: PLC0415
        ServerCampaignOptions,
        run_server_campaign,
    )
    from kvfsm.chaos._servers import SHIM  # noqa: PLC0415

    seed = args.seed if args.seed is not None else secrets.randbits(31)
    plan = PlanOptions(
        requests=args.requests,
        concurrency=args.concurrency,
        max_prompt=args.max_prompt,
        stream_rate=args.stream_rate,
        long_stop_s=args.long_stop_s,
        cut_s=args.cut_s,
    )
    opts = ServerCampaignOptions(
        seed=seed,
        plan=plan,
        kinds=_kinds(args.faults),
        minutes=args.minutes,
        unclaimed_s=args.unclaimed_s,
        log_dir=args.log_dir,
        shim=args.shim or SHIM,
        sample_every_s=args.sample_s,
        one_host=args.one_host,
        prefills=args.prefills,
        decodes=args.decodes,
    )
    print(f"kvfsm chaos servers: seed {seed}", file=sys.stderr)

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    # SIGTERM (a timeout, a CI runner's cancel) unwinds like Ctrl-C: the servers are stopped and
    # the network namespaces removed, instead of left for the next run to clean up.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = run_server_campaign(opts, say)
    if args.png is not None:
        report.write_png(result, args.png)
    if args.json:
        print(json.dumps(report.as_json(result), indent=1))
    else:
        report.print_table(result)
    return 0 if result.score.ok else 1
