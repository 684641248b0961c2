"""The sans-IO room core: every (state, event) pair of both roles against the table, the
late-event policy, the ledger, and the payload checks that turn bad input into one Failed room."""

from __future__ import annotations

import pytest

from kvfsm.rooms import IllegalEventError, RoomCore, RoomStats
from kvfsm.states import (
    EVENT_TYPES,
    TABLES,
    TERMINAL,
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    ChunkStalled,
    ChunkSubmitted,
    DeadlineExpired,
    DestinationReceived,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    Part,
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
    TransferCompleted,
    TransferConfirmed,
)
from tests.helpers.rooms import DST, EXPECTED_STATE, pages, receiver_at, sender_at

SENDER_CONTEXTS = ["bootstrapping", "waiting", "waiting+init", "transferring", "success", "failed"]
RECEIVER_CONTEXTS = [
    "bootstrapping",
    "bootstrapping+init",
    "waiting",
    "transferring",
    "success",
    "failed",
]


def sample(event_type: type[Event], role: Role, state: KVPoll) -> Event:
    """A payload that is valid whenever the table allows the event at all."""
    samples: dict[type[Event], Event] = {
        DestinationReceived: DestinationReceived(DST, 5),
        Initialized: Initialized(num_pages=4, aux_index=1)
        if role is Role.SENDER
        else Initialized(peer_rank=0),
        ChunkSubmitted: ChunkSubmitted(pages(2)),
        ChunkDone: ChunkDone(0),
        ChunkFailed: ChunkFailed(0, "boom"),
        ChunkStalled: ChunkStalled(0, "slow"),
        PeerResolved: PeerResolved(0),
        MetadataSubmitted: MetadataSubmitted(DST, 5),
        TransferConfirmed: TransferConfirmed(0),
        PeerSettled: PeerSettled(0),
        TransferCompleted: TransferCompleted(),
        AbortRequested: AbortRequested("stop"),
        DeadlineExpired: DeadlineExpired(state, 1.0),
        PeerLost: PeerLost("gone"),
        PeerFailed: PeerFailed("broke"),
        EventRejected: EventRejected("bad"),
    }
    return samples[event_type]


# Payload rules on top of the table: (role, context, event) -> why the room rejects it.
PAYLOAD_REJECTIONS = {
    (Role.SENDER, "waiting", ChunkSubmitted): "send before init",
    (Role.SENDER, "waiting+init", Initialized): "init called twice",
}
# Events after which the room's bookkeeping completes the transfer by itself.
DERIVED_COMPLETION = {(Role.RECEIVER, "transferring", TransferConfirmed)}


def cases() -> list[tuple[Role, str, type[Event]]]:
    return [
        (role, context, event_type)
        for role, contexts in ((Role.SENDER, SENDER_CONTEXTS), (Role.RECEIVER, RECEIVER_CONTEXTS))
        for context in contexts
        for event_type in EVENT_TYPES
    ]


def at(role: Role, context: str, stats: RoomStats, *, strict: bool) -> RoomCore:
    factory = sender_at if role is Role.SENDER else receiver_at
    return factory(context, stats, strict=strict)


@pytest.mark.parametrize(("role", "context", "event_type"), cases())
def test_every_state_event_pair_follows_the_table(
    role: Role, context: str, event_type: type[Event]
) -> None:
    stats = RoomStats()
    core = at(role, context, stats, strict=False)
    state = core.state
    assert state is EXPECTED_STATE[context]
    late, rejected = stats.late_events, stats.rejected_events
    event = sample(event_type, role, state)
    commands = core.handle(event)

    if state in TERMINAL:
        # Late or duplicate: dropped and counted, never raised.
        assert core.state is state
        assert stats.late_events == late + 1
        assert not any(isinstance(c, PostChunk) for c in commands)
        return
    edge = TABLES[role][state].get(event_type)
    reason = PAYLOAD_REJECTIONS.get((role, context, event_type))
    if edge is None or reason is not None:
        assert core.state is KVPoll.Failed
        assert stats.rejected_events == rejected + 1
        expected = reason or f"{event_type.__name__} in {state.name}"
        assert expected in core.reason
        return
    expected_state = edge
    if (role, context, event_type) in DERIVED_COMPLETION:
        expected_state = TABLES[role][edge][TransferCompleted]
    assert core.state is expected_state
    assert stats.rejected_events == rejected


@pytest.mark.parametrize(("role", "context", "event_type"), cases())
def test_strict_core_raises_where_a_lenient_core_fails_closed(
    role: Role, context: str, event_type: type[Event]
) -> None:
    core = at(role, context, RoomStats(), strict=True)
    state = core.state
    illegal = state not in TERMINAL and (
        event_type not in TABLES[role][state] or (role, context, event_type) in PAYLOAD_REJECTIONS
    )
    if illegal:
        with pytest.raises(IllegalEventError, match=state.name):
            core.handle(sample(event_type, role, state))
        assert core.state is state  # a raising core changed nothing
    else:
        core.handle(sample(event_type, role, state))


