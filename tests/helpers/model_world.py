"""The model's world: who is who (sides, callers, chunk fates), its configuration, and its
virtual clock, which runs the two processes' callbacks and freezes either of them
(:mod:`tests.helpers.model_pair` says what the world is)."""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, TypeAlias

from kvfsm.control._routing import (
    RoutingConfig,
)
from kvfsm.states import (
    NON_TERMINAL,
    KVPoll,
    Role,
    deadline_of,
)

_INF: Final = math.inf
DECODE_RANK: Final = 0
PREFILL_RANK: Final = 0
Cause: TypeAlias = tuple[int, int | None]  # (room, generation) named by the frame being handled


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    __hash__ = object.__hash__

    @property
    def other(self) -> Side:
        return Side.DECODE if self is Side.PREFILL else Side.PREFILL

    @property
    def role(self) -> Role:
        return Role.SENDER if self is Side.PREFILL else Role.RECEIVER


class Who(enum.Enum):
    """Which sides get a room for a request (SGLang routes each request to both)."""

    BOTH = "both"
    DECODE_ONLY = "decode_only"
    PREFILL_ONLY = "prefill_only"


class ChunkFate(enum.Enum):
    """What NIXL does with one chunk (DONE_AT_POST first: hypothesis shrinks towards it)."""

    DONE_AT_POST = "done_at_post"  # the copy finishes inside transfer()
    DONE_LATER = "done_later"  # in progress; lands at the first progress after the delay
    ERR_AT_POST = "err_at_post"  # transfer() raises on the first part: nothing posted
    ERR_LATER_PART = "err_later_part"  # the first part is in flight, the next raises
    ERR_LATER = "err_later"  # in progress; after the delay half its pages land, then ERR
    STALL = "stall"  # in progress for ever; released: nothing more lands
    STALL_FLUSH = "stall_flush"  # in progress for ever; released: everything lands then
    STALL_LATE = "stall_late"  # in progress for ever; released: lands late_land_s later


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    pages: int  # how many of the request's pages this chunk sends
    fate: ChunkFate = ChunkFate.DONE_AT_POST
    delay: float = 0.3


def _default_deadlines() -> Mapping[Role, Mapping[KVPoll, float]]:
    return MappingProxyType(
        {
            Role.SENDER: MappingProxyType(
                {
                    KVPoll.Bootstrapping: 20.0,
                    KVPoll.WaitingForInput: 12.0,
                    KVPoll.Transferring: 12.0,
                }
            ),
            Role.RECEIVER: MappingProxyType(
                {KVPoll.Bootstrapping: 8.0, KVPoll.WaitingForInput: 12.0, KVPoll.Transferring: 20.0}
            ),
        }
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Times in virtual seconds (production defaults shrunk so episodes reach their ends) and
    pool sizes. The relations production relies on are kept: the settle timeout outlasts a
    chunk's deadline plus its quarantine, a late landing comes within the fence margin."""

    deadlines: Mapping[Role, Mapping[KVPoll, float]] = field(default_factory=_default_deadlines)
    settle_timeout_s: float = 20.0
    # ChannelConfig
    heartbeat_s: float = 1.0
    silence_s: float = 2.0
    tick_s: float = 0.25  # the watchdog's period (production: min(heartbeat, lease) / 10)
    connect_timeout_s: float = 2.0
    latency_s: float = 0.002
    lease_s: float = 2.0
    fence_margin_s: float = 1.0
    pending_ttl_s: float = 6.0
    pending_max: int = 4
    # TransferConfig
    chunk_deadline_s: float = 3.0
    quarantine_s: float = 1.0
    reload_s: float = 0.5  # a NIXL peer is reloaded this long after a remote disconnect
    # physics
    post_delay_s: float = 0.0005  # the poster thread takes a queued chunk this soon
    late_land_s: float = 0.4  # STALL_LATE: released bytes land this long after the release
    #: The pump progresses the agent at least this often while a record is in flight or held
    #: (production: every 1 to 20 ms); well under the gate's quarter margin.
    progress_s: float = 0.05
    # pools
    dst_pages: int = 12
    dst_aux_rows: int = 4
    dst_state_rows: int = 3
    page_bytes: int = 8

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            pending_max=self.pending_max,
            pending_ttl_s=self.pending_ttl_s,
            lease_s=self.lease_s,
            fence_margin_s=self.fence_margin_s,
        )

    def overrides(self, role: Role) -> Mapping[KVPoll, float] | None:
        return self.deadlines.get(role)

    def budget(self, role: Role) -> float:
        """Law 3: the longest a room may stay non-terminal, the sum of its state deadlines."""
        return sum(deadline_of(role, s, self.overrides(role)) for s in NON_TERMINAL)


