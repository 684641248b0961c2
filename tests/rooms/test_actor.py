"""Room tasks on a real event loop, with a scripted sink and virtual time (looptime): the
mailbox, deadlines in every non-terminal state, publication, settle and reaping."""

from __future__ import annotations

import asyncio

import pytest

from kvfsm.rooms import RoomConfig, RoomKey
from kvfsm.rooms._ports import Publication
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    DEFAULT_DEADLINES,
    AbortRequested,
    ChunkDone,
    ChunkSubmitted,
    DestinationReceived,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    Part,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    Role,
    SendMetadata,
    TransferConfirmed,
)
from tests.helpers.rooms import DST, ScriptedSink, drain, pages
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.asyncio

PATHS = {
    # events that bring a fresh room to the given state
    (Role.SENDER, KVPoll.Bootstrapping): [],
    (Role.SENDER, KVPoll.WaitingForInput): [DestinationReceived(DST, 5)],
    (Role.SENDER, KVPoll.Transferring): [
        DestinationReceived(DST, 5),
        Initialized(num_pages=4, aux_index=1),
        ChunkSubmitted(pages(0)),
    ],
    (Role.RECEIVER, KVPoll.Bootstrapping): [Initialized(peer_rank=0)],
    (Role.RECEIVER, KVPoll.WaitingForInput): [Initialized(peer_rank=0), PeerResolved(0)],
    (Role.RECEIVER, KVPoll.Transferring): [
        Initialized(peer_rank=0),
        PeerResolved(0),
        MetadataSubmitted(DST, 5),
    ],
}


def make_registry(**config: object) -> tuple[Registry, ScriptedSink]:
    sink = ScriptedSink()
    return Registry(sink, RoomConfig(strict=True, **config)), sink  # type: ignore[arg-type]


@pytest.mark.looptime
@pytest.mark.parametrize(("role", "state"), list(PATHS))
async def test_deadline_expiry_in_every_non_terminal_state(role: Role, state: KVPoll) -> None:
    registry, _ = make_registry(settle_timeout_s=3600.0)
    loop = asyncio.get_running_loop()
    pub = Publication()
    key = RoomKey(7, 1)
    registry.spawn(key, role, pub)
    for event in PATHS[(role, state)]:
        registry.deliver(key, event)
    await drain()
    assert pub.status is state
    entered = loop.time()
    deadline = DEFAULT_DEADLINES[role][state]

    await asyncio.sleep(deadline - 1.0)
    assert pub.status is state, "failed before its deadline"
    await asyncio.sleep(2.0)
    assert pub.status is KVPoll.Failed
    assert f"deadline expired: {state.name}" in pub.reason
    assert loop.time() - entered == pytest.approx(deadline + 1.0)
    assert registry.stats.deadline_expiries == 1
    assert registry.errors == []


@pytest.mark.looptime
async def test_each_state_gets_its_own_deadline_and_the_sum_bounds_the_room() -> None:
    deadlines = {
        Role.SENDER: {
            KVPoll.Bootstrapping: 10.0,
            KVPoll.WaitingForInput: 20.0,
            KVPoll.Transferring: 30.0,
        }
    }
    registry, _ = make_registry(deadlines=deadlines)
    loop = asyncio.get_running_loop()
    start = loop.time()
    pub = Publication()
    key = RoomKey(1, 1)
    registry.spawn(key, Role.SENDER, pub)
    await asyncio.sleep(9.0)
    registry.deliver(key, DestinationReceived(DST, 5))  # leaves Bootstrapping at t=9
    await asyncio.sleep(19.0)
    registry.deliver(key, Initialized(num_pages=2, aux_index=0))
    registry.deliver(key, ChunkSubmitted(pages(1)))  # enters Transferring at t=28
    await drain()
    assert pub.status is KVPoll.Transferring
    # Checked every virtual half second: the failure is placed to within that.
    await wait_until(lambda: pub.status is not KVPoll.Transferring, timeout=60.0, interval=0.5)
    assert pub.status is KVPoll.Failed
    assert loop.time() - start == pytest.approx(28.0 + 30.0, abs=0.6)
    assert loop.time() - start <= sum(deadlines[Role.SENDER].values())


