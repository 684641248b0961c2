"""The control plane's routing cores, driven directly: every rule of kvfsm.control._routing,
with ``now`` passed in and the actions checked as values."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.control._frames import (
    Error,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    pack_refs,
    unpack_refs,
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
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import (
    AbortRequested,
    DestinationReceived,
    EventRejected,
    KVPoll,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    TransferConfirmed,
)

CONFIG = RoutingConfig(pending_max=8, pending_ttl_s=10.0, lease_s=2.0, fence_margin_s=1.0)
PAGES = np.arange(4, dtype="<i4").tobytes()
A, B = 1, 2  # link ids (the control plane's link generations; also the fence ids)
S1, S2 = RoomKey(7, 101), RoomKey(7, 102)  # prefill sender keys (prefill's own generations)


def sends(actions: list[Action], link: int | None = None) -> list[object]:
    return [a.frame for a in actions if isinstance(a, Send) and (link is None or a.link == link)]


def delivered(actions: list[Action]) -> list[tuple[RoomKey, object]]:
    return [(a.key, a.event) for a in actions if isinstance(a, Deliver)]


def metadata(room: int = 7, gen: int = 1) -> RoomMetadata:
    return RoomMetadata(room, gen, PAGES, 3)


@pytest.fixture
def prefill() -> PrefillRouting:
    core = PrefillRouting(CONFIG)
    core.link_opened(A, "decode-0-1", now=0.0, hello_sent=0.0, lease_ms=2000)
    core.link_opened(B, "decode-0-2", now=0.0, hello_sent=0.0, lease_ms=2000)
    return core


def idle(core: PrefillRouting | DecodeRouting, now: float = 1e6) -> dict[str, int]:
    core.tick(now)
    return {k: v for k, v in core.entries().items() if v}


# -- prefill: claims and binding ---------------------------------------------------------------


def test_a_claim_before_the_sender_binds_it_when_it_spawns(prefill: PrefillRouting) -> None:
    assert prefill.on_claim(A, RoomClaim(7, 1), 0.0) == []
    assert prefill.sender_spawned(S1, 0.1) == []
    assert prefill.bound_to(A) == [S1]
    ((key, event),) = delivered(prefill.on_metadata(A, metadata(), 0.2))
    assert key == S1
    assert event == DestinationReceived(PAGES, 3, "decode-0-1", b"", A)  # fenced by link A


def test_a_page_list_without_a_claim_is_a_claim_too(prefill: PrefillRouting) -> None:
    assert prefill.on_metadata(A, metadata(), 0.0) == []
    ((key, event),) = delivered(prefill.sender_spawned(S1, 0.1))
    assert key == S1
    assert isinstance(event, DestinationReceived)
    assert event.fence == A


def test_a_lost_decode_fails_its_claimed_rooms_at_once_whatever_their_state(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_claim(A, RoomClaim(7, 1), 0.0)  # no page list yet: Bootstrapping
    actions = prefill.link_lost(A, "decode gone", 1.0)
    assert RevokeLease(A) in actions
    assert delivered(actions) == [(S1, PeerLost("decode gone"))]
    # It never had the pages: its failure needs no settle and leaves nothing behind.
    assert prefill.sender_outcome(S1, KVPoll.Failed, "peer lost", 1.1) == []
    prefill.sender_reaped(S1)
    assert idle(prefill) == {}


def test_a_retransmitted_page_list_changes_nothing(prefill: PrefillRouting) -> None:
    prefill.sender_spawned(S1, 0.0)
    assert len(delivered(prefill.on_metadata(A, metadata(), 0.0))) == 1
    assert prefill.on_metadata(A, metadata(), 0.1) == []
    assert prefill.on_claim(A, RoomClaim(7, 1), 0.2) == []
    assert prefill.stats["stale_frames"] == 2


def test_a_second_receiver_from_another_decode_is_refused_and_the_first_untouched(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(), 0.0)
    actions = prefill.on_metadata(B, metadata(gen=5), 0.1)
    outcome, settled = sends(actions, B)
    assert isinstance(outcome, RoomOutcome)
    assert outcome.status == int(KVPoll.Failed)
    assert "duplicate room id 7" in outcome.reason
    assert settled == RoomSettled(7, 5)  # nothing was written to the newcomer's pages
    assert delivered(actions) == []
    assert prefill.bound_to(A) == [S1]


def test_a_claim_from_another_decode_for_a_held_id_is_refused(prefill: PrefillRouting) -> None:
    assert prefill.on_metadata(A, metadata(gen=1), 0.0) == []
    outcome, settled = sends(prefill.on_metadata(B, metadata(gen=9), 0.1), B)
    assert isinstance(outcome, RoomOutcome)
    assert "duplicate room id 7" in outcome.reason
    assert settled == RoomSettled(7, 9)
    ((key, _),) = delivered(prefill.sender_spawned(S1, 0.2))  # the first keeps its claim
    assert key == S1
    assert prefill.bound_to(A) == [S1]


def test_held_claims_are_capped_per_link_not_shared(prefill: PrefillRouting) -> None:
    for room in range(CONFIG.pending_max):
        assert prefill.on_claim(A, RoomClaim(room + 100, 1), 0.0) == []
    refused = sends(prefill.on_claim(A, RoomClaim(999, 1), 0.0))
    assert isinstance(refused[0], RoomOutcome)
    assert "over their quota" in refused[0].reason
    # Another decode link still has its own room.
    assert prefill.on_claim(B, RoomClaim(999, 1), 0.0) == []


def test_early_aborts_are_remembered_within_each_links_quota(prefill: PrefillRouting) -> None:
    for room in range(CONFIG.pending_max + 3):
        assert prefill.on_abort(A, RoomAbort(room, 1, "flood"), 0.0) == [
            Send(A, RoomSettled(room, 1))
        ]
    assert prefill.stats["early_aborts_over_quota"] == 3
    prefill.on_abort(B, RoomAbort(500, 1, "client gone"), 0.0)  # B's mark is kept
    assert delivered(prefill.sender_spawned(RoomKey(500, 9), 0.1)) == [
        (RoomKey(500, 9), AbortRequested("client gone", origin="peer"))
    ]
    assert prefill.entries()["early_aborts"] == CONFIG.pending_max
    prefill.tick(CONFIG.pending_ttl_s + 1)
    assert prefill.entries()["early_aborts"] == 0
    assert prefill.on_abort(A, RoomAbort(1, 1, "again"), 20.0) == [Send(A, RoomSettled(1, 1))]
    assert prefill.entries()["early_aborts"] == 1  # the quota came back with the expiry


def test_a_page_list_behind_an_answered_claim_is_stale(prefill: PrefillRouting) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_claim(A, RoomClaim(7, 1), 0.0)
    assert RoomSettled(7, 1) in sends(prefill.sender_outcome(S1, KVPoll.Failed, "x", 0.1))
    prefill.sender_reaped(S1)
    assert prefill.on_metadata(A, metadata(), 0.2) == []  # not held for the next sender
    assert prefill.sender_spawned(S2, 0.3) == []
    assert prefill.entries()["held"] == 0


def test_held_claims_expire_with_an_answer(prefill: PrefillRouting) -> None:
    prefill.on_metadata(A, metadata(), 0.0)
    assert prefill.tick(5.0) == []
    outcome, settled = sends(prefill.tick(10.5), A)
    assert isinstance(outcome, RoomOutcome)
    assert outcome.status == int(KVPoll.Failed)
    assert settled == RoomSettled(7, 1)
    assert idle(prefill) == {}


# -- prefill: ends, tombstones, early aborts ---------------------------------------------------


def test_success_unbinds_and_a_late_abort_is_answered_without_marking_the_id(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(), 0.0)
    assert sends(prefill.sender_outcome(S1, KVPoll.Success, "", 1.0)) == [
        RoomOutcome(7, 1, int(KVPoll.Success), "")
    ]
    assert prefill.on_abort(A, RoomAbort(7, 1, "too late"), 1.1) == [Send(A, RoomSettled(7, 1))]
    prefill.sender_reaped(S1)
    # The id's next sender is not aborted by that late abort.
    assert prefill.sender_spawned(S2, 2.0) == []


def test_a_failed_sender_with_pages_settles_only_when_its_handles_did(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(), 0.0)
    assert sends(prefill.sender_outcome(S1, KVPoll.Failed, "boom", 1.0)) == [
        RoomOutcome(7, 1, int(KVPoll.Failed), "boom")
    ]
    assert sends(prefill.sender_settled(S1, 2.0)) == [RoomSettled(7, 1)]
    prefill.sender_reaped(S1)
    assert idle(prefill) == {}


def test_a_sender_failed_before_any_claim_answers_the_claim_when_it_comes(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.sender_outcome(S1, KVPoll.Failed, "prefill aborted", 0.5)
    prefill.sender_reaped(S1)
    outcome, settled = sends(prefill.on_claim(A, RoomClaim(7, 1), 1.0))
    assert outcome == RoomOutcome(7, 1, int(KVPoll.Failed), "prefill aborted")
    assert settled == RoomSettled(7, 1)
    assert idle(prefill) == {}


def test_a_sender_no_decode_claims_fails_with_its_own_reason(prefill: PrefillRouting) -> None:
    # Its decode half never arrived (a router that failed to reach decode): it fails after
    # unclaimed_s, not after its Bootstrapping deadline, and a claim that comes after all is
    # answered with the failure.
    limit = CONFIG.unclaimed_s
    prefill.sender_spawned(S1, 0.0)
    prefill.sender_spawned(RoomKey(8, 103), 1.0)
    prefill.on_claim(A, RoomClaim(8, 1), 2.0)  # claimed: never failed for want of a claim
    assert delivered(prefill.tick(limit)) == []
    [(key, event)] = delivered(prefill.tick(limit + 0.5))
    assert key == S1
    assert isinstance(event, PeerLost)
    assert event.reason.startswith(f"no decode room claimed it within {limit:g}s")
    assert delivered(prefill.tick(limit + 100)) == []  # once
    assert prefill.stats["unclaimed_failed"] == 1
    assert prefill.stats["claim_wait_max_ms"] == 1000  # room 8 waited 1 s for its claim
    prefill.sender_outcome(S1, KVPoll.Failed, "peer lost: no decode room claimed it", limit + 1)
    late = prefill.on_claim(A, RoomClaim(7, 1), limit + 2)
    assert [type(f).__name__ for f in sends(late, A)] == ["RoomOutcome", "RoomSettled"]


def test_an_early_abort_is_acknowledged_and_fails_the_next_sender(prefill: PrefillRouting) -> None:
    assert prefill.on_abort(A, RoomAbort(7, 1, "client gone"), 0.0) == [Send(A, RoomSettled(7, 1))]
    assert delivered(prefill.sender_spawned(S1, 0.5)) == [
        (S1, AbortRequested("client gone", origin="peer"))
    ]
    # Its decode room knows already: no tombstone for the id's next claim.
    prefill.sender_outcome(S1, KVPoll.Failed, "aborted", 0.6)
    assert prefill.entries()["tombstones"] == 0


def test_an_id_reused_after_an_early_abort_is_not_killed_by_it(prefill: PrefillRouting) -> None:
    prefill.on_abort(A, RoomAbort(7, 1, "client gone"), 0.0)
    prefill.on_claim(A, RoomClaim(7, 2), 0.1)  # generation 2 reuses the id
    assert prefill.sender_spawned(S2, 0.2) == []
    ((key, event),) = delivered(prefill.on_metadata(A, metadata(gen=2), 0.3))
    assert key == S2
    assert isinstance(event, DestinationReceived)


def test_an_id_reused_while_the_old_generation_drains_both_settle(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(gen=1), 0.0)
    assert delivered(prefill.on_abort(A, RoomAbort(7, 1, "retracted"), 0.1)) == [
        (S1, AbortRequested("retracted", origin="peer"))
    ]
    # Decode reuses the id at once; prefill's old room still has writes to drain.
    assert prefill.on_metadata(A, metadata(gen=2), 0.2) == []  # held, not refused
    prefill.sender_outcome(S1, KVPoll.Failed, "aborted", 0.3)
    assert sends(prefill.sender_settled(S1, 0.4)) == [RoomSettled(7, 1)]  # the old one settles
    prefill.sender_reaped(S1)
    ((key, event),) = delivered(prefill.sender_spawned(S2, 0.5))
    assert key == S2
    assert isinstance(event, DestinationReceived)


def test_an_error_frame_fails_exactly_the_room_it_names(prefill: PrefillRouting) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(gen=1), 0.0)
    assert prefill.on_error(A, Error(7, "nope", 2)) == []  # another generation
    assert prefill.on_error(B, Error(7, "nope", 1)) == []  # another link
    ((key, event),) = delivered(prefill.on_error(A, Error(7, "aux row 9 out of range", 1)))
    assert key == S1
    assert isinstance(event, EventRejected)
    assert "aux row 9 out of range" in event.reason


# -- prefill: links, reconciliation, leases ----------------------------------------------------


def test_after_a_reconnect_the_rooms_still_writing_settle_on_the_new_link(
    prefill: PrefillRouting,
) -> None:
    prefill.sender_spawned(S1, 0.0)
    prefill.on_metadata(A, metadata(), 0.0)
    prefill.link_lost(A, "cut", 1.0)
    prefill.sender_outcome(S1, KVPoll.Failed, "peer lost", 1.0)
    assert prefill.entries()["orphans"] == 1
    c = 3
    prefill.link_opened(
        c, "decode-0-1", now=2.0, hello_sent=2.0, lease_ms=2000
    )  # the same decode incarnation
    refs = pack_refs([(7, 1), (8, 4)])
    assert sends(prefill.on_reconcile(c, Reconcile(refs), 2.1)) == [RoomSettled(8, 4)]  # unknown
    assert sends(prefill.sender_settled(S1, 3.0), c) == [RoomSettled(7, 1)]
    prefill.sender_reaped(S1)
    assert idle(prefill) == {}


# -- prefill: legs (decode's attention TP larger: one sender room per decode rank) -----------


@pytest.fixture
def legs() -> PrefillRouting:
    """Links A and B are decode ranks 0 and 1 of one prefill rank's two: legs 0 and 1 of 2."""
    core = PrefillRouting(CONFIG)
    core.link_opened(A, "decode-0-1", now=0.0, hello_sent=0.0, lease_ms=2000, leg=0, legs=2)
    core.link_opened(B, "decode-1-1", now=0.0, hello_sent=0.0, lease_ms=2000, leg=1, legs=2)
    return core


