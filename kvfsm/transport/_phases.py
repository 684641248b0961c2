"""The phases of a chunk record in the ledger, and the table of the edges between them.

Rule 1: a record changes phase only along an edge of ``PHASES`` below, looked up by ``step``.
        ``ChunkLedger`` assigns a record's phase in one place, with what ``step`` answers; an
        edge missing from the table raises ``PhaseError`` there. The table is the truth about
        the ledger's phases, not a picture of it: a test drives the real ledger through every
        edge and checks that every other (phase, event) pair is refused.
Rule 2: phases only move forward (``NEW`` < ``QUEUED`` < ``ACTIVE`` < ``HELD`` < ``FINAL``),
        and ``FINAL`` maps to an empty row: a final record has no way out.
Rule 3: this file is data plus one lookup. What makes the ledger fire each event (which handle
        state, which lease, which flush) is the ledger's; see its module rules.

::

    NEW --ACCEPTED--> QUEUED --POSTED--> ACTIVE --DONE | FAILED | ABANDONED--> FINAL
     |                  |                   |
     +--REFUSED--> FINAL |                  +--STALLED | FENCED | RAISED | PEER_LOST--> HELD
                        +--DONE | FAILED--> FINAL                                        |
                        +--FENCED | RAISED | PEER_LOST--> HELD        SETTLED | ABANDONED --> FINAL

    QUEUED, ACTIVE, HELD --DRAINED--> FINAL (shutdown)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, TypeAlias

__all__ = ["PHASES", "Phase", "PhaseError", "PhaseEvent", "PhaseTable", "step"]


class Phase(enum.IntEnum):
    """Where a record is. Integers, in the order a record moves through them; the pump
    compares a record's phase once per record per round."""

    NEW = 0  # made, not accepted yet
    QUEUED = 1  # accepted, in the poster's hands
    ACTIVE = 2  # posted, in progress: the pump's
    HELD = 3  # released, quarantined: waits for its quarantine and a flush (or its peer's loss)
    FINAL = 4  # final event decided; forgotten by the ledger


class PhaseEvent(enum.Enum):
    """What happened to a record, as far as its phase is concerned."""

    #: The transport validated it and its lease (if any) is valid: it goes to the poster.
    ACCEPTED = "accepted"
    #: Refused at acceptance: unfenced on a fenced transport, or its lease is gone.
    REFUSED = "refused"
    #: The poster posted every part and at least one is still in progress.
    POSTED = "posted"
    #: Every handle reported DONE (at post or when polled).
    DONE = "done"
    #: It ends failed with nothing that can still move a byte: a handle ERR and none in
    #: progress, nothing posted (dropped, rejected, stopped by its lease before its first
    #: part), or NIXL raised before anything was in flight.
    FAILED = "failed"
    #: In progress past its deadline: released and held.
    STALLED = "stalled"
    #: Its lease is gone with a part in flight (the poster's check or the pump's): held.
    FENCED = "fenced"
    #: NIXL raised on it with a part in flight (or its peer lost): held.
    RAISED = "raised"
    #: Its peer generation is lost with a part in flight: held.
    PEER_LOST = "peer lost"
    #: Held, its quarantine is over, and a flush proved its WRITE over (or its peer is lost).
    SETTLED = "settled"
    #: The agent is fenced out: every posted record fails at once, its handles untouched.
    ABANDONED = "abandoned"
    #: Shutdown: forgotten, no final event (the rooms are gone).
    DRAINED = "drained"

    # Events key the table's rows; members are singletons, so identity hashing is correct
    # and C-fast (Enum's default hashes the member's name in Python).
    __hash__ = object.__hash__


PhaseTable: TypeAlias = Mapping[Phase, Mapping[PhaseEvent, Phase]]

# ------------------------------------------------------------------------------------------------
# The table: ``phase -> {event -> next phase}``, literal data. A missing key is a missing edge.
# FINAL maps to an empty row on purpose; do not "complete" it.
# ------------------------------------------------------------------------------------------------

PHASES: Final[PhaseTable] = MappingProxyType(
    {
        Phase.NEW: MappingProxyType(
            {
                PhaseEvent.ACCEPTED: Phase.QUEUED,
                PhaseEvent.REFUSED: Phase.FINAL,
            }
        ),
        Phase.QUEUED: MappingProxyType(
            {
                PhaseEvent.POSTED: Phase.ACTIVE,
                PhaseEvent.DONE: Phase.FINAL,
                PhaseEvent.FAILED: Phase.FINAL,
                PhaseEvent.FENCED: Phase.HELD,
                PhaseEvent.RAISED: Phase.HELD,
                PhaseEvent.PEER_LOST: Phase.HELD,
                PhaseEvent.DRAINED: Phase.FINAL,
            }
        ),
        Phase.ACTIVE: MappingProxyType(
            {
                PhaseEvent.DONE: Phase.FINAL,
                PhaseEvent.FAILED: Phase.FINAL,
                PhaseEvent.STALLED: Phase.HELD,
                PhaseEvent.FENCED: Phase.HELD,
                PhaseEvent.RAISED: Phase.HELD,
                PhaseEvent.PEER_LOST: Phase.HELD,
                PhaseEvent.ABANDONED: Phase.FINAL,
                PhaseEvent.DRAINED: Phase.FINAL,
            }
        ),
        Phase.HELD: MappingProxyType(
            {
                PhaseEvent.SETTLED: Phase.FINAL,
                PhaseEvent.ABANDONED: Phase.FINAL,
                PhaseEvent.DRAINED: Phase.FINAL,
            }
        ),
        Phase.FINAL: MappingProxyType({}),
    }
)


class PhaseError(RuntimeError):
    """A phase change the table has no edge for: a bug in the ledger, never a peer's doing."""


def step(phase: Phase, event: PhaseEvent) -> Phase:
    """The phase a record in ``phase`` moves to on ``event``; ``PhaseError`` if none."""
    to = PHASES[phase].get(event)
    if to is None:
        raise PhaseError(f"a chunk record in phase {phase.name} has no edge for {event.name}")
    return to
