"""The sans-IO core of the data path: which chunks exist, where each one is, and what ends it.

``ChunkLedger`` knows no NIXL, no asyncio, no threads and no clock. It is told what happened
(a chunk accepted, posted, polled; a peer lost; a lease gone; a quarantine over; a room asking
to release) with ``now`` passed in, and answers with *actions* that
:class:`~kvfsm.transport.NixlTransport` executes: ``Post`` (hand the record to the poster),
``Release`` (release every handle the record holds), ``Deliver`` (an event to a room),
``StartQuarantine`` (call ``quarantine_over`` at ``until``), ``PostFlush`` / ``CancelFlush``
(a flush of one peer generation, answered by ``flushed`` or ``flush_failed``) and ``Finish``
(release what is left, then deliver the record's final event). Decide first, then do IO.
Records and actions are defined in :mod:`kvfsm.transport._records`; the rules are here.

Rules
-----

A record is one accepted chunk. It moves through five phases, only forward and only along an
edge of ``PHASES`` (:mod:`kvfsm.transport._phases`, which names each edge's event): ``_move`` is
the one place a phase changes, and it raises ``PhaseError`` on an edge the table lacks. A new
record is accepted (QUEUED) or refused under rule 3 (FINAL); then:

    QUEUED --posted: in progress--> ACTIVE --polled: over--> FINAL
      |                               |
      |                               +--deadline | peer lost | lease gone | NIXL raised--> HELD
      +--posted: over, or nothing posted--> FINAL                                          |
      +--posted: part in flight and it failed, or its peer was lost--> HELD                |
                                            quarantine over, and flushed or peer lost --> FINAL

and a fenced-out agent (``abandon``) or a shutdown (``drain``) ends every record at once.

1. **Exactly one final event.** Every accepted record gets exactly one ``ChunkDone`` or
   ``ChunkFailed`` (``Finish``), and then the ledger forgets it. A record refused at
   acceptance is never stored and gets its ``Finish`` at once.
2. **Final means settled** (law 4). A record becomes final only when none of its handles can
   move another byte: every posted handle reported DONE or ERR, nothing was posted, or its
   handles were released, a quarantine of ``quarantine_s`` is over **and a flush of its peer
   proved the WRITE over**. ``ChunkStalled`` (room fails at once) precedes every quarantine;
   the ``ChunkFailed`` after it settles the pages.

   *Flushes.* Releasing a handle does not cancel its WRITE: over UCX's TCP transport (and any
   transport the target's own progress drives) the bytes wait in the writer's queue and the
   socket until the target progresses, however long it is frozen, and land then. A time-based
   quarantine therefore proves nothing when the target is stopped. What does is a *flush*: a
   small READ from the same peer generation (``PostFlush``), posted after the held record's
   WRITE. NIXL's UCX backend ends every request with an endpoint flush, and UCX completes a
   flush only once every operation posted on that endpoint before it has completed at the
   target, released ones included, so the READ's DONE (``flushed(peer, seq)``) means the held
   WRITE has landed, or never will. A held record needs the first flush *posted* after it was
   held; one flush per peer is in flight at a time, the next posted when it ends if a record
   still needs it. A flush that NIXL refuses (``flush_failed``) is posted again later. A record
   of a lost peer generation (rule 6) needs no flush: its endpoint is gone with it.
3. **Fences.** With leases configured, a chunk is accepted only with a valid lease on its
   fence (fence 0 is refused: an unfenced chunk on a fenced transport). The poster checks the
   lease again right before each part's ``transfer()``; a chunk stopped there before its
   first part fails settled, one stopped after a part that is still in progress is held.
   Before every progress of the agent the pump asks ``leases_checked``: an ACTIVE record whose
   lease is gone is released and held at once, instead of waiting for its deadline.
4. **Deadlines.** An ACTIVE record still in progress past ``due`` (``now`` at acceptance plus
   ``deadline_s(nbytes)``) is released and held (``chunks_stalled``).
5. **Errors.** ERR from NIXL means that handle writes nothing more: a chunk none of whose
   handles is still in progress ends (``ChunkFailed`` if any errored). A chunk with a handle
   still in progress waits for it, whatever its siblings say. NIXL raising on a record fails it
   settled, unless a part is in flight or its peer is lost: then it is held (the error does not
   end a WRITE already posted). Bad input found by the poster (``rejected``) fails settled.
6. **Lost peers.** ``peer_lost`` (a remote disconnect, or the peer connected again as a new
   generation, whose old lists and agent then go) tells every record of that generation's room
   ``PeerLost``, marks each one dropped (the poster skips it if it has not reached it yet) and
   holds the ACTIVE ones: their remote agent is about to be removed, after which NIXL says ERR
   for reasons that say nothing about the WRITE. A record of a lost peer that comes back from
   the poster with handles is held too. The generation is forgotten with its last record.
   Its held records wait for no flush (an endpoint that failed moves nothing more; a peer that
   came back as a new incarnation is another process), and its flush in flight is cancelled
   (``CancelFlush``: the handle goes before the remote agent does).
7. **Release requests** (a room failed) only mark the room's records dropped: one the poster
   has not reached yet is skipped and fails settled ("dropped"); a posted one is still polled
   until it is over or hits a rule above. Handles belong to the ledger, not to rooms.

8. **Chunks posted together.** A record may carry several chunks (``members``: each one's
   room, chunk number and bytes), of one or several rooms, posted to one peer generation under
   one fence as one NIXL request. The record is still the unit of every rule above: its
   handles are polled, held, released and judged together, and when it ends each of its
   chunks gets its own final event (``Finish.events``), so rule 1 holds per chunk. A release
   request marks it dropped only once every room in it asked (the others' chunks are still
   wanted; a failed room's chunk that is posted anyway settles when the record does).

Hot path: a chunk done inside ``transfer()`` costs ``accepted`` (one ``Post``) and ``posted``
(one ``Finish``); a pump round costs one ``polled`` per ACTIVE record, which allocates nothing
while the record stays in progress.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvfsm.rooms import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, ChunkStalled, PeerLost
from kvfsm.transport._fence import Leases
from kvfsm.transport._phases import Phase, PhaseEvent, step
from kvfsm.transport._records import (
    Action,
    CancelFlush,
    Deliver,
    Finish,
    Member,
    Post,
    PostFlush,
    Record,
    Release,
    StartQuarantine,
)

__all__ = [
    "ACTIVE",
    "DROPPED",
    "ERR_REASON",
    "FINAL",
    "HELD",
    "NEW",
    "QUEUED",
    "Action",
    "CancelFlush",
    "ChunkLedger",
    "Deliver",
    "Finish",
    "LedgerStats",
    "Member",
    "Post",
    "PostFlush",
    "Record",
    "Release",
    "StartQuarantine",
]

# The phases by their old names: the pump and the tests compare a record's phase with them.
NEW: Final = Phase.NEW
QUEUED: Final = Phase.QUEUED
ACTIVE: Final = Phase.ACTIVE
HELD: Final = Phase.HELD
FINAL: Final = Phase.FINAL

_E: Final = PhaseEvent  # (short: every phase change below names its event)

_DONE: Final = "DONE"
_PROC: Final = "PROC"
#: Why a chunk failed when NIXL reported a handle's state as "ERR" (no exception to describe).
ERR_REASON: Final = "NIXL reported the transfer as failed (ERR)"


_NOTHING: Final[list[Action]] = []  # returned, never appended to


@dataclass(slots=True)
class LedgerStats:
    """The ledger's counters (loop thread). ``TransportStats`` extends it."""

    chunks_done: int = 0
    chunks_failed: int = 0
    chunks_rejected: int = 0  # bad input (the transport counts those refused at acceptance)
    chunks_dropped: int = 0  # the room failed before the poster reached the chunk
    chunks_stalled: int = 0  # past the deadline
    chunks_fenced: int = 0  # stopped by an invalid lease (at acceptance, posting or in flight)
    chunks_quarantined: int = 0
    flushes_posted: int = 0  # rule 2: flushes asked for (retries included)
    flushes_done: int = 0
    flushes_failed: int = 0  # NIXL refused or failed one (it is posted again)
    done_at_post: int = 0
    bytes_done: int = 0


