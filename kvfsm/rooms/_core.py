"""The sans-IO core of a room: one event in, commands out.

``RoomCore.handle(event)`` is the only place a room's state changes, and it changes it only
along an edge of the role's ``transitions`` machine (built from the tables in
:mod:`kvfsm.states`), read from that machine's compiled dispatch
(:func:`kvfsm.rooms._machine.compile_dispatch`: the built machine's edges as a lookup, proven
equal to firing the machine by ``tests/rooms/test_machine.py``). Around that it keeps the room's
bookkeeping:

* the **ledger** (physical): which chunks are in flight (sender) or whether the receiver's pages
  are exposed to the sender's writes. Settlement events update it in every state, terminal ones
  included, because a chunk that completes after an abort still has to be accounted for;
* the **payload checks**: an event that is legal for the table can still be wrong for this room
  (a chunk beyond the pages the receiver reserved, ``send`` before ``init``). Those become
  ``EventRejected`` and fail the room, so bad input fails one room and nothing else.

No clocks, no IO, no threads: the actor around it owns those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias, cast

from kvfsm.rooms._machine import DISPATCH
from kvfsm.rooms._stats import RoomStats
from kvfsm.states import (
    FAILURE_EVENTS,
    SETTLEMENT_EVENTS,
    TERMINAL,
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    ChunkSubmitted,
    Command,
    DeadlineExpired,
    DestinationReceived,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    Part,
    PeerFailed,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
    TransferCompleted,
    TransferConfirmed,
    failure_reason,
)

__all__ = ["Claim", "IllegalEventError", "RoomCore", "page_count"]

# Python 3.11's EnumType defines ``__getattr__``, which sends every attribute read on an enum
# class (``KVPoll.Failed``) through a slow slot hook: several times a module global's cost. What
# runs per room step reads these globals instead.
_BOOTSTRAPPING: Final = KVPoll.Bootstrapping
_FAILED: Final = KVPoll.Failed
_SUCCESS: Final = KVPoll.Success
_TRANSFERRING: Final = KVPoll.Transferring
_SENDER: Final = Role.SENDER

_PAGE_BYTES: Final = 4  # pages travel as packed int32
_NO_COMMANDS: Final[tuple[Command, ...]] = ()


#: A receiver's admission of its destinations (the engine's ``DestinationOwners``): called with
#: the ``MetadataSubmitted`` the room is about to apply; takes them and returns None, or returns
#: why they cannot be had (another room holds some) and takes nothing.
Claim: TypeAlias = Callable[[MetadataSubmitted], "str | None"]


class IllegalEventError(RuntimeError):
    """Raised by a strict core instead of failing the room (tests use strict cores)."""


def page_count(pages: bytes) -> int:
    """Number of int32 page indices packed in ``pages``; raises ``ValueError`` if ragged."""
    count, rest = divmod(len(pages), _PAGE_BYTES)
    if rest:
        raise ValueError(f"page list of {len(pages)} bytes is not a whole number of int32")
    return count


def _from_peer(event: Event) -> bool:
    """The peer told us (it failed, or it aborted): telling it back would be an echo. A lost
    peer is not one of these: the loss may be only the data path's (a NIXL remote disconnect
    while the control link is up), and the peer must hear why its room failed; over a lost
    control link the report simply goes nowhere."""
    if isinstance(event, PeerFailed):
        return True
    return isinstance(event, AbortRequested) and event.origin == "peer"


class RoomCore:
    """State, ledger and payload checks of one room. Not thread-safe: one owner at a time."""

    __slots__ = (
        "role",
        "state",
        "reason",
        "_dispatch",
        "_checks",
        "_actions",
        "_stats",
        "_strict",
        "_claim",
        # sender
        "_dst",
        "_dst_pages",
        "_dst_aux",
        "peer_agent",
        "_dst_state",
        "_dst_rings",
        "_dst_known",
        "fence",
        "_prefix",
        "part",
        "legs",
        "_num_pages",
        "_src_aux",
        "_submitted_pages",
        "_next_chunk",
        "_last_submitted",
        "_in_flight",
        # receiver
        "peer_rank",
        "_exposed",
    )

    def __init__(
        self,
        role: Role,
        stats: RoomStats | None = None,
        *,
        strict: bool = False,
        claim: Claim | None = None,
    ):
        self.role: Final = role
        #: Written only by :meth:`_fire`, along an edge of the role's compiled dispatch (the
        #: built ``transitions`` machine's edges; ``trigger`` and ``set_state`` never run on the
        #: hot path), and read by everyone.
        self.state: KVPoll = _BOOTSTRAPPING
        #: Why the room failed; empty until it does.
        self.reason = ""
        self._dispatch = DISPATCH[role]
        self._checks = _CHECKS[role]
        self._actions = _ACTIONS[role]
        self._stats = stats if stats is not None else RoomStats()
        self._strict = strict
        self._claim = claim
        self._dst = b""
        self._dst_pages = 0
        self._dst_aux = -1
        #: Sender: the receiver's transport agent, once its destination arrived ("" before; a
        #: receiver's stays ""). The peer attributes are plain slots, read (never written)
        #: outside the core: a reaped room's record reads all three without a call.
        self.peer_agent = ""
        self._dst_state = b""
        self._dst_rings = b""
        # A dummy leg's destination names no page and no aux row, yet its receiver waits for
        # this sender's word (ReportSettled) like any other: it is known once it arrived.
        self._dst_known = False
        #: Sender: the write lease its destination came under (0: none yet, or unfenced; a
        #: receiver's stays 0).
        self.fence = 0
        #: Prompt tokens the receiver holds already (decode prefix caching): the sender's
        #: ``DestinationReceived.prefix``, the receiver's ``MetadataSubmitted.prefix``.
        self._prefix = 0
        #: Sender: what its destination said it carries (``Part``) and how many decode ranks
        #: the request goes to; published with ``prefix`` before WaitingForInput.
        self.part = 0
        self.legs = 1
        self._num_pages = -1  # -1 until the caller's init
        self._src_aux = -1
        self._submitted_pages = 0
        self._next_chunk = 0
        self._last_submitted = False
        self._in_flight: set[int] = set()
        #: Receiver: the prefill rank serving it (-1 before ``init``; a sender's stays -1).
        self.peer_rank = -1
        self._exposed = False

    # -- reads ---------------------------------------------------------------------------------

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def settled(self) -> bool:
        """True once the room is terminal and nothing can still write into its pages."""
        return self.state in TERMINAL and not self._in_flight and not self._exposed

    @property
    def prefix(self) -> int:
        """Prompt tokens the receiver already holds, as its destination said; 0 until it did.
        The actor publishes it before the sender's WaitingForInput, so a caller that sees
        WaitingForInput reads it (SGLang's ``pop_decode_prefix_len``)."""
        return self._prefix

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._in_flight)

    # -- the one entry point -------------------------------------------------------------------

    def handle(self, event: Event) -> tuple[Command, ...]:
        """Apply ``event``; return the commands the owner must execute, in order."""
        kind = type(event)
        state = self.state
        # (Only settlement events touch the ledger; the test keeps a call off every other one.)
        settled_now = self._settle(event) if kind in SETTLEMENT_EVENTS else _NO_COMMANDS
        if kind is DeadlineExpired and cast("DeadlineExpired", event).state is not state:
            # A timer armed for a state the room has left since; its cancel lost the race.
            self._stats.late_events += 1
            return settled_now
        if state in TERMINAL:
            # Late or duplicate: a chunk finishing after an abort, a peer's abort after Success.
            self._stats.late_events += 1
            if kind is DestinationReceived and state is _FAILED:
                # The receiver reserved pages for a sender that already failed (say, aborted
                # while bootstrapping, before it knew its peer): answer, or they wait for a
                # deadline. Nothing was ever posted to them, so they are settled too.
                return (ReportOutcome(_FAILED, self.reason), ReportSettled())
            return settled_now
        dest = self._dispatch[state].get(kind)
        if dest is None:
            return self._reject(f"{kind.__name__} in {state.name}")
        check = self._checks.get(kind)
        if check is not None:
            problem = check(self, event)
            if problem is not None:
                return self._reject(problem)
        if kind is MetadataSubmitted and self._claim is not None:
            # Last, so that only metadata this room is about to apply takes its destinations,
            # and before the transition, so that SendMetadata never names pages another room
            # holds. A refusal is not an illegal event (strict cores do not raise): it is the
            # caller's double booking, and it fails this room only.
            problem = self._claim(cast("MetadataSubmitted", event))
            if problem is not None:
                self._stats.destinations_refused += 1
                return self._fail(EventRejected(problem))
        if kind in FAILURE_EVENTS:
            return self._fail(event)
        self._fire(event, dest)
        action = self._actions.get(kind)
        commands = action(self, event) if action is not None else _NO_COMMANDS
        if self.state is _TRANSFERRING and self._complete():
            return commands + self.handle(TransferCompleted())
        return commands

    # -- steps ---------------------------------------------------------------------------------

    def _fire(self, event: Event, dest: KVPoll) -> None:
        """Take an edge of the built machine, ``dest`` as its dispatch gave it for ``event`` in
        the current state (``handle`` and ``_fail`` look it up). The one assignment of a room's
        state."""
        self.state = dest

    def _settle(self, event: Event) -> tuple[Command, ...]:
        """Ledger first, whatever the state: physical facts are never dropped.

        Returns ``ReportSettled`` when this event drains the last in-flight chunk of a failed
        sender: the receiver may hold its pages until it hears that (law 4).
        """
        kind = type(event)
        if kind is ChunkDone or kind is ChunkFailed:
            assert isinstance(event, (ChunkDone, ChunkFailed))
            if event.chunk in self._in_flight:
                self._in_flight.discard(event.chunk)
                if self.state is _FAILED and not self._in_flight and self._peer_known():
                    return (ReportSettled(),)
        elif kind is PeerSettled or kind is TransferConfirmed:
            self._exposed = False
        return _NO_COMMANDS

    def fail(self, problem: str) -> tuple[Command, ...]:
        """Fail the room from outside the event flow (mailbox overflow, an internal error).
        Never raises; a no-op on a terminal room."""
        if self.state in TERMINAL:
            return _NO_COMMANDS
        return self._fail(EventRejected(problem))

    def _reject(self, problem: str) -> tuple[Command, ...]:
        self._stats.rejected_events += 1
        if self._strict:
            raise IllegalEventError(f"{self.role.value} room in {self.state.name}: {problem}")
        return self._fail(EventRejected(problem))

    def _fail(self, event: Event) -> tuple[Command, ...]:
        if isinstance(event, DeadlineExpired):
            self._stats.deadline_expiries += 1
        dest = self._dispatch[self.state].get(type(event))
        if dest is not _FAILED:  # every non-terminal state has its failure edges: a bug
            raise RuntimeError(f"no edge {type(event).__name__} -> Failed from {self.state.name}")
        self.reason = failure_reason(event)
        self._fire(event, dest)
        commands: list[Command] = []
        if self._in_flight:
            commands.append(ReleaseHandles())
        # Tell the peer, unless it is the one that told us or it is gone. A receiver's Failed is
        # an abort that the sender acknowledges with ReportSettled. A sender that fails before
        # it knows its receiver reports too: the control channel keeps the outcome for the
        # receiver's page list that may still be on its way.
        if not _from_peer(event) and (self._peer_known() or self.role is _SENDER):
            commands.append(ReportOutcome(_FAILED, self.reason))
        if self._peer_known() and self.role is _SENDER and not self._in_flight:
            commands.append(ReportSettled())
        return tuple(commands)

    def _peer_known(self) -> bool:
        if self.role is _SENDER:
            return self._dst_known
        return self.peer_rank >= 0

    def _complete(self) -> bool:
        if self.state is not _TRANSFERRING:
            return False
        if self.role is _SENDER:
            return self._last_submitted and not self._in_flight
        return not self._exposed

    # -- per-event payload checks: return a problem, or None --------------------------------

    def _check_pages(self, event: DestinationReceived | MetadataSubmitted) -> str | None:
        try:
            page_count(event.pages)
            page_count(event.state)
        except ValueError as exc:
            return str(exc)
        if event.prefix < 0:
            return f"decode prefix of {event.prefix} tokens is negative"
        part = event.part
        if part == Part.WHOLE:
            if event.aux_index < 0:
                return f"aux row {event.aux_index} is negative"
            return None
        if part == Part.KV:
            # State rows are allowed: under unequal attention TP each prefill rank writes its
            # shard of the request's state (the link's state piece says which bytes, if any).
            if event.aux_index != -1:
                return "a KV-only leg names an aux row (another leg carries it)"
            return None
        if part == Part.NONE:
            if event.pages or event.state or event.aux_index != -1:
                return "a dummy leg names destinations"
            return None
        if part == Part.STATE:
            if event.pages or event.aux_index != -1:
                return "a state-only leg names pages or an aux row"
            return None
        return f"unknown leg part {part}"

    def _check_init(self, event: Initialized) -> str | None:
        if self._num_pages >= 0:
            return "init called twice"
        if event.num_pages < 0:
            return f"init with {event.num_pages} pages"
        if event.num_pages > self._dst_pages:
            return f"init for {event.num_pages} pages but the receiver reserved {self._dst_pages}"
        return None

    def _check_chunk(self, event: ChunkSubmitted) -> str | None:
        if self._num_pages < 0:
            return "send before init"
        try:
            n = page_count(event.pages)
        except ValueError as exc:
            return str(exc)
        if self._last_submitted:
            return "chunk after the last chunk"
        if self._submitted_pages + n > self._num_pages:
            return (
                f"chunk of {n} pages overruns init: {self._submitted_pages} of "
                f"{self._num_pages} pages already sent"
            )
        if event.state:
            if self._submitted_pages + n != self._num_pages:
                return "state rows sent with a chunk that is not the last"
            if len(event.state) != len(self._dst_state):
                return (
                    f"{len(event.state) // _PAGE_BYTES} state rows sent but the receiver "
                    f"reserved {len(self._dst_state) // _PAGE_BYTES}"
                )
        return None

    def _check_chunk_done(self, event: ChunkDone) -> str | None:
        if event.chunk >= self._next_chunk:
            return f"completion for chunk {event.chunk} that was never posted"
        return None

    # -- per-event actions after the transition: return the commands -------------------------

    def _on_destination(self, event: DestinationReceived) -> tuple[Command, ...]:
        self._dst = event.pages
        self._dst_pages = len(event.pages) // _PAGE_BYTES
        self._dst_aux = event.aux_index
        self.peer_agent = event.peer
        self._dst_state = event.state
        self._dst_rings = event.rings
        self._dst_known = True
        self.fence = event.fence
        self._prefix = event.prefix
        self.part = event.part
        self.legs = event.legs
        return _NO_COMMANDS

    def _on_sender_init(self, event: Initialized) -> tuple[Command, ...]:
        self._num_pages = event.num_pages
        self._src_aux = event.aux_index
        return _NO_COMMANDS

    def _on_chunk(self, event: ChunkSubmitted) -> tuple[Command, ...]:
        return (self._post(event.pages, event.state, event.rings),)

    def _on_sender_completed(self, event: TransferCompleted) -> tuple[Command, ...]:
        return (ReportOutcome(_SUCCESS),)

    def _on_receiver_init(self, event: Initialized) -> tuple[Command, ...]:
        self.peer_rank = event.peer_rank
        return (ResolvePeer(event.peer_rank),)

    def _on_resolved(self, event: PeerResolved) -> tuple[Command, ...]:
        self.peer_rank = event.peer_rank
        return _NO_COMMANDS

    def _on_metadata(self, event: MetadataSubmitted) -> tuple[Command, ...]:
        self._exposed = True
        self._prefix = event.prefix
        return (
            SendMetadata(
                event.pages,
                event.aux_index,
                event.state,
                event.part,
                prefix=event.prefix,
                rings=event.rings,
            ),
        )

    def _post(self, src: bytes, src_state: bytes, src_rings: bytes = b"") -> PostChunk:
        start = self._submitted_pages * _PAGE_BYTES
        self._submitted_pages += len(src) // _PAGE_BYTES
        chunk = self._next_chunk
        self._next_chunk += 1
        self._in_flight.add(chunk)
        last = self._submitted_pages == self._num_pages
        self._last_submitted = last
        return PostChunk(
            chunk=chunk,
            src=src,
            dst=self._dst[start : start + len(src)],
            is_last=last,
            src_aux=self._src_aux if last else -1,
            dst_aux=self._dst_aux if last else -1,
            peer=self.peer_agent,
            src_state=src_state if last else b"",
            dst_state=self._dst_state if last else b"",
            fence=self.fence,
            src_rings=src_rings if last else b"",
            dst_rings=self._dst_rings if last else b"",
        )


