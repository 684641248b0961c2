"""The lifecycle of a room's binding to a control link, on each side: states, events, tables.

Rule 1: a binding changes state only along an edge of ``PREFILL_BINDINGS`` (prefill's record of
        a decode room it serves) or ``DECODE_BINDINGS`` (decode's record of a room it claimed),
        looked up by ``prefill_step`` / ``decode_step``. Each routing core changes a binding's
        state in one place, its ``_move``, with what the step answers; an edge missing from
        the table raises ``BindingError`` there. Which of the core's indexes (its dicts and
        counters) hold a binding follows from its state alone, and ``_move`` keeps them so.
Rule 2: ``GONE`` maps to an empty row: a binding that is gone has no way out. A room that binds
        again (a new generation, a reused id) gets a new binding.
Rule 3: this file is data plus two lookups. When each event fires (which frame, which command,
        which deadline) is the routing cores' (:mod:`kvfsm.control._routing` states the rules).

Prefill: a decode room ``(link, room, generation)`` and the sender room serving it::

    NEW --HOLD--> HELD --BIND--> CLAIMED --PAGES--> EXPOSED --ABORT--> ABORTED
     |                             ^                   |                  |
     +--BIND (a live sender)-------+               LINK_LOST          LINK_LOST
                                                       v                  v
                                                   ORPHANED        ORPHANED_ABORTED
                                   (RECONCILED: back to EXPOSED / ABORTED, on the new link)

    HELD --ABORT | LINK_LOST | EXPIRED--> GONE, and CLAIMED --ABORT | FAILED | SUCCEEDED |
    SETTLED | LINK_LOST | REAPED--> GONE: nothing was written, nothing is left to settle.
    EXPOSED, ABORTED and the orphans go only by SUCCEEDED, SETTLED or REAPED; FAILED leaves
    them as they are, their writes still to settle.

Decode: a receiver room and the link its claim went out on::

    NEW --BIND--> CLAIMED --PAGES--> EXPOSED --LINK_LOST--> LOST --RECONCILED--> RECONCILING
                                                              ^                      |
                                                              +------LINK_LOST-------+

    CLAIMED --FAILED | SUCCEEDED | SETTLED | LINK_LOST | REAPED--> GONE
    EXPOSED --SUCCEEDED | SETTLED | REAPED--> GONE (FAILED: its abort went out, it waits for
    RoomSettled). LOST, RECONCILING --SETTLED | EXPIRED | REAPED--> GONE: a lost room's pages
    settle by ``RoomSettled`` or at its bound; an outcome (SUCCEEDED) leaves it waiting.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, TypeAlias

__all__ = [
    "DECODE_BINDINGS",
    "PREFILL_BINDINGS",
    "BindingError",
    "BindingEvent",
    "DecodeBinding",
    "DecodeTable",
    "PrefillBinding",
    "PrefillTable",
    "decode_step",
    "prefill_step",
]


class PrefillBinding(enum.Enum):
    """Where prefill's binding of a decode room ``(link, room, generation)`` is."""

    NEW = "new"  # made for a claim, not placed yet
    HELD = "held"  # a claim (maybe with its page list) waiting for a sender of its id
    CLAIMED = "claimed"  # bound to a sender, no page list yet: nothing can be written
    EXPOSED = "exposed"  # the sender has decode's pages (DestinationReceived): writes may happen
    ABORTED = "aborted"  # exposed, and decode aborted it: a newer claim of the id may be held
    ORPHANED = "orphaned"  # exposed, its link lost: waits for Reconcile or its settle
    ORPHANED_ABORTED = "orphaned, aborted"  # aborted, its link lost
    GONE = "gone"  # unbound: forgotten

    # States key the table's rows; members are singletons, so identity hashing is correct
    # and C-fast (Enum's default hashes the member's name in Python).
    __hash__ = object.__hash__


