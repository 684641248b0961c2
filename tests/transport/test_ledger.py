"""The chunk ledger, driven directly with plain values for ``now`` (no NIXL, no loop).

One test per rule of ``kvfsm.transport._ledger``, then a hypothesis state machine that plays
the transport (poster, pump, timers, peers, leases, rooms) around the production ledger with
a physical model of every handle and every flush: whatever the order, every accepted chunk gets
exactly one final event, none is final while a handle of it may still move bytes (unless its
peer generation was lost: a released WRITE in doubt ends only when a flush posted after it
proved it over), and nothing is left once the world lets every WRITE end. Its records carry one to
three chunks of up to three rooms (rule 8), as the transport's merged requests do.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfsm.rooms._actor import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, ChunkStalled, Event, PeerLost
from kvfsm.transport import Leases
from kvfsm.transport._ledger import (
    ACTIVE,
    ERR_REASON,
    FINAL,
    HELD,
    QUEUED,
    Action,
    CancelFlush,
    ChunkLedger,
    Deliver,
    Finish,
    Post,
    PostFlush,
    Record,
    Release,
    StartQuarantine,
)

KEY = RoomKey(1, 1)
OTHER = RoomKey(2, 1)
Q = 2.0  # quarantine_s
DEADLINE = 1.0


class Peer:
    """A peer generation: identity is what the ledger compares."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Peer {self.name}>"


PEER = Peer("decode")


def ledger(leases: Leases | None = None) -> ChunkLedger:
    return ChunkLedger(deadline_s=lambda nbytes: DEADLINE, quarantine_s=Q, leases=leases)


def record(key: RoomKey = KEY, chunk: int = 0, peer: Any = PEER, fence: int = 0) -> Record:
    return Record(key, chunk, peer, 4096, fence)


def accept(book: ChunkLedger, rec: Record, now: float = 0.0) -> Record:
    actions = book.accepted(rec, now)
    assert len(actions) == 1
    assert isinstance(actions[0], Post)
    assert actions[0].record is rec
    return rec


def post(rec: Record, *states: str, released_at_post: bool | None = None) -> None:
    """What the poster leaves on a record: one handle and one state per part; the handles are
    released at post when every part was DONE."""
    rec.handles = [object() for _ in states]
    rec.states = list(states)
    if released_at_post is None:
        released_at_post = all(s == "DONE" for s in states)
    if released_at_post:
        rec.handles = []


def only_finish(actions: list[Action]) -> Finish:
    assert len(actions) == 1, actions
    assert isinstance(actions[0], Finish), actions
    return actions[0]


def held(actions: list[Action], rec: Record, until: float) -> str:
    """Assert ``actions`` hold ``rec`` (release, stalled, quarantine, and the flush that will
    prove its WRITE over, unless one is in flight already); return the reason."""
    types = [type(a) for a in actions]
    if types == [Release, Deliver, StartQuarantine, PostFlush]:
        flush = actions.pop()
        assert isinstance(flush, PostFlush)
        assert flush.peer is rec.peer
        assert rec.flush == flush.seq
    assert [type(a) for a in actions] == [Release, Deliver, StartQuarantine], actions
    release, deliver, start = actions
    assert isinstance(release, Release)
    assert isinstance(deliver, Deliver)
    assert isinstance(start, StartQuarantine)
    assert release.record is rec
    assert start.record is rec
    assert start.until == pytest.approx(until)
    assert deliver.key == rec.key
    assert isinstance(deliver.event, ChunkStalled)
    assert deliver.event.chunk == rec.chunk
    assert rec.phase == HELD
    return deliver.event.reason


def flushed(book: ChunkLedger, rec: Record, now: float = 100.0) -> list[Action]:
    """The flush ``rec`` waits for reached DONE (all of its peer's flushes up to it)."""
    return book.flushed(rec.peer, rec.flush, now)


# -- rule 1 and the happy paths --------------------------------------------------------------


def test_accepted_is_posted_and_tracked_with_its_deadline() -> None:
    book = ledger()
    rec = accept(book, record(), now=5.0)
    assert rec.phase == QUEUED
    assert rec.t0 == 5.0
    assert rec.due == 5.0 + DEADLINE
    assert book.in_flight == 1
    assert not book.busy  # the poster has it, not the pump


def test_done_inside_transfer_is_done_at_once() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "DONE", "DONE")
    finish = only_finish(book.posted(rec, 0.1))
    assert finish.event == ChunkDone(0)
    assert rec.phase == FINAL
    assert book.in_flight == 0
    assert book.stats.done_at_post == 1
    assert book.stats.chunks_done == 1
    assert book.stats.bytes_done == 4096


def test_in_progress_goes_to_the_pump_until_done() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "PROC")
    assert book.posted(rec, 0.1) == []
    assert rec.phase == ACTIVE
    assert book.busy
    for now in (0.2, 0.3):
        batch = book.take_active()
        assert batch == [rec]
        assert book.polled(rec, ["PROC"], now) == []
    assert book.take_active() == [rec]
    assert only_finish(book.polled(rec, ["DONE"], 0.4)).event == ChunkDone(0)
    assert not book.busy
    assert book.in_flight == 0