async def test_status_is_published_and_the_room_is_reaped_once_settled() -> None:
    registry, sink = make_registry()
    pub = Publication()
    key = RoomKey(3, 1)
    room = registry.spawn(key, Role.SENDER, pub)
    for event in PATHS[(Role.SENDER, KVPoll.Transferring)]:
        registry.deliver(key, event)
    await drain()
    assert pub.status is KVPoll.Transferring
    assert [c.chunk for c in sink.of(key, PostChunk)] == [0]  # type: ignore[attr-defined]
    registry.deliver(key, AbortRequested("test"))
    await drain()
    assert pub.status is KVPoll.Failed
    assert "test" in pub.reason
    assert not pub.settled
    assert len(registry) == 1
    assert sink.of(key, ReleaseHandles)
    registry.deliver(key, ChunkDone(0))
    await drain()
    assert pub.settled
    assert len(registry) == 0
    assert room.done
    assert room.coro is None
    assert registry.deadlines.live == 0  # its deadline went with it: an idle engine arms none
    assert registry.stats.reaped == 1
    assert registry.stats.late_events == 1


async def test_receiver_pages_stay_unsettled_until_the_sender_acknowledges() -> None:
    registry, _ = make_registry()
    pub = Publication()
    key = RoomKey(4, 1)
    registry.spawn(key, Role.RECEIVER, pub)
    for event in PATHS[(Role.RECEIVER, KVPoll.Transferring)]:
        registry.deliver(key, event)
    registry.deliver(key, AbortRequested())
    await drain()
    assert pub.status is KVPoll.Failed
    assert not pub.settled
    registry.deliver(key, PeerSettled(0))
    await drain()
    assert pub.settled
    assert len(registry) == 0


@pytest.mark.looptime
async def test_a_room_that_never_settles_gives_up_after_the_settle_timeout() -> None:
    registry, _ = make_registry(settle_timeout_s=60.0)
    pub = Publication()
    key = RoomKey(5, 1)
    registry.spawn(key, Role.SENDER, pub)
    for event in PATHS[(Role.SENDER, KVPoll.Transferring)]:
        registry.deliver(key, event)
    registry.deliver(key, AbortRequested())
    await asyncio.sleep(59.0)
    assert len(registry) == 1
    await asyncio.sleep(2.0)
    assert len(registry) == 0
    assert registry.stats.settle_timeouts == 1
    assert pub.status is KVPoll.Failed
    assert not pub.settled


async def test_mailbox_overflow_fails_the_room_but_keeps_settlement_events() -> None:
    registry, _ = make_registry(mailbox_size=4)
    pub = Publication()
    key = RoomKey(6, 1)
    registry.spawn(key, Role.SENDER, pub)
    for event in PATHS[(Role.SENDER, KVPoll.Transferring)]:
        registry.deliver(key, event)
    await drain()
    for _ in range(10):  # a flood the room cannot keep up with (no loop iteration between)
        registry.deliver(key, AbortRequested("flood", origin="peer"))
    registry.deliver(key, ChunkDone(0))  # a settlement event is never refused
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.settled
    assert registry.stats.mailbox_overflows == 1


async def test_duplicate_live_room_is_refused_and_old_generation_events_are_dropped() -> None:
    from kvfsm.rooms._registry import DuplicateRoomError

    registry, _ = make_registry()
    first = RoomKey(9, 1)
    registry.spawn(first, Role.SENDER)
    with pytest.raises(DuplicateRoomError, match="sender room 9 is already live"):
        registry.spawn(RoomKey(9, 2), Role.SENDER)
    registry.spawn(RoomKey(9, 3), Role.RECEIVER)  # the other role may use the same id
    registry.deliver(first, AbortRequested())
    await drain()
    # The first room is terminal (and settled): the id is free for a new generation.
    second = RoomKey(9, 4)
    pub = Publication()
    registry.spawn(second, Role.SENDER, pub)
    stale = registry.stats.stale_events
    assert not registry.deliver(first, DestinationReceived(DST, 5))  # old generation
    assert registry.stats.stale_events == stale + 1
    await drain()
    assert pub.status is KVPoll.Bootstrapping
    assert registry.current(Role.SENDER, 9) == second