def test_each_legs_claim_binds_its_own_sender_and_tells_it_how_many_legs(
    legs: PrefillRouting,
) -> None:
    # Both decode ranks claim room 7 (their own generations); neither is a duplicate.
    assert legs.on_metadata(A, metadata(gen=1), 0.0) == []
    assert legs.on_metadata(B, metadata(gen=4), 0.0) == []
    ((key, event),) = delivered(legs.sender_spawned(S1, 0.1))  # leg 0
    assert key == S1
    assert isinstance(event, DestinationReceived)
    assert (event.fence, event.legs) == (A, 2)
    assert legs.bound_to(B) == []  # leg 1's claim waits for leg 1's sender, not leg 0's
    ((key, event),) = delivered(legs.sender_spawned(S2, 0.2, leg=1))
    assert key == S2
    assert isinstance(event, DestinationReceived)
    assert (event.fence, event.legs) == (B, 2)
    assert legs.bound_to(A) == [S1]
    assert legs.bound_to(B) == [S2]


def test_a_second_claim_for_the_same_leg_is_still_a_duplicate(legs: PrefillRouting) -> None:
    legs.link_opened(3, "decode-9-1", now=0.0, hello_sent=0.0, lease_ms=2000, leg=1, legs=2)
    legs.sender_spawned(S2, 0.0, leg=1)
    legs.on_metadata(B, metadata(gen=4), 0.0)
    outcome, _settled = sends(legs.on_metadata(3, metadata(gen=5), 0.1), 3)
    assert isinstance(outcome, RoomOutcome)
    assert "duplicate room id 7" in outcome.reason
    assert legs.bound_to(B) == [S2]