class DecodeBinding(enum.Enum):
    """Where decode's binding of a receiver room to a prefill link is."""

    NEW = "new"  # made, not claimed yet
    CLAIMED = "claimed"  # RoomClaim sent on its link, no page list yet
    EXPOSED = "exposed"  # its page list went out: writes may come
    LOST = "lost"  # exposed, its link lost: waits for its settle bound
    RECONCILING = "reconciling"  # lost, and named in a Reconcile on a new link to the same peer
    GONE = "gone"  # forgotten

    __hash__ = object.__hash__


class BindingEvent(enum.Enum):
    """What happened to a binding. Named for both sides; each table uses the ones it needs."""

    #: Prefill: a claim for an id no live, unbound sender has is held for the next one.
    HOLD = "hold"
    #: Prefill: a sender takes the claim. Decode: the room's prefill rank is connected and
    #: its ``RoomClaim`` goes out.
    BIND = "bind"
    #: The page list: prefill delivers ``DestinationReceived``; decode sends ``RoomMetadata``.
    PAGES = "pages"
    #: Prefill: decode's ``RoomAbort`` for it.
    ABORT = "abort"
    #: The room on this side failed (prefill: the sender's outcome; decode: the receiver's).
    FAILED = "failed"
    #: The transfer succeeded (prefill: the sender's outcome; decode: prefill's RoomOutcome).
    SUCCEEDED = "succeeded"
    #: Writes are over: prefill's sender reported ``ReportSettled``; decode got ``RoomSettled``.
    SETTLED = "settled"
    #: Its control link is lost.
    LINK_LOST = "link lost"
    #: Re-attached to a new link to the same peer incarnation (prefill: at decode's
    #: ``Reconcile``; decode: when the link opens, naming it in that ``Reconcile``).
    RECONCILED = "reconciled"
    #: Its time is up: a held claim's TTL (prefill), a lost room's settle bound (decode).
    EXPIRED = "expired"
    #: The room is reaped.
    REAPED = "reaped"

    __hash__ = object.__hash__


PrefillTable: TypeAlias = Mapping[PrefillBinding, Mapping[BindingEvent, PrefillBinding]]
DecodeTable: TypeAlias = Mapping[DecodeBinding, Mapping[BindingEvent, DecodeBinding]]

_E: Final = BindingEvent
_P: Final = PrefillBinding
_D: Final = DecodeBinding

# ------------------------------------------------------------------------------------------------
# The tables: ``state -> {event -> next state}``, literal data. A missing key is a missing edge;
# an edge to the same state is one the core takes on purpose (the binding stays). GONE maps to an
# empty row on purpose; do not "complete" it.
# ------------------------------------------------------------------------------------------------

PREFILL_BINDINGS: Final[PrefillTable] = MappingProxyType(
    {
        _P.NEW: MappingProxyType(
            {
                _E.HOLD: _P.HELD,
                _E.BIND: _P.CLAIMED,
            }
        ),
        _P.HELD: MappingProxyType(
            {
                _E.BIND: _P.CLAIMED,
                _E.ABORT: _P.GONE,
                _E.LINK_LOST: _P.GONE,
                _E.EXPIRED: _P.GONE,
            }
        ),
        _P.CLAIMED: MappingProxyType(
            {
                _E.PAGES: _P.EXPOSED,
                _E.ABORT: _P.GONE,
                _E.FAILED: _P.GONE,
                _E.SUCCEEDED: _P.GONE,
                _E.SETTLED: _P.GONE,
                _E.LINK_LOST: _P.GONE,
                _E.REAPED: _P.GONE,
            }
        ),
        _P.EXPOSED: MappingProxyType(
            {
                _E.ABORT: _P.ABORTED,
                _E.FAILED: _P.EXPOSED,  # its writes may still land: it waits for SETTLED
                _E.SUCCEEDED: _P.GONE,
                _E.SETTLED: _P.GONE,
                _E.LINK_LOST: _P.ORPHANED,
                _E.REAPED: _P.GONE,
            }
        ),
        _P.ABORTED: MappingProxyType(
            {
                _E.ABORT: _P.ABORTED,  # told again: the sender is told again
                _E.FAILED: _P.ABORTED,
                _E.SUCCEEDED: _P.GONE,
                _E.SETTLED: _P.GONE,
                _E.LINK_LOST: _P.ORPHANED_ABORTED,
                _E.REAPED: _P.GONE,
            }
        ),
        _P.ORPHANED: MappingProxyType(
            {
                _E.FAILED: _P.ORPHANED,
                _E.SUCCEEDED: _P.GONE,
                _E.SETTLED: _P.GONE,
                _E.RECONCILED: _P.EXPOSED,
                _E.REAPED: _P.GONE,
            }
        ),
        _P.ORPHANED_ABORTED: MappingProxyType(
            {
                _E.FAILED: _P.ORPHANED_ABORTED,
                _E.SUCCEEDED: _P.GONE,
                _E.SETTLED: _P.GONE,
                _E.RECONCILED: _P.ABORTED,
                _E.REAPED: _P.GONE,
            }
        ),
        _P.GONE: MappingProxyType({}),
    }
)