# -- rule 5: ERR ------------------------------------------------------------------------------


def test_err_at_post_fails_settled() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "DONE", "ERR")
    assert only_finish(book.posted(rec, 0.1)).event == ChunkFailed(0, ERR_REASON)


def test_an_errored_handle_waits_for_a_sibling_still_in_progress() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "ERR", "PROC")
    assert book.posted(rec, 0.1) == []
    book.take_active()
    assert book.polled(rec, ["ERR", "PROC"], 0.2) == []
    book.take_active()
    assert only_finish(book.polled(rec, ["ERR", "DONE"], 0.3)).event == ChunkFailed(0, ERR_REASON)


def test_nixl_raising_with_nothing_posted_fails_settled() -> None:
    book = ledger()
    rec = accept(book, record())
    rec.handles = [object()]  # made, transfer() raised: not posted
    finish = only_finish(book.errored(rec, "nixlBackendError: boom", 0.1))
    assert finish.event == ChunkFailed(0, "nixlBackendError: boom")


def test_nixl_raising_after_a_part_in_flight_holds_the_chunk() -> None:
    book = ledger()
    rec = accept(book, record())
    rec.handles = [object(), object()]
    rec.states = ["PROC"]  # the first part is moving; the second part's transfer() raised
    reason = held(book.errored(rec, "nixlBackendError: boom", 0.5), rec, until=0.5 + Q)
    assert reason == "nixlBackendError: boom; released"
    assert flushed(book, rec) == []  # proven over, but its quarantine is not
    over = only_finish(book.quarantine_over(rec))
    assert over.event == ChunkFailed(0, f"{reason}; quarantine of {Q:g}s over")
    assert book.in_flight == 0
    assert book.held == 0


def test_nixl_raising_after_a_part_that_is_done_fails_settled() -> None:
    book = ledger()
    rec = accept(book, record())
    rec.handles = [object(), object()]
    rec.states = ["DONE"]  # over inside transfer(): nothing of it can move any more
    assert isinstance(only_finish(book.errored(rec, "x", 0.1)).event, ChunkFailed)


def test_a_check_raising_in_the_pump_holds_the_chunk() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "PROC")
    book.posted(rec, 0.1)
    book.take_active()
    held(book.errored(rec, "nixlBackendError: check", 0.2), rec, until=0.2 + Q)


def test_bad_input_found_by_the_poster_fails_settled() -> None:
    book = ledger()
    rec = accept(book, record())
    finish = only_finish(book.rejected(rec, "destination page index 9 out of range"))
    assert finish.event == ChunkFailed(0, "destination page index 9 out of range")
    assert book.stats.chunks_rejected == 1


# -- rule 4: deadlines ------------------------------------------------------------------------


def test_past_its_deadline_a_chunk_is_released_and_held_then_fails() -> None:
    book = ledger()
    rec = accept(book, record(), now=10.0)
    post(rec, "PROC")
    book.posted(rec, 10.0)
    book.take_active()
    assert book.polled(rec, ["PROC"], 10.0 + DEADLINE) == []  # at the deadline: not past it
    book.take_active()
    reason = held(book.polled(rec, ["PROC"], 11.5), rec, until=11.5 + Q)
    assert reason == f"in flight past its {DEADLINE:g}s deadline; released"
    assert book.stats.chunks_stalled == 1
    assert book.in_flight == 1  # not settled until the quarantine is over
    assert book.busy  # held: the pump keeps progressing
    assert book.take_active() == []
    assert book.quarantine_over(rec) == []  # its quarantine is over; its WRITE may not be
    assert book.awaiting_flush == 1
    assert book.busy
    assert only_finish(flushed(book, rec)).event.reason.endswith("quarantine of 2s over")
    assert book.quarantine_over(rec) == []  # once
    assert not book.busy


# -- rule 2: a held WRITE is final only once a flush proved it over --------------------------


def stalled_at(book: ChunkLedger, rec: Record, now: float) -> list[Action]:
    """Post ``rec`` in progress and poll it past its deadline: it is held."""
    post(rec, "PROC")
    book.posted(rec, now)
    book.take_active()
    return book.polled(rec, ["PROC"], now + DEADLINE + 0.5)


def test_a_held_chunk_waits_for_its_flush_however_long_its_quarantine_is_over() -> None:
    """The target may be frozen: its socket holds the released WRITE's bytes, which land when
    it resumes. No time is enough; the flush's DONE is."""
    book = ledger()
    rec = accept(book, record())
    actions = stalled_at(book, rec, 0.0)
    flush = actions[-1]
    assert isinstance(flush, PostFlush)
    assert (flush.peer, flush.seq, flush.not_before) == (PEER, 1, DEADLINE + 0.5)
    for now in (10.0, 1000.0):
        assert book.quarantine_over(rec) == []
        assert book.leases_checked(now) == []
    assert rec.phase == HELD
    assert book.awaiting_flush == 1
    assert book.busy  # the pump keeps polling the flush and progressing the agent
    assert book.flushed(PEER, 2, 5.0) == []  # not the one it waits for (never posted)
    finish = only_finish(book.flushed(PEER, 1, 5.0))
    assert isinstance(finish.event, ChunkFailed)
    assert book.stats.flushes_posted == book.stats.flushes_done == 1
    assert not book.busy


