"""The engine runtime and the synchronous facade, from a caller's thread (law 6)."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest

from kvfsm.rooms import KVTransferError, RoomConfig, RoomEngine
from kvfsm.rooms import _engine as engine_module
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._ports import Publication
from kvfsm.states import DestinationReceived, KVPoll, Part, PeerResolved, SendMetadata
from tests.helpers.rooms import DST, SCRIPTED_GRACE_S, ScriptedSink, pages
from tests.helpers.waiting import wait_until_sync


@pytest.fixture
def engine() -> RoomEngine:
    eng = RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ).start()
    yield eng  # type: ignore[misc]
    eng.close()
    assert eng.registry_on_loop().errors == []


@pytest.fixture
def loopback() -> RoomEngine:
    eng = RoomEngine(LoopbackSink(), RoomConfig(strict=True)).start()
    yield eng  # type: ignore[misc]
    eng.close()
    assert eng.registry_on_loop().errors == []


def block_loop(engine: RoomEngine) -> threading.Event:
    """Park the loop thread inside a callback until the returned event is set."""
    release, parked = threading.Event(), threading.Event()

    def park() -> None:
        parked.set()
        release.wait(10)

    engine.loop.call_soon_threadsafe(park)
    assert parked.wait(5)
    return release


def test_poll_and_abort_never_wait_for_the_loop(engine: RoomEngine) -> None:
    sender = engine.sender(1)
    wait_until_sync(lambda: engine.stats()["spawned"] == 1)
    release = block_loop(engine)
    seen: list[KVPoll] = []

    def calls() -> None:
        seen.append(sender.poll())
        sender.abort()
        # Failed at once for this caller, although the room task has not run yet.
        seen.append(sender.poll())
        sender.init(4, 1)  # enqueue-and-return calls do not wait either
        sender.send(np.arange(4))

    try:
        # Event order, not a stopwatch: every call returns while the loop is still held (a call
        # that waited on the loop could not return before release.set() below).
        caller = threading.Thread(target=calls)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "a facade call waited on the blocked loop"
        assert seen == [KVPoll.Bootstrapping, KVPoll.Failed]
        assert engine.registry_on_loop().stats.failed == 0  # the room itself has not moved
    finally:
        release.set()
    wait_until_sync(lambda: sender.settled)
    assert sender.poll() is KVPoll.Failed
    assert "aborted by caller" in sender.reason


def test_full_pair_lifecycle_over_the_loopback(loopback: RoomEngine) -> None:
    sender, receiver = loopback.sender(5), loopback.receiver(5)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(np.arange(100, 108), aux_index=3)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(8, aux_index=1)
    sender.send(np.arange(5))
    sender.send(np.arange(5, 8))
    wait_until_sync(lambda: receiver.poll() is KVPoll.Success)
    wait_until_sync(lambda: sender.poll() is KVPoll.Success)
    wait_until_sync(lambda: loopback.stats()["live"] == 0)
    assert sender.settled
    assert receiver.settled
    assert loopback.stats()["succeeded"] == 2


def test_decode_abort_reaches_prefill_and_is_acknowledged(loopback: RoomEngine) -> None:
    sender, receiver = loopback.sender(6), loopback.receiver(6)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(np.arange(4), aux_index=0)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    receiver.abort()
    assert receiver.poll() is KVPoll.Failed
    wait_until_sync(lambda: sender.poll() is KVPoll.Failed)
    assert "aborted (peer)" in sender.reason
    wait_until_sync(lambda: receiver.settled)  # the sender's ReportSettled arrived as PeerSettled


def test_failure_exception_always_raises_with_a_reason(engine: RoomEngine) -> None:
    sender = engine.sender(2)
    with pytest.raises(KVTransferError, match="while the room is Bootstrapping"):
        sender.failure_exception()
    sender.abort("client went away")
    with pytest.raises(KVTransferError, match="client went away") as info:
        sender.failure_exception()
    assert "client went away" in info.value.failure_reason
    sender.clear()
    sender.clear()  # idempotent
    assert sender.poll() is KVPoll.Failed


def test_clear_before_completion_aborts(engine: RoomEngine) -> None:
    receiver = engine.receiver(3)
    receiver.clear()
    assert receiver.poll() is KVPoll.Failed
    wait_until_sync(lambda: receiver.settled)
    assert "cleared before completion" in receiver.reason


def test_duplicate_live_room_fails_the_newcomer_only(engine: RoomEngine) -> None:
    first = engine.sender(77)
    wait_until_sync(lambda: engine.stats()["spawned"] == 1)
    second = engine.sender(77)
    wait_until_sync(lambda: second.poll() is KVPoll.Failed)
    assert "already live" in second.reason
    assert first.poll() is KVPoll.Bootstrapping
    engine.post(first.key, DestinationReceived(DST, 5))
    wait_until_sync(lambda: first.poll() is KVPoll.WaitingForInput)


def test_bad_page_indices_fail_the_room_not_the_caller(engine: RoomEngine) -> None:
    sender = engine.sender(8)
    engine.post(sender.key, DestinationReceived(DST, 5))
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(2)
    sender.send(np.array([[1, 2]]))  # two-dimensional: refused, and the room fails
    assert sender.poll() is KVPoll.Failed
    wait_until_sync(lambda: sender.settled)
    assert "bad page indices" in sender.reason
    other = engine.sender(9)
    sender.send([1.5])  # after failure: ignored, no exception
    assert other.poll() is KVPoll.Bootstrapping


def test_close_fails_live_rooms_and_is_idempotent() -> None:
    engine = RoomEngine(ScriptedSink(), RoomConfig(shutdown_timeout_s=0.2)).start()
    rooms = [engine.sender(i) for i in range(5)] + [engine.receiver(i) for i in range(5)]
    wait_until_sync(lambda: engine.stats()["spawned"] == 10)
    engine.close()
    engine.close()
    assert all(r.poll() is KVPoll.Failed for r in rooms)
    assert all("engine shutting down" in r.reason for r in rooms)
    assert not any(t.name == "kvfsm-loop" for t in threading.enumerate())
    with pytest.raises(RuntimeError):
        engine.sender(99)


def test_asyncio_loop_works_without_uvloop() -> None:
    with RoomEngine(LoopbackSink(), use_uvloop=False) as engine:
        assert "uvloop" not in type(engine.loop).__module__
        receiver = engine.receiver(1)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    with RoomEngine(LoopbackSink()) as engine:
        assert "uvloop" in type(engine.loop).__module__


# -- calls that can be checked where they are made fail at once --------------------------------


@pytest.fixture
def small() -> RoomEngine:
    eng = RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, max_pages=8, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ).start()
    yield eng  # type: ignore[misc]
    eng.close()
    assert eng.registry_on_loop().errors == []


def test_send_metadata_with_too_many_pages_fails_at_once(small: RoomEngine) -> None:
    receiver = small.receiver(1)
    receiver.init(0)
    receiver.send_metadata(np.arange(6), aux_index=0, state_indices=[1, 2, 3])
    assert receiver.poll() is KVPoll.Failed  # no loop round trip: the call itself failed it
    assert receiver.reason == (
        "rejected: send_metadata with 6 pages and 3 state rows: more than max_pages (8) in one room"
    )
    wait_until_sync(lambda: receiver.settled)
    assert receiver.reason.startswith("rejected: send_metadata with 6 pages")  # the room agrees
    assert small.stats()["live"] == 0
    assert [c for _, c in small._sink.log if isinstance(c, SendMetadata)] == []  # type: ignore[attr-defined]


def test_a_page_list_at_the_limit_is_accepted(small: RoomEngine) -> None:
    receiver = small.receiver(2)
    receiver.init(0)
    small.post(receiver.key, PeerResolved(0))
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(np.arange(8), aux_index=0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.Transferring)


def test_sender_calls_beyond_the_limit_fail_at_once(small: RoomEngine) -> None:
    too_big = small.sender(3)
    too_big.init(9, aux_index=0)
    assert too_big.poll() is KVPoll.Failed
    assert too_big.reason == "rejected: init with 9 pages: more than max_pages (8)"
    negative = small.sender(4)
    negative.init(-1)
    assert negative.poll() is KVPoll.Failed
    assert negative.reason == "rejected: init with -1 pages: negative"
    chunk = small.sender(5)
    chunk.send(np.arange(9))
    assert chunk.poll() is KVPoll.Failed
    assert chunk.reason == "rejected: send with 9 pages: more than max_pages (8) in one room"
    wait_until_sync(lambda: small.stats()["live"] == 0)


def test_a_negative_aux_row_fails_send_metadata_at_once(small: RoomEngine) -> None:
    receiver = small.receiver(6)
    receiver.send_metadata([1], aux_index=-1)
    assert receiver.poll() is KVPoll.Failed
    assert receiver.reason == "rejected: aux row -1 is negative"


def test_the_default_limit_is_what_a_control_frame_holds(engine: RoomEngine) -> None:
    assert RoomConfig().max_pages == 4_000_000
    assert 4_000_000 * 4 < 16 * 2**20  # the control channel's default frame limit
    receiver = engine.receiver(7)
    receiver.send_metadata(np.arange(4_000_001, dtype=np.int32), aux_index=0)
    assert receiver.poll() is KVPoll.Failed
    assert "4000001 pages: more than max_pages (4000000)" in receiver.reason
    with pytest.raises(ValueError, match="max_pages"):
        RoomConfig(max_pages=0)


# -- legs: the part a sender carries -------------------------------------------------------


class PartAtStatus(Publication):
    """Records, at every status write, the part already published (what a caller that reads
    the status and then the part could see)."""

    __slots__ = ()
    seen: ClassVar[list[tuple[KVPoll, int]]] = []

    def __setattr__(self, name: str, value: object) -> None:
        if name == "status" and hasattr(self, "part"):
            PartAtStatus.seen.append((value, self.part))  # type: ignore[arg-type]
        super().__setattr__(name, value)


@pytest.mark.parametrize("part", [Part.KV, Part.NONE])
def test_a_senders_part_is_visible_when_it_first_polls_waiting_for_input(
    monkeypatch: pytest.MonkeyPatch, part: Part
) -> None:
    PartAtStatus.seen.clear()
    monkeypatch.setattr(engine_module, "Publication", PartAtStatus)
    with RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ) as engine:
        sender = engine.sender(12)
        assert sender.part is Part.WHOLE  # before its destination arrived
        dst, aux = (pages(3, 4), -1) if part is Part.KV else (b"", -1)
        engine.post(sender.key, DestinationReceived(dst, aux, part=part))
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        assert sender.poll() is KVPoll.WaitingForInput
        assert sender.part is part
        assert engine.registry_on_loop().errors == []
    # The status write that made the room WaitingForInput found the part already there.
    assert PartAtStatus.seen[0] == (KVPoll.WaitingForInput, part)
    # A whole sender stays WHOLE.
    with RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ) as engine:
        whole = engine.sender(13)
        engine.post(whole.key, DestinationReceived(DST, 5))
        wait_until_sync(lambda: whole.poll() is KVPoll.WaitingForInput)
        assert whole.part is Part.WHOLE


def test_send_metadata_of_a_kv_or_dummy_leg_needs_no_aux_row(engine: RoomEngine) -> None:
    sink: ScriptedSink = engine._sink  # type: ignore[assignment]
    rooms = [engine.receiver(14, leg=leg, group=1) for leg in range(3)]
    for leg, room in enumerate(rooms):
        room.init(leg)
        engine.post(room.key, PeerResolved(leg))
    wait_until_sync(lambda: all(r.poll() is KVPoll.WaitingForInput for r in rooms))
    rooms[0].send_metadata([5, 6], 2, [1])
    rooms[1].send_metadata([5, 6], -1, None, Part.KV)
    rooms[2].send_metadata([], -1, None, Part.NONE)
    wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in rooms))
    sent = [c for r in rooms for c in sink.of(r.key, SendMetadata)]
    assert sent == [
        SendMetadata(pages(5, 6), 2, pages(1), Part.WHOLE),
        SendMetadata(pages(5, 6), -1, b"", Part.KV),
        SendMetadata(b"", -1, b"", Part.NONE),
    ]
    # A whole leg still needs its aux row, at once.
    whole = engine.receiver(15)
    whole.send_metadata([1], -1)
    assert whole.poll() is KVPoll.Failed
    for room in rooms:
        room.abort()


@pytest.mark.parametrize("part", [Part.KV, Part.NONE])
def test_the_loopback_carries_a_legs_part_to_its_sender(loopback: RoomEngine, part: Part) -> None:
    sender, receiver = loopback.sender(16), loopback.receiver(16)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    dst = [4, 5] if part is Part.KV else []
    receiver.send_metadata(dst, -1, None, part)
    wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
    assert sender.poll() is KVPoll.WaitingForInput, sender.reason
    assert sender.part is part
    sender.init(len(dst))
    sender.send(np.arange(len(dst)))
    wait_until_sync(lambda: receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success)
    wait_until_sync(lambda: sender.settled and receiver.settled)
