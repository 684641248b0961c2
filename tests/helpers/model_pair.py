"""``Pair``: a prefill process and a decode process, run on production cores in virtual time.

This is the model checker's world (design section 8). Nothing here decides what a room, a
control link or a chunk does: those rules live in the production cores, which the harness only
calls and whose answers it executes, the way the production IO around them does.

    production core                          played here as the production IO plays it
    kvfsm.rooms._core.RoomCore               kvfsm.rooms._actor.Room: mailbox, deadline timer of
    (one per room per side)                  each state, settle timeout, Publication (reason
                                             before status), reaped once settled or given up;
                                             kvfsm.rooms._registry.Registry: spawn (a live
                                             duplicate is refused), deliver by full key, reap
                                             hooks, DestinationOwners (claimed by a receiver's
                                             metadata, released when reaped settled);
                                             RoomEngine's generation counter; callers use the
                                             production facades (SenderRoom, ReceiverRoom)
                                             through a post callable.
    kvfsm.control._routing                 kvfsm.control._plane.ControlPlane: submit(),
    PrefillRouting / DecodeRouting           room_spawned / room_reaped, the Hello exchange ->
                                             link_opened, _lose -> link_lost, the watchdog
                                             (silence, lease_due, tick), _on_frame -> on_*,
                                             the execution of Send / Deliver / GrantLease /
                                             RevokeLease; decode's _resolve / _link_to.
    kvfsm.transport._fence.Leases            the prefill transport's write fence.
    kvfsm.transport._ledger.ChunkLedger      kvfsm.transport.NixlTransport: accept and the poster
                                             (_chunks: lease check right before each part's
                                             transfer()), the pump (_pump: leases_checked,
                                             progress, polled, quarantine timers), peer loss,
                                             release requests.

Frames are the real :mod:`kvfsm.control._frames` classes and cross the model link as bytes,
through ``FrameCodec.encode`` and ``FrameReader.feed``.

The world
---------

* **Virtual time, two processes.** One clock; every callback belongs to a process (or to the
  world). A process can be *frozen* for any length of time: while frozen none of its callbacks
  runs (timers, watchdog, poster, pump, frame reads, its scheduler's calls); they run when it
  resumes. Its threads and tasks race then: a freeze draws the ``order`` in which its frame
  reader, its poster thread and its timers go, each in the order it fell due. The other
  process keeps going.
* **One control link at a time**, opened by decode (a room's ResolvePeer, or :meth:`reconnect`),
  FIFO both ways with a small latency. It can be *cut* silently (frames in the network are lost,
  nothing arrives, each side finds out by silence, at its own time) or *reset* (each side reads
  the end of the stream after its own delay; unread frames are lost). A side that gives a link
  up closes it, so the other side reads the end of the stream unless the link is cut. Each
  handshake is a new link id on each side (prefill's is the fence id).
* **Liveness** as ControlPlane's watchdog: every ``tick_s`` each side declares a link silent for
  more than ``silence_s - tick_s`` lost, sends a heartbeat on a link idle for ``heartbeat_s``;
  prefill asks for leases (``lease_due``), decode grants them; both cores are ticked.
* **The data path physics** (UCX over TCP, as on this machine: a WRITE moves bytes only when the
  writer's agent is progressed, in ``transfer()`` or by the pump). Each chunk has a
  :class:`ChunkFate`: its bytes land inside ``transfer()``; or later, at the pump's first
  progress after its delay (then its handle reads DONE, or ERR with half the pages written);
  ``transfer()`` raises (on the first part, or on a later one with an earlier part in flight);
  or the handle never completes. A released handle that has not landed moves nothing more
  (STALL), or lands everything at the release (a flush), or lands it ``late_land_s`` later
  (STALL_LATE: bytes landing during the quarantine). A flush (the ledger's rule 2) ends at
  the first pump round after every WRITE to its peer generation posted before it can move
  nothing more: landed, over, or released with nothing left to land. The pump checks leases
  before it progresses (as the ledger's rule 3 asks), and checking and posting are one instant. NIXL
  can also report the peer gone (a remote disconnect): the ledger's ``peer_lost``, then a
  reload of the peer as a new generation.
* **Decode memory.** Decode allocates pages, an aux row and state rows to a room when its
  scheduler calls ``send_metadata`` and frees them, writing a canary into each, the moment the
  room publishes ``settled``; they are reused by the next allocation. Source contents are
  unique per sender room.

What the fence cannot cover in this physics: a WRITE that is *in flight* when the prefill process
freezes, and that the freeze outlasts, moves its bytes at the first progress after the resume
(even a release flushes it). Such a landing is recorded with ``excused=True`` (and counted);
a chunk that is merely queued across a freeze is not excused: the poster must refuse it.

The harness records facts (every landing and what owned each page then, every event a room got
and which frame caused it, polls, statuses, link losses and who was claimed on them, every
decode room prefill told RoomSettled and every page list it handed out after that). Judging
them is the test's job (:mod:`tests.model.test_room_pair_properties`), so a test can plant a
bug in a subclass and prove the checker sees it.
"""

from __future__ import annotations

import enum
import functools
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias

import numpy as np

from kvfsm.control._frames import (
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameCodec,
    FrameError,
    FrameReader,
    Heartbeat,
    Hello,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    check_hello,
)
from kvfsm.control._routing import (
    Action,
    DecodeRouting,
    Deliver,
    GrantLease,
    PrefillRouting,
    RevokeLease,
    RoutingConfig,
    Send,
)
from kvfsm.rooms._actor import Publication, RoomKey
from kvfsm.rooms._core import Claim, RoomCore
from kvfsm.rooms._facade import ReceiverRoom, SenderRoom
from kvfsm.rooms._owners import DestinationOwners
from kvfsm.rooms._stats import RoomStats
from kvfsm.states import (
    NON_TERMINAL,
    TERMINAL,
    ChunkDone,
    ChunkFailed,
    Command,
    DeadlineExpired,
    DestinationReceived,
    Event,
    KVPoll,
    MetadataSubmitted,
    PeerLost,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
    deadline_of,
)
from kvfsm.transport import _ledger as ledger
from kvfsm.transport._fence import Leases

__all__ = [
    "ORDER",
    "ChunkFate",
    "ChunkPlan",
    "Landing",
    "ModelConfig",
    "ModelRoom",
    "Pair",
    "Side",
    "Who",
]

_INF: Final = math.inf
_SUCCESS: Final = int(KVPoll.Success)
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


#: Fates whose released bytes land at the release (a flush); STALL_LATE lands later.
_FLUSHED: Final = frozenset({ChunkFate.DONE_LATER, ChunkFate.ERR_LATER, ChunkFate.STALL_FLUSH})


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


class _Timer:
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

    def __lt__(self, other: _Timer) -> bool:
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
        self._heap: list[_Timer] = []
        self._seq = itertools.count()
        self.frozen_until: dict[Side, float] = {Side.PREFILL: 0.0, Side.DECODE: 0.0}
        self._order: dict[Side, tuple[str, ...]] = {side: ORDER for side in Side}
        #: Every freeze, as [start, end] (merged while it is extended).
        self.freezes: dict[Side, list[list[float]]] = {Side.PREFILL: [], Side.DECODE: []}

    def at(
        self, when: float, side: Side | None, fn: Callable[[], object], kind: str = "timer"
    ) -> _Timer:
        timer = _Timer(max(when, self.now), next(self._seq), side, fn, kind)
        heapq.heappush(self._heap, timer)
        return timer

    def soon(self, side: Side | None, fn: Callable[[], object]) -> _Timer:
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


# ------------------------------------------------------------------------------------------------
# Rooms, run as kvfsm.rooms._actor.Room runs them
# ------------------------------------------------------------------------------------------------


