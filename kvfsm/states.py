"""The room state machine of kvfsm: states, events, transition tables, commands, deadlines.

Rule 1: every state change of a room is an edge in ``SENDER_TABLE`` or ``RECEIVER_TABLE`` below.
        Nothing else assigns a room's state. ``Success`` and ``Failed`` map to empty tables, so a
        terminal state has no way out; a test walks the *built* ``transitions`` machine to prove it.
Rule 2: this file knows nothing of NIXL, sockets, threads or clocks. It is data plus a few pure
        helpers. Deadlines are plain numbers of seconds; somebody else owns the clock.
Rule 3: the integers of ``KVPoll`` are SGLang's. The scheduler all-reduces polls across ranks with
        MIN, so the order *is* the protocol: any rank's Failed (0) fails the request everywhere,
        and Success (4) needs every rank. Never renumber, never add a state.

Theory of operation
-------------------

A *room* is one request's KV transfer between one prefill rank (the **sender**, it WRITEs) and one
decode rank (the **receiver**, it owns the destination pages). Each room is owned by exactly one
task. Everything that happens to a room (a caller's ``abort()``, a finished NIXL chunk, a control
frame, a timer) arrives as an **event**: a frozen, tagged ``msgspec.Struct`` named in the past
tense. The room looks the pair (state, type(event)) up in its role's table:

* found: the room moves to the listed state and emits **commands** (imperatives such as
  ``PostChunk`` or ``ReportOutcome``) that its task then executes. Decide first, then do IO.
* not found, room terminal: the event is late or duplicated. That is normal in a distributed
  system (a chunk that completes after an abort, a peer's abort after Success). It is dropped and
  counted, never raised into a caller.
* not found, room not terminal: the event is illegal here. The room fails closed (h2's rule) with
  a reason naming the event and the state.

Two events are *derived*: the room posts ``TransferCompleted`` to itself when its own bookkeeping
says the last chunk (sender) or the last peer confirmation (receiver) is in. Keeping the condition
out of the table keeps the table a plain mapping.

Logical outcome is not physical settle (law 4). A room publishes Failed at once, but the pages it
exposed stay unsafe until every transfer handle that touches them has settled: the sender counts
its in-flight chunks, the receiver waits for the sender's abort acknowledgement (``PeerSettled``)
or the sender's success. Settlement events are therefore applied to the room's ledger even when
the table drops them as late.

::

         sender (prefill)                                receiver (decode)

    Bootstrapping                                   Bootstrapping
      | DestinationReceived                           | PeerResolved      (Initialized: stay)
      v                                               v
    WaitingForInput   (Initialized: stay)           WaitingForInput
      | ChunkSubmitted                                | MetadataSubmitted
      v                                               v
    Transferring  (ChunkSubmitted, ChunkDone: stay) Transferring        (TransferConfirmed: stay)
      | TransferCompleted                             | TransferCompleted
      v                                               v
    Success                                         Success

    every non-terminal state --AbortRequested | DeadlineExpired | PeerLost | PeerFailed |
                               EventRejected--> Failed
    Transferring (sender) --ChunkFailed | ChunkStalled--> Failed
    Success, Failed: no edges.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal, TypeAlias

import msgspec

__all__ = [
    "DEFAULT_DEADLINES",
    "EVENT_TYPES",
    "FAILURE_EVENTS",
    "NON_TERMINAL",
    "RECEIVER_TABLE",
    "RING_FIELDS",
    "SENDER_TABLE",
    "SETTLEMENT_EVENTS",
    "TABLES",
    "TERMINAL",
    "AbortRequested",
    "ChunkDone",
    "ChunkFailed",
    "ChunkStalled",
    "ChunkSubmitted",
    "Command",
    "DeadlineExpired",
    "DestinationReceived",
    "Event",
    "EventRejected",
    "Initialized",
    "KVPoll",
    "MetadataSubmitted",
    "Part",
    "PeerFailed",
    "PeerLost",
    "PeerResolved",
    "PeerSettled",
    "PostChunk",
    "ReleaseHandles",
    "ReportOutcome",
    "ReportSettled",
    "ResolvePeer",
    "Role",
    "SendMetadata",
    "Table",
    "TransferCompleted",
    "TransferConfirmed",
    "deadline_of",
    "failure_reason",
    "reason_kind",
]


class KVPoll(enum.IntEnum):
    """Room status, integer-compatible with ``sglang.srt.disaggregation.base.conn.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL: Final = frozenset({KVPoll.Success, KVPoll.Failed})
