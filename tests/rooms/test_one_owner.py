"""One owner per destination, as rooms see it: a decode engine refuses a receiver whose pages,
aux row or state rows another live or unsettled receiver holds, before SendMetadata goes out."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvfsm.rooms import RoomConfig, RoomEngine, RoomKey
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._ports import Publication
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    AbortRequested,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    PeerSettled,
    Role,
    SendMetadata,
    TransferConfirmed,
)
from tests.helpers.rooms import ScriptedSink, drain, pages
from tests.helpers.waiting import wait_until_sync

FIRST, SECOND, THIRD = RoomKey(17, 2), RoomKey(18, 3), RoomKey(19, 4)


def make_registry(**config: object) -> tuple[Registry, ScriptedSink]:
    sink = ScriptedSink()
    return Registry(sink, RoomConfig(strict=True, **config)), sink  # type: ignore[arg-type]


def receiver(
    registry: Registry, key: RoomKey, dst: bytes, aux: int, state: bytes = b""
) -> Publication:
    pub = Publication()
    registry.spawn(key, Role.RECEIVER, pub)
    for event in (Initialized(peer_rank=0), PeerResolved(0), MetadataSubmitted(dst, aux, state)):
        registry.deliver(key, event)
    return pub


@pytest.mark.asyncio
async def test_overlapping_pages_fail_the_second_room_and_leave_the_first_alone() -> None:
    registry, sink = make_registry()  # strict: a refusal is not an illegal event
    first = receiver(registry, FIRST, pages(1, 2, 3, 4, 7, 8), 1)
    second = receiver(registry, SECOND, pages(20, 3, 4, 7, 21, 8), 2)
    await drain()
    assert second.status is KVPoll.Failed
    assert second.reason == "rejected: pages [3, 4, 7, 8] (4 pages) already held by room 17 gen 2"
    assert sink.of(SECOND, SendMetadata) == []  # nothing named the first room's pages
    assert second.settled  # it never exposed a page
    assert registry.stats.destinations_refused == 1
    assert registry.errors == []
    # The first room goes on to Success and, once reaped, frees its pages.
    assert first.status is KVPoll.Transferring
    assert len(sink.of(FIRST, SendMetadata)) == 1
    registry.deliver(FIRST, TransferConfirmed(0))
    await drain()
    assert first.status is KVPoll.Success
    assert first.settled
    assert len(registry) == 0
    assert len(registry.owners) == 0


@pytest.mark.asyncio
async def test_a_shared_aux_row_or_state_row_is_refused_too() -> None:
    registry, _ = make_registry()
    receiver(registry, FIRST, pages(1), 5, pages(9))
    by_aux = receiver(registry, SECOND, pages(2), 5)
    by_state = receiver(registry, THIRD, pages(3), 6, pages(9))
    await drain()
    assert by_aux.reason == "rejected: aux row 5 already held by room 17 gen 2"
    assert by_state.reason == "rejected: state row 9 already held by room 17 gen 2"


@pytest.mark.asyncio
async def test_a_page_twice_in_one_list_is_refused() -> None:
    registry, sink = make_registry()
    pub = receiver(registry, FIRST, pages(4, 5, 4), 1)
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.reason == "rejected: page 4 appears more than once in the page list"
    assert sink.of(FIRST, SendMetadata) == []


@pytest.mark.asyncio
async def test_reaping_a_settled_room_lets_a_later_room_take_its_pages() -> None:
    registry, _ = make_registry()
    first = receiver(registry, FIRST, pages(1, 2, 3), 1)
    await drain()
    registry.deliver(FIRST, AbortRequested("client gone"))
    await drain()
    assert first.status is KVPoll.Failed
    # Failed but not settled: the sender may still write, so the pages are still held.
    refused = receiver(registry, SECOND, pages(3), 2)
    await drain()
    assert "page 3 already held by room 17 gen 2" in refused.reason
    registry.deliver(FIRST, PeerSettled(0))  # the sender acknowledged the abort
    await drain()
    assert first.settled
    later = receiver(registry, THIRD, pages(1, 2, 3), 1)
    await drain()
    assert later.status is KVPoll.Transferring


@pytest.mark.asyncio
@pytest.mark.looptime
async def test_a_room_reaped_unsettled_keeps_its_pages_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, _ = make_registry(settle_timeout_s=60.0)
    first = receiver(registry, FIRST, pages(1, 2, 3), 1)
    await drain()
    registry.deliver(FIRST, AbortRequested("client gone"))  # no acknowledgement ever comes
    await asyncio.sleep(61.0)
    assert len(registry) == 0
    assert registry.stats.settle_timeouts == 1
    assert not first.settled
    assert registry.stats.destinations_quarantined == 1
    assert "stay held for the life of this engine" in caplog.text
    # A caller who reuses them anyway is refused, not mixed into a late WRITE.
    reused = receiver(registry, SECOND, pages(3, 4), 2)
    await drain()
    assert reused.reason == "rejected: page 3 already held by room 17 gen 2"
    assert registry.owners.held_pages == 3


def test_through_the_engine_the_first_pair_succeeds_and_the_second_fails() -> None:
    with RoomEngine(LoopbackSink(), RoomConfig(strict=True)) as engine:
        s1, r1 = engine.sender(1), engine.receiver(1)
        s2, r2 = engine.sender(2), engine.receiver(2)
        r1.init(0)
        r2.init(0)
        wait_until_sync(lambda: r1.poll() is r2.poll() is KVPoll.WaitingForInput)
        r1.send_metadata(np.arange(0, 8), aux_index=1)
        r2.send_metadata(np.arange(4, 12), aux_index=2)
        wait_until_sync(lambda: r2.poll() is KVPoll.Failed)
        assert "pages [4, 5, 6, 7] (4 pages) already held by room 1" in r2.reason
        wait_until_sync(lambda: s2.poll() is KVPoll.Failed)  # its sender heard the abort
        wait_until_sync(lambda: s1.poll() is KVPoll.WaitingForInput)
        s1.init(8, aux_index=0)
        s1.send(np.arange(8))
        wait_until_sync(lambda: r1.poll() is KVPoll.Success and s1.poll() is KVPoll.Success)
        wait_until_sync(lambda: engine.stats()["live"] == 0)
        assert engine.stats()["destinations_refused"] == 1
        assert engine.stats()["held_pages"] == 0  # the first room's were released at reap
        assert engine.registry_on_loop().errors == []