def test_an_early_abort_marks_only_its_own_leg(legs: PrefillRouting) -> None:
    assert legs.on_abort(B, RoomAbort(7, 4, "client gone"), 0.0) == [Send(B, RoomSettled(7, 4))]
    assert delivered(legs.sender_spawned(S1, 0.1)) == []  # leg 0 is not aborted by leg 1's
    assert delivered(legs.sender_spawned(S2, 0.2, leg=1)) == [
        (S2, AbortRequested("client gone", origin="peer"))
    ]


def test_a_legs_tombstone_answers_only_that_legs_claim(legs: PrefillRouting) -> None:
    legs.sender_spawned(S2, 0.0, leg=1)
    legs.sender_outcome(S2, KVPoll.Failed, "deadline", 0.1)  # failed before any claim
    legs.sender_reaped(S2)
    assert legs.on_metadata(A, metadata(gen=1), 0.2) == []  # leg 0: held, not answered
    outcome, settled = sends(legs.on_metadata(B, metadata(gen=4), 0.3), B)
    assert isinstance(outcome, RoomOutcome)
    assert outcome.reason == "deadline"
    assert settled == RoomSettled(7, 4)


def test_leases_count_from_prefills_own_send_time() -> None:
    core = PrefillRouting(CONFIG)
    # Decode's Hello answers prefill's and grants its lease length (decode's, not prefill's).
    assert core.link_opened(A, "d", now=0.05, hello_sent=0.0, lease_ms=2000) == [GrantLease(A, 2.0)]
    assert core.link_opened(B, "d", now=0.05, hello_sent=0.0, lease_ms=0) == []  # none yet
    assert core.lease_due(A, 0.3) == []  # renewed every lease_s / 4
    assert core.lease_due(A, 0.5) == [Send(A, LeaseRequest(1))]
    assert core.lease_due(A, 0.6) == []
    # The grant comes late (prefill was frozen): it grants from when it was asked.
    assert core.lease_granted(A, 1, 2000, now=30.0) == [GrantLease(A, 2.5)]
    assert core.lease_granted(A, 1, 2000, now=30.1) == []  # a replayed grant extends nothing
    assert core.lease_granted(A, 99, 2000, now=30.1) == []  # never asked


