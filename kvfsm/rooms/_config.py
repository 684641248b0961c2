"""Room runtime settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvfsm.states import NON_TERMINAL, KVPoll, Role

__all__ = ["RoomConfig"]


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
    #: error and leaves its pages marked unsettled (they must not be reused).
    settle_timeout_s: float = 60.0
    #: Raise on illegal events instead of failing the room (for tests).
    strict: bool = False
    #: How long engine shutdown waits for rooms to settle before cancelling them.
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mailbox_size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {self.mailbox_size}")
        if not self.settle_timeout_s > 0:
            raise ValueError(f"settle_timeout_s must be > 0, got {self.settle_timeout_s}")
        for role, states in self.deadlines.items():
            for state, seconds in states.items():
                if state not in NON_TERMINAL:
                    raise ValueError(f"{state.name} is terminal and has no deadline")
                if not seconds > 0:
                    raise ValueError(f"deadline of {role.value} {state.name} must be > 0")