NON_TERMINAL: Final = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)


class Role(enum.Enum):
    """Which end of a transfer a room is. Prefill rooms send, decode rooms receive."""

    SENDER = "sender"
    RECEIVER = "receiver"

    # Enum's default hash is a Python-level hash of the member name; roles key several hot
    # dicts (a few lookups per room), and members are singletons, so identity hashing is both
    # correct and C-fast.
    __hash__ = object.__hash__


#: int32 values per ring row in a ``rings`` field: ``[position, offset1, count1, offset2,
#: count2, ring]``: the row's place among the request's state rows, then SGLang's entry for it
#: (``get_dsa_tail_state_indices``) less its row: the live slots of the ring row (at most two
#: segments, the ring wrapped) and the ring's slot count. Each side sends its own: a request's
#: live slots start at its length modulo that side's ring, so a sender places them in a ring of
#: another size only from both sides' segments.
RING_FIELDS: Final = 6


class Part(enum.IntEnum):
    """What one *leg* of a room carries, when a decode rank's request is fed by several
    prefill ranks (unequal attention TP): each leg is a room of its own between one prefill
    rank and one decode rank, and they share the decode request's pages.

    * ``WHOLE``: the KV (or this leg's head slice of it), the aux row and the state rows. The
      only part when TP is equal; with several legs, exactly one of them.
    * ``KV``: the KV slice, and the state rows when state is sharded over attention TP (each
      prefill rank writes its shard; replicated state is written by the ``WHOLE`` leg only);
      another leg of the request carries the aux row.
    * ``NONE``: nothing. The prefill rank holds no KV this decode rank needs (an MLA replica,
      or a replicated KV head another replica sends): it is SGLang's "dummy" rank for it, and
      its room still runs to Success so every rank's poll reports the same progress.
    * ``STATE``: its shard of the request's state only. The prefill rank holds a shard of the
      decode rank's state (Mamba's channels) but writes it no KV: another replica of its KV
      heads does (prefill's attention TP above the model's KV heads).
    """

    WHOLE = 0
    KV = 1
    NONE = 2
    STATE = 3


# --------------------------------------------------------------------------------------------
# Events: what happened. Frozen (safe to share between tasks), tagged (the class name is the tag,
# so the same classes can travel in a msgspec union), gc=False (scalar payloads, no cycles),
# array_like (encoded as ``[tag, fields...]``: what a reaped room's flight recorder encodes, with
# no field name written per event: kvfsm.rooms._timeline).
# --------------------------------------------------------------------------------------------


class Event(
    msgspec.Struct, frozen=True, tag=True, gc=False, forbid_unknown_fields=True, array_like=True
):
    """Base of every event. Never instantiated itself."""


Origin: TypeAlias = Literal["local", "peer"]


class DestinationReceived(Event, frozen=True):
    """Sender: the receiver's destination pages (packed int32) and aux row arrived, from the
    transport peer named ``peer`` (the receiver's NIXL agent, as the transport knows it)."""

    pages: bytes
    aux_index: int
    peer: str = ""
    #: The receiver's state rows (packed int32), empty when the model has no per-request state.
    state: bytes = b""
    #: The write lease these pages are fenced by (law 4): the control link that brought them.
    #: Every chunk into them is posted only while that lease is valid; 0 means unfenced.
    fence: int = 0
    #: Which part of the decode request this room carries (:class:`Part`).
    part: int = 0
    #: How many decode ranks this prefill rank writes the request into: one sender room, a
    #: leg, per decode rank. More than 1 under unequal attention TP when decode's is larger,
    #: or when this rank also sends its state shard to a decode rank it writes no KV into (KV
    #: heads replicated on both sides); 1 otherwise.
    legs: int = 1
    #: Prompt tokens the receiver already holds (SGLang's ``decode_prefix_len``): ``pages``
    #: start after them, and the sender's caller sends only the pages that follow.
    prefix: int = 0
    #: The receiver's live segments of its ring rows (:data:`RING_FIELDS` packed int32 per
    #: ring row), empty when ``state`` names none.
    rings: bytes = b""


