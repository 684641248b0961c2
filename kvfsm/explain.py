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

# -- the table ----------------------------------------------------------------------------------
#
# A room's reason is ``failure_reason``'s prefix for the event that failed it (``deadline
# expired:``, ``peer lost:``, ``peer failed:``, ``aborted (local|peer):``, ``chunk N failed:``,
# ``chunk N stalled:``, ``rejected:``) and the words of whoever raised it, or ``refused:`` for a
# room the registry never started. Rules are tried in order; the first whose pattern matches
# at the start of the reason (and whose role, if it names one, is the room's) wins. Each
# family's specific rows come before its fallback row.
#
# ``explanation`` and ``check`` are ``str.format`` templates over the pattern's named groups
# and: ``room``, ``role``; ``peer_side`` (the other role's name: decode or prefill); ``peer``
# (the peer as the rank named it: engine, rank, incarnation, agent); ``host`` and ``pid`` (from a
# kvfsm agent name, else "its host" and "?"); ``story`` (the ``kvfsm rooms --room`` command for
# the room). ``inner`` (a reason the peer or another leg sent) is classified too, and its own
# check is shown beside this one.

#: Which law of the design (docs/design.md) or which timeout each kind of end comes from.
LAW_DEADLINE: Final = "law 3 (bounded time): the state's deadline (RoomConfig.deadlines)"
LAW_LIVENESS: Final = (
    "law 3 (bounded time): peer loss within the liveness bound "
    "(ChannelConfig.heartbeat_s x liveness_factor)"
)
LAW_LINK: Final = "law 3 (bounded time): the control link to the peer ended"
LAW_UNCLAIMED: Final = "law 3 (bounded time): the unclaimed-room bound (ChannelConfig.unclaimed_s)"
LAW_FENCE: Final = "law 4 (physical settle): a write fenced after its lease expired"
LAW_CHUNK: Final = "law 3 (bounded time): a failed chunk fails its room"
LAW_STALL: Final = "law 3 (bounded time): the chunk deadline (a WRITE in flight too long)"
LAW_ABORT: Final = "law 6 (abort is an event): the caller aborted"
LAW_PEER: Final = "the peer's room failed, and the peer said so on the control link"
LAW_INPUT: Final = "law 7 (bad input fails one room)"
LAW_QUOTA: Final = "law 7 (bad input fails one room): a quota"
LAW_IDENTITY: Final = "law 5 (identity is room and generation)"
LAW_HANDSHAKE: Final = "law 7 (bad input fails one room): a handshake refusal"
LAW_INTERNAL: Final = "law 3 (bounded time): any exception fails its room, never the engine"
LAW_SHUTDOWN: Final = "shutdown: the engine aborts its live rooms when it closes"
LAW_UNKNOWN: Final = "unknown: no rule of kvfsm explain knows this reason"


@dataclass(frozen=True)
class Rule:
    """A reason pattern and what it means."""

    #: Short name of the cause: what ``--json`` and the summary group by.
    kind: str
    #: A regular expression matched at the start of the reason; named groups feed the texts.
    pattern: str
    law: str
    #: What happened (a template, see the table's comment).
    explanation: str
    #: What to check first (a template).
    check: str
    #: Only for rooms of this role ("sender", "receiver"); None: any.
    role: str | None = None
    #: A family's catch-all, after its specific rows: the reason is known only by its prefix.
    fallback: bool = False


_STORY: Final = "`kvfsm rooms --url <this rank's status server> --room {room}`"
_PEER_STORY: Final = "`kvfsm rooms --url <the {peer_side} rank's status server> --room {room}`"
_SECONDS: Final = r"(?P<seconds>[0-9.e+-]+)"

