"""``kvfsm explain FILE``: why rooms ended, and what to check first, from a log or a dump.

It reads (``-``: stdin) any mix of

* failed-room lines: the one JSON line a failed room logs on ``kvfsm.rooms.failed`` (room,
  generation, role, reason, peer, timeline), with whatever a logging format put before it;
* a ``kill -USR1`` dump of a kvfsm process: faulthandler's stacks of every thread, then one
  ``kvfsm live rooms:`` JSON line per room engine (its live rooms with their state, age, the
  state's deadline, peer and latest timeline entries; the names of the threads).

and says, for each failed room, which law or timeout ended it (:data:`RULES`, by its reason),
on which peer, the timeline entries that led there and what to check first; for each live room
of a dump, how long it has been in its state against that state's deadline (one past it is a
wedge: its engine is not running room steps); and what each thread was doing.

:func:`explain` is the whole analysis, a pure function from text to a :class:`Report`; the
printers (:func:`print_report`, :func:`report_json`) only format it. A reason no rule knows is
reported as ``unknown`` with the reason as it was, never dropped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from kvfsm.explain._rules import LAW_DEADLINE, RULES, STORY, Classification, Rule, classify

__all__ = [
    "RULES",
    "Classification",
    "Finding",
    "Report",
    "Rule",
    "ThreadStack",
    "add_parser",
    "classify",
    "explain",
    "print_report",
    "report_json",
    "run",
]


# -- findings -----------------------------------------------------------------------------------

#: A kvfsm agent name: kvfsm-<role>-<engine>-r<rank>-<host>-pid<pid>-<hex>.
_AGENT: Final = re.compile(
    r"^kvfsm-(?P<role>prefill|decode)-(?P<engine>.+)-r(?P<rank>\d+)-(?P<host>[^-]+)"
    r"-pid(?P<pid>\d+)-[0-9a-f]+$"
)
#: Timeline kinds that are routine traffic: left out of "what led there" unless last.
_ROUTINE: Final = frozenset({"chunk_done", "chunk_posted"})
#: Timeline entries a finding shows.
SHOWN: Final = 5


@dataclass
class Finding:
    """One room: a failed one (``source`` "failed") or a live one of a dump ("live")."""

    source: str
    room: int
    generation: int
    role: str
    state: str
    reason: str
    kind: str
    law: str
    explanation: str
    check: str
    peer: dict[str, Any] | None
    #: The peer in words, for people.
    peer_text: str
    #: The entries that led there, oldest first.
    timeline: list[dict[str, Any]] = field(default_factory=list)
    #: Failed rooms: creation to failure.
    duration_s: float | None = None
    #: Live rooms: age, seconds in the current state, the state's deadline, seconds left.
    age_s: float | None = None
    in_state_s: float | None = None
    deadline_s: float | None = None
    deadline_in_s: float | None = None
    #: The relayed reason's classification (the peer's own failure), if any.
    cause: dict[str, str] | None = None
    #: The process a dump came from.
    pid: int | None = None


@dataclass
class ThreadStack:
    """One thread of a faulthandler dump, innermost frame first."""

    ident: str
    name: str
    current: bool
    frames: list[str]


@dataclass
class Report:
    failed: list[Finding] = field(default_factory=list)
    live: list[Finding] = field(default_factory=list)
    threads: list[ThreadStack] = field(default_factory=list)
    #: ``kvfsm live rooms`` lines read (one per engine of a dumped process).
    engines: int = 0
    #: What else the dump said about itself (an engine that could not be read).
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.failed or self.live or self.threads or self.engines)


def _peer_words(peer: Mapping[str, Any] | None) -> dict[str, str]:
    """``peer``, ``host`` and ``pid`` for the templates."""
    if not peer:
        return {"peer": "unknown (the room never learnt it)", "host": "its host", "pid": "?"}
    parts = [f"{k} {peer[k]}" for k in ("engine", "rank", "incarnation") if k in peer]
    agent = str(peer.get("agent") or "")
    if agent:
        parts.append(f"agent {agent}")
    parts += [f"{k} {v}" for k, v in peer.items() if k not in ("engine", "rank", "incarnation")]
    parts = list(dict.fromkeys(parts))  # agent once
    words = {"peer": ", ".join(parts), "host": "its host", "pid": "?"}
    match = _AGENT.match(agent)
    if match:
        words.update(host=match["host"], pid=match["pid"])
    return words


class _Fill(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "?"


def _fill(template: str, values: Mapping[str, str]) -> str:
    return template.format_map(_Fill(values))


def _worth_showing(timeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The last :data:`SHOWN` entries that are not routine traffic, and the last entry; each
    without the peer it repeats (the finding names it once)."""
    kept = [e for e in timeline[:-1] if e.get("kind") not in _ROUTINE]
    if timeline:
        kept.append(timeline[-1])
    return [{k: v for k, v in e.items() if k != "peer"} for e in kept[-SHOWN:]]