class Initialized(Event, frozen=True):
    """The caller's ``init``. Sender: how many pages it will send and its aux row.
    Receiver: which prefill rank serves this room."""

    num_pages: int = 0
    aux_index: int = -1
    peer_rank: int = 0


class ChunkSubmitted(Event, frozen=True):
    """Sender: the caller's ``send`` of one chunk of source pages (packed int32; may be empty).
    The last chunk may carry the source state rows (packed int32) to copy with it."""

    pages: bytes
    state: bytes = b""
    #: The live segments of the source ring rows among ``state`` (:data:`RING_FIELDS`).
    rings: bytes = b""


class ChunkDone(Event, frozen=True):
    """Sender: the transport finished chunk number ``chunk`` (its handle is released)."""

    chunk: int


class ChunkFailed(Event, frozen=True):
    """Sender: chunk ``chunk`` errored, stalled past its deadline, or was released after an abort.
    Its handle is released and its pages are out of quarantine: it is settled."""

    chunk: int
    reason: str


class ChunkStalled(Event, frozen=True):
    """Sender: chunk ``chunk`` outlived its deadline. Its handle was released, but bytes of a
    cancelled WRITE may still land, so it is *not* settled: a ``ChunkFailed`` follows once
    its quarantine is over."""

    chunk: int
    reason: str


class PeerResolved(Event, frozen=True):
    """Receiver: the prefill peer for this room is known and reachable."""

    peer_rank: int = 0


class MetadataSubmitted(Event, frozen=True):
    """Receiver: the caller's ``send_metadata``: destination pages (packed int32), aux row, and
    state rows (packed int32; hybrid models' per-request state, empty for none)."""

    pages: bytes
    aux_index: int
    state: bytes = b""
    #: Which part of the request this leg carries (:class:`Part`).
    part: int = 0
    #: Prompt tokens this side already holds (decode prefix caching); ``pages`` follow them.
    prefix: int = 0
    #: The live segments of the ring rows among ``state`` (:data:`RING_FIELDS`).
    rings: bytes = b""


class TransferConfirmed(Event, frozen=True):
    """Receiver: a sender reported that all of its chunks and the aux row landed."""

    peer_rank: int = 0


class PeerSettled(Event, frozen=True):
    """Receiver: a sender acknowledged an abort after every handle touching this room settled."""

    peer_rank: int = 0


class TransferCompleted(Event, frozen=True):
    """Derived: posted by the room to itself when its bookkeeping says the transfer is complete."""


class AbortRequested(Event, frozen=True):
    """An abort, from the local caller or from the peer."""

    reason: str = "aborted"
    origin: Origin = "local"


class DeadlineExpired(Event, frozen=True):
    """The deadline of the state the room was in when the timer was armed has passed."""

    state: KVPoll
    seconds: float


class PeerLost(Event, frozen=True):
    """The peer is gone: heartbeat silence, NIXL remote disconnect, or a closed channel."""

    reason: str


class PeerFailed(Event, frozen=True):
    """The peer reported that its side of this room failed."""

    reason: str


class EventRejected(Event, frozen=True):
    """Derived: an event was illegal in the room's state, or its payload was invalid."""

    reason: str


# --------------------------------------------------------------------------------------------
# The tables. One per role, literal data: ``state -> {event type -> next state}``. A missing key
# is a missing edge. Terminal states map to empty tables on purpose; do not "complete" them.
# --------------------------------------------------------------------------------------------

Table: TypeAlias = Mapping[KVPoll, Mapping[type[Event], KVPoll]]

_FAILURES: Final[Mapping[type[Event], KVPoll]] = {
    AbortRequested: KVPoll.Failed,
    DeadlineExpired: KVPoll.Failed,
    PeerLost: KVPoll.Failed,
    PeerFailed: KVPoll.Failed,
    EventRejected: KVPoll.Failed,
}

