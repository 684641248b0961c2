"""The table ``kvfsm explain`` reads reasons with: which law of the design or which timeout
each kind of room end comes from, what it means and what to check first (:data:`RULES`), and
:func:`classify`, which applies it. Data first, so that a new reason is a new row."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LAW_DEADLINE",
    "RULES",
    "STORY",
    "Classification",
    "Rule",
    "classify",
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
LAW_REGISTRY: Final = (
    "law 3 (bounded time): one bootstrap registry request's bound "
    "(ManagerConfig.registry_timeout_s)"
)
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


STORY: Final = "`kvfsm rooms --url <this rank's status server> --room {room}`"
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
        "what the room waited for in {state}: its timeline below; " + STORY,
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
        "registry_timeout",
        r"peer lost: cannot reach prefill rank (?P<rank>\d+): bootstrap registry (?P<url>\S+) "
        r"unreachable: TimeoutError",
        LAW_REGISTRY,
        "the bootstrap registry at {url} did not answer the lookup of prefill rank {rank} "
        "within its request bound",
        "is the registry up, and is its host (or this one) so loaded that it answers late "
        "(`curl {url}/v1/ranks?engine=<engine>`)? A registry that only answers slowly needs a "
        "longer bound: ManagerConfig.registry_timeout_s (KVFSM_REGISTRY_TIMEOUT_S under "
        "SGLang; 2 s by default)",
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
        "unclaimed_stalled",
        rf"peer lost: this prefill rank stood still for {_SECONDS}s",
        LAW_UNCLAIMED,
        "this prefill rank stood still for {seconds}s (stopped, swapping, its loop blocked) "
        "while the room waited for its decode room's claim: the stall is why it ran out",
        "why this prefill process stood still (SIGSTOP, swapping, a long GC or a blocking call "
        "on its loop; its control plane counts them as own_stalls)",
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
        "is the {peer_side} process (pid {pid} on {host}) alive and reachable? " + STORY,
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
        "the caller's calls and the frames for this room: " + STORY,
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
    "the reason as written, and this rank's log at that time; " + STORY,
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