class _Flushes:
    """Rule 2's bookkeeping for one peer generation: the last flush number posted, and
    whether it is still in flight."""

    __slots__ = ("in_flight", "posted")

    def __init__(self) -> None:
        self.posted = 0
        self.in_flight = False


#: How long after NIXL refused a flush the next one is posted.
FLUSH_RETRY_S: Final = 0.05


class ChunkLedger:
    """Records, the pump's active list, held records and lost peers; see the module rules.
    Not thread-safe: the loop thread owns it."""

    __slots__ = (
        "_active",
        "_deadline_s",
        "_flushes",
        "_held",
        "_leases",
        "_lost",
        "_quarantine_s",
        "_records",
        "stats",
    )

    def __init__(
        self,
        *,
        deadline_s: Callable[[int], float],
        quarantine_s: float,
        leases: Leases | None = None,
        stats: LedgerStats | None = None,
    ) -> None:
        self._deadline_s = deadline_s
        self._quarantine_s = quarantine_s
        self._leases = leases
        self.stats = stats if stats is not None else LedgerStats()
        self._records: set[Record] = set()  # accepted, not final
        # ACTIVE records for the next pump round. Records held meanwhile are skipped, not
        # removed (phase check), so a peer loss never scans this list.
        self._active: list[Record] = []
        self._held: set[Record] = set()
        self._lost: dict[Any, int] = {}  # lost peer generation -> its records not final
        self._flushes: dict[Any, _Flushes] = {}  # peer generation -> its flushes (rule 2)

    # -- reads ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Records accepted and not final (held ones included)."""
        return len(self._records)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def active(self) -> int:
        """Records waiting for the next pump round (some may have been held meanwhile)."""
        return len(self._active)

    @property
    def busy(self) -> bool:
        """The pump has work: something is (or may be) in progress, or held."""
        return bool(self._active or self._held)

    def lost(self, peer: Hashable) -> bool:
        return peer in self._lost

    @property
    def awaiting_flush(self) -> int:
        """Held records whose quarantine is over but no flush has proved them yet (their
        peer has not made their WRITE's bytes land: frozen, or unreachable)."""
        return sum(1 for r in self._held if r.quarantined and r.flush)

    def records(self) -> list[Record]:
        return list(self._records)

    # -- what happened -------------------------------------------------------------------------

    def accepted(self, record: Record, now: float) -> list[Action]:
        """The transport validated ``record`` (loop thread, inside a room's command): post it,
        or refuse it under rule 3. A refusal's ``Finish`` should be delivered after the
        current callback (the room is mid-command)."""
        record.t0 = now
        record.due = now + self._deadline_s(record.nbytes)
        leases = self._leases
        if leases is not None:
            fence = record.fence
            if fence == 0:
                return [self._refuse(record, "unfenced chunk on a fenced transport: not posted")]
            if not leases.valid(fence, now):
                why = leases.describe(fence, now)
                return [self._refuse(record, f"write lease of fence {fence} {why}: not posted")]
        _move(record, _E.ACCEPTED)
        self._records.add(record)
        return [Post(record)]

    def posted(self, record: Record, now: float) -> list[Action]:
        """The poster posted every part of ``record``, or skipped it (dropped)."""
        if record.phase != QUEUED:
            return self._stray(record)
        states = record.states
        if record.handles and record.peer in self._lost:
            # Posted while its peer was being lost: its state means nothing now.
            return self._hold(record, _E.PEER_LOST, "peer lost while posting; released", now)
        if not states:
            self.stats.chunks_dropped += len(record.members)
            return [self._finish(record, ChunkFailed(record.chunk, DROPPED))]
        if _PROC not in states:
            if states.count(_DONE) != len(states):
                return [self._finish(record, ChunkFailed(record.chunk, ERR_REASON))]
            self.stats.done_at_post += len(record.members)
            return [self._finish(record, ChunkDone(record.chunk))]
        _move(record, _E.POSTED)
        self._active.append(record)
        return _NOTHING

    def rejected(self, record: Record, reason: str) -> list[Action]:
        """The poster found bad input before posting anything (a page out of range)."""
        if record.phase != QUEUED:
            return self._stray(record)
        self.stats.chunks_rejected += len(record.members)
        return [self._finish(record, ChunkFailed(record.chunk, reason))]

    def fenced(self, record: Record, reason: str, now: float) -> list[Action]:
        """The poster found the lease invalid right before a part's ``transfer()``: that part
        and the later ones were not posted; ``record.states`` says what the earlier ones did."""
        if record.phase != QUEUED:
            return self._stray(record)
        self.stats.chunks_fenced += len(record.members)
        return self._stopped(record, _E.FENCED, reason, now)

    def errored(self, record: Record, reason: str, now: float) -> list[Action]:
        """NIXL raised while posting ``record`` or checking its handles. A remote disconnect
        is the caller's to report (``peer_lost``) first."""
        return self._stopped(record, _E.RAISED, reason, now)

    def pending(self) -> Sequence[Record]:
        """The records the next pump round will poll (a view: do not keep it)."""
        return self._active

    def take_active(self) -> list[Record]:
        """The pump's batch for one round; each one that is still ACTIVE goes to ``polled``."""
        batch, self._active = self._active, []
        return batch

    def polled(self, record: Record, states: list[str], now: float) -> list[Action]:
        """The pump checked every handle of ``record`` (``states``, in order)."""
        if record.phase != ACTIVE:
            return _NOTHING  # held or over meanwhile: its handles are released
        if record.peer in self._lost:
            return self._hold(record, _E.PEER_LOST, "peer lost; released", now)
        if _PROC not in states:
            # Over: done, or errored. An errored handle writes nothing more, so the chunk
            # fails settled; a chunk with a handle still in flight waits for it (or for its
            # deadline) even if another of its handles errored.
            if states.count(_DONE) != len(states):
                return [self._finish(record, ChunkFailed(record.chunk, ERR_REASON))]
            return [self._finish(record, ChunkDone(record.chunk))]
        if now > record.due:
            self.stats.chunks_stalled += len(record.members)
            deadline = self._deadline_s(record.nbytes)
            why = f"in flight past its {deadline:g}s deadline; released"
            return self._hold(record, _E.STALLED, why, now)
        self._active.append(record)
        return _NOTHING

    def leases_checked(self, now: float) -> list[Action]:
        """Before the pump progresses the agent: hold every ACTIVE record whose lease is gone.
        Rule 3: progressing moves queued bytes of a progress-driven WRITE, and the owner may
        already count on its pages."""
        leases = self._leases
        if leases is None or not self._active:
            return _NOTHING
        out: list[Action] | None = None
        for record in self._active:
            if record.phase == ACTIVE and not leases.valid(record.fence, now):
                self.stats.chunks_fenced += len(record.members)
                why = leases.describe(record.fence, now)
                why = f"write lease of fence {record.fence} {why}"
                held = self._hold(record, _E.FENCED, why, now)
                if out is None:
                    out = held
                else:
                    out += held
        return _NOTHING if out is None else out

    def peer_lost(self, peer: Hashable, reason: str, now: float) -> list[Action]:
        """The peer generation ``peer`` is gone (a remote disconnect); its remote agent is
        about to be removed, so every handle to it is released first (rule 6)."""
        out: list[Action] = []
        records = [r for r in self._records if r.peer is peer]
        if records:
            self._lost[peer] = len(records)  # (before _hold: it needs no flush now)
        for record in records:
            out += [Deliver(key, PeerLost(reason)) for key in _rooms(record)]
            record.dropped = True  # not posted yet: the poster skips it
            if record.phase == ACTIVE:
                out += self._hold(record, _E.PEER_LOST, f"peer lost ({reason}); released", now)
            elif record.phase == HELD and record.flush:
                # Its flush can never come now: the endpoint is gone (rule 6).
                record.flush = 0
                if record.quarantined:
                    out.append(self._settle_held(record))
        flushes = self._flushes.pop(peer, None)
        if flushes is not None and flushes.in_flight:
            out.append(CancelFlush(peer))
        return out

    def quarantine_over(self, record: Record) -> list[Action]:
        """The quarantine ``StartQuarantine`` asked for has passed."""
        if record.phase != HELD:
            return _NOTHING
        record.quarantined = True
        if record.flush:
            return _NOTHING  # its WRITE is not proven over yet (rule 2): the flush ends it
        return [self._settle_held(record)]

    def flushed(self, peer: Hashable, seq: int, now: float) -> list[Action]:
        """Flush ``seq`` of ``peer`` reached DONE: every WRITE posted to that peer before it
        has completed at the target (rule 2)."""
        flushes = self._flushes.get(peer)
        if flushes is None or seq != flushes.posted or not flushes.in_flight:
            return _NOTHING  # cancelled meanwhile (its generation was lost)
        flushes.in_flight = False
        self.stats.flushes_done += 1
        out: list[Action] = []
        later = False
        for record in [r for r in self._held if r.peer is peer and r.flush]:
            if record.flush <= seq:
                record.flush = 0
                if record.quarantined:
                    out.append(self._settle_held(record))
            else:
                later = True
        if later:  # held after this flush was posted: the next one proves them
            out.append(self._next_flush(peer, flushes, now))
        elif not any(r.peer is peer for r in self._held):
            self._flushes.pop(peer, None)  # (settling its last record may have dropped it)
        return out

    def flush_failed(self, peer: Hashable, seq: int, reason: str, now: float) -> list[Action]:
        """NIXL refused flush ``seq`` of ``peer``, or reported it ERR, without a remote
        disconnect (that one is ``peer_lost``): it proves nothing, so another is posted, a
        little later. Its records stay held meanwhile."""
        flushes = self._flushes.get(peer)
        if flushes is None or seq != flushes.posted or not flushes.in_flight:
            return _NOTHING
        flushes.in_flight = False
        self.stats.flushes_failed += 1
        return [self._next_flush(peer, flushes, now + FLUSH_RETRY_S)]

    def tracks(self, key: RoomKey, chunk: int) -> bool:
        """Whether chunk ``chunk`` of room ``key`` is in an accepted record not yet final. A
        scan: for error paths, not per chunk."""
        return any(k == key and c == chunk for r in self._records for k, c, _ in r.members)

    def release_requested(self, key: RoomKey) -> list[Action]:
        """The room ``key`` failed and asks to release its chunks (rule 7)."""
        for record in self._records:
            if len(record.members) == 1:
                if record.key == key:
                    record.dropped = True  # the poster skips it if it has not posted it yet
                continue
            rooms = _rooms(record)
            if key in rooms:  # rule 8: dropped once every room in it asked
                asked = record._asked = (record._asked or set()) | {key}
                record.dropped = len(asked) == len(rooms)
        return _NOTHING

    def abandon(self, reason: str) -> list[Action]:
        """The agent is fenced out (``Leases.progress_allowed``): every posted record fails now
        (the caller must not release their handles: that would touch the agent). Records still
        with the poster fail there (no lease is valid any more)."""
        posted = [r for r in self._records if r.phase in (ACTIVE, HELD)]
        out: list[Action] = [
            self._finish(r, ChunkFailed(r.chunk, reason), _E.ABANDONED) for r in posted
        ]
        self._active.clear()
        self._held.clear()
        self._flushes.clear()  # (the pump keeps its flush handles, as it keeps the others)
        return out

    def drain(self) -> list[Record]:
        """Shutdown: forget everything; the caller releases the returned records' handles.
        No final events: the rooms are gone."""
        records = list(self._records)
        for record in records:
            _move(record, _E.DRAINED)
        self._records.clear()
        self._active.clear()
        self._held.clear()
        self._lost.clear()
        self._flushes.clear()
        return records

    def flushes_in_flight(self) -> list[Any]:
        """The peers with a flush in flight (shutdown: the caller releases their handles)."""
        return [peer for peer, f in self._flushes.items() if f.in_flight]

    # -- steps ---------------------------------------------------------------------------------

    def _stopped(self, record: Record, event: PhaseEvent, reason: str, now: float) -> list[Action]:
        """The poster or NIXL stopped ``record`` (``event``: its lease, or NIXL raising)."""
        if record.phase not in (QUEUED, ACTIVE):
            return _NOTHING  # over or held meanwhile (its peer was lost first)
        if record.handles and (record.peer in self._lost or _PROC in record.states):
            # A part was posted and may still move bytes (an earlier part when a later one
            # failed to post; any, once its peer is lost): the error does not end that WRITE.
            return self._hold(record, event, f"{reason}; released", now)
        return [self._finish(record, ChunkFailed(record.chunk, reason))]

    def _hold(self, record: Record, event: PhaseEvent, reason: str, now: float) -> list[Action]:
        """Release now, tell the room it stalled, settle after the quarantine (rule 2)."""
        _move(record, event)
        record.reason = reason
        self._held.add(record)
        self.stats.chunks_quarantined += len(record.members)
        out: list[Action] = [Release(record)]
        out += [Deliver(key, ChunkStalled(chunk, reason)) for key, chunk, _ in record.members]
        out.append(StartQuarantine(record, now + self._quarantine_s))
        peer = record.peer
        if peer not in self._lost:
            # Rule 2: the first flush posted from now on proves this WRITE over.
            flushes = self._flushes.get(peer)
            if flushes is None:
                flushes = self._flushes[peer] = _Flushes()
            record.flush = flushes.posted + 1
            if not flushes.in_flight:
                out.append(self._next_flush(peer, flushes, now))
        return out

    def _next_flush(self, peer: Any, flushes: _Flushes, not_before: float) -> PostFlush:
        flushes.posted += 1
        flushes.in_flight = True
        self.stats.flushes_posted += 1
        return PostFlush(peer, flushes.posted, not_before)

    def _settle_held(self, record: Record) -> Finish:
        """A held record whose quarantine is over and whose WRITE is proven over (rule 2)."""
        self._held.discard(record)
        over = f"{record.reason}; quarantine of {self._quarantine_s:g}s over"
        flushes = self._flushes.get(record.peer)
        if (
            flushes is not None
            and not flushes.in_flight
            and not any(r.peer is record.peer for r in self._held)
        ):
            del self._flushes[record.peer]
        return self._finish(record, ChunkFailed(record.chunk, over), _E.SETTLED)

    def _finish(
        self, record: Record, event: ChunkDone | ChunkFailed, why: PhaseEvent | None = None
    ) -> Finish:
        """``record`` is final with ``event``; ``why``: its phase event (default DONE | FAILED)."""
        if why is None:
            why = _E.DONE if type(event) is ChunkDone else _E.FAILED
        _move(record, why)
        self._records.discard(record)
        lost = self._lost
        if lost:
            left = lost.get(record.peer)
            if left is not None:
                if left > 1:
                    lost[record.peer] = left - 1
                else:
                    del lost[record.peer]  # its last chunk is over: nothing left to judge
        stats = self.stats
        if type(event) is ChunkDone:
            stats.chunks_done += len(record.members)
            stats.bytes_done += record.nbytes
        else:
            stats.chunks_failed += len(record.members)
        return Finish(record, event)

    def _refuse(self, record: Record, reason: str) -> Finish:
        _move(record, _E.REFUSED)
        self.stats.chunks_fenced += len(record.members)
        self.stats.chunks_failed += len(record.members)
        return Finish(record, ChunkFailed(record.chunk, reason))

    def _stray(self, record: Record) -> list[Action]:
        # The poster handed back a record the ledger no longer tracks (drained at shutdown):
        # nothing to decide, but its handles must not leak.
        return [Release(record)] if record.handles else _NOTHING


def _move(record: Record, event: PhaseEvent) -> None:
    """The one place a record's phase changes: along the table's edge for ``event``, or
    ``PhaseError`` (rule 1 of ``kvfsm.transport._phases``)."""
    record.phase = step(record.phase, event)


def _rooms(record: Record) -> dict[RoomKey, None]:
    """The rooms of ``record``'s chunks, each once, in order."""
    return dict.fromkeys(key for key, _, _ in record.members)


#: Why a chunk failed whose room failed before it was posted (rule 7).
DROPPED: Final = "dropped: room failed before posting"