# What each event does to a room beyond its state, per role: h2's "side effects as data". An event
# type absent here has no payload to check or nothing to do after its transition.
_Check: TypeAlias = Callable[[RoomCore, Any], "str | None"]
_Action: TypeAlias = Callable[[RoomCore, Any], tuple[Command, ...]]

_CHECKS: Final[Mapping[Role, Mapping[type[Event], _Check]]] = {
    Role.SENDER: {
        DestinationReceived: RoomCore._check_pages,
        Initialized: RoomCore._check_init,
        ChunkSubmitted: RoomCore._check_chunk,
        ChunkDone: RoomCore._check_chunk_done,
    },
    Role.RECEIVER: {
        MetadataSubmitted: RoomCore._check_pages,
    },
}

_ACTIONS: Final[Mapping[Role, Mapping[type[Event], _Action]]] = {
    Role.SENDER: {
        DestinationReceived: RoomCore._on_destination,
        Initialized: RoomCore._on_sender_init,
        ChunkSubmitted: RoomCore._on_chunk,
        TransferCompleted: RoomCore._on_sender_completed,
    },
    Role.RECEIVER: {
        Initialized: RoomCore._on_receiver_init,
        PeerResolved: RoomCore._on_resolved,
        MetadataSubmitted: RoomCore._on_metadata,
    },
}
