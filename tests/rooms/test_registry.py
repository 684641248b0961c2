"""The ``Registry`` on its own loop, with a recording sink: duplicates refused (and published
as such to a caller on another thread), legs keyed apart, events routed by full key (an old
generation's event is dropped and counted), hooks called on spawn and reap, receivers'
destinations released only when settled, shutdown aborting what is left."""

from __future__ import annotations

import pytest

from kvfsm.rooms import RoomConfig, RoomKey
from kvfsm.rooms._ports import Publication
from kvfsm.rooms._registry import DuplicateRoomError, Registry
from kvfsm.states import (
    TERMINAL,
    AbortRequested,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    PeerSettled,
    Role,
)
from tests.helpers.rooms import ScriptedSink, drain, pages
from tests.helpers.waiting import wait_until


class HookedSink(ScriptedSink):
    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple[RoomKey, Role]] = []
        self.reaped: list[tuple[RoomKey, Role]] = []

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        self.spawned.append((key, role))

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        self.reaped.append((key, role))


async def ended(registry: Registry, key: RoomKey) -> None:
    """Until room ``key`` is reaped (its settle timeout is real time: short in these tests)."""
    await wait_until(
        lambda: registry.get(key) is None, timeout=2.5, message=f"room {key} to be reaped"
    )


@pytest.mark.asyncio
async def test_a_live_duplicate_is_refused_and_an_ended_id_may_be_reused() -> None:
    sink = HookedSink()
    registry = Registry(sink)
    first = RoomKey(5, 1)
    registry.spawn(first, Role.SENDER)
    with pytest.raises(DuplicateRoomError, match="sender room 5 is already live"):
        registry.spawn(RoomKey(5, 2), Role.SENDER)
    assert registry.stats.duplicates_refused == 1
    # the same id on the other role is another room
    registry.spawn(RoomKey(5, 3), Role.RECEIVER)
    # an abort queued: the id may be reused at once, as SGLang does after abort()
    registry.deliver(first, AbortRequested("client gone"))
    await drain()
    second = RoomKey(5, 4)
    registry.spawn(second, Role.SENDER)
    assert registry.current(Role.SENDER, 5) == second
    await ended(registry, first)
    assert (first, Role.SENDER) in sink.reaped
    assert registry.current(Role.SENDER, 5) == second  # the old one's reap does not unmap it
    assert [key for key, _ in sink.spawned] == [first, RoomKey(5, 3), second]
    await registry.shutdown(1.0)


@pytest.mark.asyncio
async def test_a_refusal_for_a_caller_on_another_thread_is_published() -> None:
    registry = Registry(ScriptedSink())
    registry.spawn(RoomKey(8, 1), Role.RECEIVER)
    refused = Publication()
    registry.spawn_or_refuse(RoomKey(8, 2), Role.RECEIVER, refused)
    assert refused.status is KVPoll.Failed
    assert refused.reason.startswith("refused: receiver room 8 is already live")
    assert refused.settled  # it never exposed a page
    await registry.shutdown(1.0)


@pytest.mark.asyncio
async def test_legs_of_one_request_are_keyed_apart() -> None:
    registry = Registry(ScriptedSink())
    zero, one = RoomKey(9, 1), RoomKey(9, 2)
    registry.spawn(zero, Role.RECEIVER, group=9)
    registry.spawn(one, Role.RECEIVER, leg=1, group=9)
    assert (registry.leg_of(zero), registry.leg_of(one)) == (0, 1)
    with pytest.raises(DuplicateRoomError):
        registry.spawn(RoomKey(9, 3), Role.RECEIVER, leg=1, group=9)
    assert registry.current(Role.RECEIVER, 9) == zero  # a room id alone names leg 0
    await registry.shutdown(1.0)


@pytest.mark.asyncio
async def test_events_route_by_full_key_and_stale_ones_are_counted() -> None:
    registry = Registry(ScriptedSink())
    key = RoomKey(3, 7)
    registry.spawn(key, Role.RECEIVER)
    assert registry.deliver(RoomKey(3, 6), PeerResolved(0)) is False  # an older generation
    assert registry.deliver(RoomKey(99, 1), PeerResolved(0)) is False  # nobody
    assert registry.stats.stale_events == 2
    assert registry.deliver(key, PeerResolved(0)) is True
    await drain()
    room = registry.get(key)
    assert room is not None
    assert room.publication.status is KVPoll.WaitingForInput
    assert registry.role_of(key) is Role.RECEIVER
    assert not registry.ended(key)
    rows = registry.snapshot()
    assert [row["room"] for row in rows] == [3]
    await registry.shutdown(1.0)
    assert registry.ended(key)
    assert registry.role_of(key) is None


@pytest.mark.asyncio
async def test_a_settled_receiver_gives_its_pages_back_an_unsettled_one_keeps_them() -> None:
    """Both receivers' page lists went out and both were aborted. The prefill of the first
    acknowledges (PeerSettled): its pages are free again. The second's never does: it is
    reaped by the settle timeout *unsettled*, and its pages stay held, since a WRITE may still
    land there (a second room naming them would be refused)."""
    registry = Registry(ScriptedSink(), RoomConfig(settle_timeout_s=0.05))
    acknowledged, silent = RoomKey(1, 1), RoomKey(2, 2)
    for key, dst in ((acknowledged, pages(1, 2)), (silent, pages(3, 4))):
        registry.spawn(key, Role.RECEIVER)
        registry.deliver(key, PeerResolved(0))
        registry.deliver(key, MetadataSubmitted(dst, key.room))
    await drain()
    assert registry.owners.held_pages == 4
    for key in (acknowledged, silent):
        registry.deliver(key, AbortRequested("test"))
    registry.deliver(acknowledged, PeerSettled())
    await ended(registry, acknowledged)
    await ended(registry, silent)
    assert registry.stats.destinations_quarantined == 1
    assert registry.owners.held_pages == 2  # the silent room's two pages
    await registry.shutdown(1.0)


@pytest.mark.asyncio
async def test_shutdown_aborts_what_is_live_and_refuses_new_rooms() -> None:
    registry = Registry(ScriptedSink())
    keys = [RoomKey(n, n) for n in range(1, 6)]
    pubs = [registry.spawn(key, Role.SENDER).publication for key in keys]
    await registry.shutdown(1.0)
    assert len(registry) == 0
    assert all(pub.status in TERMINAL for pub in pubs)
    assert all("engine shutting down" in pub.reason for pub in pubs)
    with pytest.raises(RuntimeError, match="shutting down"):
        registry.spawn(RoomKey(50, 1), Role.SENDER)