RULES: Final[tuple[Rule, ...]] = (
    # -- deadlines: a state held longer than its bound -----------------------------------------
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>Bootstrapping) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "prefill's room waited {seconds}s for decode's claim and page list, which never came",
        "did the request reach decode with this bootstrap_room, and can decode reserve KV pages "
        "for it (a full KV pool holds it back)? " + _PEER_STORY,
        role="sender",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>WaitingForInput) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "decode's pages arrived but prefill's caller did not send the first chunk within "
        "{seconds}s (the forward pass never produced it)",
        "is prefill's scheduler running this request (queued, preempted, a stuck forward "
        "pass)? `kill -USR1` the prefill process and `kvfsm explain` its stderr",
        role="sender",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>Transferring) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "the room's chunks were not all sent and completed within {seconds}s",
        "did the caller send every page it announced at init (the last chunk carries the aux "
        "row)? A chunk posted without 'chunk done' below is NIXL not completing: the network to "
        "{host}, and the transfer's NIXL logs (NIXL_LOG_LEVEL=INFO)",
        role="sender",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>Bootstrapping) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "decode could not resolve and connect its prefill rank within {seconds}s",
        "is the prefill rank registered with the bootstrap registry and its control port "
        "reachable from this host? The registry's entries (`kvfsm bootstrap` server's log)",
        role="receiver",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>WaitingForInput) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "decode's caller did not call send_metadata within {seconds}s: no pages were reserved "
        "for the request",
        "decode's KV pool and queue: is it full, is the scheduler admitting requests? "
        "`kill -USR1` the decode process and `kvfsm explain` its stderr",
        role="receiver",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>Transferring) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "prefill did not push every chunk and the aux row within {seconds}s",
        "is the request computing on prefill, and its chunks completing? " + _PEER_STORY,
        role="receiver",
    ),
    Rule(
        "deadline",
        rf"deadline expired: (?P<state>\w+) for more than {_SECONDS}s",
        LAW_DEADLINE,
        "the room stayed in {state} longer than its {seconds}s deadline",
        "what the room waited for in {state}: its timeline below; " + _STORY,
        fallback=True,
    ),
    # -- peer loss: the control link --------------------------------------------------------------
    Rule(
        "peer_silent",
        rf"peer lost: (?P<who>.+?) silent for more than {_SECONDS}s",
        LAW_LIVENESS,
        "the {peer_side} ({who}) sent nothing, not even a heartbeat, for {seconds}s",
        "is the {peer_side} process (pid {pid} on {host}) alive and its loop running? A stopped "
        "or swapping process, or a loop starved by a GIL-bound scheduler, falls silent while "
        "alive: `kill -USR1` it and `kvfsm explain` its stderr; then the network between the "
        "hosts",
    ),
    Rule(
        "peer_fatal_frame",
        r"peer lost: connection to (?P<who>\S+) closed: fatal frame after Hello",
        LAW_INPUT,
        "the {peer_side} ({who}) sent a frame this rank cannot accept on an established link, "
        "and the link was closed",
        "this rank's log (kvfsm.control) for the frame rejected just before, and whether both "
        "ranks run the same kvfsm version",
    ),
    Rule(
        "internal_error",
        r"peer lost: connection to (?P<who>\S+) closed: internal error: (?P<why>.+)",
        LAW_INTERNAL,
        "the control link to {who} hit a bug in this rank ({why})",
        "this rank's log (kvfsm.control) for the traceback; it is a kvfsm bug to report",
    ),
    Rule(
        "peer_closed",
        r"peer lost: connection to (?P<who>\S+) (?:closed|broken): (?P<why>.+)",
        LAW_LINK,
        "the TCP connection to the {peer_side} ({who}) ended: {why}",
        "did the {peer_side} process (pid {pid} on {host}) exit or restart then? Its exit "
        "status, the OOM killer (`dmesg`), its last log lines",
    ),
    Rule(
        "peer_replaced",
        r"peer lost: replaced by a new connection",
        LAW_LINK,
        "the {peer_side} connected again (a restart, or a reconnect after a network break); "
        "rooms of the old link cannot continue on the new one",
        "was the {peer_side} ({host}) restarted (a new incarnation in its peer field), or did "
        "the network between the hosts break?",
    ),
    Rule(
        "shutdown",
        r"(?:peer lost|aborted \(local\)): engine shutting down",
        LAW_SHUTDOWN,
        "this rank was shutting down while the room was live",
        "why this process was stopped (its supervisor's log); nothing failed in the transfer",
    ),
    Rule(
        "handshake_refused",
        r"peer lost: cannot reach prefill rank (?P<rank>\d+): .*?handshake refused: (?P<why>.+)",
        LAW_HANDSHAKE,
        "prefill rank {rank} and this rank refused each other at the handshake: {why}",
        "the two ranks' configuration: the refusal names what differs (model layout, page "
        "size, kvfsm version, auth secret) or the bound that was reached (ChannelConfig."
        "max_links, the per-host handshake cap)",
    ),
    Rule(
        "unreachable",
        r"peer lost: cannot reach prefill rank (?P<rank>\d+): (?P<why>.+)",
        LAW_LINK,
        "decode could not resolve or connect prefill rank {rank}: {why}",
        "is prefill rank {rank} up and registered with the bootstrap registry, and its control "
        "port reachable from this host (firewall, address it registered)?",
    ),
    Rule(
        "unclaimed",
        rf"peer lost: no decode room claimed it within {_SECONDS}s",
        LAW_UNCLAIMED,
        "no decode room claimed this room within {seconds}s: its decode half never arrived",
        "was the request sent to decode with this bootstrap_room (the router)? " + _PEER_STORY,
    ),
    Rule(
        "link_lost_early",
        r"peer lost: control link lost before the page list was sent",
        LAW_LINK,
        "the control link to prefill went down between send_metadata and sending the page list",
        "why the link went down: this rank's log (kvfsm.control, 'control link lost') at that "
        "time names the cause",
    ),
    Rule(
        "peer_lost",
        r"peer lost: (?P<why>.+)",
        LAW_LIVENESS,
        "the {peer_side} was lost: {why}",
        "is the {peer_side} process (pid {pid} on {host}) alive and reachable? " + _STORY,
        fallback=True,
    ),
    # -- the peer said: its own room failed, or it aborted ------------------------------------
    Rule(
        "peer_failed",
        r"peer failed: (?P<inner>.*)",
        LAW_PEER,
        "the {peer_side}'s room failed first and reported it (RoomOutcome Failed): {inner}",
        "the {peer_side}'s side of this room: " + _PEER_STORY,
    ),
    Rule(
        "peer_aborted",
        r"aborted \(peer\): (?P<inner>.*)",
        LAW_PEER,
        "the {peer_side} aborted the room (RoomAbort): {inner}",
        "the {peer_side}'s side of this room: " + _PEER_STORY,
    ),
    # -- the local caller ------------------------------------------------------------------------
    Rule(
        "other_leg_failed",
        r"aborted \(local\): another leg of this request failed: (?P<inner>.*)",
        LAW_ABORT,
        "the request is written by several prefill ranks, and another leg failed: {inner}",
        "the failed leg (the same room id on the other prefill ranks): its reason below",
    ),
    Rule(
        "scheduler_abort",
        r"aborted \(local\): aborted by the scheduler",
        LAW_ABORT,
        "SGLang's scheduler aborted the request (a client cancel, or the scheduler's own limit)",
        "SGLang's log for this request's abort; nothing failed in kvfsm",
    ),
    Rule(
        "cleared",
        r"aborted \(local\): cleared before completion",
        LAW_ABORT,
        "the caller dropped the room before it completed",
        "why the caller released the request early (SGLang's log); nothing failed in kvfsm",
    ),
    Rule(
        "caller_abort",
        r"aborted \((?P<origin>[^)]*)\): (?P<why>.*)",
        LAW_ABORT,
        "the caller aborted the room: {why}",
        "the caller's own reason ('{why}'); nothing failed in kvfsm",
    ),
    # -- chunks: the data path -------------------------------------------------------------------
    Rule(
        "fenced_out",
        r"chunk (?P<chunk>\d+) (?:failed|stalled): .*?(?:stale-progress gate|unfenced chunk)",
        LAW_FENCE,
        "this rank's NIXL agent was fenced out: no write of it may go on",
        "restart this process: its agent cannot write again (its log says why it was fenced out)",
    ),
    Rule(
        "fenced",
        r"chunk (?P<chunk>\d+) (?:failed|stalled): .*?write lease of fence (?P<fence>\d+) "
        r"(?P<why>.+?)(?:: not posted| before part .*|; released)?$",
        LAW_FENCE,
        "chunk {chunk} was not written: decode's write lease (fence {fence}) was {why} when it "
        "was posted or progressed",
        "was prefill late (a frozen process, a starved poster thread), or did decode stop "
        "renewing the lease (its link to prefill silent)? The links: `kvfsm rooms --url <this "
        "rank's status server>` and GET /links",
    ),
    Rule(
        "chunk_dropped",
        r"chunk (?P<chunk>\d+) failed: dropped: room failed before posting",
        LAW_CHUNK,
        "chunk {chunk} was never posted: the room had failed already",
        "the room's first failure, earlier in its timeline",
    ),
    Rule(
        "nixl_error",
        r"chunk (?P<chunk>\d+) failed: NIXL reported the transfer as failed",
        LAW_CHUNK,
        "NIXL reported chunk {chunk}'s WRITE as failed",
        "NIXL and UCX on both hosts (NIXL_LOG_LEVEL=INFO): the network to {host}, and whether "
        "the {peer_side} process is alive with its memory still registered",
    ),
    Rule(
        "post_failed",
        r"chunk (?P<chunk>\d+) failed: could not post the chunk: (?P<why>.+)",
        LAW_CHUNK,
        "chunk {chunk} could not be posted: {why}",
        "the NIXL error named; the peer's registration with this agent (a reconnect)",
    ),
    Rule(
        "page_out_of_range",
        r"chunk (?P<chunk>\d+) failed: .*(?:out of range|outside the layout|does not fit)",
        LAW_INPUT,
        "chunk {chunk} names a page or row outside the layout",
        "the page indices the callers passed against the KV pool sizes of both ranks",
    ),
    Rule(
        "chunk_quarantined",
        r"chunk (?P<chunk>\d+) failed: (?P<why>.+); quarantine of (?P<quarantine>\S+)s over",
        LAW_STALL,
        "chunk {chunk} was held ({why}) and given up after its {quarantine}s quarantine",
        "the room's first failure, earlier in its timeline",
    ),
    Rule(
        "chunk_stalled",
        rf"chunk (?P<chunk>\d+) stalled: in flight past its {_SECONDS}s deadline",
        LAW_STALL,
        "chunk {chunk} was still in flight after its {seconds}s deadline and was released",
        "NIXL progress to {host}: the network, the {peer_side} process (alive, not stopped), "
        "NIXL's logs",
    ),
    Rule(
        "chunk_peer_lost",
        r"chunk (?P<chunk>\d+) stalled: peer lost",
        LAW_LIVENESS,
        "the {peer_side} was lost while chunk {chunk} was in flight; it was released and held",
        "is the {peer_side} process (pid {pid} on {host}) alive? Its exit, `dmesg`, its log",
    ),
    Rule(
        "chunk_failed",
        r"chunk (?P<chunk>\d+) (?:failed|stalled): (?P<why>.+)",
        LAW_CHUNK,
        "chunk {chunk} failed: {why}",
        "this rank's log (kvfsm.transport) at that time, and NIXL's",
        fallback=True,
    ),
    # -- refusals: bad input, quotas, identity, bugs ---------------------------------------------
    Rule(
        "max_pages",
        r"rejected: .*more than max_pages \((?P<max>\d+)\)",
        LAW_QUOTA,
        "the call named more pages than max_pages ({max}) allows one room",
        "the request's size against RoomConfig.max_pages (and the control frame limit)",
    ),
    Rule(
        "mailbox_overflow",
        r"rejected: mailbox overflow \(> (?P<max>\d+)\)",
        LAW_QUOTA,
        "more than {max} events were queued for the room (RoomConfig.mailbox_size)",
        "who floods the room: a caller in a loop, or a peer sending frames for it",
    ),
    Rule(
        "caller_misuse",
        r"rejected: (?:init |send before init|chunk after the last chunk|chunk of \d+ pages "
        r"overruns|state rows|\d+ state rows|aux row -?\d+ is negative|decode prefix|"
        r"a KV-only leg|a dummy leg|a state-only leg|unknown leg part|completion for chunk)",
        LAW_INPUT,
        "the room's calls did not fit its state or each other (a call out of order, a count "
        "that does not add up)",
        "the caller's sequence of init/send/send_metadata for this room: its timeline below",
    ),
    Rule(
        "bad_pages",
        r"rejected: (?:bad page indices|page list of|.*(?:negative|beyond the table's limit|"
        r"out of range|more than once in|already held by|names other (?:pages|state rows)))",
        LAW_INPUT,
        "the room's page list is invalid (out of range, repeated, or held by another room)",
        "the page indices the caller passed (its KV pool size, and pages it gave two live "
        "rooms at once)",
    ),
    Rule(
        "frame_refused_by_peer",
        r"rejected: (?P<side>decode|prefill) rejected a frame of this room: (?P<why>.+)",
        LAW_INPUT,
        "the {side} refused a frame this rank sent for the room: {why}",
        "both ranks' kvfsm versions and configuration; the {side}'s log (kvfsm.control)",
    ),
    Rule(
        "bad_frame",
        r"rejected: bad frame: (?P<why>.+)",
        LAW_INPUT,
        "this rank refused a frame the {peer_side} sent for the room: {why}",
        "both ranks' kvfsm versions; who else can reach this rank's control port",
    ),
    Rule(
        "frame_too_big",
        r"rejected: cannot send: (?P<why>.+)",
        LAW_QUOTA,
        "a frame for this room could not be sent: {why}",
        "the room's page count against the control channel's frame limit (ChannelConfig) and "
        "RoomConfig.max_pages",
    ),
    Rule(
        "internal_error",
        r"rejected: (?:internal error on|could not execute) (?P<what>\w+): (?P<why>.+)",
        LAW_INTERNAL,
        "executing {what} raised: {why}",
        "this rank's log (kvfsm.rooms) for the traceback; it is a kvfsm bug to report",
    ),
    Rule(
        "illegal_event",
        r"rejected: (?P<event>\w+) in (?P<state>\w+)$",
        LAW_INPUT,
        "{event} arrived while the room was {state}, where it is not allowed",
        "the caller's call order, or a late frame from the peer: the timeline below",
    ),
    Rule(
        "adapter_refused",
        r"rejected: (?:no bootstrap_room|registering its prefill DP rank|destination .*kvfsm "
        r"writes device KV only|state rows arrived after the last chunk)",
        LAW_INPUT,
        "the SGLang adapter could not serve this request as configured",
        "the SGLang server's disaggregation settings (docs/sglang.md) for what the reason names",
    ),
    Rule(
        "rejected",
        r"rejected: (?P<why>.+)",
        LAW_INPUT,
        "the room was refused: {why}",
        "the caller's calls and the frames for this room: " + _STORY,
        fallback=True,
    ),
    Rule(
        "duplicate_room",
        r"refused: .*(?:is already live|is already registered)",
        LAW_IDENTITY,
        "a room with this id and role was still live when another was started",
        "the caller reused a room id before the previous room with it ended (abort it first)",
    ),
    Rule(
        "shutdown",
        r"refused: engine is shutting down",
        LAW_SHUTDOWN,
        "the room was started while this rank's engine was closing",
        "why this process was stopped; nothing failed in the transfer",
    ),
)

