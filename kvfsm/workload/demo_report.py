"""The demo's summary: what both ranks reported about each request of the plan, counted.

A request is *succeeded* when decode's room ends Success and its bytes check; *failed* when
decode's room ends Failed (counted by reason, numbers blanked); *wedged* when either side's room
is not terminal within the room timeout (it is then aborted); *unsettled* when it is terminal but
not settled within the grace. The summary is clean (:func:`ok`) unless anything wedged,
mismatched, stayed unsettled, was written late or failed for a reason other than the demo's own
aborts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvfsm.states import KVPoll
from kvfsm.workload.options import ABORT_REASON, DemoOptions
from kvfsm.workload.plan import make_plan
from kvfsm.workload.ranks import STARVED, Outcome
from kvfsm.workload.report import describe_layout, percentile, reason_class

__all__ = ["ok", "print_text", "summarize"]


def summarize(
    opts: DemoOptions,
    seed: int,
    *,
    pre: dict[int, Outcome],
    dec: dict[int, Outcome],
    seconds: float,
    setup_s: float,
    pids: dict[str, int],
) -> dict[str, Any]:
    succeeded = failed = unexpected = mismatched_rooms = mismatched = wedged = unsettled = 0
    split = aborts_too_late = checked = moved = 0
    by_reason: Counter[str] = Counter()
    latencies: list[float] = []
    failures: list[str] = []

    def note(text: str) -> None:
        if len(failures) < 10:
            failures.append(text)

    planned = 0
    for req in make_plan(opts, seed):
        planned += bool(req.abort_side)
        d = dec[req.room]
        p = pre.get(req.room) or Outcome(req.room, int(KVPoll.Failed), STARVED, 0.0)
        wedged += p.wedged or d.wedged
        unsettled += p.unsettled or d.unsettled
        checked += d.checked
        mismatched += d.mismatched
        if p.unsettled or d.unsettled:
            note(f"room {req.room}: unsettled (prefill {p.reason!r}, decode {d.reason!r})")
        if p.wedged or d.wedged:
            note(f"room {req.room}: wedged (prefill {p.reason!r}, decode {d.reason!r})")
        if d.status == KVPoll.Success:
            split += p.status != KVPoll.Success
            if d.mismatched:
                mismatched_rooms += 1
                note(f"room {req.room}: {d.mismatched} of {d.checked} bytes differ")
            else:
                succeeded += 1
                aborts_too_late += bool(req.abort_side)
                moved += len(req.src) * opts.total_page_bytes + opts.aux_row_bytes
                latencies.append(d.elapsed_ms)
        else:
            failed += 1
            by_reason[reason_class(d.reason)] += 1
            if not (req.abort_side and ABORT_REASON in d.reason):
                unexpected += 1
                note(f"room {req.room}: failed: {d.reason}")
    gbps = round(moved / seconds / 1e9, 4) if seconds > 0 else 0.0
    return {
        "requests": opts.requests,
        "succeeded": succeeded,
        "failed": failed,
        "failed_by_reason": dict(by_reason.most_common()),
        "failed_unexpectedly": unexpected,
        "aborts_planned": planned,
        "aborts_too_late": aborts_too_late,
        "wedged": wedged,
        "unsettled": unsettled,
        "mismatched": mismatched_rooms,
        "mismatched_bytes": mismatched,
        "checked_bytes": checked,
        "split_outcomes": split,
        "bytes": moved,
        "seconds": round(seconds, 4),
        "setup_seconds": round(setup_s, 4),
        "gbps": gbps,
        "requests_per_s": round(opts.requests / seconds, 1) if seconds > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "concurrency": opts.concurrency,
        "abort_rate": opts.abort_rate,
        "layout": describe_layout(opts),
        "pids": pids,
        "seed": seed,
        "failures": failures,
    }


def ok(summary: dict[str, Any]) -> bool:
    """Every request accounted for, nothing unexpected, wedged, unsettled or written late."""
    return bool(
        summary["succeeded"] + summary["failed"] == summary["requests"]
        and summary["failed_unexpectedly"] == summary["mismatched"] == 0
        and summary["mismatched_bytes"] == 0
        and summary["wedged"] == summary["unsettled"] == 0
        and summary.get("late_writes", 0) == 0
        # --two-hosts: the KV must have crossed the veth, not a shared-memory shortcut.
        and summary.get("two_hosts", {}).get("crossed_wire", True)
    )


def print_text(s: dict[str, Any]) -> None:
    """The summary for people."""
    aborts = f", abort rate {s['abort_rate']:g}" if s["abort_rate"] else ""
    print(
        f"kvfsm demo: {s['requests']} requests, {s['concurrency']} in flight{aborts}; "
        f"prefill pid {s['pids']['prefill']} -> decode pid {s['pids']['decode']} over NIXL "
        f"(UCX, DRAM->DRAM), control channel, bootstrap registry; seed {s['seed']}"
    )
    print(f"  layout: {s['layout']}")
    rows = [
        ("requests", s["requests"]),
        ("succeeded", s["succeeded"]),
        ("failed", s["failed"]),
        *((f"  {reason}", n) for reason, n in s["failed_by_reason"].items()),
        ("wedged", s["wedged"]),
        ("unsettled", s["unsettled"]),
        ("mismatched rooms", s["mismatched"]),
        ("mismatched bytes", f"{s['mismatched_bytes']} of {s['checked_bytes']} checked"),
        ("late writes", s.get("late_writes", 0)),
        ("moved", f"{s['bytes'] / 1e9:.3f} GB in {s['seconds']:.2f} s"),
        ("GB/s", f"{s['gbps']:.2f}"),
        ("p50 ms / room", f"{s['p50_ms']:.2f}"),
        ("p99 ms / room", f"{s['p99_ms']:.2f}"),
        ("setup s", f"{s['setup_seconds']:.2f}"),
    ]
    two = s.get("two_hosts")
    if two is not None:
        p, d, wire = two["prefill"], two["decode"], two["wire"]
        rows += [
            ("prefill host", f"netns {p['netns']}, {p['device']} {p['address']}"),
            ("decode host", f"netns {d['netns']}, {d['device']} {d['address']}"),
            ("UCX", " ".join(f"{k}={v}" for k, v in two["ucx"]["prefill"].items())),
            (
                "veth sent",
                f"{wire['prefill_tx_bytes']} B by prefill, {wire['decode_tx_bytes']} B by decode",
            ),
            ("crossed veth", "yes" if two["crossed_wire"] else "NO (shared memory?)"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for line in s["failures"]:
        print(f"  {line}")