def _finding(source: str, row: Mapping[str, Any], reason: str, pid: int | None) -> Finding:
    role = str(row.get("role") or "")
    peer = row.get("peer")
    peer = dict(peer) if isinstance(peer, Mapping) else None
    found = classify(reason, role or None)
    values = {
        "room": str(row.get("room", "<id>")),
        "role": role,
        "peer_side": {"sender": "decode", "receiver": "prefill"}.get(role, "peer"),
        "reason": reason,
        **_peer_words(peer),
        **found.groups,
    }
    values["story"] = _fill(STORY, values)
    rule = found.rule
    check = _fill(rule.check, values)
    cause = None
    if found.cause is not None:
        inner = found.cause.rule
        # Read from the peer's side: its peer is this room's side, whose process is not named.
        side = {
            **values,
            **found.cause.groups,
            "peer_side": {"sender": "prefill", "receiver": "decode"}.get(role, "peer"),
            "host": "its host",
            "pid": "?",
        }
        cause = {
            "kind": inner.kind,
            "law": inner.law,
            "explanation": _fill(inner.explanation, side),
            "check": _fill(inner.check, side),
        }
    timeline = row.get("timeline")
    return Finding(
        source=source,
        room=_int(row.get("room")),
        generation=_int(row.get("generation")),
        role=role,
        state=str(row.get("state") or ("Failed" if source == "failed" else "?")),
        reason=reason,
        kind=rule.kind,
        law=rule.law,
        explanation=_fill(rule.explanation, values),
        check=check,
        peer=peer,
        peer_text=values["peer"],
        timeline=_worth_showing(timeline) if isinstance(timeline, list) else [],
        duration_s=row.get("duration_s"),
        cause=cause,
        pid=pid,
    )


def _int(value: object) -> int:
    return value if isinstance(value, int) else -1


def _live_finding(row: Mapping[str, Any], pid: int | None) -> Finding:
    """A live room of a dump: what its state waits for (the deadline rule of its role and
    state, read as if the deadline had passed) and how far it is from that deadline."""
    state = str(row.get("state") or "?")
    deadline = row.get("deadline_s")
    left = row.get("deadline_in_s")
    bound = f"{deadline:g}" if isinstance(deadline, int | float) else "?"
    waits = f"deadline expired: {state} for more than {bound}s"
    finding = _finding("live", row, waits, pid)
    finding.reason = str(row.get("reason") or "")
    finding.age_s = row.get("age_s")
    if isinstance(deadline, int | float) and isinstance(left, int | float):
        finding.deadline_s, finding.deadline_in_s = float(deadline), float(left)
        finding.in_state_s = round(float(deadline) - float(left), 3)
        if left < 0:
            finding.kind = "overdue"
            finding.law = LAW_DEADLINE + ", not enforced: the room is past it"
            finding.explanation = (
                f"in {state} {-left:g}s past its {deadline:g}s deadline and not failed: its "
                "engine is not running room steps (a blocked or starved loop thread)"
            )
            finding.check = (
                "the loop thread's stack above: what it is blocked in; the process's CPU "
                "(`top -H`), and a callback that never returns"
            )
        else:
            finding.kind = "waiting"
            finding.explanation = (
                f"in {state} for {finding.in_state_s:g}s of its {deadline:g}s deadline "
                f"({left:g}s left). If it expires: {finding.explanation}"
            )
    elif state not in ("Success", "Failed"):
        finding.kind = "waiting"
    else:
        finding.kind = "settling"
        finding.explanation = f"{state}, waiting for its transfer handles to settle"
        finding.check = "chunks in flight (in_flight) and the peer's RoomSettled: " + _fill(
            STORY, {"room": str(finding.room)}
        )
    return finding