def test_sender_full_lifecycle_emits_chunks_then_reports_success() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    assert core.handle(DestinationReceived(DST, 5)) == ()
    assert core.handle(Initialized(num_pages=3, aux_index=2)) == ()
    (first,) = core.handle(ChunkSubmitted(pages(7, 8)))
    assert first == PostChunk(0, pages(7, 8), pages(10, 11), is_last=False)
    (last,) = core.handle(ChunkSubmitted(pages(9)))
    assert last == PostChunk(1, pages(9), pages(12), is_last=True, src_aux=2, dst_aux=5)
    assert core.handle(ChunkDone(1)) == ()  # out of order: chunk 0 still in flight
    assert core.state is KVPoll.Transferring
    assert core.handle(ChunkDone(0)) == (ReportOutcome(KVPoll.Success),)
    assert core.state is KVPoll.Success
    assert core.settled


def test_zero_page_last_chunk_completes_the_room() -> None:
    core = sender_at("waiting")
    core.handle(Initialized(num_pages=0, aux_index=3))
    (post,) = core.handle(ChunkSubmitted(b""))
    assert post.is_last
    assert post.src == b""
    assert post.src_aux == 3
    assert post.dst_aux == 5
    core.handle(ChunkDone(0))
    assert core.state is KVPoll.Success


def test_receiver_full_lifecycle() -> None:
    core = RoomCore(Role.RECEIVER, strict=True)
    assert core.handle(Initialized(peer_rank=3)) == (ResolvePeer(3),)
    assert core.state is KVPoll.Bootstrapping
    assert core.handle(PeerResolved(3)) == ()
    assert core.handle(MetadataSubmitted(DST, 5)) == (SendMetadata(DST, 5),)
    assert not core.settled
    assert core.handle(TransferConfirmed(3)) == ()
    assert core.state is KVPoll.Success
    assert core.settled


class TestAbortAndSettle:
    def test_sender_abort_with_chunk_in_flight_releases_and_reports_then_acks(self) -> None:
        core = sender_at("transferring")
        commands = core.handle(AbortRequested("user"))
        assert core.state is KVPoll.Failed
        assert commands == (ReleaseHandles(), ReportOutcome(KVPoll.Failed, core.reason))
        assert not core.settled
        # The in-flight chunk finishes late: dropped by the table, applied to the ledger, and
        # the receiver is told the pages are safe.
        assert core.handle(ChunkDone(0)) == (ReportSettled(),)
        assert core.state is KVPoll.Failed
        assert core.settled

    def test_peer_abort_is_not_echoed_back(self) -> None:
        core = sender_at("waiting+init")
        commands = core.handle(AbortRequested("decode gone", origin="peer"))
        assert core.state is KVPoll.Failed
        assert commands == (ReportSettled(),)  # nothing in flight: settled at once

    def test_receiver_abort_after_metadata_waits_for_the_senders_ack(self) -> None:
        core = receiver_at("transferring")
        assert core.handle(AbortRequested()) == (ReportOutcome(KVPoll.Failed, core.reason),)
        assert core.state is KVPoll.Failed
        assert not core.settled
        core.handle(PeerSettled(0))
        assert core.settled

    def test_receiver_abort_before_metadata_is_settled_at_once(self) -> None:
        core = receiver_at("waiting")
        core.handle(AbortRequested())
        assert core.settled

    def test_abort_after_success_is_a_noop(self) -> None:
        stats = RoomStats()
        for core in (sender_at("success", stats), receiver_at("success", stats)):
            assert core.handle(AbortRequested()) == ()
            assert core.state is KVPoll.Success
            assert core.reason == ""
        assert stats.late_events == 2

    @pytest.mark.parametrize("event", [PeerFailed("prefill died"), AbortRequested("x", "peer")])
    def test_failures_the_peer_reported_are_not_echoed_back(self, event: Event) -> None:
        core = receiver_at("transferring")
        assert core.handle(event) == ()
        assert core.state is KVPoll.Failed

    def test_a_lost_peer_is_still_told_why(self) -> None:
        # The loss may be the data path's only (a NIXL remote disconnect while the control
        # link is up): the peer must hear why the room failed. Over a lost control link the
        # report goes nowhere.
        core = receiver_at("transferring")
        assert core.handle(PeerLost("remote disconnect")) == (
            ReportOutcome(KVPoll.Failed, "peer lost: remote disconnect"),
        )
        assert core.state is KVPoll.Failed

    def test_stale_deadline_for_a_state_already_left_is_ignored(self) -> None:
        stats = RoomStats()
        core = sender_at("transferring", stats)
        core.handle(DeadlineExpired(KVPoll.WaitingForInput, 10.0))
        assert core.state is KVPoll.Transferring
        assert stats.late_events == 1
        core.handle(DeadlineExpired(KVPoll.Transferring, 10.0))
        assert core.state is KVPoll.Failed
        assert "Transferring" in core.reason
        assert stats.deadline_expiries == 1