class ModelRoom:
    """One room's task: RoomCore, mailbox, timer, publication. Facts for the checker."""

    def __init__(self, proc: Process, key: RoomKey, publication: Publication) -> None:
        self.proc = proc
        self.key = key
        self.role = proc.side.role
        claim: Claim | None = None
        if self.role is Role.RECEIVER:  # as Room does: one owner per destination (Registry)
            owners = proc.owners

            def claim(event: MetadataSubmitted) -> str | None:
                return owners.claim(key, event.pages, event.aux_index, event.state)

        self.core = RoomCore(self.role, proc.stats, claim=claim)
        self.publication = publication
        self.born = proc.clock.now
        self.mailbox: deque[Event] = deque()
        self._timer: _Timer | None = None
        self._scheduled = False
        self._settle_expired = False
        self.reaped = False
        self.gave_up = False  # reaped by its settle timeout, unsettled
        self.terminal_at: float | None = None
        self.settled_at: float | None = None
        #: Every status published, in order (law 1: nothing after the first terminal one).
        self.statuses: list[KVPoll] = [publication.status]
        self.errors: list[BaseException] = []
        #: (room, generation) of every frame that caused an event delivered to this room.
        self.causes: set[Cause] = set()
        self._arm(self.core.state)

    def deliver(self, event: Event) -> None:
        self.mailbox.append(event)
        self._wake()

    def _wake(self) -> None:
        if not self._scheduled and not self.reaped:
            self._scheduled = True
            self.proc.clock.soon(self.proc.side, self._run)

    def _run(self) -> None:
        self._scheduled = False
        if self.reaped:
            return
        core = self.core
        while self.mailbox:
            self._apply(self.mailbox.popleft())
        if core.settled:
            self.proc.reap(self)
        elif core.terminal and self._settle_expired:
            self.gave_up = True
            self.proc.reap(self)

    def _apply(self, event: Event) -> None:
        before = self.core.state
        try:
            commands = self.core.handle(event)
        except Exception as exc:  # the actor's rule: a bug fails this room only
            self.errors.append(exc)
            commands = self.core.fail(f"internal error on {type(event).__name__}: {exc}")
        self._execute(before, commands)

    def _execute(self, before: KVPoll, commands: tuple[Command, ...]) -> None:
        core, pub = self.core, self.publication
        if core.state is not before:
            self._entered(core.state)
        if core.settled and not pub.settled:
            pub.settled = True
            self.settled_at = self.proc.clock.now
            self.proc.room_settled(self)
        for command in commands:
            try:
                self.proc.submit(self.key, command)
            except Exception as exc:
                self.errors.append(exc)
                state = core.state
                self._execute(state, core.fail(f"could not execute {type(command).__name__}"))

    def _entered(self, state: KVPoll) -> None:
        pub = self.publication
        if state is KVPoll.Failed:
            pub.reason = self.core.reason
        pub.status = state
        self.statuses.append(state)
        if state in TERMINAL:
            self.terminal_at = self.proc.clock.now
        self.proc.room_entered(self, state)
        self._arm(state)

    def _arm(self, state: KVPoll) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        clock = self.proc.clock
        if state in TERMINAL:
            if not self.core.settled:
                self._timer = clock.at(
                    clock.now + self.proc.config.settle_timeout_s, self.proc.side, self._on_timer
                )
            return
        seconds = deadline_of(self.role, state, self.proc.config.overrides(self.role))
        self._timer = clock.at(clock.now + seconds, self.proc.side, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.reaped:
            return
        state = self.core.state
        if state in TERMINAL:
            self._settle_expired = True
        else:
            seconds = deadline_of(self.role, state, self.proc.config.overrides(self.role))
            self.mailbox.append(DeadlineExpired(state, seconds))
        self._wake()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


# ------------------------------------------------------------------------------------------------
# Links
# ------------------------------------------------------------------------------------------------


class Conn:
    """One TCP connection of the world."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.ends: dict[Side, LinkEnd] = {}
        self.cut_at: float | None = None  # silent partition since
        self.reset_at: float | None = None  # reset since

    @property
    def broken(self) -> bool:
        return self.cut_at is not None or self.reset_at is not None


class LinkEnd:
    """One side's view of a connection (ControlPlane's ``_Link``)."""

    def __init__(self, proc: Process, conn: Conn) -> None:
        self.proc = proc
        self.conn = conn
        self.gen = 0  # the side's link generation, once the Hello exchange is done
        self.open = False
        self.closed = False
        self.peer_id = ""
        now = proc.clock.now
        self.last_seen = now
        self.last_sent = now
        self.hello_sent = now
        self.beats = itertools.count()
        self.reader = FrameReader(proc.codec)


@dataclass(slots=True)
class LinkLoss:
    """A side gave a link up: the rooms its core had claimed on it must fail at once."""

    side: Side
    gen: int
    at: float
    claimed: list[RoomKey]


# ------------------------------------------------------------------------------------------------
# The processes
# ------------------------------------------------------------------------------------------------


class Process:
    """What both engines share: a registry of rooms, links, the watchdog, executing actions."""

    side: Side

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.clock = pair.clock
        self.config = pair.config
        self.stats = RoomStats()
        self.owners = DestinationOwners()
        self.codec = FrameCodec()
        self.rooms: dict[RoomKey, ModelRoom] = {}
        self.current: dict[int, RoomKey] = {}
        self.generations = itertools.count(1)
        self.links: dict[object, LinkEnd] = {}
        self.by_gen: dict[int, LinkEnd] = {}
        self.link_gens = itertools.count(1)
        self.incarnation = 11 if isinstance(self, PrefillProcess) else 22
        self.stale_events = 0
        #: The frame being handled: every Deliver it causes is tagged with it (law 5).
        self.cause: Cause | None = None
        self.clock.at(self.config.tick_s, self.side, self._watchdog)

    @property
    def core(self) -> PrefillRouting | DecodeRouting:
        raise NotImplementedError

    # -- registry ------------------------------------------------------------------------------

    def post(self, key: RoomKey, event: Event) -> None:
        """The facades' ``post``: RoomEngine.post, a call_soon_threadsafe onto the loop."""
        self.clock.soon(self.side, lambda: self.deliver(key, event))

    def spawn(self, key: RoomKey, pub: Publication) -> None:
        """Registry.spawn_or_refuse."""
        held = self.current.get(key.room)
        live = self.rooms.get(held) if held is not None else None
        if live is not None and not live.core.terminal:
            pub.reason = f"refused: {self.side.role.value} room {key.room} is already live"
            pub.status = KVPoll.Failed
            pub.settled = True
            self.pair.refused.append((self.side, key))
            return
        room = ModelRoom(self, key, pub)
        self.rooms[key] = room
        self.current[key.room] = key
        self.pair.all_rooms.append(room)
        self.pair.rooms_by[(self.side, key)] = room
        self.room_spawned(key)

    def deliver(self, key: RoomKey, event: Event) -> bool:
        room = self.rooms.get(key)
        if room is None:
            self.stale_events += 1
            return False
        if self.cause is not None:
            room.causes.add(self.cause)
        self.pair.note_delivery(self.side, key, event, self.cause)
        room.deliver(event)
        return True

    def run_woken(self) -> None:
        """Inbox.run_woken: the model's rooms run when its clock runs them."""

    def reap(self, room: ModelRoom) -> None:
        room.reaped = True
        room.cancel_timer()
        if self.rooms.pop(room.key, None) is None:
            return
        if self.current.get(room.key.room) == room.key:
            del self.current[room.key.room]
        if room.key in self.owners and room.publication.settled:
            self.owners.release(room.key)  # Registry.reap: unsettled ones stay held
        self.room_reaped(room.key)

    # hooks, per side
    def room_spawned(self, key: RoomKey) -> None: ...

    def room_reaped(self, key: RoomKey) -> None: ...

    def room_entered(self, room: ModelRoom, state: KVPoll) -> None:
        self.pair.room_entered(room, state)

    def room_settled(self, room: ModelRoom) -> None:
        self.pair.room_settled(room)

    def submit(self, key: RoomKey, command: Command) -> None:
        raise NotImplementedError

    # -- actions -------------------------------------------------------------------------------

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        """ControlPlane._do; ``cause`` tags the deliveries with the frame that caused them."""
        for action in actions:
            if isinstance(action, Send):
                end = self.by_gen.get(action.link)
                if end is not None:
                    self.send(end, action.frame)
            elif isinstance(action, Deliver):
                self.deliver_action(action, cause)
            elif isinstance(action, GrantLease):
                self.grant(action)
            elif isinstance(action, RevokeLease):
                self.revoke(action)

    def deliver_action(self, action: Deliver, cause: Cause | None) -> None:
        saved, self.cause = self.cause, cause
        try:
            self.deliver(action.key, action.event)
        finally:
            self.cause = saved

    def grant(self, action: GrantLease) -> None:
        raise AssertionError(f"{self.side.value} got {action}")

    def revoke(self, action: RevokeLease) -> None:
        raise AssertionError(f"{self.side.value} got {action}")

    # -- links ---------------------------------------------------------------------------------

    def send(self, end: LinkEnd, frame: Frame) -> None:
        if end.closed:
            return
        data = self.codec.encode(frame)
        now = self.clock.now
        end.last_sent = now
        conn = end.conn
        if conn.broken:
            return
        other = self.side.other
        arrival = now + self.config.latency_s
        self.clock.at(
            arrival, other, lambda: self.pair.arrive(conn, other, data, arrival), kind="reader"
        )

    def receive(self, end: LinkEnd, data: bytes) -> None:
        end.last_seen = self.clock.now
        for item in end.reader.feed(data):
            if end.closed:
                return
            if isinstance(item, FrameError):
                self.pair.errors.append(f"{self.side.value} could not read a frame: {item!r}")
                continue
            if not end.open:
                if not isinstance(item, Hello):
                    self.pair.errors.append(f"{self.side.value} got {item!r} before Hello")
                    continue
                check_hello(item)
                self.opened(end, item)
                continue
            if isinstance(item, Heartbeat):
                continue
            self.on_frame(end, item)

    def hello(self) -> Hello:
        role: Literal["prefill", "decode"] = "prefill" if self.side is Side.PREFILL else "decode"
        rank = PREFILL_RANK if self.side is Side.PREFILL else DECODE_RANK
        # Decode's Hello grants the first lease (ControlPlane._handshake).
        lease_ms = 0 if self.side is Side.PREFILL else round(self.config.lease_s * 1000)
        margin_ms = 0 if self.side is Side.PREFILL else round(self.config.fence_margin_s * 1000)
        return Hello(
            PROTOCOL_VERSION,
            role,
            rank,
            f"{role}-agent",
            b"",
            b"",
            self.incarnation,
            lease_ms,
            fence_margin_ms=margin_ms,
        )

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        raise NotImplementedError

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        raise NotImplementedError

    def register(self, end: LinkEnd, key: object) -> None:
        end.gen = next(self.link_gens)
        end.open = True
        old = self.links.get(key)
        if old is not None:
            self.lose(old, "replaced by a new connection")
        self.links[key] = end
        self.by_gen[end.gen] = end

    def lose(self, end: LinkEnd, reason: str) -> None:
        """ControlPlane._lose, plus closing the socket (the peer reads the end of the stream)."""
        if end.closed:
            return
        end.closed = True
        if end.open:
            for key, link in list(self.links.items()):
                if link is end:
                    del self.links[key]
            self.by_gen.pop(end.gen, None)
            claimed = self.claimed_on(end.gen)
            self.link_lost(end, reason)
            self.pair.losses.append(LinkLoss(self.side, end.gen, self.clock.now, claimed))
        else:
            self.handshake_failed(end, reason)
        conn = end.conn
        if not conn.broken:
            other = self.side.other
            self.clock.at(
                self.clock.now + self.config.latency_s, other, lambda: self.pair.eof(conn, other)
            )

    def claimed_on(self, gen: int) -> list[RoomKey]:
        raise NotImplementedError

    def link_lost(self, end: LinkEnd, reason: str) -> None:
        self.do(self.core.link_lost(end.gen, reason, self.clock.now))

    def handshake_failed(self, end: LinkEnd, reason: str) -> None: ...

    def _watchdog(self) -> None:
        """ControlPlane._watchdog, plus the writer's heartbeats."""
        clock, config = self.clock, self.config
        clock.at(clock.now + config.tick_s, self.side, self._watchdog)
        now = clock.now
        limit = config.silence_s - config.tick_s
        for end in list(self.links.values()):
            if now - end.last_seen > limit:
                self.lose(end, f"silent for more than {config.silence_s:g}s")
                continue
            self.lease_due(end)
            if now - end.last_sent >= config.heartbeat_s and not end.closed:
                self.send(end, Heartbeat(next(end.beats)))
        self.do(self.core.tick(now))

    def lease_due(self, end: LinkEnd) -> None: ...