def test_every_lease_carries_the_margin_decodes_hello_told() -> None:
    """Prefill's stale-progress gate must use decode's fence margin (decode settles a lost
    link's pages at its last grant + lease + margin), not whatever prefill was configured
    with: decode's Hello tells it, and every lease of the link carries it."""
    core = PrefillRouting(CONFIG)
    told = core.link_opened(A, "d", now=0.05, hello_sent=0.0, lease_ms=2000, margin_ms=250)
    assert told == [GrantLease(A, 2.0, 0.25)]
    core.lease_due(A, 0.5)
    assert core.lease_granted(A, 1, 2000, now=0.6) == [GrantLease(A, 2.5, 0.25)]
    # A Hello that says nothing (0): the gate falls back on prefill's own setting.
    assert core.link_opened(B, "e", now=0.05, hello_sent=0.0, lease_ms=2000) == [
        GrantLease(B, 2.0, None)
    ]


def test_every_entry_is_gone_once_the_rooms_are(prefill: PrefillRouting) -> None:
    for i in range(50):
        key = RoomKey(i, 1000 + i)
        if i % 3:
            prefill.on_claim(A, RoomClaim(i, i), 0.0)
        prefill.sender_spawned(key, 0.0)
        prefill.on_metadata(A, metadata(i, i), 0.0)
        if i % 5 == 0:
            prefill.on_abort(A, RoomAbort(i, i, "x"), 0.1)
            prefill.sender_outcome(key, KVPoll.Failed, "aborted", 0.2)
            prefill.sender_settled(key, 0.3)
        else:
            prefill.sender_outcome(key, KVPoll.Success, "", 0.2)
        prefill.sender_reaped(key)
    assert idle(prefill) == {}