def test_a_chunk_held_while_a_flush_is_in_flight_waits_for_the_next_one() -> None:
    """A flush covers only what was posted before it: a chunk held after it was posted may
    have been posted after it too."""
    book = ledger()
    first = accept(book, record(KEY, 0))
    second = accept(book, record(KEY, 1))
    assert isinstance(stalled_at(book, first, 0.0)[-1], PostFlush)
    held(stalled_at(book, second, 0.1), second, until=0.1 + DEADLINE + 0.5 + Q)  # no new flush
    assert (first.flush, second.flush) == (1, 2)
    book.quarantine_over(first)
    book.quarantine_over(second)
    actions = book.flushed(PEER, 1, 3.0)
    assert [type(a) for a in actions] == [Finish, PostFlush]
    assert actions[0].record is first  # type: ignore[union-attr]
    assert actions[1].seq == 2  # type: ignore[union-attr]
    assert second.phase == HELD
    assert only_finish(book.flushed(PEER, 2, 3.1)).record is second


def test_a_refused_flush_is_posted_again_later_and_proves_nothing() -> None:
    book = ledger()
    rec = accept(book, record())
    stalled_at(book, rec, 0.0)
    book.quarantine_over(rec)
    again = book.flush_failed(PEER, 1, "NIXL_ERR_BACKEND", 4.0)
    assert len(again) == 1
    assert isinstance(again[0], PostFlush)
    assert (again[0].seq, again[0].not_before) == (2, pytest.approx(4.05))
    assert rec.phase == HELD
    assert book.flushed(PEER, 1, 4.1) == []  # the refused one, answered late: nothing
    assert only_finish(book.flushed(PEER, 2, 4.2)).record is rec
    assert book.stats.flushes_failed == 1


def test_a_lost_peer_cancels_its_flush_and_its_held_chunks_need_none() -> None:
    """Rule 6: the endpoint is gone with its generation; nothing of it moves any more."""
    book = ledger()
    waiting = accept(book, record(KEY, 0))
    quarantined = accept(book, record(KEY, 1))
    stalled_at(book, waiting, 0.0)
    stalled_at(book, quarantined, 0.1)
    book.quarantine_over(quarantined)
    actions = book.peer_lost(PEER, "gone", 5.0)
    kinds = sorted(type(a).__name__ for a in actions)
    assert kinds == ["CancelFlush", "Deliver", "Deliver", "Finish"], actions
    assert quarantined.phase == FINAL
    assert waiting.phase == HELD
    assert waiting.flush == 0
    assert book.flushed(PEER, 1, 5.1) == []  # cancelled: its answer means nothing now
    assert only_finish(book.quarantine_over(waiting)).record is waiting
    assert not book.busy


def test_a_chunk_held_for_a_lost_peer_posts_no_flush() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "PROC")
    book.posted(rec, 0.1)
    actions = book.peer_lost(PEER, "gone", 1.0)
    assert not any(isinstance(a, PostFlush) for a in actions)
    assert rec.flush == 0
    assert only_finish(book.quarantine_over(rec)).record is rec


# -- rule 7: release requests ------------------------------------------------------------------


def test_a_chunk_dropped_before_posting_fails_settled() -> None:
    book = ledger()
    rec = accept(book, record())
    other = accept(book, record(OTHER))
    assert book.release_requested(KEY) == []
    assert rec.dropped
    assert not other.dropped
    # The poster skipped it: no handle, no state.
    finish = only_finish(book.posted(rec, 0.1))
    assert finish.event == ChunkFailed(0, "dropped: room failed before posting")
    assert book.stats.chunks_dropped == 1


def test_a_release_request_leaves_a_posted_chunk_to_be_drained() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "PROC")
    book.posted(rec, 0.1)
    book.release_requested(KEY)
    assert book.take_active() == [rec]
    assert only_finish(book.polled(rec, ["DONE"], 0.2)).event == ChunkDone(0)


# -- rule 6: lost peers ------------------------------------------------------------------------


def test_a_lost_peer_fails_its_rooms_and_holds_what_is_in_flight() -> None:
    book = ledger()
    queued = accept(book, record(KEY, 0))
    active = accept(book, record(KEY, 1))
    post(active, "PROC")
    book.posted(active, 0.1)
    elsewhere = accept(book, record(OTHER, 0, peer=Peer("other")))
    actions = book.peer_lost(PEER, "gone", 1.0)
    peer_lost = [a for a in actions if isinstance(a, Deliver) and isinstance(a.event, PeerLost)]
    assert len(peer_lost) == 2
    assert {a.key for a in peer_lost} == {KEY}
    assert queued.dropped
    assert not elsewhere.dropped
    assert active.phase == HELD
    stalled = [a for a in actions if isinstance(a, Deliver) and isinstance(a.event, ChunkStalled)]
    assert [a.event.reason for a in stalled] == ["peer lost (gone); released"]  # type: ignore[attr-defined]
    assert book.lost(PEER)
    # The queued one comes back: skipped (dropped), so it fails settled.
    assert isinstance(only_finish(book.posted(queued, 1.1)).event, ChunkFailed)
    assert book.lost(PEER)  # the held one is not over yet
    only_finish(book.quarantine_over(active))
    assert not book.lost(PEER)  # forgotten with its last chunk


