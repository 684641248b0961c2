"""``PairHarness``: one prefill room and one decode room in one process, wired by a script.

This is the *model checker's* rig, not a transport. Every interleaving is chosen by the caller (a
hypothesis state machine): nothing moves unless a method says so, there are no threads, no event
loop and no real time. It is allowed by the design (section 6) only to force interleavings; the
real-NIXL tests remain the proof that data moves.

What it wires together, each piece modelled on the production code it stands for:

* **Rooms** (:class:`ScriptedRoom`): a real :class:`RoomCore` (production mode: an illegal event
  fails the room), run the way :class:`kvfsm.rooms.Room` runs it: a real :class:`Publication`
  updated after every event (reason before status), the deadline of a state armed on entry and
  delivered as ``DeadlineExpired(state, seconds)`` when the virtual clock passes it, a settle
  timer on terminal rooms, and reaping once settled (or once the settle timer gave up). Callers
  use the real facades (:class:`SenderRoom`, :class:`ReceiverRoom`), so ``abort()``, ``poll()``
  and page packing are production code.
* **Control link**: the frames :class:`kvfsm.bootstrap.ControlPlane` carries (RoomMetadata and
  RoomAbort prefill-ward; RoomOutcome and RoomSettled decode-ward) in one FIFO per direction,
  and the plane's routing rules around the rooms: binding a sender when its metadata arrives,
  ignoring a retransmitted page list of the room already bound, holding metadata for a sender
  that does not exist yet (answered with RoomOutcome(Failed) and RoomSettled when it expires),
  the tombstone of a sender that failed before its page list came, answering an abort for a
  sender that is gone with RoomSettled, unbinding on Success and on RoomSettled, ``PeerLost``
  for every bound room when the link dies, and decode settling a room it lost the link of
  ``peer_lost_grace_s`` later.
  Each :meth:`PairHarness.step_link` applies a :class:`FrameFate` to the head frame.
* **Transport**: ``PostChunk`` copies bytes between two in-memory page pools (numpy), so
  "Success means the destination holds the source bytes" and "no byte lands after settle" are
  facts that can be checked. Like :class:`kvfsm.transport.NixlTransport`: a chunk with nothing
  to move completes without NIXL, a chunk released before it was posted is dropped, a posted
  chunk runs to its end (``ReleaseHandles`` does not stop it), a chunk past its deadline is
  reported ``ChunkStalled`` and ``ChunkFailed`` only after the quarantine, and a remote
  disconnect fails the room (``PeerLost``) before it fails the chunk. The :class:`ChunkFate` of
  each chunk is given when the scheduler sends it.

The harness only records *facts* (every write with whether its room was settled at that moment,
a snapshot of the destination when a room succeeded, when each room became terminal and
settled); judging them is the test's job, so a test can plant a bug in the harness and prove its
checker notices.
"""

from __future__ import annotations

import enum
import functools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from kvfsm.rooms._actor import Publication, RoomKey
from kvfsm.rooms._core import RoomCore
from kvfsm.rooms._facade import ReceiverRoom, SenderRoom
from kvfsm.rooms._stats import RoomStats
from kvfsm.states import (
    NON_TERMINAL,
    TERMINAL,
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    ChunkStalled,
    Command,
    DeadlineExpired,
    DestinationReceived,
    Event,
    KVPoll,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
    TransferConfirmed,
    deadline_of,
)

__all__ = [
    "ChunkFate",
    "ChunkPlan",
    "Direction",
    "FrameFate",
    "PairConfig",
    "PairHarness",
    "Request",
    "ScriptedRoom",
    "Write",
]

ROOM_ID: Final = 7
PEER_AGENT: Final = "decode-0"  # the receiver's transport identity, as the prefill side knows it
_INF: Final = math.inf
Pool: TypeAlias = npt.NDArray[np.uint8]


class FrameFate(enum.Enum):
    """What the link does with the frame at the head of one direction. DELIVER comes first:
    hypothesis shrinks a sampled fate towards it, so minimal failures use as few faults as
    they can."""

    DELIVER = "deliver"
    #: The frame is lost (TCP would lose the connection instead; this is the harsher model).
    DROP = "drop"
    #: Delivered now, and a copy later (after whatever is queued behind it).
    DUPLICATE = "duplicate"
    #: Sent behind the frames queued after it: a reordering TCP would not make.
    REORDER = "reorder"
    #: The whole direction stalls for a while (head-of-line blocking, as on one TCP stream),
    #: at most ``PairConfig.silence_s``.
    DELAY = "delay"


