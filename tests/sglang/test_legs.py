"""``kvfsm.sglang._legs.Legs``: the receiver rooms of one decode request that several prefill
ranks feed, seen by the scheduler as one room. Real ``ReceiverRoom``s of a real ``RoomEngine``
whose sink only records commands: the test delivers what the peers would answer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.rooms import ReceiverRoom, RoomConfig, RoomEngine
from kvfsm.sglang._legs import Legs
from kvfsm.states import (
    TERMINAL,
    DestinationReceived,
    KVPoll,
    Part,
    PeerFailed,
    PeerResolved,
    PeerSettled,
    ReportOutcome,
    ResolvePeer,
    SendMetadata,
    TransferConfirmed,
)
from tests.helpers.rooms import SCRIPTED_GRACE_S, ScriptedSink, pages
from tests.helpers.waiting import wait_until_sync

#: The prefill attention-TP rank each leg of the request hears from (leg order).
RANKS = [2, 3, 6]


@pytest.fixture
def engine() -> Iterator[RoomEngine]:
    eng = RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ).start()
    yield eng
    eng.close()
    assert eng.registry_on_loop().errors == []


def sink_of(engine: RoomEngine) -> ScriptedSink:
    sink = engine._sink  # the engine's own sink (the test reads what the rooms commanded)
    assert isinstance(sink, ScriptedSink)
    return sink


def request(engine: RoomEngine, room: int, n: int = 3) -> Legs[ReceiverRoom]:
    """One request's legs, as the adapter builds them: leg 0 first, the others once known."""
    legs = Legs(engine.receiver(room, group=room))
    for leg in range(1, n):
        legs.add(engine.receiver(room, leg=leg, group=room))
    legs.sources = [f"prefill attention-TP rank {rank}" for rank in RANKS[:n]]
    return legs


def resolve(engine: RoomEngine, room: ReceiverRoom, rank: int) -> None:
    room.init(rank)
    wait_until_sync(lambda: ResolvePeer(rank) in sink_of(engine).of(room.key))
    engine.post(room.key, PeerResolved(rank))
    wait_until_sync(lambda: room.poll() is KVPoll.WaitingForInput)


def send_metadata(legs: Legs[ReceiverRoom], dst: list[int], aux: int) -> None:
    parts = [Part.WHOLE] + [Part.KV] * (len(legs.rooms) - 2) + [Part.NONE]
    for room, part in zip(legs.rooms, parts, strict=True):
        if part is Part.WHOLE:
            room.send_metadata(np.asarray(dst), aux)
        elif part is Part.KV:
            room.send_metadata(np.asarray(dst), -1, None, Part.KV)
        else:
            room.send_metadata(np.empty(0, np.int32), -1, None, Part.NONE)


def test_poll_is_the_min_over_the_legs_and_success_needs_every_leg(engine: RoomEngine) -> None:
    legs = request(engine, 50)
    first, second, third = legs.rooms
    resolve(engine, second, RANKS[1])
    assert second.poll() is KVPoll.WaitingForInput
    assert legs.poll() is KVPoll.Bootstrapping  # the others are still bootstrapping
    resolve(engine, first, RANKS[0])
    resolve(engine, third, RANKS[2])
    assert legs.poll() is KVPoll.WaitingForInput
    send_metadata(legs, [4, 5, 6], 2)
    wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in legs.rooms))
    sent = [c for r in legs.rooms for c in sink_of(engine).of(r.key, SendMetadata)]
    assert [c.part for c in sent] == [Part.WHOLE, Part.KV, Part.NONE]  # type: ignore[attr-defined]
    assert legs.poll() is KVPoll.Transferring
    for i, room in enumerate(legs.rooms):
        engine.post(room.key, TransferConfirmed(RANKS[i]))
        wait_until_sync(lambda room=room: room.poll() is KVPoll.Success)  # type: ignore[misc]
        if i < 2:
            assert legs.poll() is KVPoll.Transferring
    assert legs.poll() is KVPoll.Success
    wait_until_sync(lambda: legs.settled)
    assert legs.reason == ""
    wait_until_sync(lambda: engine.stats()["live"] == 0)
    assert engine.stats()["held_pages"] == 0