def test_a_chunk_posted_while_its_peer_was_lost_is_held() -> None:
    book = ledger()
    rec = accept(book, record())
    book.peer_lost(PEER, "gone", 1.0)
    post(rec, "PROC")  # the poster was already past the dropped check
    reason = held(book.posted(rec, 1.1), rec, until=1.1 + Q)
    assert reason == "peer lost while posting; released"


def test_a_chunk_done_inside_transfer_while_its_peer_was_lost_is_done() -> None:
    book = ledger()
    rec = accept(book, record())
    book.peer_lost(PEER, "gone", 1.0)
    post(rec, "DONE")  # released at post: nothing can move
    assert only_finish(book.posted(rec, 1.1)).event == ChunkDone(0)
    assert not book.lost(PEER)


def test_a_peer_lost_mid_round_holds_a_record_of_the_taken_batch() -> None:
    book = ledger()
    rec = accept(book, record())
    post(rec, "PROC")
    book.posted(rec, 0.1)
    batch = book.take_active()
    book.peer_lost(PEER, "gone", 0.2)
    assert rec.phase == HELD
    assert batch == [rec]
    assert book.polled(rec, [], 0.2) == []  # skipped: its handles are released


def test_a_remote_disconnect_on_a_lost_peer_holds_even_with_nothing_in_progress() -> None:
    book = ledger()
    rec = accept(book, record())
    book.peer_lost(PEER, "gone", 1.0)
    rec.handles = [object()]  # transfer() raised the disconnect
    held(book.errored(rec, "nixlRemoteDisconnectError", 1.1), rec, until=1.1 + Q)


def test_a_peer_without_chunks_is_not_remembered() -> None:
    book = ledger()
    assert book.peer_lost(PEER, "gone", 1.0) == []
    assert not book.lost(PEER)


# -- rule 3: fences ----------------------------------------------------------------------------


def leases(*fences: int, until: float = 10.0) -> Leases:
    out = Leases()
    for fence in fences:
        out.grant(fence, until)
    return out


@pytest.mark.parametrize(
    ("fence", "why"),
    [
        (0, "unfenced chunk on a fenced transport: not posted"),
        (2, "write lease of fence 2 revoked: not posted"),
        (3, "write lease of fence 3 expired 1s ago: not posted"),
        (9, "write lease of fence 9 never granted: not posted"),
    ],
)
def test_a_chunk_without_a_valid_lease_is_refused_at_acceptance(fence: int, why: str) -> None:
    fences = leases(1, 2)
    fences.grant(3, 4.0)
    fences.revoke(2)
    book = ledger(fences)
    rec = record(fence=fence)
    finish = only_finish(book.accepted(rec, 5.0))
    assert finish.event == ChunkFailed(0, why)
    assert rec.phase == FINAL
    assert book.in_flight == 0
    assert book.stats.chunks_fenced == 1
    assert book.stats.chunks_failed == 1


def test_a_chunk_with_a_valid_lease_is_accepted() -> None:
    book = ledger(leases(1))
    accept(book, record(fence=1), now=5.0)


def test_no_leases_means_nothing_is_fenced() -> None:
    book = ledger()
    rec = accept(book, record(fence=0))
    post(rec, "PROC")
    book.posted(rec, 0.1)
    assert book.leases_checked(100.0) == []


def test_fenced_before_its_first_part_fails_settled() -> None:
    book = ledger(leases(1))
    rec = accept(book, record(fence=1))
    rec.handles = [object()]  # made, then the lease check failed: never posted
    reason = "write lease of fence 1 revoked: not posted"
    assert only_finish(book.fenced(rec, reason, 0.1)).event == ChunkFailed(0, reason)
    assert book.stats.chunks_fenced == 1


def test_fenced_after_a_part_in_flight_holds_the_chunk() -> None:
    book = ledger(leases(1))
    rec = accept(book, record(fence=1))
    rec.handles = [object(), object()]
    rec.states = ["PROC"]
    held(book.fenced(rec, "write lease of fence 1 revoked before part 2 of 2", 0.1), rec, 0.1 + Q)


def test_fenced_after_a_part_that_is_done_fails_settled() -> None:
    book = ledger(leases(1))
    rec = accept(book, record(fence=1))
    rec.handles = [object(), object()]
    rec.states = ["DONE"]
    assert isinstance(only_finish(book.fenced(rec, "x", 0.1)).event, ChunkFailed)


def test_an_in_flight_chunk_whose_lease_goes_is_held_before_the_next_progress() -> None:
    fences = leases(1, 2)
    fences.grant(3, 1.0)
    book = ledger(fences)
    revoked = accept(book, record(KEY, 0, fence=1))
    expiring = accept(book, record(KEY, 1, fence=3))
    fine = accept(book, record(OTHER, 0, fence=2))
    for rec in (revoked, expiring, fine):
        post(rec, "PROC")
        book.posted(rec, 0.1)
    assert book.leases_checked(0.5) == []
    fences.revoke(1)
    actions = book.leases_checked(0.6)
    assert held(actions, revoked, 0.6 + Q) == "write lease of fence 1 revoked"
    actions = book.leases_checked(1.5)
    assert held(actions, expiring, 1.5 + Q) == "write lease of fence 3 expired 0.5s ago"
    assert fine.phase == ACTIVE
    assert book.stats.chunks_fenced == 2
    # The held ones are skipped by the pump; the fine one is still polled.
    assert [r for r in book.take_active() if r.phase == ACTIVE] == [fine]


