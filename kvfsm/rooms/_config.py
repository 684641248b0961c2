"""Room runtime settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from kvfsm.states import NON_TERMINAL, KVPoll, Role

__all__ = ["DEFAULT_MAX_PAGES", "RoomConfig"]

#: Pages (plus state rows) one room may name. A receiver's page list travels in one control
#: frame, and the control channel's default frame limit, 16 MiB, holds about 4.19 M packed int32
#: indices; 4 M leaves room for the frame's header and some state rows. (The number is repeated
#: here rather than imported: the rooms layer does not depend on kvfsm.control.) A channel
#: configured with a smaller frame limit wants a smaller ``max_pages`` too.
DEFAULT_MAX_PAGES: Final = 4_000_000


def _no_overrides() -> Mapping[Role, Mapping[KVPoll, float]]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RoomConfig:
    """How rooms behave. Defaults are production values; tests shrink the times.

    ``deadlines`` overrides :data:`kvfsm.states.DEFAULT_DEADLINES` per role and state (seconds).
    """

    deadlines: Mapping[Role, Mapping[KVPoll, float]] = field(default_factory=_no_overrides)
    #: Events a room may have queued before it fails with "mailbox overflow". Settlement events
    #: (chunk completions, peer acknowledgements) are never refused.
    mailbox_size: int = 1024
    #: How long a terminal room waits for its handles to settle before it gives up, logs an
    #: error and leaves its pages marked unsettled (they must not be reused; a receiver's
    #: destinations stay held by the engine, so a room that names them again is refused).
    settle_timeout_s: float = 60.0
    #: Raise on illegal events instead of failing the room (for tests).
    strict: bool = False
    #: How long engine shutdown waits for rooms to settle before cancelling them.
    shutdown_timeout_s: float = 5.0
    #: The most pages (plus state rows) one ``send_metadata``, ``send`` or ``init`` may name;
    #: more fails the room at the call (see :data:`DEFAULT_MAX_PAGES`).
    max_pages: int = DEFAULT_MAX_PAGES
    #: Keep each room's flight recorder (a bounded timeline, ``kvfsm.rooms._timeline``), log
    #: a JSON line with it when a room fails, and remember finished rooms. False only to
    #: measure what it costs (``benchmarks/room_lifecycle.py``).
    flight_recorder: bool = True

    def __post_init__(self) -> None:
        if self.mailbox_size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {self.mailbox_size}")
        if self.max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {self.max_pages}")
        if not self.settle_timeout_s > 0:
            raise ValueError(f"settle_timeout_s must be > 0, got {self.settle_timeout_s}")
        for role, states in self.deadlines.items():
            for state, seconds in states.items():
                if state not in NON_TERMINAL:
                    raise ValueError(f"{state.name} is terminal and has no deadline")
                if not seconds > 0:
                    raise ValueError(f"deadline of {role.value} {state.name} must be > 0")
