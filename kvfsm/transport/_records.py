"""The chunk ledger's nouns: a record (one accepted chunk, or several posted together) and the
actions the ledger answers with. The rules that create, move and end records are the ledger's
(:mod:`kvfsm.transport._ledger`); a record's phase is the table's
(:mod:`kvfsm.transport._phases`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeAlias, cast

from kvfsm.rooms import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, Event
from kvfsm.transport._phases import Phase

__all__ = [
    "Action",
    "CancelFlush",
    "Deliver",
    "Finish",
    "Member",
    "Post",
    "PostFlush",
    "Record",
    "Release",
    "StartQuarantine",
]

#: One chunk a record carries: its room, its number in that room, its bytes (rule 8).
Member: TypeAlias = tuple[RoomKey, int, int]


class Record:
    """One chunk from acceptance until its final event. ``handles`` and ``states`` (one per
    posted part) are written by the poster thread before it hands the record back; the rest
    by the loop. The transport subclasses it with what the poster needs to post."""

    __slots__ = (
        "_asked",
        "chunk",
        "dropped",
        "due",
        "fence",
        "flush",
        "handles",
        "key",
        "members",
        "nbytes",
        "opened",
        "peer",
        "phase",
        "quarantined",
        "reason",
        "states",
        "t0",
    )

    def __init__(self, key: RoomKey, chunk: int, peer: Hashable, nbytes: int, fence: int = 0):
        self.key = key
        self.chunk = chunk
        #: The peer generation it writes to (identity matters, not equality).
        self.peer: Any = peer
        self.nbytes = nbytes
        self.fence = fence
        #: Counted open by the stale-progress gate (``Leases.opened``): the poster sets it
        #: before the first ``transfer()`` and closes it if every part is over inside the
        #: call; otherwise the pump closes it at the final event.
        self.opened = False
        self.phase = Phase.NEW  # changed only by the ledger's ``_move``
        self.t0 = 0.0
        self.due = 0.0
        self.handles: list[Any] = []
        self.states: list[str] = []
        self.dropped = False
        self.reason = ""  # why it is held
        #: Held: the flush it waits for (the seq of the first one posted after it was held);
        #: 0 once a flush proved it over, or when it needs none (rule 2).
        self.flush = 0
        self.quarantined = False  # held: its quarantine is over (it may still wait for a flush)
        #: Rule 8: every chunk this record carries, as (room, chunk, bytes); the first is
        #: ``key``/``chunk``. One entry for a record of one chunk.
        self.members: tuple[Member, ...] = ((key, chunk, nbytes),)
        self._asked: set[RoomKey] | None = None  # rooms that asked to release (rule 8)

    def __repr__(self) -> str:
        more = f" (+{len(self.members) - 1} chunks)" if len(self.members) > 1 else ""
        return f"<Record room {self.key.room} chunk {self.chunk}{more} phase {self.phase.name}>"


# -- actions ------------------------------------------------------------------------------------


class Post:
    """Hand ``record`` to the poster thread."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record


class Release:
    """Release every handle ``record`` holds now (it may still move bytes; it is held)."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record


class Deliver:
    """Deliver ``event`` to the room ``key``."""

    __slots__ = ("event", "key")

    def __init__(self, key: RoomKey, event: Event) -> None:
        self.key = key
        self.event = event


class StartQuarantine:
    """Call ``ChunkLedger.quarantine_over(record)`` at ``until`` (the caller's clock); keep the
    agent progressed meanwhile, so a released WRITE's queued bytes land early in it."""

    __slots__ = ("record", "until")

    def __init__(self, record: Record, until: float) -> None:
        self.record = record
        self.until = until


class PostFlush:
    """Post flush number ``seq`` of ``peer`` (rule 2) and tell the ledger how it ended
    (``flushed`` or ``flush_failed``); not before ``not_before`` (the caller's clock: a retry
    after a refusal)."""

    __slots__ = ("not_before", "peer", "seq")

    def __init__(self, peer: Any, seq: int, not_before: float = 0.0) -> None:
        self.peer = peer
        self.seq = seq
        self.not_before = not_before


class CancelFlush:
    """Release ``peer``'s flush in flight, unanswered: its generation is lost (rule 6)."""

    __slots__ = ("peer",)

    def __init__(self, peer: Any) -> None:
        self.peer = peer


class Finish:
    """Release whatever handles ``record`` still holds, then deliver the final event of each of
    its chunks: ``event`` (for its first chunk) made for each (``events``)."""

    __slots__ = ("event", "record")

    def __init__(self, record: Record, event: ChunkDone | ChunkFailed) -> None:
        self.record = record
        self.event = event

    def events(self) -> list[tuple[RoomKey, ChunkDone | ChunkFailed]]:
        """(room, final event) for every chunk of the record, in the record's order."""
        event, members = self.event, self.record.members
        if len(members) == 1:
            return [(members[0][0], event)]
        if type(event) is ChunkDone:
            return [(key, ChunkDone(chunk)) for key, chunk, _ in members]
        reason = cast("ChunkFailed", event).reason
        return [(key, ChunkFailed(chunk, reason)) for key, chunk, _ in members]


Action: TypeAlias = Post | Release | Deliver | StartQuarantine | PostFlush | CancelFlush | Finish
