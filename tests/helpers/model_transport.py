"""The prefill transport of the model: ``NixlTransport``'s IO (accepting, the poster thread,
the pump, quarantine timers, peers) around the production ``ChunkLedger`` and ``Leases``, and
what the model's NIXL does with each chunk (its :class:`ChunkFate`)."""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from kvfsm.rooms._actor import RoomKey
from kvfsm.states import (
    ChunkDone,
    ChunkFailed,
    Command,
    Event,
    PostChunk,
    ReleaseHandles,
)
from kvfsm.transport import _ledger as ledger
from kvfsm.transport._fence import Leases
from tests.helpers.model_world import ChunkFate, ChunkPlan, Side, Timer

if TYPE_CHECKING:
    from tests.helpers.model_processes import PrefillProcess

_INF: Final = math.inf
#: Fates whose released bytes land at the release (a flush); STALL_LATE lands later.
_FLUSHED: Final = frozenset({ChunkFate.DONE_LATER, ChunkFate.ERR_LATER, ChunkFate.STALL_FLUSH})


class NixlPeer:
    """A transport peer generation (identity is what the ledger compares)."""

    def __init__(self, peer_id: str, generation: int) -> None:
        self.peer_id = peer_id
        self.generation = generation

    def __repr__(self) -> str:
        return f"<NixlPeer {self.peer_id} gen {self.generation}>"


@dataclass(slots=True)
class TransferPart:
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
        parts: list[TransferPart],
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


def unpack_ints(packed: bytes) -> list[int]:
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
        self._poster: Timer | None = None
        self._pump: Timer | None = None
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
        src, dst = unpack_ints(command.src), unpack_ints(command.dst)
        if src:
            parts.append(TransferPart("kv", src, dst))
        if command.is_last and command.src_aux >= 0 and command.dst_aux >= 0:
            parts.append(TransferPart("aux", [command.src_aux], [command.dst_aux]))
        if command.src_state:
            parts.append(
                TransferPart(
                    "state", unpack_ints(command.src_state), unpack_ints(command.dst_state)
                )
            )
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