# -- shutdown and strays -----------------------------------------------------------------------


def test_drain_forgets_everything() -> None:
    book = ledger()
    queued = accept(book, record(KEY, 0))
    active = accept(book, record(KEY, 1))
    post(active, "PROC")
    book.posted(active, 0.1)
    assert set(book.drain()) == {queued, active}
    assert book.in_flight == 0
    assert not book.busy
    assert book.quarantine_over(active) == []
    # A record the poster hands back after the drain has its handles released, nothing else.
    post(queued, "PROC")
    actions = book.posted(queued, 0.2)
    assert [type(a) for a in actions] == [Release]


# -- the property test ------------------------------------------------------------------------


# -- rule 8: chunks posted together ------------------------------------------------------------


def together(*members: tuple[RoomKey, int], peer: Any = PEER) -> Record:
    """A record of several chunks (``(room, chunk)`` each, 1000 bytes each), as merged."""
    first_key, first_chunk = members[0]
    rec = Record(first_key, first_chunk, peer, 1000 * len(members))
    rec.members = tuple((key, chunk, 1000) for key, chunk in members)
    return rec


def test_chunks_posted_together_end_together_each_with_its_own_event() -> None:
    book = ledger()
    rec = accept(book, together((KEY, 0), (KEY, 1), (OTHER, 0)))
    post(rec, "DONE")
    finish = only_finish(book.posted(rec, 0.1))
    assert finish.events() == [(KEY, ChunkDone(0)), (KEY, ChunkDone(1)), (OTHER, ChunkDone(0))]
    assert book.stats.chunks_done == 3  # chunks, not records
    assert book.stats.done_at_post == 3
    assert book.stats.bytes_done == 3000
    assert book.in_flight == 0


def test_a_failed_request_fails_each_of_its_chunks_with_the_reason() -> None:
    book = ledger()
    rec = accept(book, together((KEY, 0), (OTHER, 3)))
    post(rec, "ERR")
    finish = only_finish(book.posted(rec, 0.1))
    assert finish.events() == [
        (KEY, ChunkFailed(0, ERR_REASON)),
        (OTHER, ChunkFailed(3, ERR_REASON)),
    ]
    assert book.stats.chunks_failed == 2


def test_a_stalled_request_holds_every_chunk_of_it_once() -> None:
    book = ledger()
    rec = accept(book, together((KEY, 0), (OTHER, 1)))
    post(rec, "PROC")
    book.posted(rec, 0.1)
    assert book.take_active() == [rec]
    actions = book.polled(rec, ["PROC"], DEADLINE + 0.5)
    assert [type(a) for a in actions] == [Release, Deliver, Deliver, StartQuarantine, PostFlush]
    stalled = [(a.key, a.event) for a in actions if isinstance(a, Deliver)]
    reason = f"in flight past its {DEADLINE:g}s deadline; released"
    assert stalled == [(KEY, ChunkStalled(0, reason)), (OTHER, ChunkStalled(1, reason))]
    assert book.stats.chunks_stalled == 2
    assert book.stats.chunks_quarantined == 2
    assert rec.flush == 1  # one flush for the request, as for one chunk
    assert flushed(book, rec) == []
    over = only_finish(book.quarantine_over(rec))
    assert [key for key, _ in over.events()] == [KEY, OTHER]
    assert all(isinstance(e, ChunkFailed) for _, e in over.events())


def test_a_lost_peer_tells_each_room_of_a_shared_request_once() -> None:
    book = ledger()
    accept(book, together((KEY, 0), (KEY, 1), (OTHER, 0)))
    actions = book.peer_lost(PEER, "gone", 1.0)
    assert [(a.key, a.event) for a in actions if isinstance(a, Deliver)] == [
        (KEY, PeerLost("gone")),
        (OTHER, PeerLost("gone")),
    ]


def test_a_shared_request_is_dropped_only_once_every_room_in_it_asked() -> None:
    book = ledger()
    rec = accept(book, together((KEY, 0), (OTHER, 0), (KEY, 1)))
    book.release_requested(KEY)
    assert not rec.dropped  # OTHER's chunk is still wanted: it is posted
    book.release_requested(RoomKey(9, 1))  # a room not in it changes nothing
    assert not rec.dropped
    book.release_requested(OTHER)
    assert rec.dropped
    finish = only_finish(book.posted(rec, 0.1))  # the poster skipped it
    assert {type(e) for _, e in finish.events()} == {ChunkFailed}
    assert book.stats.chunks_dropped == 3