async def test_spawn_or_refuse_publishes_failed_instead_of_raising() -> None:
    registry, _ = make_registry()
    registry.spawn(RoomKey(11, 1), Role.RECEIVER)
    pub = Publication()
    registry.spawn_or_refuse(RoomKey(11, 2), Role.RECEIVER, pub)
    assert pub.status is KVPoll.Failed
    assert "already live" in pub.reason
    assert pub.settled
    assert registry.stats.duplicates_refused == 1


async def test_shutdown_fails_live_rooms_and_cancels_unsettled_ones() -> None:
    registry, _ = make_registry(shutdown_timeout_s=0.05)
    pubs = []
    for i in range(3):
        pub = Publication()
        key = RoomKey(i, i + 1)
        registry.spawn(key, Role.SENDER, pub)
        pubs.append(pub)
    for event in PATHS[(Role.SENDER, KVPoll.Transferring)]:
        registry.deliver(RoomKey(0, 1), event)  # room 0 has a chunk that never completes
    await drain()
    await registry.shutdown()
    assert [p.status for p in pubs] == [KVPoll.Failed] * 3
    assert all("engine shutting down" in p.reason for p in pubs)
    assert len(registry) == 0
    with pytest.raises(RuntimeError, match="shutting down"):
        registry.spawn(RoomKey(5, 99), Role.SENDER)


async def test_internal_error_fails_only_that_room() -> None:
    registry, _ = make_registry()  # strict: an illegal event raises inside the core
    bad, good = Publication(), Publication()
    registry.spawn(RoomKey(1, 1), Role.SENDER, bad)
    registry.spawn(RoomKey(2, 2), Role.SENDER, good)
    registry.deliver(RoomKey(1, 1), TransferConfirmed())  # a receiver-only event
    registry.deliver(RoomKey(2, 2), DestinationReceived(DST, 5))
    await drain()
    assert bad.status is KVPoll.Failed
    assert "internal error" in bad.reason
    assert good.status is KVPoll.WaitingForInput
    assert len(registry.errors) == 1


# -- legs: one receiver room per prefill rank of one request -----------------------------------


@pytest.mark.parametrize("role", [Role.RECEIVER, Role.SENDER])
async def test_legs_of_one_room_id_coexist_and_duplicates_are_refused_per_leg(role: Role) -> None:
    from kvfsm.rooms._registry import DuplicateRoomError

    registry, _ = make_registry()
    legs = [RoomKey(40, 1), RoomKey(40, 2), RoomKey(40, 3)]
    for leg, key in enumerate(legs):
        registry.spawn(key, role, leg=leg, group=7 if role is Role.RECEIVER else None)
    assert len(registry) == 3
    assert [registry.leg_of(key) for key in legs] == [0, 1, 2]
    for leg in range(3):
        with pytest.raises(DuplicateRoomError, match=f"{role.value} room 40 is already live"):
            registry.spawn(RoomKey(40, 10 + leg), role, leg=leg)
    assert registry.stats.duplicates_refused == 3
    # The other role's room of the same id is no duplicate of any leg.
    other = Role.SENDER if role is Role.RECEIVER else Role.RECEIVER
    registry.spawn(RoomKey(40, 20), other, leg=1)
    assert registry.current(role, 40) == legs[0]
    assert all(registry.get(key) is not None for key in legs)


async def test_reaping_a_leg_frees_only_its_own_entry() -> None:
    from kvfsm.rooms._registry import DuplicateRoomError

    registry, _ = make_registry()
    pubs = [Publication() for _ in range(3)]
    keys = [RoomKey(41, 1), RoomKey(41, 2), RoomKey(41, 3)]
    for leg, (key, pub) in enumerate(zip(keys, pubs, strict=True)):
        registry.spawn(key, Role.RECEIVER, pub, leg=leg, group=3)
    registry.deliver(keys[1], AbortRequested("leg 1 ends"))  # no peer yet: settled at once
    await drain()
    assert pubs[1].status is KVPoll.Failed
    assert registry.get(keys[1]) is None  # reaped
    assert [p.status for p in (pubs[0], pubs[2])] == [KVPoll.Bootstrapping] * 2
    # Leg 1's id is free again; legs 0 and 2 are still live and still refuse a duplicate.
    again = Publication()
    registry.spawn(RoomKey(41, 4), Role.RECEIVER, again, leg=1, group=4)
    for leg in (0, 2):
        with pytest.raises(DuplicateRoomError):
            registry.spawn(RoomKey(41, 5 + leg), Role.RECEIVER, leg=leg, group=4)
    assert registry.current(Role.RECEIVER, 41) == keys[0]
    # Reaping leg 0 frees leg 0 only: the new leg 1 keeps its entry and refuses a duplicate.
    registry.deliver(keys[0], AbortRequested("leg 0 ends"))
    await drain()
    assert registry.current(Role.RECEIVER, 41) is None
    registry.spawn(RoomKey(41, 8), Role.RECEIVER, leg=0, group=5)
    with pytest.raises(DuplicateRoomError):
        registry.spawn(RoomKey(41, 9), Role.RECEIVER, leg=1, group=5)
    assert again.status is KVPoll.Bootstrapping
    assert registry.errors == []