SENDER_TABLE: Final[Table] = MappingProxyType(
    {
        KVPoll.Bootstrapping: MappingProxyType(
            {
                DestinationReceived: KVPoll.WaitingForInput,
                **_FAILURES,
            }
        ),
        KVPoll.WaitingForInput: MappingProxyType(
            {
                Initialized: KVPoll.WaitingForInput,
                ChunkSubmitted: KVPoll.Transferring,
                **_FAILURES,
            }
        ),
        KVPoll.Transferring: MappingProxyType(
            {
                ChunkSubmitted: KVPoll.Transferring,
                ChunkDone: KVPoll.Transferring,
                ChunkFailed: KVPoll.Failed,
                ChunkStalled: KVPoll.Failed,
                TransferCompleted: KVPoll.Success,
                **_FAILURES,
            }
        ),
        KVPoll.Success: MappingProxyType({}),
        KVPoll.Failed: MappingProxyType({}),
    }
)

RECEIVER_TABLE: Final[Table] = MappingProxyType(
    {
        KVPoll.Bootstrapping: MappingProxyType(
            {
                Initialized: KVPoll.Bootstrapping,
                PeerResolved: KVPoll.WaitingForInput,
                **_FAILURES,
            }
        ),
        KVPoll.WaitingForInput: MappingProxyType(
            {
                MetadataSubmitted: KVPoll.Transferring,
                **_FAILURES,
            }
        ),
        KVPoll.Transferring: MappingProxyType(
            {
                TransferConfirmed: KVPoll.Transferring,
                TransferCompleted: KVPoll.Success,
                **_FAILURES,
            }
        ),
        KVPoll.Success: MappingProxyType({}),
        KVPoll.Failed: MappingProxyType({}),
    }
)

TABLES: Final[Mapping[Role, Table]] = MappingProxyType(
    {Role.SENDER: SENDER_TABLE, Role.RECEIVER: RECEIVER_TABLE}
)

EVENT_TYPES: Final[tuple[type[Event], ...]] = (
    DestinationReceived,
    Initialized,
    ChunkSubmitted,
    ChunkDone,
    ChunkFailed,
    ChunkStalled,
    PeerResolved,
    MetadataSubmitted,
    TransferConfirmed,
    PeerSettled,
    TransferCompleted,
    AbortRequested,
    DeadlineExpired,
    PeerLost,
    PeerFailed,
    EventRejected,
)

#: Events that move a room into Failed; each carries the reason the room publishes.
FAILURE_EVENTS: Final = frozenset(
    {
        AbortRequested,
        DeadlineExpired,
        PeerLost,
        PeerFailed,
        EventRejected,
        ChunkFailed,
        ChunkStalled,
    }
)

#: Events that settle physical resources. The room's ledger applies them in every state,
#: including terminal ones, before (and regardless of) the table lookup.
SETTLEMENT_EVENTS: Final = frozenset({ChunkDone, ChunkFailed, PeerSettled, TransferConfirmed})


def failure_reason(event: Event) -> str:
    """The human-readable reason a failure event carries, as published with ``Failed``."""
    if isinstance(event, AbortRequested):
        return f"aborted ({event.origin}): {event.reason}"
    if isinstance(event, DeadlineExpired):
        return f"deadline expired: {event.state.name} for more than {event.seconds:g}s"
    if isinstance(event, PeerLost):
        return f"peer lost: {event.reason}"
    if isinstance(event, PeerFailed):
        return f"peer failed: {event.reason}"
    if isinstance(event, ChunkFailed):
        return f"chunk {event.chunk} failed: {event.reason}"
    if isinstance(event, ChunkStalled):
        return f"chunk {event.chunk} stalled: {event.reason}"
    if isinstance(event, EventRejected):
        return f"rejected: {event.reason}"
    raise TypeError(f"{type(event).__name__} is not a failure event")


_DIGITS: Final = re.compile(r"\d+")


def reason_kind(reason: str) -> str:
    """The class of a failure reason, what operators group failures by (metrics, the status
    server, the failed-room log line): the part before the first colon, numbers as ``#``."""
    return _DIGITS.sub("#", reason.split(":", 1)[0].strip()) or "unknown"


# --------------------------------------------------------------------------------------------
# Commands: what the room's task must do after a transition. The core decides; the task executes
# them against the transport and the control channel, which answer with events.
# --------------------------------------------------------------------------------------------