# -- reading ------------------------------------------------------------------------------------

_THREAD: Final = re.compile(r"^(?P<current>Current thread|Thread) (?P<ident>0x[0-9a-f]+) ")
_STACK: Final = re.compile(r"^Stack \(most recent call first\):")
_FRAME: Final = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
_DECODER: Final = json.JSONDecoder()


def _json_objects(line: str) -> Iterable[dict[str, Any]]:
    """The JSON object in ``line``, after any prefix a logging format put there."""
    start = line.find("{")
    while start >= 0:
        try:
            obj, _ = _DECODER.raw_decode(line, start)
        except ValueError:
            start = line.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            yield obj
        return


def explain(text: str) -> Report:
    """Everything ``text`` says about rooms: its failed-room lines and any ``kill -USR1``
    dump in it. Pure: no I/O, no clock."""
    report = Report()
    names: dict[str, str] = {}
    thread: ThreadStack | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head is not None or _STACK.match(line):
            ident = head["ident"] if head is not None else "?"
            current = head is None or head["current"] == "Current thread"
            thread = ThreadStack(ident, "", current, [])
            report.threads.append(thread)
            continue
        frame = _FRAME.match(line)
        if frame is not None and thread is not None:
            file = frame["file"].rsplit("/", 1)[-1]
            thread.frames.append(f"{frame['func']} ({file}:{frame['line']})")
            continue
        thread = None
        for obj in _json_objects(line):
            event = obj.get("event")
            if event == "room_failed":
                report.failed.append(_finding("failed", obj, str(obj.get("reason") or ""), None))
            elif event == "live_rooms":
                report.engines += 1
                pid = obj.get("pid")
                pid = int(pid) if isinstance(pid, int) else None
                threads = obj.get("threads")
                if isinstance(threads, dict):
                    names.update({str(k): str(v) for k, v in threads.items()})
                if obj.get("error"):
                    report.notes.append(f"engine {obj.get('engine')}: {obj['error']}")
                rooms = obj.get("rooms")
                for row in rooms if isinstance(rooms, list) else []:
                    if isinstance(row, dict):
                        report.live.append(_live_finding(row, pid))
    for stack in report.threads:
        stack.name = names.get(stack.ident, "")
    # The rooms nearest their deadline (or past it) first.
    report.live.sort(key=lambda f: f.deadline_in_s if f.deadline_in_s is not None else 1e18)
    return report


# -- printing -----------------------------------------------------------------------------------

#: Rooms past which the text report opens with a summary by kind and shows a few of each.
SUMMARY_FROM: Final = 6


def _entry_text(entry: Mapping[str, Any]) -> str:
    extra = " ".join(
        f"{k}={entry[k]}"
        for k in ("chunk", "pages", "fence", "rank", "state", "reason")
        if k in entry and not (k == "state" and "entered" in str(entry.get("what")))
    )
    t = entry.get("t_ms")
    when = f"{t:>10.3f} ms" if isinstance(t, int | float) else " " * 13
    return f"{when}  {entry.get('kind', '?'):<14} {entry.get('what', '')}  {extra}".rstrip()