async def test_legs_of_a_group_share_pages_through_their_rooms_until_the_last_is_reaped() -> None:
    registry, sink = make_registry()
    keys = [RoomKey(42, 1), RoomKey(42, 2), RoomKey(42, 3)]
    parts = [
        MetadataSubmitted(pages(1, 2, 3), 4, pages(6), Part.WHOLE),
        MetadataSubmitted(pages(1, 2, 3), -1, b"", Part.KV),
        MetadataSubmitted(b"", -1, b"", Part.NONE),
    ]
    pubs = []
    for leg, (key, meta) in enumerate(zip(keys, parts, strict=True)):
        pub = Publication()
        registry.spawn(key, Role.RECEIVER, pub, leg=leg, group=11)
        for event in (Initialized(peer_rank=leg), PeerResolved(leg), meta):
            registry.deliver(key, event)
        pubs.append(pub)
    other = Publication()
    registry.spawn(RoomKey(43, 4), Role.RECEIVER, other, group=12)
    for event in (Initialized(peer_rank=0), PeerResolved(0), MetadataSubmitted(pages(3), 5)):
        registry.deliver(RoomKey(43, 4), event)
    await drain()
    assert [p.status for p in pubs] == [KVPoll.Transferring] * 3
    assert [c.part for k in keys for c in sink.of(k, SendMetadata)] == [0, 1, 2]  # type: ignore[attr-defined]
    assert other.reason == "rejected: page 3 already held by room 42 gen 1"
    assert registry.owners.held_pages == 3
    for i, key in enumerate(keys):
        registry.deliver(key, TransferConfirmed(i))
        await drain()
        assert pubs[i].status is KVPoll.Success
        assert registry.get(key) is None
        assert registry.owners.held_pages == (3 if i < 2 else 0)
    assert len(registry.owners) == 0


@pytest.mark.looptime
async def test_a_leg_reaped_unsettled_keeps_the_shared_pages_held() -> None:
    registry, _ = make_registry(settle_timeout_s=60.0)
    keys = [RoomKey(44, 1), RoomKey(44, 2)]
    metas = [
        MetadataSubmitted(pages(1, 2), 4, b"", Part.WHOLE),
        MetadataSubmitted(pages(1, 2), -1, b"", Part.KV),
    ]
    pubs = []
    for leg, (key, meta) in enumerate(zip(keys, metas, strict=True)):
        pub = Publication()
        registry.spawn(key, Role.RECEIVER, pub, leg=leg, group=13)
        for event in (Initialized(peer_rank=leg), PeerResolved(leg), meta):
            registry.deliver(key, event)
        pubs.append(pub)
    await drain()
    for key in keys:
        registry.deliver(key, AbortRequested("request aborted"))
    registry.deliver(keys[0], PeerSettled(0))  # leg 0's prefill rank acknowledged; leg 1's never
    await asyncio.sleep(61.0)
    assert len(registry) == 0
    assert pubs[0].settled
    assert not pubs[1].settled
    # Prefill rank 1 may still write into pages 1 and 2: they stay held for the engine's life.
    assert registry.owners.held_pages == 2
    later = Publication()
    registry.spawn(RoomKey(45, 3), Role.RECEIVER, later)
    for event in (Initialized(peer_rank=0), PeerResolved(0), MetadataSubmitted(pages(2), 1)):
        registry.deliver(RoomKey(45, 3), event)
    await drain()
    # The refusal names the leg that still holds them, not the one that settled.
    assert later.reason == "rejected: page 2 already held by room 44 gen 2"