_COMPILED: Final = tuple((re.compile(rule.pattern), rule) for rule in RULES)
_UNKNOWN: Final = Rule(
    "unknown",
    "",
    LAW_UNKNOWN,
    "the room failed with a reason kvfsm explain does not know: {reason}",
    "the reason as written, and this rank's log at that time; " + _STORY,
)
#: How deep reasons the peer relayed are classified (a relayed reason holds at most one more).
_DEPTH: Final = 3


@dataclass(frozen=True)
class Classification:
    """A reason as :data:`RULES` read it."""

    rule: Rule
    groups: dict[str, str]
    #: ``inner``'s classification, when the reason relays another one (the peer's, a leg's).
    cause: Classification | None = None


def classify(reason: str, role: str | None = None, depth: int = _DEPTH) -> Classification:
    """The first rule of :data:`RULES` matching ``reason`` for a room of ``role``; the unknown
    rule if none does."""
    for pattern, rule in _COMPILED:
        if rule.role is not None and role is not None and rule.role != role:
            continue
        match = pattern.match(reason)
        if match is None:
            continue
        groups = {k: v for k, v in match.groupdict().items() if v is not None}
        inner = groups.get("inner")
        cause = None
        if inner is not None and depth > 0:
            # The relayed reason happened on the other side: read it as that side's.
            cause = classify(inner, _other(role), depth - 1)
        return Classification(rule, groups, cause)
    return Classification(_UNKNOWN, {})


def _other(role: str | None) -> str | None:
    return {"sender": "receiver", "receiver": "sender"}.get(role or "")


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
    values["story"] = _fill(_STORY, values)
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
            _STORY, {"room": str(finding.room)}
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