#: Fates that break the FIFO, reliable stream a real control connection gives. After one of
#: them a receiver may legitimately never hear that its pages are free (it gives up and keeps
#: them quarantined); it must still never hear it too early.
LOSSY_FATES: Final = frozenset({FrameFate.DROP, FrameFate.REORDER})


class ChunkFate(enum.Enum):
    """What NIXL does with one chunk (COMPLETE first, for shrinking)."""

    #: Done inside ``transfer()``, as on shared memory.
    COMPLETE = "complete"
    #: In progress; done after ``delay`` seconds (stalled instead if that is past its deadline).
    DELAYED = "delayed"
    #: ``transfer()`` raises: nothing lands.
    ERROR_ON_POST = "error_on_post"
    #: Part of the pages land, then the handle reports an error after ``delay`` seconds.
    ERROR_ON_COMPLETION = "error_on_completion"
    #: Never completes: stalled at its deadline, failed after the quarantine.
    STALL = "stall"
    #: As STALL, and the cancelled WRITE's bytes land during the quarantine anyway.
    STALL_LANDS = "stall_lands"


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    fate: ChunkFate = ChunkFate.COMPLETE
    delay: float = 1.0


class Direction(enum.Enum):
    TO_PREFILL = "to_prefill"
    TO_DECODE = "to_decode"


# -- frames: what the control connection carries (kvfsm.bootstrap._frames, minus the wire) ----


@dataclass(frozen=True, slots=True)
class Metadata:
    pages: bytes
    aux_index: int
    state: bytes


@dataclass(frozen=True, slots=True)
class Abort:
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    status: KVPoll
    reason: str


@dataclass(frozen=True, slots=True)
class Settled:
    pass


Frame: TypeAlias = Metadata | Abort | Outcome | Settled


@dataclass(frozen=True, slots=True)
class PairConfig:
    """Times (virtual seconds) and pool sizes. Defaults are the production defaults."""

    deadlines: Mapping[Role, Mapping[KVPoll, float]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    settle_timeout_s: float = 60.0  # RoomConfig.settle_timeout_s
    chunk_deadline_s: float = 10.0  # TransferConfig.deadline_base_s (bytes are negligible here)
    quarantine_s: float = 2.0  # TransferConfig.quarantine_s
    pending_ttl_s: float = 60.0  # ChannelConfig.pending_ttl_s
    #: ChannelConfig.peer_lost_grace_s: decode declares a room's pages free this long after
    #: the room's control link was lost (no acknowledgement can come over it). Above
    #: ``silence_s + chunk_deadline_s + quarantine_s``, as the real one must be.
    peer_lost_grace_s: float = 20.0
    #: ChannelConfig.silence_s: a control stream silent this long is declared lost, so no
    #: frame on a live link waits longer (DELAY is capped to it).
    silence_s: float = 2.0
    page_bytes: int = 8
    pool_pages: int = 16
    aux_rows: int = 4
    state_rows: int = 4

    def budget(self, role: Role) -> float:
        """Law 3: the longest a room may stay non-terminal, the sum of its state deadlines."""
        return sum(deadline_of(role, s, self.deadlines.get(role)) for s in NON_TERMINAL)


@dataclass(frozen=True, slots=True)
class Request:
    """One request's shape: which source pages prefill sends and where decode wants them."""

    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]  # as many as src_pages (decode reserves what the request needs)
    src_aux: int
    dst_aux: int
    src_state: tuple[int, ...] = ()
    dst_state: tuple[int, ...] = ()
    peer_rank: int = 0

    def __post_init__(self) -> None:
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError("decode reserves exactly the pages prefill sends")
        if len(self.src_state) != len(self.dst_state):
            raise ValueError("state rows must pair up")


@dataclass(frozen=True, slots=True)
class Write:
    """One landing of bytes into the receiver's memory, with the facts at that moment."""

    at: float
    chunk: int
    nbytes: int
    receiver_settled: bool  # the receiver's pages were already declared free
    sender_settled: bool  # the sender's source pages were already declared free


def _nothing() -> None:
    pass