DECODE_BINDINGS: Final[DecodeTable] = MappingProxyType(
    {
        _D.NEW: MappingProxyType(
            {
                _E.BIND: _D.CLAIMED,
            }
        ),
        _D.CLAIMED: MappingProxyType(
            {
                _E.PAGES: _D.EXPOSED,
                _E.FAILED: _D.GONE,  # its abort goes out; nothing to acknowledge
                _E.SUCCEEDED: _D.GONE,
                _E.SETTLED: _D.GONE,
                _E.LINK_LOST: _D.GONE,  # its abort is owed to the next link to the peer
                _E.REAPED: _D.GONE,
            }
        ),
        _D.EXPOSED: MappingProxyType(
            {
                _E.PAGES: _D.EXPOSED,  # the page list again: sent again
                _E.FAILED: _D.EXPOSED,  # its abort goes out; it waits for RoomSettled
                _E.SUCCEEDED: _D.GONE,
                _E.SETTLED: _D.GONE,
                _E.LINK_LOST: _D.LOST,
                _E.REAPED: _D.GONE,
            }
        ),
        _D.LOST: MappingProxyType(
            {
                _E.RECONCILED: _D.RECONCILING,
                _E.SUCCEEDED: _D.LOST,
                _E.SETTLED: _D.GONE,
                _E.EXPIRED: _D.GONE,
                _E.REAPED: _D.GONE,
            }
        ),
        _D.RECONCILING: MappingProxyType(
            {
                _E.RECONCILED: _D.RECONCILING,  # yet another link to the peer: asked there
                _E.SUCCEEDED: _D.RECONCILING,
                _E.SETTLED: _D.GONE,
                _E.EXPIRED: _D.GONE,
                _E.LINK_LOST: _D.LOST,
                _E.REAPED: _D.GONE,
            }
        ),
        _D.GONE: MappingProxyType({}),
    }
)


class BindingError(RuntimeError):
    """A binding change the table has no edge for: a bug in the routing core."""


def prefill_step(state: PrefillBinding, event: BindingEvent) -> PrefillBinding:
    """The state a prefill binding in ``state`` moves to on ``event``; ``BindingError`` if
    the table has no such edge."""
    to = PREFILL_BINDINGS[state].get(event)
    if to is None:
        raise BindingError(f"a prefill binding {state.name} has no edge for {event.name}")
    return to


def decode_step(state: DecodeBinding, event: BindingEvent) -> DecodeBinding:
    """The state a decode binding in ``state`` moves to on ``event``; ``BindingError`` if
    the table has no such edge."""
    to = DECODE_BINDINGS[state].get(event)
    if to is None:
        raise BindingError(f"a decode binding {state.name} has no edge for {event.name}")
    return to