class TestBadInputFailsOneRoom:
    @pytest.mark.parametrize(
        ("events", "reason"),
        [
            ([DestinationReceived(b"\x01\x02\x03", 5)], "not a whole number of int32"),
            ([DestinationReceived(DST, -1)], "aux row -1"),
            ([DestinationReceived(DST, 5), Initialized(num_pages=9)], "reserved 8"),
            ([DestinationReceived(DST, 5), Initialized(num_pages=-1)], "-1 pages"),
            (
                [
                    DestinationReceived(DST, 5),
                    Initialized(num_pages=2),
                    ChunkSubmitted(pages(1, 2, 3)),
                ],
                "overruns init",
            ),
            (
                [
                    DestinationReceived(DST, 5),
                    Initialized(num_pages=1),
                    ChunkSubmitted(pages(1)),
                    ChunkSubmitted(pages(2)),
                ],
                "after the last chunk",
            ),
            (
                [
                    DestinationReceived(DST, 5),
                    Initialized(num_pages=4),
                    ChunkSubmitted(pages(1)),
                    ChunkDone(5),
                ],
                "never posted",
            ),
        ],
    )
    def test_sender_payloads(self, events: list[Event], reason: str) -> None:
        stats = RoomStats()
        core = RoomCore(Role.SENDER, stats)
        posted = []
        for event in events:
            posted += [c for c in core.handle(event) if isinstance(c, PostChunk)]
        assert core.state is KVPoll.Failed
        assert reason in core.reason
        assert stats.rejected_events == 1
        # Nothing past the bad input reached the transport.
        assert all(len(p.src) == len(p.dst) for p in posted)

    def test_receiver_ragged_metadata(self) -> None:
        core = receiver_at("waiting", strict=False)
        assert core.handle(MetadataSubmitted(b"\x00" * 5, 1)) == (
            ReportOutcome(KVPoll.Failed, core.reason),
        )
        assert "int32" in core.reason

    def test_fail_from_outside_is_a_noop_on_terminal_rooms(self) -> None:
        core = sender_at("success")
        assert core.fail("overflow") == ()
        assert core.state is KVPoll.Success
        core = sender_at("waiting")
        core.fail("mailbox overflow")
        assert core.state is KVPoll.Failed
        assert "mailbox overflow" in core.reason


def test_failed_sender_answers_a_receiver_that_reserved_pages_too_late() -> None:
    # Prefill aborted while bootstrapping, before it knew its decode peer; decode's page list
    # arrives afterwards. Decode must hear the outcome now, not at its deadline.
    core = sender_at("bootstrapping")
    core.handle(AbortRequested("prefill aborted"))
    assert core.handle(DestinationReceived(DST, 5)) == (
        ReportOutcome(KVPoll.Failed, core.reason),
        ReportSettled(),
    )
    assert core.state is KVPoll.Failed


def test_a_stalled_chunk_fails_the_room_but_settles_only_after_its_quarantine() -> None:
    core = sender_at("transferring")
    commands = core.handle(ChunkStalled(0, "no progress for 5s"))
    assert core.state is KVPoll.Failed
    assert "chunk 0 stalled" in core.reason
    assert ReportOutcome(KVPoll.Failed, core.reason) in commands
    assert not core.settled  # bytes of the cancelled WRITE may still land
    assert core.handle(ChunkFailed(0, "quarantine over")) == (ReportSettled(),)
    assert core.settled


def test_post_chunk_names_the_peer_the_destination_came_from() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(DST, 5, peer="decode-3"))
    core.handle(Initialized(num_pages=1, aux_index=0))
    (post,) = core.handle(ChunkSubmitted(pages(1)))
    assert isinstance(post, PostChunk)
    assert post.peer == "decode-3"


# -- legs: what each part may name (unequal attention TP) --------------------------------------

KV, NONE, STATE, WHOLE = Part.KV, Part.NONE, Part.STATE, Part.WHOLE

