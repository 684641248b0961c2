"""``Pair``: a prefill process and a decode process, run on production cores in virtual time.

This is the model checker's world (docs/testing.md). Nothing here decides what a room, a
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

The pieces, a module each: the configuration, the clock and the world's vocabulary
(:mod:`tests.helpers.model_world`), rooms (:mod:`tests.helpers.model_rooms`), connections and
links (:mod:`tests.helpers.model_links`), the two engines (:mod:`tests.helpers.model_processes`),
the prefill transport and its NIXL (:mod:`tests.helpers.model_transport`); here, the pair that
wires them together, its schedulers, decode memory and the facts. Every name a test uses is
importable from here.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfsm.control._frames import (
    RoomMetadata,
)
from kvfsm.rooms._actor import Publication, RoomKey
from kvfsm.rooms._facade import ReceiverRoom, SenderRoom
from kvfsm.states import (
    TERMINAL,
    DestinationReceived,
    Event,
    KVPoll,
    Role,
)
from tests.helpers.model_links import Conn, LinkEnd, LinkLoss
from tests.helpers.model_processes import DecodeProcess, PrefillProcess, Process
from tests.helpers.model_rooms import ModelRoom
from tests.helpers.model_transport import Chunk, NixlPeer, TransferPart, Transport, unpack_ints
from tests.helpers.model_world import (
    ORDER,
    PREFILL_RANK,
    Cause,
    ChunkFate,
    ChunkPlan,
    Clock,
    ModelConfig,
    Side,
    Who,
)

__all__ = [
    "ORDER",
    "Chunk",
    "ChunkFate",
    "ChunkPlan",
    "Clock",
    "Conn",
    "DecodeProcess",
    "Landing",
    "LinkEnd",
    "LinkLoss",
    "ModelConfig",
    "ModelRoom",
    "NixlPeer",
    "Pair",
    "PrefillProcess",
    "Process",
    "Side",
    "Transport",
    "Who",
]


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

    def land(
        self, record: Chunk, parts: list[TransferPart] | None = None, fraction: float = 1.0
    ) -> None:
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
        pairs = [("kv", p, d) for p, d in zip(job.pages, unpack_ints(dest.pages), strict=False)]
        pairs.append(("aux", job.aux, dest.aux_index))
        pairs += [("state", s, d) for s, d in zip(job.state, unpack_ints(dest.state), strict=False)]
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