# -- decode ------------------------------------------------------------------------------------

R1, R2 = RoomKey(7, 1), RoomKey(7, 2)


@pytest.fixture
def decode() -> DecodeRouting:
    core = DecodeRouting(CONFIG)
    core.link_opened(A, "prefill-0-9", rank=0, now=0.0)
    return core


def test_decode_claims_a_room_as_soon_as_its_prefill_is_connected(decode: DecodeRouting) -> None:
    actions = decode.bind(R1, A, 0)
    assert sends(actions, A) == [RoomClaim(7, 1)]
    assert delivered(actions) == [(R1, PeerResolved(0))]
    assert sends(decode.metadata(R1, metadata())) == [metadata()]
    assert decode.expecting_writes
    assert delivered(decode.on_outcome(A, RoomOutcome(7, 1, int(KVPoll.Success)))) == [
        (R1, TransferConfirmed(0))
    ]
    assert not decode.expecting_writes
    decode.receiver_reaped(R1)
    assert idle(decode) == {}


def test_a_decode_room_aborted_before_its_page_list_leaves_nothing_bound(
    decode: DecodeRouting,
) -> None:
    decode.bind(R1, A, 0)
    assert sends(decode.receiver_failed(R1, "client gone")) == [RoomAbort(7, 1, "client gone")]
    assert decode.entries() == {"rooms": 0, "lost": 0, "exposed": 0, "untold": 0}
    assert not decode.expecting_writes