PART_RULES = [
    # (part, pages, aux row, state rows) -> why the room rejects it (None: accepted)
    (WHOLE, DST, 5, pages(1), None),
    (WHOLE, b"", 0, b"", None),  # a request of no pages still has its aux row
    (WHOLE, DST, -1, b"", "aux row -1 is negative"),
    (KV, DST, -1, b"", None),
    (KV, DST, -1, pages(1), None),  # its shard of sharded state (unequal attention TP)
    (KV, DST, 5, b"", "a KV-only leg names an aux row"),
    (KV, DST, -2, pages(1), "a KV-only leg names an aux row"),
    (NONE, b"", -1, b"", None),
    (NONE, pages(3), -1, b"", "a dummy leg names destinations"),
    (NONE, b"", 0, b"", "a dummy leg names destinations"),
    (NONE, b"", -1, pages(2), "a dummy leg names destinations"),
    (STATE, b"", -1, pages(2), None),  # its shard of the state, no KV
    (STATE, b"", -1, b"", None),  # (a request of no state rows)
    (STATE, pages(3), -1, pages(2), "a state-only leg names pages or an aux row"),
    (STATE, b"", 0, pages(2), "a state-only leg names pages or an aux row"),
    (7, b"", -1, b"", "unknown leg part 7"),
]


@pytest.mark.parametrize(("part", "dst", "aux", "state", "reason"), PART_RULES)
def test_a_sender_checks_the_part_its_destination_names(
    part: int, dst: bytes, aux: int, state: bytes, reason: str | None
) -> None:
    stats = RoomStats()
    core = RoomCore(Role.SENDER, stats)
    commands = core.handle(DestinationReceived(dst, aux, state=state, part=part))
    if reason is None:
        assert core.state is KVPoll.WaitingForInput
        assert commands == ()
        assert stats.rejected_events == 0
        return
    assert core.state is KVPoll.Failed
    assert reason in core.reason
    assert stats.rejected_events == 1
    assert ReportOutcome(KVPoll.Failed, core.reason) in commands


@pytest.mark.parametrize(("part", "dst", "aux", "state", "reason"), PART_RULES)
def test_a_receiver_checks_the_part_of_its_metadata_and_sends_it_on(
    part: int, dst: bytes, aux: int, state: bytes, reason: str | None
) -> None:
    stats = RoomStats()
    core = receiver_at("waiting", stats, strict=False)
    commands = core.handle(MetadataSubmitted(dst, aux, state, part))
    if reason is None:
        assert commands == (SendMetadata(dst, aux, state, part),)
        assert core.state is KVPoll.Transferring
        assert not core.settled  # exposed to its sender, whatever the part
        return
    assert core.state is KVPoll.Failed
    assert reason in core.reason
    assert stats.rejected_events == 1
    assert not any(isinstance(c, SendMetadata) for c in commands)


def test_a_strict_core_raises_on_a_part_that_names_what_it_must_not() -> None:
    core = receiver_at("waiting")
    with pytest.raises(IllegalEventError, match="dummy leg names destinations"):
        core.handle(MetadataSubmitted(DST, -1, b"", Part.NONE))
    assert core.state is KVPoll.WaitingForInput


def test_a_kv_leg_sender_writes_pages_and_no_aux_or_state_row() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(pages(10, 11), -1, part=Part.KV))
    core.handle(Initialized(num_pages=2, aux_index=-1))
    (post,) = core.handle(ChunkSubmitted(pages(3, 4)))
    assert post == PostChunk(0, pages(3, 4), pages(10, 11), is_last=True)
    assert core.handle(ChunkDone(0)) == (ReportOutcome(KVPoll.Success),)
    assert core.settled


def test_a_dummy_sender_completes_with_one_empty_last_chunk() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    assert core.handle(DestinationReceived(b"", -1, part=Part.NONE)) == ()
    core.handle(Initialized(num_pages=0, aux_index=-1))
    (post,) = core.handle(ChunkSubmitted(b""))
    assert post == PostChunk(0, b"", b"", is_last=True)
    assert core.handle(ChunkDone(0)) == (ReportOutcome(KVPoll.Success),)
    assert core.state is KVPoll.Success
    assert core.settled


def test_a_dummy_sender_that_fails_still_tells_its_receiver_it_settled() -> None:
    # The dummy's receiver leg sent metadata (it is exposed) and holds the request's shared
    # claim until this sender's ReportSettled: without it the leg is reaped unsettled and the
    # request's pages stay held for the life of the engine.
    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(b"", -1, part=Part.NONE))
    assert core.handle(AbortRequested("decode aborted", origin="peer")) == (ReportSettled(),)

    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(b"", -1, part=Part.NONE))
    assert core.handle(AbortRequested("prefill aborted")) == (
        ReportOutcome(KVPoll.Failed, core.reason),
        ReportSettled(),
    )

    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(b"", -1, part=Part.NONE))
    core.handle(Initialized(num_pages=0, aux_index=-1))
    core.handle(ChunkSubmitted(b""))  # the empty last chunk is in flight
    assert core.handle(AbortRequested("prefill aborted")) == (
        ReleaseHandles(),
        ReportOutcome(KVPoll.Failed, core.reason),
    )
    assert core.handle(ChunkDone(0)) == (ReportSettled(),)
    assert core.settled
