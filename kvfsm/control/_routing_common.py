"""What both routing cores share: the actions they answer with, their configuration, their
counters. The rules are in :mod:`kvfsm.control._routing`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from kvfsm.control._frames import Frame
from kvfsm.rooms import RoomKey
from kvfsm.states import Event, KVPoll

__all__ = [
    "FAILED",
    "SUCCESS",
    "Action",
    "Deliver",
    "GrantLease",
    "RevokeLease",
    "RoutingConfig",
    "Send",
    "Slot",
    "expire",
    "join_stats",
    "new_stats",
]

#: A sender's identity for claims: (room id, leg). The leg is the link's: which of the decode
#: ranks a prefill rank writes each room into that link's peer is (0 but for unequal TP).
Slot: TypeAlias = tuple[int, int]

SUCCESS: Final = int(KVPoll.Success)
FAILED: Final = int(KVPoll.Failed)


@dataclass(frozen=True, slots=True)
class Send:
    """Queue ``frame`` on link ``link`` (dropped if the link is closed)."""

    link: int
    frame: Frame


@dataclass(frozen=True, slots=True)
class Deliver:
    """Post ``event`` to room ``key``."""

    key: RoomKey
    event: Event


@dataclass(frozen=True, slots=True)
class GrantLease:
    """Prefill: writes under fence ``fence`` may be posted until ``until`` (monotonic); the
    page owner settles a lost link's pages ``margin_s`` after that (None: unknown)."""

    fence: int
    until: float
    margin_s: float | None = None


@dataclass(frozen=True, slots=True)
class RevokeLease:
    """Prefill: no write under fence ``fence`` may be posted any more."""

    fence: int


Action: TypeAlias = Send | Deliver | GrantLease | RevokeLease


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The routing cores' settings (``ChannelConfig.routing()`` derives them). Every table a
    peer's frames can fill is bounded *per link*, so one link's traffic never pushes out
    another's entries, and the number of links is bounded by the control plane (``max_links``,
    ``max_links_per_host``): the totals are those products, not a pool anyone can drain."""

    #: Per link, kept for ``pending_ttl_s``: claims and page lists held for rooms that do not
    #: exist yet (over it: refused), early-abort marks (over it: not remembered), marks of
    #: decode rooms already answered (over it: the link's own oldest go). Tombstones (set by
    #: this rank's own rooms, not by peers) are kept at most this many in all.
    pending_max: int = 4096
    pending_ttl_s: float = 60.0
    #: Prefill, per link: bytes of page lists (``RoomMetadata.pages`` + ``state``) held for
    #: rooms that do not exist yet. A decode holds at most its pool's pages there (4 bytes a
    #: page id): 8 MiB is 2M page ids. Over it the room is refused with that reason.
    held_bytes_max: int = 8 << 20
    #: Prefill: the control plane's link bounds (``ChannelConfig``). Here they size where the
    #: early-abort marks of *lost* links are kept until they expire: at most ``pending_max``
    #: times as many per peer host and in all (over the host's share, that host's oldest go;
    #: over the total, a newly lost link's marks that do not fit are not kept).
    max_links: int = 128
    max_links_per_host: int = 32
    #: Prefill: a sender room no decode room has claimed for this long fails with its own
    #: reason (its decode half never arrived: a router that failed to reach decode), instead of
    #: holding its pages until its Bootstrapping deadline. A live decode claims a room as soon
    #: as its receiver exists, so this only has to cover a loaded decode's request queue.
    unclaimed_s: float = 60.0
    #: Decode grants prefill write leases of this length.
    lease_s: float = 2.0
    #: Decode: added to the lease before a lost link's pages settle (a write posted just inside
    #: its lease; see docs/reliability.md for what is left unfenced).
    fence_margin_s: float = 1.0

    @property
    def renew_s(self) -> float:
        """How often prefill asks for a lease (four requests per lease)."""
        return self.lease_s / 4


def new_stats() -> dict[str, int]:
    """The routing counters, all zero (their names are the control plane's ``stats`` keys)."""
    return {
        "stale_frames": 0,
        "duplicates_refused": 0,
        "unclaimed_failed": 0,
        "claim_wait_max_ms": 0,
        "pending_dropped": 0,
        "claims": 0,
        "reconciled": 0,
        "leases_granted": 0,
        "leases_fenced": 0,
        "errors_for_rooms": 0,
        "early_aborts_over_quota": 0,
        "early_aborts_dropped": 0,
        "held_over_quota": 0,
        "finished_over_quota": 0,
        "reconcile_refs_over_quota": 0,
        "aborts_told_late": 0,
        "settles_held_unsteady": 0,
    }


def expire(marks: dict[Any, Any], before: float, when: Callable[[Any], float]) -> None:
    """Drop the marks set before ``before``, oldest first, until the first one that is not."""
    while marks:
        oldest = next(iter(marks))
        if when(marks[oldest]) >= before:
            return
        del marks[oldest]


def join_stats(stats: dict[str, int]) -> dict[str, int]:
    """``stats`` (the control plane's dict), with every routing counter it lacks added at 0."""
    for name, value in new_stats().items():
        stats.setdefault(name, value)
    return stats