def test_a_lost_links_pages_settle_when_the_last_lease_ran_out(decode: DecodeRouting) -> None:
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    assert sends(decode.lease_requested(A, LeaseRequest(4), now=5.0)) == [LeaseGrant(4, 2000)]
    assert delivered(decode.link_lost(A, "silent", 6.0)) == [(R1, PeerLost("silent"))]
    assert decode.tick(7.9) == []  # the lease granted at 5.0 runs to 7.0, plus 1.0 of margin
    assert delivered(decode.tick(8.0)) == [(R1, PeerSettled(0))]
    decode.receiver_reaped(R1)
    assert idle(decode) == {}


def test_a_link_lost_under_a_live_lease_counts_as_fenced(decode: DecodeRouting) -> None:
    """``leases_fenced``: links lost while the last lease granted on them was still running
    (its writes are held off by the fence alone); one whose lease had run out does not count."""
    assert decode.stats["leases_fenced"] == 0  # present from the start
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    decode.lease_requested(A, LeaseRequest(1), now=5.0)  # live until 7.0
    decode.link_lost(A, "cut", 6.9)
    assert decode.stats["leases_fenced"] == 1
    decode.link_opened(B, "prefill-0-9", rank=0, now=10.0)  # its Hello's lease: until 12.0
    decode.link_lost(B, "silent", 12.5)  # a peer frozen past its lease: nothing left to fence
    assert decode.stats["leases_fenced"] == 1
    decode.link_lost(B, "again", 13.0)  # a link is lost once
    assert decode.stats["leases_fenced"] == 1


def test_prefill_counts_a_live_lease_it_revokes_as_fenced(prefill: PrefillRouting) -> None:
    assert prefill.stats["leases_fenced"] == 0
    assert prefill.link_lost(A, "decode gone", 1.9) == [RevokeLease(A)]  # granted until 2.0
    assert prefill.stats["leases_fenced"] == 1
    assert prefill.link_lost(B, "decode silent", 2.0) == [RevokeLease(B)]  # ran out at 2.0
    assert prefill.stats["leases_fenced"] == 1


def test_after_a_reconnect_decode_reconciles_and_settles_early(decode: DecodeRouting) -> None:
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    decode.link_lost(A, "cut", 1.0)
    c = 3
    (frame,) = sends(decode.link_opened(c, "prefill-0-9", rank=0, now=1.5))
    assert isinstance(frame, Reconcile)
    assert unpack_refs(frame.rooms) == [(7, 1)]
    assert delivered(decode.on_settled(c, RoomSettled(7, 1))) == [(R1, PeerSettled(0))]
    assert decode.tick(100.0) == []  # not settled twice


def test_another_prefill_incarnation_is_not_asked(decode: DecodeRouting) -> None:
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    decode.link_lost(A, "restart", 1.0)
    assert decode.link_opened(3, "prefill-0-10", rank=0, now=1.5) == []


def test_generations_of_one_id_are_routed_apart(decode: DecodeRouting) -> None:
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata(gen=1))
    decode.receiver_failed(R1, "aborted")
    decode.bind(R2, A, 0)  # reused before generation 1 settled
    decode.metadata(R2, metadata(gen=2))
    assert delivered(decode.on_settled(A, RoomSettled(7, 1))) == [(R1, PeerSettled(0))]
    assert delivered(decode.on_outcome(A, RoomOutcome(7, 2, 0, "x"))) == [(R2, PeerFailed("x"))]
    assert decode.on_outcome(A, RoomOutcome(7, 3, 0, "x")) == []  # never existed
    assert decode.stats["stale_frames"] == 1


def test_decode_fails_the_room_an_error_frame_names(decode: DecodeRouting) -> None:
    decode.bind(R1, A, 0)
    decode.bind(R2, A, 0)
    ((key, event),) = delivered(decode.on_error(A, Error(7, "aux row 9 out of range", 2)))
    assert key == R2
    assert isinstance(event, EventRejected)
    assert "aux row 9 out of range" in event.reason


# -- a decode frozen past the settle bound, and what a lost link leaves to tell -------------------