class Command(msgspec.Struct, frozen=True, tag=True, gc=False, array_like=True):
    """Base of every command (array_like, as events are)."""


class PostChunk(Command, frozen=True):
    """Sender: WRITE source pages ``src`` into the receiver's pages ``dst`` (both packed int32,
    equal length). The last chunk also copies aux row ``src_aux`` into the receiver's row
    ``dst_aux``; on other chunks both are -1."""

    chunk: int
    src: bytes
    dst: bytes
    is_last: bool
    src_aux: int = -1
    dst_aux: int = -1
    #: The transport peer to write to (``DestinationReceived.peer``).
    peer: str = ""
    #: On the last chunk: state rows to copy (packed int32, equal counts), else empty.
    src_state: bytes = b""
    dst_state: bytes = b""
    #: The write lease to check right before posting (``DestinationReceived.fence``); 0: none.
    fence: int = 0
    #: On the last chunk: both sides' live segments of the ring rows among the state rows
    #: (:data:`RING_FIELDS`), else empty.
    src_rings: bytes = b""
    dst_rings: bytes = b""


class ReleaseHandles(Command, frozen=True):
    """Sender: cancel every in-flight chunk of this room. The transport still reports each one
    (``ChunkDone`` or ``ChunkFailed``) once its handle is released and any quarantine is over."""


class ResolvePeer(Command, frozen=True):
    """Receiver: find and connect the prefill rank ``peer_rank``; answer with ``PeerResolved``."""

    peer_rank: int


class SendMetadata(Command, frozen=True):
    """Receiver: tell the sender where to write (packed int32 pages), which aux row and which
    state rows (packed int32, maybe empty) to fill."""

    pages: bytes
    aux_index: int
    state: bytes = b""
    part: int = 0
    #: Prompt tokens the receiver already holds (``MetadataSubmitted.prefix``).
    prefix: int = 0
    #: The live segments of the ring rows among ``state`` (``MetadataSubmitted.rings``).
    rings: bytes = b""


class ReportOutcome(Command, frozen=True):
    """Tell the peer how this side ended. A receiver's Failed is an abort that the sender must
    acknowledge once its handles settled; a sender's outcome tells the receiver to finish."""

    status: KVPoll
    reason: str = ""


class ReportSettled(Command, frozen=True):
    """Sender: every handle of this failed room has settled; the receiver may reuse its pages.
    This is the abort acknowledgement; the receiver sees it as ``PeerSettled``."""


# --------------------------------------------------------------------------------------------
# Deadlines: every non-terminal state has one (law 3). A room's total time is bounded by the sum
# over the states it passes through. Seconds; the engine's configuration can override each one.
# --------------------------------------------------------------------------------------------

DEFAULT_DEADLINES: Final[Mapping[Role, Mapping[KVPoll, float]]] = MappingProxyType(
    {
        Role.SENDER: MappingProxyType(
            {
                # Waiting for the decode side to reserve pages and send their list. SGLang's own
                # bootstrap timeout is 300 s; a decode rank short of memory can hold this long.
                KVPoll.Bootstrapping: 300.0,
                # Waiting for the prefill forward pass to produce the first chunk.
                KVPoll.WaitingForInput: 300.0,
                # From the first chunk to the last chunk and its completion.
                KVPoll.Transferring: 120.0,
            }
        ),
        Role.RECEIVER: MappingProxyType(
            {
                # Finding the prefill rank through the bootstrap registry.
                KVPoll.Bootstrapping: 60.0,
                # Waiting for decode memory so the caller can call ``send_metadata``.
                KVPoll.WaitingForInput: 300.0,
                # Waiting for prefill to compute and push every chunk and the aux row.
                KVPoll.Transferring: 300.0,
            }
        ),
    }
)


def deadline_of(
    role: Role, state: KVPoll, overrides: Mapping[KVPoll, float] | None = None
) -> float:
    """The deadline in seconds of ``state`` for ``role``; terminal states have none (``inf``)."""
    if state in TERMINAL:
        return float("inf")
    if overrides is not None and state in overrides:
        return overrides[state]
    return DEFAULT_DEADLINES[role][state]