def _print_finding(f: Finding, out: Any) -> None:
    what = "failed" if f.source == "failed" else f"live, {f.state}"
    took = f" after {f.duration_s:g}s" if isinstance(f.duration_s, int | float) else ""
    pid = f" (pid {f.pid})" if f.pid is not None else ""
    print(f"room {f.room} generation {f.generation}: {f.role}, {what}{took}{pid}", file=out)
    if f.reason:
        print(f"  reason:  {f.reason}", file=out)
    print(f"  cause:   [{f.kind}] {f.law}", file=out)
    print(f"  what:    {f.explanation}", file=out)
    print(f"  peer:    {f.peer_text}", file=out)
    if f.cause is not None:
        print(f"  peer's cause: [{f.cause['kind']}] {f.cause['law']}", file=out)
        print(f"           {f.cause['explanation']}", file=out)
        print(f"           check there: {f.cause['check']}", file=out)
    print(f"  check:   {f.check}", file=out)
    if f.timeline:
        print("  last entries:", file=out)
        for entry in f.timeline:
            print(f"    {_entry_text(entry)}", file=out)


def _groups(findings: Sequence[Finding]) -> list[tuple[str, list[Finding]]]:
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(f.kind, []).append(f)
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))


def print_report(report: Report, out: Any = None, per_kind: int = 3) -> None:
    """The report for people. Past :data:`SUMMARY_FROM` rooms, a summary by kind comes first
    and each kind shows ``per_kind`` rooms."""
    out = sys.stdout if out is None else out
    for title, findings in (("failed rooms", report.failed), ("live rooms", report.live)):
        if not findings:
            continue
        many = len(findings) >= SUMMARY_FROM
        print(f"== {len(findings)} {title}", file=out)
        groups = _groups(findings)
        if many:
            for kind, members in groups:
                first = members[0]
                print(f"  {len(members):>5}  {kind:<22} {first.law}", file=out)
                print(f"         {'':<22} check: {first.check}", file=out)
            print(file=out)
        for kind, members in groups:
            shown = members[:per_kind] if many else members
            for f in shown:
                _print_finding(f, out)
                print(file=out)
            if len(members) > len(shown):
                print(f"  ... and {len(members) - len(shown)} more {kind} rooms\n", file=out)
    if report.engines and not report.live:
        print("== the dump shows no live rooms", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    if report.threads:
        print(f"== {len(report.threads)} threads (innermost frame first)", file=out)
        for t in report.threads:
            name = t.name or "(no name: a dump without its kvfsm live rooms line)"
            mark = "  <- the thread the signal interrupted" if t.current else ""
            print(f"  {name} {t.ident}{mark}", file=out)
            for frame in t.frames[:4]:
                print(f"      {frame}", file=out)


def report_json(report: Report) -> dict[str, Any]:
    """The report for machines: ``failed``, ``live`` and ``threads`` as lists of objects,
    ``summary``: rooms per kind (failed and live apart)."""
    return {
        "failed": [asdict(f) for f in report.failed],
        "live": [asdict(f) for f in report.live],
        "threads": [asdict(t) for t in report.threads],
        "notes": report.notes,
        "summary": {
            "failed": {kind: len(m) for kind, m in _groups(report.failed)},
            "live": {kind: len(m) for kind, m in _groups(report.live)},
        },
    }


# -- the subcommand -----------------------------------------------------------------------------

HELP: Final = (
    "explain failed rooms (their JSON log lines) and a kill -USR1 dump: which law or timeout "
    "ended each room, on which peer, and what to check first"
)


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``explain`` subcommand to ``kvfsm``'s subparsers and return its parser."""
    parser = subparsers.add_parser(
        "explain", help=HELP, description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("file", help="a log or a kill -USR1 dump (stderr); - for stdin")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--per-kind",
        type=int,
        default=3,
        help="rooms shown of each kind once there are many (%(default)s)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Explain ``args.file``. Exit status 1 if it cannot be read or holds nothing to explain."""
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
    except OSError as exc:
        print(f"kvfsm explain: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    report = explain(text)
    if args.json:
        print(json.dumps(report_json(report)))
    else:
        print_report(report, per_kind=max(1, args.per_kind))
    if report.empty:
        print(
            f"kvfsm explain: {args.file} has no failed-room lines (logger kvfsm.rooms.failed) "
            "and no kill -USR1 dump",
            file=sys.stderr,
        )
        return 1
    return 0