# ------------------------------------------------------------------------------------------------
# The clock
# ------------------------------------------------------------------------------------------------


#: What runs in a process, by kind; the default order on resume is the order things fell due.
ORDER: Final = ("timer", "reader", "poster")


class Timer:
    __slots__ = ("at", "cancelled", "due", "fn", "kind", "prio", "seq", "side")

    def __init__(
        self, at: float, seq: int, side: Side | None, fn: Callable[[], object], kind: str
    ) -> None:
        self.at = at  # when it runs: ``due``, or the end of a freeze it fell due in
        self.due = at
        self.prio = len(ORDER)  # after what a freeze deferred to the same instant
        self.seq = seq
        self.side = side
        self.fn = fn
        self.kind = kind  # "reader" (a frame read), "poster" (the poster thread) or "timer"
        self.cancelled = False

    def __lt__(self, other: Timer) -> bool:
        # Deferred by a freeze: kind by kind, each in the order it fell due (asyncio's timer
        # heap is ordered by deadline, a thread's queue by arrival).
        return (self.at, self.prio, self.due, self.seq) < (
            other.at,
            other.prio,
            other.due,
            other.seq,
        )

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """Virtual time and the two processes' liveness."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self.frozen_until: dict[Side, float] = {Side.PREFILL: 0.0, Side.DECODE: 0.0}
        self._order: dict[Side, tuple[str, ...]] = {side: ORDER for side in Side}
        #: Every freeze, as [start, end] (merged while it is extended).
        self.freezes: dict[Side, list[list[float]]] = {Side.PREFILL: [], Side.DECODE: []}

    def at(
        self, when: float, side: Side | None, fn: Callable[[], object], kind: str = "timer"
    ) -> Timer:
        timer = Timer(max(when, self.now), next(self._seq), side, fn, kind)
        heapq.heappush(self._heap, timer)
        return timer

    def soon(self, side: Side | None, fn: Callable[[], object]) -> Timer:
        return self.at(self.now, side, fn)

    def running(self, side: Side) -> bool:
        return self.now >= self.frozen_until[side]

    def freeze(self, side: Side, seconds: float, order: tuple[str, ...] = ORDER) -> None:
        """Freeze ``side``; on resume what fell due meanwhile runs kind by kind in ``order``
        (a permutation of :data:`ORDER`), each kind in the order it fell due. (asyncio itself
        runs the I/O callbacks of a loop iteration before its expired timers; the poster is
        another thread: any order is possible.)"""
        until = self.now + seconds
        spans = self.freezes[side]
        if self.running(side):
            spans.append([self.now, until])
            self._order[side] = order
        else:
            spans[-1][1] = max(spans[-1][1], until)
        self.frozen_until[side] = max(self.frozen_until[side], until)

    def frozen_for(self, side: Side, start: float, end: float) -> float:
        """How long ``side`` was frozen between ``start`` and ``end``."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.freezes[side] if s < end)

    def froze_during(self, side: Side, start: float, end: float) -> bool:
        """A freeze of ``side`` began at or after ``start`` and before ``end``."""
        return any(start <= s < end for s, _ in self.freezes[side])

    def next_due(self) -> float:
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0].at if self._heap else _INF

    def run_until(self, target: float) -> None:
        heap = self._heap
        while heap and heap[0].at <= target:
            timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            self.now = max(self.now, timer.at)
            side = timer.side
            if side is not None and self.now < self.frozen_until[side]:
                timer.at = self.frozen_until[side]
                # On resume the frame reader may run before the timers that fell due meanwhile.
                timer.prio = self._order[side].index(timer.kind)
                heapq.heappush(heap, timer)
                continue
            timer.fn()
        self.now = max(self.now, target)