def _ints(packed: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(packed, dtype=np.int32)


class ScriptedRoom:
    """A room run as :class:`kvfsm.rooms.Room` runs it, with the harness's clock."""

    def __init__(self, role: Role, now: float, config: PairConfig, stats: RoomStats) -> None:
        self.role = role
        self.key = RoomKey(ROOM_ID, 1)
        self.core = RoomCore(role, stats)
        self.publication = Publication()
        self.config = config
        self._overrides = config.deadlines.get(role)
        self.born = now
        self.due = now + deadline_of(role, KVPoll.Bootstrapping, self._overrides)
        self.settle_due = _INF
        self.terminal_at: float | None = None
        self.settled_at: float | None = None
        self.reaped = False
        self.gave_up = False  # the settle timer fired: reaped while still unsettled
        #: The core's state after every event it handled (terminal finality is checked on it).
        self.history: list[KVPoll] = [KVPoll.Bootstrapping]
        self.errors: list[BaseException] = []

    def handle(self, event: Event, now: float) -> tuple[Command, ...]:
        """``Room._apply`` + ``Room._execute`` minus the sink: the commands are returned."""
        core = self.core
        before = core.state
        try:
            commands = core.handle(event)
        except Exception as exc:  # as the actor does: a bug fails this room only
            self.errors.append(exc)
            commands = core.fail(f"internal error on {type(event).__name__}: {exc}")
        self.history.append(core.state)
        if core.state is not before:
            self._entered(core.state, now)
        if core.settled and not self.publication.settled:
            self.publication.settled = True
            self.settled_at = now
            self.reaped = True  # the task leaves its loop once settled; the registry reaps it
            self.settle_due = _INF
        return commands

    def _entered(self, state: KVPoll, now: float) -> None:
        pub = self.publication
        if state is KVPoll.Failed:
            pub.reason = self.core.reason  # before the status: a reader of Failed sees why
        pub.status = state
        if state in TERMINAL:
            self.terminal_at = now
            self.due = _INF
            if not self.core.settled:
                self.settle_due = now + self.config.settle_timeout_s
        else:
            self.due = now + deadline_of(self.role, state, self._overrides)

    def next_timer(self) -> float:
        if self.reaped:
            return _INF
        return self.settle_due if self.core.terminal else self.due

    def fire_timer(self, now: float) -> tuple[Command, ...]:
        """The actor's ``_on_timer`` at ``now`` (>= the timer's due time)."""
        state = self.core.state
        if state in TERMINAL:
            self.gave_up = True
            self.reaped = True
            self.settle_due = _INF
            return ()
        return self.handle(
            DeadlineExpired(state, deadline_of(self.role, state, self._overrides)), now
        )


class _Chunk:
    __slots__ = (
        "command",
        "complete_at",
        "dropped",
        "due",
        "finals",
        "land_at",
        "phase",
        "plan",
        "quarantine_end",
    )

    def __init__(self, command: PostChunk, plan: ChunkPlan) -> None:
        self.command = command
        self.plan = plan
        self.phase = "queued"  # queued -> active -> (quarantined) -> final
        self.dropped = False
        self.due = _INF
        self.complete_at = _INF
        self.quarantine_end = _INF
        self.land_at = _INF
        self.finals: list[Event] = []


class PairHarness:
    """The rig. Callers drive it through the facades (``sender``/``receiver``) and the step
    methods; :meth:`drain` ends an episode the way a healthy system would finish it."""

    # The control plane's rules as they are now. Each switch turns one back into a bug this
    # harness (helper-11's property test) or the campaign found, so a test can plant it and
    # prove the checker sees what it did.

    #: Expired held metadata is answered with RoomSettled after RoomOutcome(Failed) (nothing
    #: was written into its pages). Without it the receiver, failed on the peer's word, sends
    #: no abort, never hears that its pages are free, gives up after the settle timeout and
    #: leaks them (the bug: ``ControlPlane._expire_pending`` before the fix).
    expiry_settles: bool = True
    #: A page list for the room already bound to this link is a retransmission and ignored.
    #: False: refused as a second receiver (RoomOutcome(Failed) + RoomSettled), telling decode
    #: its pages are free while the sender still writes them (the law-4 bug the campaign found).
    retransmission_ignored: bool = True

    def __init__(self, request: Request, config: PairConfig | None = None) -> None:
        self.request = request
        self.config = config = config if config is not None else PairConfig()
        self.now = 0.0
        self.stats = RoomStats()
        rng = np.random.default_rng(1234)  # fixed: source contents are data, not a fault
        pb = config.page_bytes
        self.src_kv: Pool = rng.integers(1, 256, (config.pool_pages, pb), dtype=np.uint8)
        self.dst_kv: Pool = np.zeros((config.pool_pages, pb), dtype=np.uint8)
        self.src_aux: Pool = rng.integers(1, 256, (config.aux_rows, pb), dtype=np.uint8)
        self.dst_aux: Pool = np.zeros((config.aux_rows, pb), dtype=np.uint8)
        self.src_state: Pool = rng.integers(1, 256, (config.state_rows, pb), dtype=np.uint8)
        self.dst_state: Pool = np.zeros((config.state_rows, pb), dtype=np.uint8)
        # rooms and their facades; decode creates its room first (prefill's may come later)
        self.receiver_room = ScriptedRoom(Role.RECEIVER, 0.0, config, self.stats)
        self.receiver = ReceiverRoom(
            self.receiver_room.key, self.receiver_room.publication, self._poster(Role.RECEIVER)
        )
        self.sender_room: ScriptedRoom | None = None
        self.sender: SenderRoom | None = None
        # control link
        self.queues: dict[Direction, deque[Frame]] = {d: deque() for d in Direction}
        self.paused_until: dict[Direction, float] = dict.fromkeys(Direction, 0.0)
        self.link_alive = True
        #: When decode settles the room it lost the link of (``peer_lost_grace_s`` after).
        self.grace_due = _INF
        self.resolving = False
        self.receiver_bound = False
        self.sender_bound = False
        self.pending: tuple[float, Metadata] | None = None
        self.tombstone: str | None = None
        self.aborted_early: str | None = None
        self.faults: list[str] = []  # what the link and the peers did that TCP would not
        # transport
        self.peer_alive = True
        self.chunks: dict[int, _Chunk] = {}
        self.next_plan = ChunkPlan()
        # facts for the checker
        self.writes: list[Write] = []
        self.stale_events = 0
        self.sender_reported: list[ReportOutcome] = []
        #: (role, what the destination held when that room entered Success)
        self.success_snapshots: list[tuple[Role, Pool, Pool, Pool]] = []

    # -- reads ---------------------------------------------------------------------------------

    def rooms(self) -> list[ScriptedRoom]:
        return [r for r in (self.sender_room, self.receiver_room) if r is not None]

    @property
    def lossy(self) -> bool:
        return bool(self.faults)

    @property
    def frames_lost(self) -> bool:
        """A frame was dropped or reordered: a receiver may then never hear its settle
        acknowledgement (a lost link is not such a fault: decode settles after the grace)."""
        return any(f.startswith(("drop ", "reorder ")) for f in self.faults)

    def outstanding(self) -> list[int]:
        """Chunks the transport has not reported final yet."""
        return [c for c, ch in self.chunks.items() if ch.phase != "final"]

    def expected(self) -> tuple[Pool, Pool, Pool]:
        """What a finished transfer leaves in the destination: the source pages, aux row and
        state rows, where the receiver asked for them."""
        r = self.request
        kv = self.src_kv[list(r.src_pages)]
        aux = self.src_aux[r.src_aux]
        state = self.src_state[list(r.src_state)]
        return kv, aux, state

    def destination(self) -> tuple[Pool, Pool, Pool]:
        r = self.request
        return (
            self.dst_kv[list(r.dst_pages)].copy(),
            self.dst_aux[r.dst_aux].copy(),
            self.dst_state[list(r.dst_state)].copy(),
        )

    # -- routing events to rooms (what Registry.deliver does) ----------------------------------

    def _current(self, role: Role) -> ScriptedRoom | None:
        room = self.sender_room if role is Role.SENDER else self.receiver_room
        return room if room is not None and not room.reaped else None

    def deliver(self, role: Role, event: Event) -> None:
        room = self._current(role)
        if room is None:
            self.stale_events += 1
            return
        before = room.core.state
        commands = room.handle(event, self.now)
        if room.core.state is KVPoll.Success and before is not KVPoll.Success:
            self.success_snapshots.append((role, *self.destination()))
        self.execute(role, commands)

    def execute(self, role: Role, commands: tuple[Command, ...]) -> None:
        for command in commands:
            if role is Role.SENDER:
                self._sender_command(command)
            else:
                self._receiver_command(command)

    # -- the callers (SGLang's schedulers) -----------------------------------------------------

    def spawn_sender(self) -> SenderRoom:
        """Prefill creates its room (maybe after decode sent the page list)."""
        if self.sender is not None:
            return self.sender
        room = self.sender_room = ScriptedRoom(Role.SENDER, self.now, self.config, self.stats)
        self.sender = SenderRoom(room.key, room.publication, self._poster(Role.SENDER))
        self._sender_spawned()
        return self.sender

    def _poster(self, role: Role) -> Callable[[RoomKey, Event], None]:
        """The facades' ``post``. Both rooms have the same key (one room id in two engines),
        so each facade gets a poster bound to its role."""

        def post(key: RoomKey, event: Event) -> None:
            self.deliver(role, event)

        return post

    def send_chunk(
        self, pages: tuple[int, ...], plan: ChunkPlan, state: tuple[int, ...] = ()
    ) -> None:
        """The prefill scheduler's ``send``; ``plan`` is what NIXL will do with that chunk."""
        assert self.sender is not None
        self.next_plan = plan
        self.sender.send(list(pages), list(state) if state else None)
        self.next_plan = ChunkPlan()

    # -- prefill side: commands, and the control plane's routing -------------------------------

    def _sender_command(self, command: Command) -> None:
        if isinstance(command, PostChunk):
            self._accept(command)
        elif isinstance(command, ReleaseHandles):
            for chunk in self.chunks.values():
                chunk.dropped = True  # a queued one is skipped; a posted one runs on
        elif isinstance(command, ReportOutcome):
            self.sender_reported.append(command)
            if self.sender_bound:
                self.send(Direction.TO_DECODE, Outcome(command.status, command.reason))
                if command.status is KVPoll.Success:
                    self.sender_bound = False
            elif command.status is KVPoll.Failed:
                # Failed before decode's page list came: answer that list when it comes.
                self.tombstone = command.reason
                self.pending = None
        elif isinstance(command, ReportSettled):
            if self.sender_bound:
                self.send(Direction.TO_DECODE, Settled())
            self.sender_bound = False
        else:  # pragma: no cover - a new command must be wired here
            raise TypeError(f"sender command {command!r}")

    def _sender_spawned(self) -> None:
        """``ControlPlane.room_spawned``."""
        self.tombstone = None
        if self.aborted_early is not None:
            reason, self.aborted_early = self.aborted_early, None
            self.deliver(Role.SENDER, AbortRequested(reason, origin="peer"))
            return
        if self.pending is not None and self.link_alive:
            _, frame = self.pending
            self.pending = None
            self._bind_sender(frame)

    def _bind_sender(self, frame: Metadata) -> None:
        self.sender_bound = True
        self.deliver(
            Role.SENDER, DestinationReceived(frame.pages, frame.aux_index, PEER_AGENT, frame.state)
        )

    def on_prefill_frame(self, frame: Frame) -> None:
        """``ControlPlane._on_frame`` on the prefill side."""
        if isinstance(frame, Metadata):
            tombstone, self.tombstone = self.tombstone, None
            if self._current(Role.SENDER) is not None:
                if self.sender_bound and self.retransmission_ignored:
                    # One receiver and one link here: a page list for the bound room is always
                    # a retransmission of the one that bound it (same link, same generation).
                    self.stale_events += 1
                elif self.sender_bound:
                    # The bug: treated as a second receiver and refused as a duplicate room.
                    reason = "duplicate room id: prefill already serves another receiver"
                    self.send(Direction.TO_DECODE, Outcome(KVPoll.Failed, reason))
                    self.send(Direction.TO_DECODE, Settled())
                else:
                    self._bind_sender(frame)
            elif tombstone is not None:
                self.send(Direction.TO_DECODE, Outcome(KVPoll.Failed, tombstone))
                self.send(Direction.TO_DECODE, Settled())
            else:
                self.pending = (self.now, frame)
        elif isinstance(frame, Abort):
            if self._current(Role.SENDER) is not None:
                self.deliver(Role.SENDER, AbortRequested(frame.reason, origin="peer"))
            else:
                self.on_abort_for_absent_sender(frame)
        else:  # pragma: no cover
            raise TypeError(f"prefill got {frame!r}")

    def on_abort_for_absent_sender(self, frame: Abort) -> None:
        """Decode gave up on a room prefill has not (or no longer) got: nothing can write into
        its pages, so acknowledge at once; a room created later fails at once."""
        self.pending = None
        self.aborted_early = frame.reason
        self.send(Direction.TO_DECODE, Settled())

    # -- decode side ---------------------------------------------------------------------------

    def _receiver_command(self, command: Command) -> None:
        if isinstance(command, ResolvePeer):
            self.resolving = True
        elif isinstance(command, SendMetadata):
            if self.receiver_bound:
                self.send(
                    Direction.TO_PREFILL, Metadata(command.pages, command.aux_index, command.state)
                )
        elif isinstance(command, ReportOutcome):
            if self.receiver_bound:
                self.send(Direction.TO_PREFILL, Abort(command.reason or "aborted"))
        else:  # pragma: no cover
            raise TypeError(f"receiver command {command!r}")

    def resolve(self, ok: bool = True) -> None:
        """Decode's connection to the prefill rank is made (or cannot be)."""
        if not self.resolving:
            return
        self.resolving = False
        rank = self.request.peer_rank
        if ok and self.link_alive:
            self.receiver_bound = True
            self.deliver(Role.RECEIVER, PeerResolved(rank))
        else:
            self.deliver(Role.RECEIVER, PeerLost(f"cannot reach prefill rank {rank}"))

    def on_decode_frame(self, frame: Frame) -> None:
        if self._current(Role.RECEIVER) is None:
            self.stale_events += 1
            return
        if isinstance(frame, Settled):
            self.receiver_bound = False
            self.deliver(Role.RECEIVER, PeerSettled(self.request.peer_rank))
        elif isinstance(frame, Outcome):
            if frame.status is KVPoll.Success:
                self.receiver_bound = False
                self.deliver(Role.RECEIVER, TransferConfirmed(self.request.peer_rank))
            else:
                self.deliver(Role.RECEIVER, PeerFailed(frame.reason))
        else:  # pragma: no cover
            raise TypeError(f"decode got {frame!r}")

    # -- the link ------------------------------------------------------------------------------

    def send(self, direction: Direction, frame: Frame) -> None:
        if self.link_alive:
            self.queues[direction].append(frame)

    def can_step(self, direction: Direction) -> bool:
        return bool(self.queues[direction]) and self.now >= self.paused_until[direction]

    def step_link(self, direction: Direction, fate: FrameFate, delay: float = 1.0) -> None:
        """Apply ``fate`` to the frame at the head of ``direction``."""
        if not self.can_step(direction):
            return
        queue = self.queues[direction]
        if fate is FrameFate.DELAY:
            self.paused_until[direction] = self.now + min(delay, self.config.silence_s)
            return
        frame = queue.popleft()
        if fate is FrameFate.DROP:
            self.faults.append(f"drop {frame}")
            return
        if fate is FrameFate.REORDER and queue:
            self.faults.append(f"reorder {frame}")
            queue.append(frame)
            return
        if fate is FrameFate.DUPLICATE:
            queue.append(frame)
        self._arrive(direction, frame)

    def _arrive(self, direction: Direction, frame: Frame) -> None:
        if direction is Direction.TO_PREFILL:
            self.on_prefill_frame(frame)
        else:
            self.on_decode_frame(frame)

    def lose_link(self, data_path: bool = False) -> None:
        """The control connection dies (and with ``data_path``, NIXL reports the peer gone):
        frames in flight are lost, every bound room hears ``PeerLost``."""
        if self.link_alive:
            self.faults.append("link lost")
            self.link_alive = False
            for queue in self.queues.values():
                queue.clear()
            self.pending = None
            reason = "control link lost"
            if self.sender_bound:
                self.sender_bound = False
                self.deliver(Role.SENDER, PeerLost(reason))
            if self.receiver_bound:
                self.receiver_bound = False
                # ControlPlane._lose on decode: no acknowledgement can come over this link, so
                # the room's pages are declared free once prefill cannot be writing any more.
                self.grace_due = self.now + self.config.peer_lost_grace_s
                self.deliver(Role.RECEIVER, PeerLost(reason))
        if data_path and self.peer_alive:
            self.faults.append("peer lost")
            self.peer_alive = False
            # NixlTransport._failed on a remote disconnect: the room fails with peer-lost first,
            # then each errored handle settles its chunk. Nothing more lands from a dead peer.
            active = [c for c in self.chunks.values() if c.phase == "active"]
            if active or any(c.phase == "quarantined" for c in self.chunks.values()):
                self.deliver(Role.SENDER, PeerLost("NIXL remote disconnect"))
            for chunk in active:
                self._final(chunk, ChunkFailed(chunk.command.chunk, "remote disconnect"))

    # -- the transport -------------------------------------------------------------------------

    def _accept(self, command: PostChunk) -> None:
        assert command.chunk not in self.chunks, "chunk id reused"
        self.chunks[command.chunk] = _Chunk(command, self.next_plan)

    def queued(self) -> list[int]:
        return [c for c, ch in self.chunks.items() if ch.phase == "queued"]

    def post_next(self) -> bool:
        """The poster thread takes the oldest accepted chunk. False when there is none."""
        queued = self.queued()
        if not queued:
            return False
        self._post_chunk(self.chunks[queued[0]])
        return True

    def post_all(self) -> None:
        # The poster posts within microseconds: before any virtual second passes.
        while self.post_next():
            pass

    def _post_chunk(self, chunk: _Chunk) -> None:
        cmd, fate = chunk.command, chunk.plan.fate
        has_aux = cmd.is_last and cmd.src_aux >= 0 and cmd.dst_aux >= 0
        if chunk.dropped:
            self._final(chunk, ChunkFailed(cmd.chunk, "dropped: room failed before posting"))
        elif not self.peer_alive:
            self._final(chunk, ChunkFailed(cmd.chunk, f"no connected peer {cmd.peer!r}"))
        elif not cmd.src and not has_aux and not cmd.src_state:
            self._final(chunk, ChunkDone(cmd.chunk))  # nothing to move: no NIXL at all
        elif fate is ChunkFate.COMPLETE:
            self.land(chunk, 1.0)
            self._final(chunk, ChunkDone(cmd.chunk))
        elif fate is ChunkFate.ERROR_ON_POST:
            self._final(chunk, ChunkFailed(cmd.chunk, "transfer() raised"))
        else:
            chunk.phase = "active"
            chunk.due = self.now + self.config.chunk_deadline_s
            if fate in (ChunkFate.DELAYED, ChunkFate.ERROR_ON_COMPLETION):
                chunk.complete_at = self.now + chunk.plan.delay

    def land(self, chunk: _Chunk, fraction: float) -> None:
        """Bytes of ``chunk`` land in the receiver's memory: the first ``fraction`` of its pages
        (all of them, the aux row and the state rows when 1.0)."""
        cmd = chunk.command
        src, dst = _ints(cmd.src), _ints(cmd.dst)
        n = len(src) if fraction >= 1.0 else int(len(src) * fraction)
        nbytes = 0
        if n:
            self.dst_kv[dst[:n]] = self.src_kv[src[:n]]
            nbytes += n * self.config.page_bytes
        if fraction >= 1.0:
            if cmd.is_last and cmd.src_aux >= 0 and cmd.dst_aux >= 0:
                self.dst_aux[cmd.dst_aux] = self.src_aux[cmd.src_aux]
                nbytes += self.config.page_bytes
            if cmd.src_state:
                self.dst_state[_ints(cmd.dst_state)] = self.src_state[_ints(cmd.src_state)]
                nbytes += len(_ints(cmd.src_state)) * self.config.page_bytes
        if nbytes:
            sender = self.sender_room
            self.writes.append(
                Write(
                    self.now,
                    cmd.chunk,
                    nbytes,
                    receiver_settled=self.receiver_room.publication.settled,
                    sender_settled=sender is not None and sender.publication.settled,
                )
            )

    def _final(self, chunk: _Chunk, event: ChunkDone | ChunkFailed) -> None:
        chunk.phase = "final"
        chunk.finals.append(event)
        self.deliver(Role.SENDER, event)

    def _chunk_timer(self, chunk: _Chunk) -> float:
        if chunk.phase == "active":
            return min(chunk.complete_at, chunk.due)
        if chunk.phase == "quarantined":
            return min(chunk.land_at, chunk.quarantine_end)
        return _INF

    def _fire_chunk(self, chunk: _Chunk) -> None:
        cmd, fate = chunk.command, chunk.plan.fate
        if chunk.phase == "active":
            if chunk.complete_at <= chunk.due and self.now >= chunk.complete_at:
                if fate is ChunkFate.ERROR_ON_COMPLETION:
                    self.land(chunk, 0.5)
                    self._final(chunk, ChunkFailed(cmd.chunk, "handle reported ERR"))
                else:
                    self.land(chunk, 1.0)
                    self._final(chunk, ChunkDone(cmd.chunk))
                return
            # NixlTransport._stall: released, reported stalled, failed after the quarantine.
            chunk.phase = "quarantined"
            chunk.quarantine_end = self.now + self.config.quarantine_s
            if fate is ChunkFate.STALL_LANDS:
                chunk.land_at = self.now + self.config.quarantine_s / 2
            elif fate is ChunkFate.DELAYED and chunk.complete_at < chunk.quarantine_end:
                chunk.land_at = chunk.complete_at  # the cancel came too late to stop it
            self.deliver(Role.SENDER, ChunkStalled(cmd.chunk, "in flight past its deadline"))
        elif self.now >= chunk.land_at:
            chunk.land_at = _INF
            self.land(chunk, 1.0)
        else:
            self.quarantine_over(chunk)

    def quarantine_over(self, chunk: _Chunk) -> None:
        self._final(chunk, ChunkFailed(chunk.command.chunk, "stalled; quarantine over"))

    # -- the clock -----------------------------------------------------------------------------

    def _timers(self) -> list[tuple[float, Callable[[], None]]]:
        timers: list[tuple[float, Callable[[], None]]] = []
        for room in self.rooms():
            t = room.next_timer()
            if t < _INF:
                timers.append((t, self._room_timer(room)))
        for chunk in self.chunks.values():
            t = self._chunk_timer(chunk)
            if t < _INF:
                timers.append((t, functools.partial(self._fire_chunk, chunk)))
        if self.pending is not None and self._current(Role.SENDER) is None:
            t = self.pending[0] + self.config.pending_ttl_s
            timers.append((t, self._expire_pending))
        if self.grace_due < _INF:
            timers.append((self.grace_due, self._settle_lost))
        # A paused direction resumes by itself: nothing fires, but the drain must get there.
        timers.extend(
            (self.paused_until[d], _nothing)
            for d in Direction
            if self.queues[d] and self.paused_until[d] > self.now
        )
        return timers

    def _room_timer(self, room: ScriptedRoom) -> Callable[[], None]:
        def fire() -> None:
            if room.reaped:
                return
            role = room.role
            before = room.core.state
            commands = room.fire_timer(self.now)
            if room.core.state is KVPoll.Success and before is not KVPoll.Success:
                self.success_snapshots.append((role, *self.destination()))
            self.execute(role, commands)

        return fire

    def _expire_pending(self) -> None:
        """``ControlPlane._expire_pending``: metadata no sender room claimed in time."""
        if self.pending is None:
            return
        self.pending = None
        self.send(Direction.TO_DECODE, Outcome(KVPoll.Failed, "no prefill room in time"))
        if self.expiry_settles:
            self.send(Direction.TO_DECODE, Settled())

    def _settle_lost(self) -> None:
        """``ControlPlane._settle_lost``: the grace after the link loss is over. A room that
        settled meanwhile, or was reaped, drops it as a late or stale event."""
        self.grace_due = _INF
        self.deliver(Role.RECEIVER, PeerSettled(self.request.peer_rank))

    def next_timer(self) -> float:
        return min((t for t, _ in self._timers()), default=_INF)

    def deliver_ready(self) -> None:
        """Deliver every frame the link can deliver now, in order per direction. A live TCP
        stream delivers within milliseconds, long before a virtual second passes; a longer
        hold-up is a DELAY (at most ``silence_s``: heartbeats share the stream, so a stream
        stuck longer is declared lost by the watchdog) or a lost link."""
        while True:
            ready = [d for d in Direction if self.can_step(d)]
            if not ready:
                return
            self.step_link(ready[0], FrameFate.DELIVER)

    def advance(self, seconds: float) -> None:
        """Move the clock, firing every timer that falls due on the way, in time order. Before
        any time passes the poster posts and the link delivers (both take microseconds)."""
        target = self.now + seconds
        while True:
            self.post_all()
            self.deliver_ready()
            timers = self._timers()
            if not timers:
                break
            t, fire = min(timers, key=lambda item: item[0])
            if t > target:
                break
            self.now = max(self.now, t)
            fire()
        self.now = max(self.now, target)

    # -- the end of an episode -----------------------------------------------------------------

    def drain(self, max_steps: int = 10_000) -> None:
        """Faults stop: prefill's room exists, the poster posts, the link delivers in order,
        and the clock jumps from timer to timer until nothing is left to happen."""
        self.spawn_sender()
        for _ in range(max_steps):
            if self.post_next():
                continue
            if self.resolving:
                self.resolve(ok=True)
                continue
            ready = [d for d in Direction if self.can_step(d)]
            if ready:
                self.step_link(ready[0], FrameFate.DELIVER)
                continue
            t = self.next_timer()
            if t == _INF:
                return
            self.advance(max(0.0, t - self.now))
        raise RuntimeError(f"drain did not converge in {max_steps} steps")