def test_the_first_failure_aborts_the_running_legs_and_is_the_reason(engine: RoomEngine) -> None:
    legs = request(engine, 51)
    for room, rank in zip(legs.rooms, RANKS, strict=True):
        resolve(engine, room, rank)
    send_metadata(legs, [7, 8], 1)
    wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in legs.rooms))
    first, second, third = legs.rooms
    engine.post(third.key, PeerFailed("prefill rank 6 went away"))
    wait_until_sync(lambda: third.poll() is KVPoll.Failed)
    assert first.poll() is second.poll() is KVPoll.Transferring  # nobody polled the request yet
    assert legs.poll() is KVPoll.Failed
    # The poll that saw the failure ended the others (their facades are Failed at once) ...
    assert first.poll() is second.poll() is KVPoll.Failed
    for room in (first, second):
        assert room.reason.startswith("aborted (local): another leg of this request failed: ")
        assert "prefill rank 6 went away" in room.reason
    # ... and the request's reason is the first failure, naming its prefill rank, not the
    # aborts it caused in legs 0 and 1.
    want = "peer failed: prefill rank 6 went away (leg from prefill attention-TP rank 6)"
    assert legs.reason == want
    wait_until_sync(lambda: all(r.reason.startswith("aborted") for r in (first, second)))
    assert legs.reason == want
    # The aborted legs tell their prefill ranks; the failed one heard it from its peer.
    sink = sink_of(engine)
    for room in (first, second):
        wait_until_sync(lambda room=room: bool(sink.of(room.key, ReportOutcome)))  # type: ignore[misc]
    assert sink.of(third.key, ReportOutcome) == []


def test_settled_only_once_every_leg_settled(engine: RoomEngine) -> None:
    legs = request(engine, 52)
    for room, rank in zip(legs.rooms, RANKS, strict=True):
        resolve(engine, room, rank)
    send_metadata(legs, [9, 10], 3)
    wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in legs.rooms))
    first, second, third = legs.rooms
    engine.post(second.key, PeerFailed("prefill rank 3 died"))
    wait_until_sync(lambda: legs.poll() is KVPoll.Failed)
    # Every leg exposed its destination: each settles when its own prefill rank says so.
    engine.post(second.key, PeerSettled(RANKS[1]))
    engine.post(third.key, PeerSettled(RANKS[2]))
    wait_until_sync(lambda: second.settled and third.settled)
    assert not first.settled
    assert not legs.settled  # prefill rank 2 may still write into the shared pages
    assert engine.stats()["held_pages"] == 2
    engine.post(first.key, PeerSettled(RANKS[0]))
    wait_until_sync(lambda: legs.settled)
    wait_until_sync(lambda: engine.stats()["live"] == 0)
    assert engine.stats()["held_pages"] == 0


def test_a_failure_before_any_leg_is_known_ends_the_others_too(engine: RoomEngine) -> None:
    legs = request(engine, 53, n=2)
    first, second = legs.rooms
    resolve(engine, first, RANKS[0])
    second.reject("no prefill rank 3 registered")
    assert legs.poll() is KVPoll.Failed
    assert first.poll() is KVPoll.Failed
    assert legs.reason == (
        "rejected: no prefill rank 3 registered (leg from prefill attention-TP rank 3)"
    )
    wait_until_sync(lambda: legs.settled)  # nothing was exposed: settled at once


def test_a_single_leg_reads_through(engine: RoomEngine) -> None:
    legs = Legs(engine.receiver(54))
    assert legs.poll() is KVPoll.Bootstrapping
    legs.abort("client gone")
    assert legs.poll() is KVPoll.Failed
    assert legs.reason == "aborted (local): client gone"  # no leg suffix for a lone room
    wait_until_sync(lambda: legs.settled)


@pytest.mark.parametrize("end", ["abort", "reject"])
def test_abort_and_reject_end_every_leg(engine: RoomEngine, end: str) -> None:
    legs = request(engine, 55 if end == "abort" else 56)
    for room, rank in zip(legs.rooms, RANKS, strict=True):
        resolve(engine, room, rank)
    getattr(legs, end)("scheduler gave up")
    assert all(r.poll() is KVPoll.Failed for r in legs.rooms)
    assert all("scheduler gave up" in r.reason for r in legs.rooms)
    assert legs.poll() is KVPoll.Failed
    assert "scheduler gave up" in legs.reason
    wait_until_sync(lambda: legs.settled)
    assert all(r.poll() in TERMINAL for r in legs.rooms)


def test_sender_legs_poll_the_min_and_the_first_failure_ends_the_others(
    engine: RoomEngine,
) -> None:
    # Decode's attention TP the larger: one prefill request, one sender room per decode rank.
    legs = Legs(engine.sender(57))
    for leg in (1, 2):
        legs.add(engine.sender(57, leg=leg))
    first, second, third = legs.rooms
    for i, room in enumerate(legs.rooms[:2]):
        engine.post(room.key, DestinationReceived(pages(10 + i), 5))
    wait_until_sync(lambda: first.poll() is second.poll() is KVPoll.WaitingForInput)
    assert legs.poll() is KVPoll.Bootstrapping  # leg 2 has not heard from its decode rank
    engine.post(third.key, PeerFailed("decode rank 2 went away"))
    wait_until_sync(lambda: third.poll() is KVPoll.Failed)
    assert legs.poll() is KVPoll.Failed
    assert first.poll() is second.poll() is KVPoll.Failed
    assert "decode rank 2 went away" in legs.reason
    assert "another leg" not in legs.reason
    wait_until_sync(lambda: legs.settled)