def test_the_ledger_tracks_each_chunk_of_a_record_until_it_is_final() -> None:
    book = ledger()
    rec = accept(book, together((KEY, 0), (OTHER, 2)))
    assert book.tracks(KEY, 0)
    assert book.tracks(OTHER, 2)
    assert not book.tracks(OTHER, 0)  # its room, another chunk
    assert not book.tracks(RoomKey(9, 1), 0)
    post(rec, "DONE")
    only_finish(book.posted(rec, 0.1))
    assert not book.tracks(KEY, 0)
    assert not book.tracks(OTHER, 2)


class Handle:
    """One NIXL handle as the world sees it: made, maybe posted, moving (PROC) until it is
    DONE or ERR; released by the transport. A released handle that was moving stays in doubt:
    its bytes may still land. ``says`` is what NIXL reports: the truth, except for a lost peer
    generation, whose handles NIXL may report ERR ("remote agent invalidated") while the
    WRITE is still moving."""

    __slots__ = ("peer", "posted", "real", "released")

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.posted = False
        self.real = "NEW"
        self.released = False

    def says(self, lost: list[Peer]) -> str:
        return "ERR" if self.peer in lost and self.real == "PROC" else self.real


class LedgerMachine(RuleBasedStateMachine):
    """The transport around the production ledger, as a model (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.leases: Leases | None = None
        self.book = ledger()
        self.peers = [Peer("a1"), Peer("b1")]  # the current generation per peer slot
        self.lost_peers: list[Peer] = []
        self.made: dict[Record, list[Handle]] = {}
        self.accepted: list[Record] = []
        self.finals: dict[Record, list[Event]] = {}
        self.queue: list[Record] = []  # in the poster's queue
        self.back: list[tuple[Record, str, str]] = []  # posted, not handed back yet
        self.timers: list[tuple[float, Record]] = []
        self.held_at: dict[Record, float] = {}
        self.stalled: dict[Record, int] = {}
        self.delivered: list[tuple[RoomKey, Event]] = []
        self.parts: dict[Record, int] = {}
        self.by_id: dict[tuple[RoomKey, int], Record] = {}
        self.chunk_finals: dict[tuple[RoomKey, int], int] = {}
        self.chunks = 0
        #: The flush in flight per peer generation: its number and the WRITEs it covers (every
        #: handle to that peer still moving when it was posted, released or not).
        self.flushes: dict[Peer, tuple[int, list[Handle]]] = {}

    @initialize(fenced=st.booleans())
    def configure(self, fenced: bool) -> None:
        if fenced:
            self.leases = Leases()
            for fence in (1, 2, 3):
                self.leases.grant(fence, 5.0)
            self.book = ledger(self.leases)

    # -- executing actions, with the physical checks -------------------------------------------

    def run(self, actions: list[Action], *, quarantine_over: bool = False) -> None:
        """``quarantine_over``: these actions end held records (a timer, a flush, a loss)."""
        for action in actions:
            if isinstance(action, Finish):
                self.finished(action, quarantine_over)
            elif isinstance(action, PostFlush):
                peer = action.peer
                assert peer not in self.lost_peers, "a flush of a lost generation"
                assert peer not in self.flushes, "two flushes of one peer in flight"
                covered = [
                    h for hs in self.made.values() for h in hs
                    if h.peer is peer and h.posted and h.real == "PROC"
                ]  # fmt: skip
                self.flushes[peer] = (action.seq, covered)
            elif isinstance(action, CancelFlush):
                assert action.peer in self.lost_peers, "a live generation's flush cancelled"
                del self.flushes[action.peer]
            elif isinstance(action, Release):
                self.release(action.record)
            elif isinstance(action, Deliver):
                self.delivered.append((action.key, action.event))
                if isinstance(action.event, ChunkStalled):
                    rec = self.by_id[action.key, action.event.chunk]
                    assert rec.phase == HELD
                    self.stalled[rec] = self.stalled.get(rec, 0) + 1
            elif isinstance(action, StartQuarantine):
                assert action.record.phase == HELD
                self.held_at[action.record] = self.now
                self.timers.append((action.until, action.record))
            else:
                assert isinstance(action, Post)
                self.queue.append(action.record)

    def release(self, rec: Record) -> None:
        for handle in rec.handles:
            assert not handle.released, "released twice"
            handle.released = True
        rec.handles = []

    def finished(self, finish: Finish, quarantine_over: bool) -> None:
        rec, event = finish.record, finish.event
        self.release(rec)
        self.finals.setdefault(rec, []).append(event)
        # Rule 8: each chunk of the record ends, once, the way the record did.
        events = finish.events()
        assert [(key, e.chunk) for key, e in events] == [(k, c) for k, c, _ in rec.members]
        assert all(type(e) is type(event) for _, e in events)
        for key, e in events:
            self.chunk_finals[key, e.chunk] = self.chunk_finals.get((key, e.chunk), 0) + 1
        moving = [h for h in self.made.get(rec, []) if h.posted and h.real == "PROC"]
        if moving:
            # Final while a handle may still move bytes: only once released and quarantined,
            # and only for a lost generation (rule 6); otherwise a flush proved it over first.
            assert quarantine_over, f"{rec} final with a handle in flight"
            assert all(h.released for h in moving)
            assert rec.peer in self.lost_peers, f"{rec} final, its WRITE not proven over"
        if quarantine_over:
            assert self.now >= self.held_at[rec] + Q - 1e-9
        if quarantine_over:
            # One ChunkStalled per chunk of the record, each before its quarantine.
            assert self.stalled.get(rec) == len(rec.members), "not one ChunkStalled per chunk"
            assert isinstance(event, ChunkFailed)
        assert all(h.released or not h.posted or h.real == "DONE" for h in self.made.get(rec, []))

    # -- the world -----------------------------------------------------------------------------

    @rule(room=st.integers(0, 3), slot=st.integers(0, 1), parts=st.integers(1, 3),
          fence=st.integers(0, 4), more=st.lists(st.integers(0, 3), max_size=2))  # fmt: skip
    def accept(self, room: int, slot: int, parts: int, fence: int, more: list[int]) -> None:
        """A record of one chunk, or (``more``: their rooms) of several posted together."""
        rooms = [room, *more]
        members = tuple((RoomKey(r, 1), self.chunks + i, 100) for i, r in enumerate(rooms))
        self.chunks += len(rooms)
        rec = Record(RoomKey(room, 1), members[0][1], self.peers[slot], 100 * len(rooms), fence)
        rec.members = members
        self.made[rec] = []
        self.parts[rec] = parts
        for key, chunk, _ in members:
            self.by_id[key, chunk] = rec
        self.accepted.append(rec)
        self.run(self.book.accepted(rec, self.now))

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def poster_runs(self, data: st.DataObject) -> None:
        """The poster takes the oldest queued record and posts it (or stops part-way)."""
        rec = self.queue.pop(0)
        if rec.dropped:
            self.back.append((rec, "ok", ""))
            return
        outcome = data.draw(st.sampled_from(["ok", "ok", "ok", "layout", "raise", "disconnect"]))
        if outcome == "layout":
            self.back.append((rec, "layout", "page out of range"))
            return
        parts = self.parts[rec]
        stop_at = data.draw(st.integers(0, parts - 1)) if outcome != "ok" else parts
        for part in range(parts):
            handle = Handle(rec.peer)
            self.made[rec].append(handle)
            rec.handles.append(handle)
            if self.leases is not None and not self.leases.valid(rec.fence, self.now):
                self.back.append((rec, "fenced", f"fence {rec.fence}"))
                return
            if part == stop_at:
                self.back.append((rec, outcome, "transfer() raised"))
                return
            handle.posted = True
            handle.real = data.draw(st.sampled_from(["DONE", "DONE", "PROC", "ERR"]))
            rec.states.append(handle.says(self.lost_peers))
        if all(state == "DONE" for state in rec.states) and len(rec.states) == parts:
            self.release(rec)  # released at post
        self.back.append((rec, "ok", ""))

    @precondition(lambda self: self.back)
    @rule(data=st.data())
    def hand_back(self, data: st.DataObject) -> None:
        rec, outcome, reason = self.back.pop(data.draw(st.integers(0, len(self.back) - 1)))
        lost = outcome == "ok" and rec.handles and rec.peer in self.lost_peers
        if lost and data.draw(st.booleans()):
            # The poster's one check_xfer_state ran after the peer was lost.
            rec.states = [h.says(self.lost_peers) for h in rec.handles if h.posted]
        if outcome == "ok":
            self.run(self.book.posted(rec, self.now))
        elif outcome == "layout":
            self.run(self.book.rejected(rec, reason))
        elif outcome == "fenced":
            self.run(self.book.fenced(rec, reason, self.now))
        else:
            if outcome == "disconnect":
                self.lose(self.peers.index(rec.peer) if rec.peer in self.peers else -1)
            self.run(self.book.errored(rec, reason, self.now))

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        moving = [h for hs in self.made.values() for h in hs if h.posted and h.real == "PROC"]
        if moving:
            handle = data.draw(st.sampled_from(moving))
            handle.real = data.draw(st.sampled_from(["DONE", "DONE", "ERR"]))

    @precondition(lambda self: self.flushes)
    @rule(data=st.data())
    def flush_ends(self, data: st.DataObject) -> None:
        """A flush in flight ends: NIXL refuses it, or it is DONE, which it can be only once
        every WRITE it covers has ended (UCX's flush)."""
        peer = data.draw(st.sampled_from(sorted(self.flushes, key=lambda p: p.name)))
        seq, covered = self.flushes[peer]
        if data.draw(st.booleans()):
            del self.flushes[peer]
            self.run(self.book.flush_failed(peer, seq, "refused", self.now), quarantine_over=True)
        elif all(h.real != "PROC" for h in covered):
            del self.flushes[peer]
            self.run(self.book.flushed(peer, seq, self.now), quarantine_over=True)

    @rule(check_raises=st.booleans())
    def pump_round(self, check_raises: bool) -> None:
        self.run(self.book.leases_checked(self.now))
        if self.leases is not None:
            for rec in self.made:
                if rec.phase == ACTIVE:
                    assert self.leases.valid(rec.fence, self.now), "progress under a dead lease"
        for rec in self.book.take_active():
            # The transport skips records held meanwhile; asking anyway proves polled() does.
            if check_raises and rec.chunk % 5 == 0 and rec.phase == ACTIVE:
                self.run(self.book.errored(rec, "check raised", self.now))
            else:
                states = [h.says(self.lost_peers) for h in rec.handles]
                self.run(self.book.polled(rec, states, self.now))

    @rule(dt=st.sampled_from([0.1, 0.5, 1.5, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def fire_timers(self) -> None:
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, rec in due:
            self.run(self.book.quarantine_over(rec), quarantine_over=True)

    @precondition(lambda self: self.finals)
    @rule(data=st.data())
    def stray_timer(self, data: st.DataObject) -> None:
        """A timer for a record that is over already (or fires twice) changes nothing."""
        rec = data.draw(st.sampled_from(sorted(self.finals, key=lambda r: r.chunk)))
        assert self.book.quarantine_over(rec) == []

    @rule(slot=st.integers(0, 1))
    def lose_peer(self, slot: int) -> None:
        self.lose(slot)

    def lose(self, slot: int) -> None:
        """Like PeerSet.lost: only the current generation is lost, once."""
        if slot < 0:
            return
        peer = self.peers[slot]
        self.peers[slot] = Peer(peer.name[0] + str(int(peer.name[1:]) + 1))
        self.lost_peers.append(peer)
        self.run(self.book.peer_lost(peer, "gone", self.now), quarantine_over=True)
        # The transport removes the remote agent next: nothing posted to it may be unreleased.
        for rec in self.made:
            if rec.peer is peer and rec.phase == ACTIVE:
                raise AssertionError(f"{rec} still in progress when its remote agent goes")

    @precondition(lambda self: self.leases is not None)
    @rule(fence=st.integers(1, 4), dt=st.sampled_from([0.5, 2.0, 5.0]))
    def grant(self, fence: int, dt: float) -> None:
        assert self.leases is not None
        self.leases.grant(fence, self.now + dt)

    @precondition(lambda self: self.leases is not None)
    @rule(fence=st.integers(1, 4))
    def revoke(self, fence: int) -> None:
        assert self.leases is not None
        self.leases.revoke(fence)

    @rule(room=st.integers(0, 3))
    def release_room(self, room: int) -> None:
        assert self.book.release_requested(RoomKey(room, 1)) == []

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def at_most_one_final_and_the_ledger_agrees(self) -> None:
        for rec, events in self.finals.items():
            assert len(events) == 1, f"{rec}: {events}"
            assert rec.phase == FINAL
        open_records = [r for r in self.accepted if r not in self.finals]
        assert self.book.in_flight == sum(1 for r in open_records if r.phase != 0)
        assert self.book.held == sum(1 for r in open_records if r.phase == HELD)

    def teardown(self) -> None:
        """Let everything end: the poster drains, time passes, timers fire, the pump runs.
        Handles still moving are completed only after deadlines had their chance to hold
        them: then the world lets every WRITE end (a frozen target resumes), and the flushes
        must end what the quarantines could not."""
        for round_ in range(12):
            while self.queue:
                self.post_everything(self.queue.pop(0))
            while self.back:
                self.hand_back_first()
            self.now += DEADLINE + Q + 1.0
            self.pump_round(False)
            self.fire_timers()
            self.now += Q + 1.0
            self.fire_timers()
            if round_ >= 1:
                for handles in self.made.values():
                    for handle in handles:
                        if handle.posted and handle.real == "PROC":
                            handle.real = "DONE"
                for peer, (seq, _) in sorted(self.flushes.items(), key=lambda i: i[0].name):
                    del self.flushes[peer]
                    self.run(self.book.flushed(peer, seq, self.now), quarantine_over=True)
            if not self.book.in_flight:
                break
        assert not self.flushes, "a flush left in flight with nothing held"
        assert self.book.in_flight == 0
        assert not self.book.busy
        for peer in {r.peer for r in self.accepted}:
            assert not self.book.lost(peer)
        assert sorted(self.chunk_finals.values()) == [1] * len(self.by_id)  # each chunk, once
        for rec in self.accepted:
            assert len(self.finals.get(rec, [])) == 1, f"{rec}: {self.finals.get(rec)}"
            for handle in self.made[rec]:
                assert handle.released or not handle.posted or handle.real == "DONE"

    def post_everything(self, rec: Record) -> None:
        """The poster at teardown: every part posted and left in progress (under the lease)."""
        if not rec.dropped:
            for _part in range(self.parts[rec]):
                handle = Handle(rec.peer)
                self.made[rec].append(handle)
                rec.handles.append(handle)
                if self.leases is not None and not self.leases.valid(rec.fence, self.now):
                    self.back.append((rec, "fenced", "fence"))
                    return
                handle.posted = True
                handle.real = "PROC"
                rec.states.append("PROC")
        self.back.append((rec, "ok", ""))

    def hand_back_first(self) -> None:
        rec, outcome, reason = self.back.pop(0)
        if outcome == "ok":
            self.run(self.book.posted(rec, self.now))
        elif outcome == "layout":
            self.run(self.book.rejected(rec, reason))
        elif outcome == "fenced":
            self.run(self.book.fenced(rec, reason, self.now))
        else:
            self.run(self.book.errored(rec, reason, self.now))


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_ledger_properties = LedgerMachine.TestCase