class PrefillProcess(Process):
    """The prefill engine: senders, PrefillRouting, Leases and the transport around the ledger."""

    side = Side.PREFILL
    transport_class: type[Transport]  # set below, once Transport is defined

    def __init__(self, pair: Pair) -> None:
        self.routing = PrefillRouting(pair.config.routing())
        super().__init__(pair)
        self.transport = self.transport_class(self)

    @property
    def core(self) -> PrefillRouting:
        return self.routing

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        actions = list(actions)
        for action in actions:
            if isinstance(action, Send) and isinstance(action.frame, RoomSettled):
                frame = action.frame
                self.pair.settled_answers.add((action.link, frame.room, frame.generation))
        super().do(actions, cause)

    def room_spawned(self, key: RoomKey) -> None:
        self.do_spawned(key, self.routing.sender_spawned(key, self.clock.now))

    def do_spawned(self, key: RoomKey, actions: list[Action]) -> None:
        """A held page list delivered at spawn: its cause is the metadata frame it came in."""
        for action in actions:
            cause = None
            if isinstance(action, Deliver) and isinstance(action.event, DestinationReceived):
                cause = self.pair.held_metadata_cause(key, action.event)
            self.do([action], cause)

    def room_reaped(self, key: RoomKey) -> None:
        self.do(self.routing.sender_reaped(key))

    def submit(self, key: RoomKey, command: Command) -> None:
        """ControlPlane.submit on prefill (PostChunk and ReleaseHandles go to the transport)."""
        now = self.clock.now
        if isinstance(command, (PostChunk, ReleaseHandles)):
            self.transport.submit(key, command)
        elif isinstance(command, ReportOutcome):
            actions = self.routing.sender_outcome(key, command.status, command.reason, now)
            for action in actions:
                if (
                    isinstance(action, Send)
                    and isinstance(action.frame, RoomOutcome)
                    and action.frame.status == _SUCCESS
                ):
                    self.pair.success_from[RoomKey(action.frame.room, action.frame.generation)] = (
                        key
                    )
            self.do(actions)
        elif isinstance(command, ReportSettled):
            self.do(self.routing.sender_settled(key, now))
        else:
            raise TypeError(f"prefill cannot execute {command!r}")

    def grant(self, action: GrantLease) -> None:
        self.transport.leases.grant(action.fence, action.until, action.margin_s)
        self.transport.schedule_pump()

    def revoke(self, action: RevokeLease) -> None:
        self.transport.leases.revoke(action.fence)
        self.transport.schedule_pump()

    def accept(self, conn: Conn) -> None:
        """The listener accepted decode's connection: send our Hello (the first lease counts
        from here)."""
        end = LinkEnd(self, conn)
        conn.ends[Side.PREFILL] = end
        end.hello_sent = self.clock.now
        self.send(end, self.hello())

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        peer_id = f"{hello.role}-{hello.rank}-{hello.incarnation}"
        end.peer_id = peer_id
        self.transport.connect_peer(peer_id)  # _connect_data_path, before the link is opened
        self.register(end, peer_id)
        now = self.clock.now
        self.do(
            self.routing.link_opened(
                end.gen,
                peer_id,
                now,
                end.hello_sent,
                hello.lease_ms,
                margin_ms=hello.fence_margin_ms,
            )
        )

    def claimed_on(self, gen: int) -> list[RoomKey]:
        return self.routing.bound_to(gen)

    def lease_due(self, end: LinkEnd) -> None:
        self.do(self.routing.lease_due(end.gen, self.clock.now))

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        """ControlPlane._on_frame on prefill."""
        gen, now, core = end.gen, self.clock.now, self.routing
        if isinstance(frame, LeaseGrant):
            self.do(core.lease_granted(gen, frame.seq, frame.lease_ms, now))
        elif isinstance(frame, RoomClaim):
            self.do(core.on_claim(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, RoomMetadata):
            self.pair.metadata_seen.append((gen, frame))
            self.do(core.on_metadata(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, RoomAbort):
            self.do(core.on_abort(gen, frame, now), (frame.room, frame.generation))
        elif isinstance(frame, Reconcile):
            self.do(core.on_reconcile(gen, frame, now))
        elif isinstance(frame, Error):
            cause = None if frame.room is None else (frame.room, frame.generation)
            self.do(core.on_error(gen, frame), cause)
        else:
            self.pair.errors.append(f"prefill got {frame!r}")


class DecodeProcess(Process):
    """The decode engine: receivers, DecodeRouting, decode's resolver and connector."""

    side = Side.DECODE

    def __init__(self, pair: Pair) -> None:
        self.routing = DecodeRouting(pair.config.routing())
        super().__init__(pair)
        self.connecting: Conn | None = None
        self.waiting: list[RoomKey] = []  # rooms whose _resolve waits for the connection
        #: RoomKeys claimed on each decode link (from the RoomClaim sends).
        self.claims: dict[int, set[RoomKey]] = {}

    @property
    def core(self) -> DecodeRouting:
        return self.routing

    def room_reaped(self, key: RoomKey) -> None:
        self.do(self.routing.receiver_reaped(key))

    def submit(self, key: RoomKey, command: Command) -> None:
        """ControlPlane.submit on decode."""
        if isinstance(command, ResolvePeer):
            self.clock.soon(self.side, lambda: self.resolve(key, command.peer_rank))
        elif isinstance(command, SendMetadata):
            frame = RoomMetadata(
                key.room, key.generation, command.pages, command.aux_index, command.state
            )
            self.do(self.routing.metadata(key, frame))
        elif isinstance(command, ReportOutcome):
            if command.status is KVPoll.Failed:
                self.do(self.routing.receiver_failed(key, command.reason))
        else:
            raise TypeError(f"decode cannot execute {command!r}")

    def do(self, actions: Iterable[Action], cause: Cause | None = None) -> None:
        actions = list(actions)
        for action in actions:
            if isinstance(action, Send) and isinstance(action.frame, RoomClaim):
                key = RoomKey(action.frame.room, action.frame.generation)
                self.claims.setdefault(action.link, set()).add(key)
        super().do(actions, cause)

    # -- _resolve / _link_to -------------------------------------------------------------------

    def resolve(self, key: RoomKey, peer_rank: int) -> None:
        end = self.links.get(peer_rank)
        if end is not None:
            self.bind(key, end)
            return
        self.waiting.append(key)
        if self.connecting is None:
            self.connect()

    def bind(self, key: RoomKey, end: LinkEnd) -> None:
        room = self.rooms.get(key)
        if room is None or room.core.terminal:
            return  # it ended while its peer was being resolved: nothing to claim
        self.do(self.routing.bind(key, end.gen, PREFILL_RANK))

    def connect(self) -> None:
        """Open a connection to prefill: our Hello first, prefill accepts and answers."""
        if self.connecting is not None:
            return
        conn = self.pair.new_conn()
        end = LinkEnd(self, conn)
        conn.ends[Side.DECODE] = end
        self.connecting = conn
        prefill = self.pair.prefill

        def accepted() -> None:
            if not conn.broken:
                prefill.accept(conn)

        def timed_out() -> None:
            if not end.open and not end.closed:
                self.lose(end, "connect timed out")

        now = self.clock.now
        # Accepted before our Hello arrives (scheduled first: it runs first on a tie).
        self.clock.at(now + self.config.latency_s / 2, Side.PREFILL, accepted, kind="reader")
        self.send(end, self.hello())
        self.clock.at(now + self.config.connect_timeout_s, self.side, timed_out)

    def opened(self, end: LinkEnd, hello: Hello) -> None:
        end.peer_id = f"{hello.role}-{hello.rank}-{hello.incarnation}"
        self.register(end, PREFILL_RANK)
        self.do(self.routing.link_opened(end.gen, end.peer_id, hello.rank, self.clock.now))
        if self.connecting is end.conn:
            self.connecting = None
        waiting, self.waiting = self.waiting, []
        for key in waiting:
            self.bind(key, end)

    def handshake_failed(self, end: LinkEnd, reason: str) -> None:
        if self.connecting is not end.conn:
            return
        self.connecting = None
        waiting, self.waiting = self.waiting, []
        for key in waiting:
            self.deliver(key, PeerLost(f"cannot reach prefill rank {PREFILL_RANK}: {reason}"))

    def claimed_on(self, gen: int) -> list[RoomKey]:
        return sorted(self.claims.pop(gen, set()))

    def on_frame(self, end: LinkEnd, frame: Frame) -> None:
        """ControlPlane._on_frame on decode."""
        gen, now, core = end.gen, self.clock.now, self.routing
        if isinstance(frame, LeaseRequest):
            self.do(core.lease_requested(gen, frame, now))
        elif isinstance(frame, RoomOutcome):
            self.do(core.on_outcome(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, RoomSettled):
            self.do(core.on_settled(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, RoomAbort):
            self.do(core.on_abort(gen, frame), (frame.room, frame.generation))
        elif isinstance(frame, Error):
            cause = None if frame.room is None else (frame.room, frame.generation)
            self.do(core.on_error(gen, frame), cause)
        else:
            self.pair.errors.append(f"decode got {frame!r}")


# ------------------------------------------------------------------------------------------------
# The prefill transport: NixlTransport's IO around the production ChunkLedger
# ------------------------------------------------------------------------------------------------


class NixlPeer:
    """A transport peer generation (identity is what the ledger compares)."""

    def __init__(self, peer_id: str, generation: int) -> None:
        self.peer_id = peer_id
        self.generation = generation

    def __repr__(self) -> str:
        return f"<NixlPeer {self.peer_id} gen {self.generation}>"


@dataclass(slots=True)
class _Part:
    """One NIXL transfer of a chunk: the KV pages, the aux row or the state rows."""

    kind: str  # "kv", "aux", "state"
    src: list[int]
    dst: list[int]
    landed: bool = False


class Chunk(ledger.Record):
    """A ledger record plus what the model's NIXL does with it."""

    __slots__ = ("fate", "delay", "late_pending", "lease", "parts", "posted_at", "nixl", "released")

    def __init__(
        self,
        key: RoomKey,
        command: PostChunk,
        *,
        peer: NixlPeer,
        plan: ChunkPlan,
        parts: list[_Part],
        nbytes: int,
    ) -> None:
        super().__init__(key, command.chunk, peer, nbytes, command.fence)
        self.fate = plan.fate
        self.delay = plan.delay
        self.parts = parts
        self.posted_at = _INF
        self.lease = ""
        self.nixl: list[str] = []  # each posted handle's state as NIXL would report it
        self.released = False
        self.late_pending = False  # released STALL_LATE bytes not landed yet

    def may_still_land(self) -> bool:
        """Some byte of it may still move (what a flush of its peer waits for)."""
        if self.posted_at == _INF:
            return False
        return self.late_pending if self.released else "PROC" in self.nixl


def _ints(packed: bytes) -> list[int]:
    return [int(i) for i in np.frombuffer(packed, dtype=np.int32)]


class Transport:
    """NixlTransport's IO for the model: submit, poster, pump, timers, peers."""

    def __init__(self, proc: PrefillProcess) -> None:
        self.proc = proc
        self.pair = proc.pair
        self.clock = proc.clock
        self.config = proc.config
        # Fenced, and gated (the stale-progress gate); decode's Hello tells its margin, and
        # this default (the same) covers nothing else.
        self.leases = Leases(margin_s=self.config.fence_margin_s)
        self.ledger = ledger.ChunkLedger(
            deadline_s=lambda nbytes: self.config.chunk_deadline_s,
            quarantine_s=self.config.quarantine_s,
            leases=self.leases,
        )
        self.peers: dict[str, NixlPeer] = {}
        self._peer_gens = itertools.count(1)
        self._queue: list[Chunk] = []
        self._poster: _Timer | None = None
        self._pump: _Timer | None = None
        #: The gate fenced the agent out: nothing is posted, progressed or released again.
        self.fenced = False
        #: Chunk plans per sender room, in the order its chunks were submitted.
        self.plans: dict[RoomKey, deque[ChunkPlan]] = {}
        #: Flushes in flight (the ledger's rule 2): peer -> (number, not before, what it covers).
        self.flushes: dict[NixlPeer, tuple[int, float, list[Chunk]]] = {}

    # -- peers ---------------------------------------------------------------------------------

    def connect_peer(self, peer_id: str) -> None:
        self.peers[peer_id] = NixlPeer(peer_id, next(self._peer_gens))

    def remote_disconnect(self) -> None:
        """NIXL reports the peer gone (``nixlRemoteDisconnectError``): ``PeerSet.lost`` (the
        transport drops that generation), then a reload of its metadata as a new one."""
        for peer_id, peer in list(self.peers.items()):
            del self.peers[peer_id]
            self.execute(
                self.ledger.peer_lost(
                    peer, f"NIXL remote disconnect from {peer_id}", self.clock.now
                )
            )

            def reload(peer_id: str = peer_id) -> None:
                if peer_id not in self.peers and any(
                    e.peer_id == peer_id for e in self.proc.links.values()
                ):
                    self.connect_peer(peer_id)

            self.clock.at(self.clock.now + self.config.reload_s, Side.PREFILL, reload)
        self.schedule_pump()

    # -- accepting -----------------------------------------------------------------------------

    def submit(self, key: RoomKey, command: Command) -> None:
        if isinstance(command, ReleaseHandles):
            self.execute(self.ledger.release_requested(key))
            return
        assert isinstance(command, PostChunk)
        plans = self.plans.get(key)
        plan = plans.popleft() if plans else ChunkPlan(0)
        peer = self.peers.get(command.peer)
        if peer is None:
            self._later(key, ChunkFailed(command.chunk, f"no connected peer {command.peer!r}"))
            return
        parts = []
        src, dst = _ints(command.src), _ints(command.dst)
        if src:
            parts.append(_Part("kv", src, dst))
        if command.is_last and command.src_aux >= 0 and command.dst_aux >= 0:
            parts.append(_Part("aux", [command.src_aux], [command.dst_aux]))
        if command.src_state:
            parts.append(_Part("state", _ints(command.src_state), _ints(command.dst_state)))
        if not parts:  # nothing to move: done without NIXL
            self._later(key, ChunkDone(command.chunk))
            return
        nbytes = sum(len(p.src) for p in parts) * self.config.page_bytes
        record = Chunk(key, command, peer=peer, plan=plan, parts=parts, nbytes=nbytes)
        self.execute(self.ledger.accepted(record, self.clock.now), later=True)

    def _later(self, key: RoomKey, event: Event) -> None:
        """call_soon: the room is in the middle of its command."""
        self.clock.soon(Side.PREFILL, lambda: self.proc.deliver(key, event))

    # -- executing the ledger's actions --------------------------------------------------------

    def execute(self, actions: Iterable[ledger.Action], later: bool = False) -> None:
        for action in actions:
            if isinstance(action, ledger.Post):
                self._queue.append(action.record)  # type: ignore[arg-type]
                if self._poster is None:
                    self._poster = self.clock.at(
                        self.clock.now + self.config.post_delay_s,
                        Side.PREFILL,
                        self._post_queued,
                        kind="poster",
                    )
            elif isinstance(action, ledger.Release):
                self.release(action.record)  # type: ignore[arg-type]
            elif isinstance(action, ledger.Deliver):
                self.proc.deliver(action.key, action.event)
            elif isinstance(action, ledger.StartQuarantine):
                self.clock.at(
                    action.until,
                    Side.PREFILL,
                    functools.partial(self._quarantine_over, action.record),
                )
            elif isinstance(action, ledger.PostFlush):
                covered = [
                    r
                    for r in self.ledger.records()
                    if r.peer is action.peer and isinstance(r, Chunk) and r.may_still_land()
                ]
                self.flushes[action.peer] = (action.seq, action.not_before, covered)
            elif isinstance(action, ledger.CancelFlush):
                self.flushes.pop(action.peer, None)
            elif isinstance(action, ledger.Finish):
                record = action.record
                if isinstance(record, Chunk) and record.handles:
                    self.release(record)
                record.handles = []
                if record.opened:  # Pump._finish: the gate stops counting it
                    self.leases.closed(record.fence)
                if later:
                    self._later(record.key, action.event)
                else:
                    self.proc.deliver(record.key, action.event)
        self.schedule_pump()

    def _quarantine_over(self, record: ledger.Record) -> None:
        self.execute(self.ledger.quarantine_over(record))

    def release(self, record: Chunk) -> None:
        """release_xfer_handle on every handle: what has not landed may still (the fate), at
        a progress of the agent, which asks the gate first. A fenced-out agent releases
        nothing and is never progressed again: nothing of it lands."""
        record.handles = []
        if self.fenced:
            return
        if record.released or "PROC" not in record.nixl:
            return  # a handle that said DONE or ERR moves nothing more
        record.released = True
        record.nixl = ["ERR" if s == "PROC" else s for s in record.nixl]
        if record.fate in _FLUSHED:
            if self.may_progress():
                self.pair.land(record)
        elif record.fate is ChunkFate.STALL_LATE:
            record.late_pending = True

            def late() -> None:
                record.late_pending = False
                if self.may_progress():
                    self.pair.land(record)

            self.clock.at(self.clock.now + self.config.late_land_s, Side.PREFILL, late)

    # -- the stale-progress gate (kvfsm.transport._fence) --------------------------------------

    def may_progress(self) -> bool:
        """Asked right before anything that progresses the agent (a post, a pump round, the
        progress that moves released bytes). Refused: Pump._abandon, once."""
        if self.leases.progress_allowed(self.clock.now):
            return True
        if not self.fenced:
            self.fenced = True
            self.pair.fenced_out += 1
            reason = self.leases.fenced_out
            assert reason is not None
            self.execute(self.ledger.abandon(reason))
        return False

    # -- the poster thread ---------------------------------------------------------------------

    def _post_queued(self) -> None:
        self._poster = None
        queue, self._queue = self._queue, []
        for record in queue:
            self.execute(self.post(record))

    def lease_valid(self, record: Chunk) -> bool:
        """The check right before each part's transfer() (a planted bug may skip it)."""
        return self.leases.valid(record.fence, self.clock.now)

    def post(self, record: Chunk) -> list[ledger.Action]:
        """kvfsm.transport._chunks.post_xfer and Pump.posted for one record."""
        now = self.clock.now
        if record.dropped:
            return self.ledger.posted(record, now)
        for index, part in enumerate(record.parts):
            if not self.lease_valid(record) or not self.may_progress():
                why = self.leases.describe(record.fence, now)
                return self.ledger.fenced(
                    record, f"write lease of fence {record.fence} {why}: not posted", now
                )
            if not record.opened:  # the gate counts it from its first transfer()
                record.opened = True
                self.leases.opened(record.fence)
            fate = record.fate
            if fate is ChunkFate.ERR_AT_POST or (fate is ChunkFate.ERR_LATER_PART and index):
                return self.ledger.errored(record, "NIXL_ERR_BACKEND: transfer() raised", now)
            record.handles.append(object())
            if record.posted_at == _INF:
                record.posted_at = now
                record.lease = self.leases.describe(record.fence, now)
            if fate is ChunkFate.DONE_AT_POST:
                self.pair.land(record, [part])
                state = "DONE"
            else:
                state = "PROC"
            record.states.append(state)
            record.nixl.append(state)
        if record.opened and "PROC" not in record.states:
            record.opened = False  # over inside transfer(): nothing of it can be queued
            self.leases.closed(record.fence)
        if all(state == "DONE" for state in record.states):
            record.handles = []  # released on the poster thread
        return self.ledger.posted(record, now)

    # -- the pump ------------------------------------------------------------------------------

    def _completes_at(self, record: Chunk) -> float:
        if record.fate in (ChunkFate.DONE_LATER, ChunkFate.ERR_LATER) and "PROC" in record.nixl:
            return record.posted_at + record.delay
        return _INF

    def schedule_pump(self) -> None:
        """The pump runs busy while anything is in flight: here, at every moment it can see a
        change (a completion, a deadline, a lease running out) and at once after a change;
        and, like the real one, it progresses the agent at least every ``progress_s`` while
        a record is in flight or held (what keeps the gate from taking a running writer for
        a frozen one)."""
        if self.fenced:
            return  # the pump stopped for good
        due = _INF
        if self.flushes:
            due = self.clock.now + self.config.progress_s
        for record in self.ledger.records():
            if record.phase == ledger.HELD:
                due = min(due, self.clock.now + self.config.progress_s)
            if record.phase != ledger.ACTIVE:
                continue
            assert isinstance(record, Chunk)
            until = self.leases.until(record.fence)
            due = min(
                due,
                self._completes_at(record),
                record.due + 1e-3,
                until,
                self.clock.now + self.config.progress_s,
            )
        if due == _INF:
            return
        due = max(due, self.clock.now)
        pending = self._pump
        if pending is not None and not pending.cancelled and pending.at <= due:
            return
        if pending is not None:
            pending.cancel()
        self._pump = self.clock.at(due, Side.PREFILL, self._round)

    def _round(self) -> None:
        self._pump = None
        now = self.clock.now
        if not self.may_progress():
            return
        self.execute(self.ledger.leases_checked(now))
        # progress: in-progress WRITEs move their bytes
        for record in self.ledger.records():
            if (
                record.phase == ledger.ACTIVE
                and isinstance(record, Chunk)
                and now >= self._completes_at(record)
            ):
                fraction = 1.0 if record.fate is ChunkFate.DONE_LATER else 0.5
                self.pair.land(record, record.parts, fraction)
                state = "DONE" if record.fate is ChunkFate.DONE_LATER else "ERR"
                record.nixl = [state if s == "PROC" else s for s in record.nixl]
        for record in self.ledger.take_active():
            assert isinstance(record, Chunk)
            self.execute(self.ledger.polled(record, list(record.nixl), now))
        for peer, (seq, not_before, covered) in list(self.flushes.items()):
            if self.flushes.get(peer, (0,))[0] != seq or now < not_before:
                continue
            if not any(r.may_still_land() for r in covered):
                del self.flushes[peer]
                self.execute(self.ledger.flushed(peer, seq, now))
        self.schedule_pump()


PrefillProcess.transport_class = Transport


# ------------------------------------------------------------------------------------------------
# The pair: the world, the schedulers, decode memory, facts
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Landing:
    """Bytes of one chunk landed in decode memory, with the facts at that moment."""

    at: float
    sender: RoomKey
    chunk: int
    target: RoomKey | None  # the decode room whose page list the sender was given
    #: (kind, index, owner at that moment) of every destination written.
    written: list[tuple[str, int, RoomKey | None]]
    sender_settled: bool  # its source pages were already declared free
    excused: bool  # in flight across a prefill freeze (the window no fence can close)
    lease: str  # what its lease was when it was posted ("valid", "expired ...", "revoked")


@dataclass(slots=True)
class Poll:
    side: Side
    key: RoomKey
    status: object
    before_input: bool  # before init (sender) / send_metadata (receiver)


@dataclass(slots=True)
class SenderJob:
    """SGLang's prefill scheduler for one request."""

    facade: SenderRoom
    chunks: list[ChunkPlan]
    pages: list[int]  # source page ids
    aux: int
    state: list[int]
    inited: bool = False
    sent: int = 0  # chunks sent


@dataclass(slots=True)
class ReceiverJob:
    """SGLang's decode scheduler for one request."""

    facade: ReceiverRoom
    pages_wanted: int
    state_wanted: int
    inited: bool = False
    pages: list[int] | None = None  # allocated at send_metadata
    aux: int = -1
    state: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Allocation:
    pages: list[int]
    aux: int
    state: list[int]


class Pair:
    """The rig. Driven by the hypothesis machine; :meth:`drain` ends an episode."""

    prefill_class: type[PrefillProcess] = PrefillProcess
    decode_class: type[DecodeProcess] = DecodeProcess

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config = config if config is not None else ModelConfig()
        self.clock = Clock()
        # facts
        self.all_rooms: list[ModelRoom] = []
        self.refused: list[tuple[Side, RoomKey]] = []
        self.errors: list[str] = []
        self.landings: list[Landing] = []
        self.polls: list[Poll] = []
        self.losses: list[LinkLoss] = []
        self.success_checks: list[tuple[Side, RoomKey, str]] = []  # a mismatch, described
        self.canary_errors: list[str] = []
        self.success_from: dict[RoomKey, RoomKey] = {}  # decode key -> the sender that said so
        self.targets: dict[RoomKey, RoomKey] = {}  # sender key -> decode key of its pages
        self.destinations: dict[RoomKey, DestinationReceived] = {}
        self.metadata_seen: list[tuple[int, RoomMetadata]] = []
        #: (prefill link, room, gen) of every decode room prefill told RoomSettled.
        self.settled_answers: set[tuple[int, int, int]] = set()
        #: (sender, decode room): a page list handed out after that room was told settled.
        self.settled_pages_given: list[tuple[RoomKey, RoomKey]] = []
        # the world
        self._conns = itertools.count(1)
        self.conns: list[Conn] = []
        self.prefill = self.prefill_class(self)
        self.decode = self.decode_class(self)
        self.procs: dict[Side, Process] = {Side.PREFILL: self.prefill, Side.DECODE: self.decode}
        #: Every request's scheduler state; the active ones are polled every iteration.
        self.senders: list[SenderJob] = []
        self.receivers: list[ReceiverJob] = []
        self.sender_jobs: dict[RoomKey, SenderJob] = {}
        self.rooms_by: dict[tuple[Side, RoomKey], ModelRoom] = {}
        # memory: decode destinations (owner per index) and prefill sources (unique contents)
        pb = config.page_bytes
        self.dst: dict[str, list[bytes]] = {
            "kv": [b"\0" * pb] * config.dst_pages,
            "aux": [b"\0" * pb] * config.dst_aux_rows,
            "state": [b"\0" * pb] * config.dst_state_rows,
        }
        self.owner: dict[str, list[RoomKey | None]] = {
            k: [None] * len(v) for k, v in self.dst.items()
        }
        self.canary: dict[str, list[bytes | None]] = {
            k: [None] * len(v) for k, v in self.dst.items()
        }
        self.allocations: dict[RoomKey, Allocation] = {}
        self.src: dict[str, dict[int, bytes]] = {"kv": {}, "aux": {}, "state": {}}
        self._src_next = itertools.count()
        self._canaries = itertools.count()
        self.excused = 0
        #: Times the stale-progress gate fenced prefill's agent out.
        self.fenced_out = 0
        self.chunks_sent = 0

    # -- the world's callbacks -----------------------------------------------------------------

    def new_conn(self) -> Conn:
        conn = Conn(next(self._conns))
        self.conns.append(conn)
        return conn

    def arrive(self, conn: Conn, side: Side, data: bytes, arrival: float) -> None:
        end = conn.ends.get(side)
        if end is None or end.closed:
            return
        if conn.reset_at is not None:
            return  # a reset throws away what was not read
        if conn.cut_at is not None and arrival > conn.cut_at:
            return  # still in the network when it was cut
        self.procs[side].receive(end, data)

    def eof(self, conn: Conn, side: Side) -> None:
        end = conn.ends.get(side)
        if end is not None and not end.closed:
            self.procs[side].lose(end, "connection closed by the peer")

    # -- faults --------------------------------------------------------------------------------

    def live_conn(self) -> Conn | None:
        for conn in reversed(self.conns):
            if not conn.broken and any(not e.closed for e in conn.ends.values()):
                return conn
        return None

    def cut(self) -> None:
        """Pull the cable: nothing more crosses; each side finds out by silence."""
        conn = self.live_conn()
        if conn is not None:
            conn.cut_at = self.clock.now

    def reset(self, prefill_after: float, decode_after: float) -> None:
        """The connection is reset: each side reads the end of its stream after its delay."""
        conn = self.live_conn()
        if conn is None:
            return
        conn.reset_at = now = self.clock.now
        for side, after in ((Side.PREFILL, prefill_after), (Side.DECODE, decode_after)):
            self.clock.at(now + after, side, functools.partial(self.eof, conn, side))

    def freeze(self, side: Side, seconds: float, order: tuple[str, ...] = ORDER) -> None:
        self.clock.freeze(side, seconds, order)

    def reconnect(self) -> None:
        """Decode (re)connects to prefill if it has no link (a new room's resolve would)."""
        if self.clock.running(Side.DECODE) and not self.decode.links:
            self.clock.soon(Side.DECODE, self.decode.connect)

    def remote_disconnect(self) -> None:
        if self.clock.running(Side.PREFILL):
            self.prefill.transport.remote_disconnect()

    # -- requests and schedulers ---------------------------------------------------------------

    def new_request(
        self, room: int, who: Who, pages: int, state: bool, chunks: list[ChunkPlan]
    ) -> None:
        """SGLang routes a request with bootstrap_room ``room`` to prefill and decode."""
        if who is not Who.PREFILL_ONLY and self.clock.running(Side.DECODE):
            facade = ReceiverRoom(*self._spawn(self.decode, room))
            self.receivers.append(ReceiverJob(facade, pages, int(state)))
        if who is not Who.DECODE_ONLY and self.clock.running(Side.PREFILL):
            sender = SenderRoom(*self._spawn(self.prefill, room))
            plan = self._split(pages, chunks)
            self.prefill.transport.plans[sender.key] = deque(plan)
            pb = self.config.page_bytes
            job = SenderJob(
                sender,
                plan,
                [self._source("kv", pb) for _ in range(pages)],
                self._source("aux", pb),
                [self._source("state", pb) for _ in range(int(state))],
            )
            self.senders.append(job)
            self.sender_jobs[sender.key] = job

    def live_id(self, room: int) -> bool:
        """A caller still waits on a room with this id, on either side."""
        jobs: list[SenderJob | ReceiverJob] = [*self.senders, *self.receivers]
        return any(j.facade.room == room for j in jobs)

    def _spawn(
        self, proc: Process, room: int
    ) -> tuple[RoomKey, Publication, Callable[[RoomKey, Event], None]]:
        """RoomEngine._spawn: a new generation, the spawn posted to the loop."""
        key = RoomKey(room, next(proc.generations))
        pub = Publication()
        self.clock.soon(proc.side, lambda: proc.spawn(key, pub))
        return key, pub, proc.post

    def _source(self, kind: str, pb: int) -> int:
        index = next(self._src_next)
        self.src[kind][index] = f"{kind[0]}{index:0{pb - 1}d}".encode()[:pb]
        return index

    @staticmethod
    def _split(pages: int, chunks: list[ChunkPlan]) -> list[ChunkPlan]:
        """Chunks that add up to ``pages``: the drawn ones, clipped, then one with the rest
        (with the last drawn one's fate)."""
        out: list[ChunkPlan] = []
        left = pages
        for plan in chunks:
            n = min(plan.pages, left)
            left -= n
            out.append(ChunkPlan(n, plan.fate, plan.delay))
            if left == 0:
                return out
        last = chunks[-1] if chunks else ChunkPlan(0)
        out.append(ChunkPlan(left, last.fate, last.delay))
        return out

    def schedulers(self) -> None:
        """One loop iteration of each running scheduler over its requests."""
        # A request whose room the scheduler saw terminal is done: it is not polled again.
        if self.clock.running(Side.DECODE):
            self.receivers = [j for j in self.receivers if self._decode_iteration(j)]
        if self.clock.running(Side.PREFILL):
            self.senders = [j for j in self.senders if self._prefill_iteration(j)]

    def _prefill_iteration(self, job: SenderJob) -> bool:
        status = job.facade.poll()
        self.polls.append(Poll(Side.PREFILL, job.facade.key, status, not job.inited))
        if status in TERMINAL:
            return False
        if not job.inited:
            if status is KVPoll.WaitingForInput:
                job.facade.init(len(job.pages), job.aux)
                job.inited = True
            return True
        if job.sent >= len(job.chunks):
            return True
        start = sum(c.pages for c in job.chunks[: job.sent])
        plan = job.chunks[job.sent]
        job.sent += 1
        last = job.sent == len(job.chunks)
        job.facade.send(job.pages[start : start + plan.pages], job.state if last else None)
        self.chunks_sent += 1
        return True

    def _decode_iteration(self, job: ReceiverJob) -> bool:
        status = job.facade.poll()
        self.polls.append(Poll(Side.DECODE, job.facade.key, status, job.pages is None))
        if status in TERMINAL:
            return False
        if not job.inited:
            job.facade.init(PREFILL_RANK)
            job.inited = True
        elif status is KVPoll.WaitingForInput and job.pages is None:
            allocation = self._allocate(job.facade.key, job.pages_wanted, job.state_wanted)
            if allocation is None:
                return True  # short of decode memory: wait
            job.pages, job.aux, job.state = allocation.pages, allocation.aux, allocation.state
            job.facade.send_metadata(job.pages, job.aux, job.state or None)
        return True

    def abort(self, side: Side, index: int) -> tuple[KVPoll, KVPoll] | None:
        """The caller aborts one of its rooms; returns the polls before and after."""
        if not self.clock.running(side):
            return None
        jobs: list[Any] = self.senders if side is Side.PREFILL else self.receivers
        live = [j for j in jobs if j.facade.poll() not in TERMINAL]
        if not live:
            return None
        facade = live[index % len(live)].facade
        before = facade.poll()
        facade.abort("chaos abort")
        return before, facade.poll()

    # -- decode memory -------------------------------------------------------------------------

    def _allocate(self, key: RoomKey, pages: int, state: int) -> Allocation | None:
        free = {k: [i for i, o in enumerate(v) if o is None] for k, v in self.owner.items()}
        if len(free["kv"]) < pages or not free["aux"] or len(free["state"]) < state:
            return None
        allocation = Allocation(free["kv"][:pages], free["aux"][0], free["state"][:state])
        for kind, indices in self._indices(allocation):
            for i in indices:
                expected = self.canary[kind][i]
                if expected is not None and self.dst[kind][i] != expected:
                    self.canary_errors.append(
                        f"{kind} {i} was written while free (canary {expected!r} is now "
                        f"{self.dst[kind][i]!r}) before {key} reused it"
                    )
                self.owner[kind][i] = key
                self.canary[kind][i] = None
        self.allocations[key] = allocation
        return allocation

    @staticmethod
    def _indices(allocation: Allocation) -> list[tuple[str, list[int]]]:
        return [("kv", allocation.pages), ("aux", [allocation.aux]), ("state", allocation.state)]

    def room_settled(self, room: ModelRoom) -> None:
        """A receiver's pages are free the moment it says settled: reuse them (canaries)."""
        if room.role is not Role.RECEIVER:
            return
        allocation = self.allocations.pop(room.key, None)
        if allocation is None:
            return
        for kind, indices in self._indices(allocation):
            for i in indices:
                canary = f"~{next(self._canaries):0{self.config.page_bytes - 1}d}".encode()
                self.owner[kind][i] = None
                self.dst[kind][i] = self.canary[kind][i] = canary[: self.config.page_bytes]

    def land(self, record: Chunk, parts: list[_Part] | None = None, fraction: float = 1.0) -> None:
        """Bytes of ``record`` land in decode memory (``parts``: those not landed yet)."""
        todo = [p for p in (record.parts if parts is None else parts) if not p.landed]
        if not todo:
            return
        now = self.clock.now
        excused = self.clock.froze_during(Side.PREFILL, record.posted_at, now)
        self.excused += excused
        written: list[tuple[str, int, RoomKey | None]] = []
        for part in todo:
            n = len(part.src) if fraction >= 1.0 else int(len(part.src) * fraction)
            for s, d in zip(part.src[:n], part.dst[:n], strict=True):
                self.dst[part.kind][d] = self.src[part.kind][s]
                written.append((part.kind, d, self.owner[part.kind][d]))
                if self.canary[part.kind][d] is not None:
                    # A landing in a free page is judged as the landing it is (above); the
                    # canary catches bytes that reach decode memory any other way.
                    self.canary[part.kind][d] = self.src[part.kind][s]
            part.landed = fraction >= 1.0
        sender = self.rooms_by.get((Side.PREFILL, record.key))
        self.landings.append(
            Landing(
                now,
                record.key,
                record.chunk,
                self.targets.get(record.key),
                written,
                sender is not None and sender.publication.settled,
                excused,
                record.lease,
            )
        )

    # -- facts at transitions ------------------------------------------------------------------

    def room_entered(self, room: ModelRoom, state: KVPoll) -> None:
        if state is not KVPoll.Success:
            return
        if room.role is Role.RECEIVER:
            self._check_receiver_success(room)
        else:
            self._check_sender_success(room)

    def _check_receiver_success(self, room: ModelRoom) -> None:
        sender = self.success_from.get(room.key)
        allocation = self.allocations.get(room.key)
        if sender is None:
            self.success_checks.append((Side.DECODE, room.key, "Success but no sender succeeded"))
            return
        job = self.sender_jobs[sender]
        if allocation is None:
            self.success_checks.append((Side.DECODE, room.key, "Success without pages"))
            return
        expected = {
            "kv": [self.src["kv"][p] for p in job.pages],
            "aux": [self.src["aux"][job.aux]],
            "state": [self.src["state"][s] for s in job.state],
        }
        for kind, indices in self._indices(allocation):
            got = [self.dst[kind][i] for i in indices][: len(expected[kind])]
            if got != expected[kind]:
                self.success_checks.append(
                    (Side.DECODE, room.key, f"Success but {kind} holds {got}, not {expected[kind]}")
                )

    def _check_sender_success(self, room: ModelRoom) -> None:
        job = self.sender_jobs[room.key]
        dest = self.destinations.get(room.key)
        if dest is None:
            self.success_checks.append((Side.PREFILL, room.key, "Success without destinations"))
            return
        pairs = [("kv", p, d) for p, d in zip(job.pages, _ints(dest.pages), strict=False)]
        pairs.append(("aux", job.aux, dest.aux_index))
        pairs += [("state", s, d) for s, d in zip(job.state, _ints(dest.state), strict=False)]
        for kind, s, d in pairs:
            if self.dst[kind][d] != self.src[kind][s]:
                self.success_checks.append(
                    (Side.PREFILL, room.key, f"Success but {kind} {d} does not hold source {s}")
                )

    def held_metadata_cause(self, key: RoomKey, event: DestinationReceived) -> Cause | None:
        """The metadata frame a page list delivered at spawn came in (it was held)."""
        for gen, frame in reversed(self.metadata_seen):
            if (
                gen == event.fence
                and frame.room == key.room
                and frame.pages == event.pages
                and frame.aux_index == event.aux_index
                and frame.state == event.state
            ):
                return (frame.room, frame.generation)
        return None

    def note_delivery(self, side: Side, key: RoomKey, event: Event, cause: Cause | None) -> None:
        if (
            side is Side.PREFILL
            and isinstance(event, DestinationReceived)
            and cause is not None
            and cause[1] is not None
        ):
            self.targets[key] = RoomKey(cause[0], cause[1])
            self.destinations[key] = event
            if (event.fence, cause[0], cause[1]) in self.settled_answers:
                self.settled_pages_given.append((key, RoomKey(cause[0], cause[1])))

    # -- time ----------------------------------------------------------------------------------

    def run(self, until: float) -> None:
        self.clock.run_until(until)

    def advance(self, seconds: float, stop: Callable[[], bool] | None = None) -> bool:
        """Move the clock; the schedulers run every tick of the way and once at the end, so
        a fault drawn next finds their last calls still queued (a chunk not yet posted).
        With ``stop``, return early (True) after the first scheduler round it is true of."""
        target = self.clock.now + seconds
        while True:
            step = min(target, self.clock.now + self.config.tick_s)
            self.run(step)
            self.schedulers()
            self.run(self.clock.now)  # what the calls queued at this instant
            if stop is not None and stop():
                return True
            if step >= target:
                return False

    def freeze_at_next_chunk(
        self, seconds: float, order: tuple[str, ...] = ORDER, within: float = 2.0
    ) -> bool:
        """The incident's interleaving: prefill freezes the moment its scheduler has sent a
        chunk, before the poster took it (if a chunk is sent ``within`` that long)."""
        sent = self.chunks_sent
        if not self.advance(within, stop=lambda: self.chunks_sent > sent):
            return False
        self.freeze(Side.PREFILL, seconds, order)
        return True

    def idle(self) -> bool:
        """No room has a task, nothing is in flight, every caller is done."""
        if self.prefill.rooms or self.decode.rooms:
            return False
        if self.prefill.transport.ledger.in_flight:
            return False
        return not self.senders and not self.receivers

    def drain(self, horizon: float = 600.0) -> None:
        """Faults stop (a freeze runs out), the link reconnects when a room needs it, and time
        passes until every room is reaped and every caller saw its end; then until every
        TTL'd mark has expired; then the links close, as at shutdown."""
        end = self.clock.now + horizon
        while not self.idle() or not all(self.clock.running(side) for side in Side):
            if self.clock.now > end:
                raise AssertionError(f"not drained after {horizon:g}s: {self.describe()}")
            if self.decode.waiting and self.decode.connecting is None:
                self.reconnect()
            self.advance(0.5)
        self.advance(self.config.pending_ttl_s + 2 * self.config.tick_s)
        for proc in self.procs.values():
            for link in list(proc.links.values()):
                proc.lose(link, "engine shutting down")
        self.advance(self.config.tick_s * 2)

    def describe(self) -> str:
        rows = [
            f"{room.role.value} {room.key} {room.core.state.name} in flight "
            f"{sorted(room.core.in_flight)} settled={room.core.settled}"
            for room in self.all_rooms
            if not room.reaped
        ]
        return "; ".join(rows) or "no live room"