def test_a_lost_links_pages_wait_for_a_steady_stretch_of_progress(decode: DecodeRouting) -> None:
    """Decode was frozen (its agent not progressed): the bytes queued for it land once it is
    progressed again, so its clock alone settles nothing. ``steady_s``: how long its agent
    has been progressed without a gap."""
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    decode.lease_requested(A, LeaseRequest(1), now=1.0)  # the lease runs to 3.0, settle at 4.0
    decode.link_lost(A, "connection to prefill closed", 60.0)  # found on waking from a freeze
    assert decode.expecting_writes  # a lost room's bytes may still come: progress fast
    assert decode.tick(60.0, steady_s=0.0) == []  # just woke: nothing taken yet
    assert decode.tick(60.5, steady_s=0.5) == []  # half the margin
    assert decode.stats["settles_held_unsteady"] == 2
    assert delivered(decode.tick(61.0, steady_s=1.0)) == [(R1, PeerSettled(0))]
    assert not decode.expecting_writes


def test_a_steady_decode_settles_a_lost_link_at_its_bound_as_before(
    decode: DecodeRouting,
) -> None:
    decode.bind(R1, A, 0)
    decode.metadata(R1, metadata())
    decode.lease_requested(A, LeaseRequest(1), now=5.0)
    decode.link_lost(A, "silent", 6.0)
    assert decode.tick(7.9, steady_s=100.0) == []
    assert delivered(decode.tick(8.0, steady_s=100.0)) == [(R1, PeerSettled(0))]


def test_rooms_a_lost_link_failed_before_their_pages_went_are_aborted_on_the_next_link(
    decode: DecodeRouting,
) -> None:
    """Their claims may never have reached prefill (sent into a link it had closed): the
    sender waiting for them is told on the next link to the same incarnation."""
    decode.bind(R1, A, 0)  # claimed only
    decode.bind(RoomKey(8, 1), A, 0)
    decode.metadata(RoomKey(8, 1), metadata(room=8))  # exposed: reconciled instead
    decode.link_lost(A, "connection to prefill closed", 1.0)
    assert decode.owes("prefill-0-9")
    assert not decode.owes("prefill-0-10")
    assert decode.entries()["untold"] == 1
    frames = sends(decode.link_opened(3, "prefill-0-9", rank=0, now=1.5))
    assert isinstance(frames[0], Reconcile)
    assert unpack_refs(frames[0].rooms) == [(8, 1)]
    assert frames[1:] == [RoomAbort(7, 1, "decode room failed while its control link was down")]
    assert decode.stats["aborts_told_late"] == 1
    assert decode.entries()["untold"] == 0
    assert decode.owes("prefill-0-9")  # room 8 still waits for its RoomSettled
    decode.on_settled(3, RoomSettled(8, 1))
    assert not decode.owes("prefill-0-9")


def test_untold_aborts_are_not_sent_to_another_incarnation_and_expire(
    decode: DecodeRouting,
) -> None:
    decode.bind(R1, A, 0)
    decode.link_lost(A, "restart", 1.0)
    assert decode.link_opened(3, "prefill-0-10", rank=0, now=1.5) == []
    decode.tick(1.0 + CONFIG.pending_ttl_s + 1)
    assert decode.entries()["untold"] == 0
    assert not decode.owes("prefill-0-9")


def test_untold_aborts_are_bounded(decode: DecodeRouting) -> None:
    keys = [RoomKey(100 + i, 1) for i in range(CONFIG.pending_max + 3)]
    for key in keys:
        decode.bind(key, A, 0)
    decode.link_lost(A, "cut", 1.0)
    assert decode.entries()["untold"] == CONFIG.pending_max


def test_an_abort_for_a_live_unbound_sender_fails_it_at_once(prefill: PrefillRouting) -> None:
    """The sender waits in Bootstrapping for a claim that died with a link: decode's abort on
    the next link is all that will come, so it fails now, not at its deadline, and nothing
    is remembered for the id's next sender."""
    prefill.sender_spawned(S1, 0.0)
    actions = prefill.on_abort(B, RoomAbort(7, 1, "decode room failed"), 1.0)
    assert delivered(actions) == [(S1, AbortRequested("decode room failed", origin="peer"))]
    assert sends(actions, B) == [RoomSettled(7, 1)]
    assert prefill.entries()["early_aborts"] == 0
    prefill.sender_outcome(S1, KVPoll.Failed, "aborted", 1.1)
    assert prefill.entries()["tombstones"] == 0  # its decode room knows
