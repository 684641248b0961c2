"""Counters an engine keeps about its rooms. Written only on the loop thread."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["RoomStats"]


@dataclass(slots=True)
class RoomStats:
    """What happened to rooms and events since the engine started.

    Readers on other threads get a consistent-enough view (each field is one int); use
    :meth:`snapshot` for a copy.
    """

    spawned: int = 0
    reaped: int = 0
    succeeded: int = 0
    failed: int = 0
    #: Events that reached a terminal room and were dropped by the table (late or duplicate).
    late_events: int = 0
    #: Events addressed to an unknown room or to an older generation of a room id.
    stale_events: int = 0
    #: Events that were illegal in a non-terminal room's state; the room failed closed.
    rejected_events: int = 0
    #: Spawns refused because a live room with the same id and role existed.
    duplicates_refused: int = 0
    #: Events refused because a room's mailbox was full; the room failed.
    mailbox_overflows: int = 0
    deadline_expiries: int = 0
    #: Terminal rooms whose handles did not settle within the settle timeout.
    settle_timeouts: int = 0
    #: Receivers refused because another room holds some of their pages, aux row or state
    #: rows, or because their own list names a page twice.
    destinations_refused: int = 0
    #: Receivers reaped unsettled: their destinations stay held for the engine's life.
    destinations_quarantined: int = 0
    #: Room tasks that raised (a bug): the room failed and was reaped without settling.
    task_errors: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
