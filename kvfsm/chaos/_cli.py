"""``kvfsm chaos``: the parser and the text report (the campaign is :mod:`._campaign`)."""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Any

from kvfsm.chaos._options import TRANSPORTS, CampaignOptions
from kvfsm.chaos._server_cli import add_parser as add_servers_parser
from kvfsm.chaos._server_cli import run as run_servers
from kvfsm.workload.command import run_command

__all__ = ["add_parser", "print_text", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    d = CampaignOptions()
    p = subparsers.add_parser(
        "chaos",
        help="fault campaign: real prefill and decode processes under transfer faults, control "
        "frame faults, hostile frames, aborts, SIGSTOP/SIGKILL (and freezes of either rank past "
        "decode's settle bound), room id reuse, oversized calls and registry restarts",
        description="Run randomized fault episodes against a real prefill-decode pair and check "
        "that no room wedges, nothing leaks, no byte lands in settled pages and no "
        "scheduler-facing call blocks. Exit status 1 on any violation.",
    )
    a = p.add_argument
    a("--seed", type=int, default=None, help="campaign seed (default: random; printed)")
    a("--duration", type=float, default=None, help="run episodes for this many seconds")
    a("--episodes", type=int, default=d.episodes, help="episodes without --duration (%(default)s)")
    a("--rooms", type=int, default=d.rooms, help="rooms per episode (%(default)s)")
    a("--concurrency", type=int, default=d.concurrency, help="rooms in flight (%(default)s)")
    a("--abort-rate", type=float, default=d.abort_rate, help="aborted rooms (%(default)s)")
    a(
        "--long-freeze-rate",
        type=float,
        default=d.long_freeze_rate,
        help="per episode: freeze prefill past decode's settle bound (%(default)s)",
    )
    a(
        "--decode-freeze-rate",
        type=float,
        default=d.decode_freeze_rate,
        help="per episode: freeze decode past its settle bound while prefill has chunks in "
        "flight (%(default)s)",
    )
    low, high = d.decode_freeze_range_s()
    a(
        "--decode-freeze-s",
        type=float,
        nargs=2,
        metavar=("FROM", "TO"),
        default=None,
        help=f"how long a decode freeze lasts (default: {low:g} to {high:g} s on one host, "
        "1.5 to 4 times decode's settle bound)",
    )
    a(
        "--transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="UCX transports of both ranks: UCX's choice, or UCX_TLS=tcp (%(default)s; "
        "--two-hosts always runs tcp)",
    )
    a(
        "--reuse-rate",
        type=float,
        default=d.reuse_rate,
        help="per room: decode aborts and reuses the id at once (%(default)s)",
    )
    a(
        "--oversized-rate",
        type=float,
        default=d.oversized_rate,
        help="per room: send_metadata with too many pages (%(default)s)",
    )
    a("--slow-call-ms", type=float, default=d.slow_call_ms, help="blocking threshold (ms)")
    a("--no-secret", action="store_true", help="unsigned control frames and registry")
    a("--no-kill", action="store_true", help="no SIGKILL of ranks")
    a(
        "--two-hosts",
        action="store_true",
        help="prefill and decode in two network namespaces joined by a veth (root, iproute2), "
        "NIXL on UCX TCP over it, and the link cut as one more fault",
    )
    a("--break", dest="break_invariant", choices=("canary",), default="", help=argparse.SUPPRESS)
    a("--json", action="store_true", help="print the report as one JSON object")
    a("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging")
    # ``kvfsm chaos servers``: the campaign against real SGLang servers; without it, the
    # campaign against kvfsm's own ranks above.
    modes = p.add_subparsers(dest="chaos_mode", metavar="{servers}")
    add_servers_parser(modes)
    return p


def options(args: argparse.Namespace) -> CampaignOptions:
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    extra: dict[str, Any] = {"sigkill_rate": 0.0} if args.no_kill else {}
    return CampaignOptions(
        seed=seed,
        duration_s=args.duration,
        episodes=args.episodes,
        rooms=args.rooms,
        concurrency=args.concurrency,
        abort_rate=args.abort_rate,
        long_freeze_rate=args.long_freeze_rate,
        decode_freeze_rate=args.decode_freeze_rate,
        decode_freeze_s=tuple(args.decode_freeze_s) if args.decode_freeze_s else None,
        transport=args.transport,
        reuse_rate=args.reuse_rate,
        oversized_rate=args.oversized_rate,
        slow_call_ms=args.slow_call_ms,
        use_secret=not args.no_secret,
        break_invariant=args.break_invariant,
        two_hosts=args.two_hosts,
        **extra,
    )


def print_text(s: dict[str, Any]) -> None:
    print(
        f"kvfsm chaos: seed {s['seed']} (replay: kvfsm chaos --seed {s['seed']} ...); "
        f"{s['episodes']} episodes in {s['seconds']} s"
    )
    rows: list[tuple[str, Any]] = [
        ("rooms", s["rooms"]),
        ("succeeded", s["succeeded"]),
        ("failed", s["failed"]),
        ("lost with a killed rank", s["killed"]),
        ("wedged", s["wedged"]),
        ("unsettled", s["unsettled"]),
        ("unsettled, frames disordered", s["unsettled_disordered"]),
        ("starved", s["starved"]),
        ("decode restarts", s["decode_restarts"]),
        ("late writes", s["late_writes"]),
        ("mismatched bytes", s["mismatched_bytes"]),
        ("slow calls", f"{s['slow_calls']} of {s['calls']}"),
        ("leaks", s["leaks"]),
        ("max room s", f"{s['max_room_s']} (bounds {s['bound_s']})"),
        ("settle after loss s", s["settle_after_loss_s"]),
        ("liveness", s["liveness"]),
        ("long freezes", s["long_freezes"]),
        ("decode freezes", s["decode_freezes"]),
        ("UCX", s["ucx"]),
        ("reused ids", s["reuse"]),
        ("oversized calls", s["oversized"]),
        ("transport", s["transport"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for role, reasons in s["failed_by_reason"].items():
        for reason, n in reasons.items():
            print(f"  {role} failed {n:>5}  {reason}")
    print(f"  faults: {s['faults']}")
    print(f"  hostile connections: {s['hostile']}")
    for line in s["violations"]:
        print(f"  VIOLATION: {line}")
    print("  OK" if s["ok"] else "  FAILED", file=sys.stdout)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "chaos_mode", None) == "servers":
        return run_servers(args)
    from kvfsm.chaos._campaign import ok, run_campaign  # noqa: PLC0415 - NIXL import

    opts = options(args)
    if not args.json:
        print(f"kvfsm chaos: seed {opts.seed}", file=sys.stderr)
    return run_command(
        "chaos", opts.validate, lambda: run_campaign(opts), print_text, ok, as_json=args.json
    )
