"""Nothing kills a room task silently (law 3): a command the sink cannot execute fails its
room, and so does any other exception in the task; the room is still published and reaped."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from kvfsm.rooms import RoomConfig, RoomKey
from kvfsm.rooms._actor import Room
from kvfsm.rooms._core import RoomCore
from kvfsm.rooms._ports import Publication
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    ChunkSubmitted,
    Command,
    DestinationReceived,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    Role,
    SendMetadata,
)
from tests.helpers.rooms import DST, ScriptedSink, drain, pages

pytestmark = pytest.mark.asyncio


class FrameError(ValueError):
    """Stands in for the control channel's refusal to encode an oversized frame."""


class RaisingSink(ScriptedSink):
    """Records every command, and raises for the command types in ``failing``."""

    def __init__(self, *failing: type[Command]) -> None:
        super().__init__()
        self.failing = failing

    def submit(self, key: RoomKey, command: Command) -> None:
        super().submit(key, command)
        if isinstance(command, self.failing):
            raise FrameError(f"{type(command).__name__} frame of 17000000 bytes is too large")


def receiver_with_metadata(registry: Registry, key: RoomKey, pub: Publication) -> Room:
    room = registry.spawn(key, Role.RECEIVER, pub)
    for event in (Initialized(peer_rank=0), PeerResolved(0), MetadataSubmitted(DST, 5)):
        registry.deliver(key, event)
    return room


async def test_a_send_metadata_that_raises_fails_the_receiver_with_the_reason() -> None:
    sink = RaisingSink(SendMetadata)
    registry = Registry(sink, RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(21, 1)
    room = receiver_with_metadata(registry, key, pub)
    await drain()
    # Failed at once (no deadline involved), with the command and the error in the reason.
    assert pub.status is KVPoll.Failed
    assert pub.reason == (
        "rejected: could not execute SendMetadata: "
        "SendMetadata frame of 17000000 bytes is too large"
    )
    assert [type(error) for _, error in registry.errors] == [FrameError]
    # The failure's own commands went out too: the abort towards the sender.
    assert sink.of(key, ReportOutcome) == [ReportOutcome(KVPoll.Failed, pub.reason)]
    assert not room.done  # the task lives on, waiting for its pages to settle
    # The frame may or may not have left: the pages stay exposed until the sender's
    # acknowledgement of the abort, then the room is reaped and its pages are free.
    assert not pub.settled
    registry.deliver(key, PeerSettled(0))
    await drain()
    assert pub.settled
    assert len(registry) == 0
    assert room.done
    assert registry.tasks.escaped == []  # nothing escaped the task
    assert len(registry.owners) == 0


class SilentSink(ScriptedSink):
    """Raises, for the command types in ``failing``, an exception whose message is empty."""

    def __init__(self, *failing: type[Command]) -> None:
        super().__init__()
        self.failing = failing

    def submit(self, key: RoomKey, command: Command) -> None:
        super().submit(key, command)
        if isinstance(command, self.failing):
            raise ConnectionResetError  # str() of it is ""


async def test_an_exception_without_a_message_is_named_by_its_type() -> None:
    """A reason never ends in an empty cause: ``str()`` of an exception raised without a
    message is "", and the reason then names its type."""
    sink = SilentSink(SendMetadata)
    registry = Registry(sink, RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(27, 1)
    receiver_with_metadata(registry, key, pub)
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.reason == "rejected: could not execute SendMetadata: ConnectionResetError"


async def test_an_exception_without_a_message_in_the_core_is_named_by_its_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = Registry(ScriptedSink(), RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(28, 1)
    registry.spawn(key, Role.RECEIVER, pub)
    await drain()

    def broken(self: object, event: object) -> tuple[Command, ...]:
        raise AssertionError

    monkeypatch.setattr(RoomCore, "handle", broken)
    registry.deliver(key, Initialized(peer_rank=0))
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.reason.endswith("internal error on Initialized: AssertionError"), pub.reason


async def test_errors_in_the_failures_own_commands_are_recorded_and_end_there() -> None:
    # Both the command and the abort that its failure sends raise: no recursion, one failure.
    sink = RaisingSink(SendMetadata, ReportOutcome)
    registry = Registry(sink, RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(22, 1)
    room = receiver_with_metadata(registry, key, pub)
    await drain()
    assert pub.status is KVPoll.Failed
    assert "could not execute SendMetadata" in pub.reason
    assert len(registry.errors) == 2
    assert len(sink.of(key, ReportOutcome)) == 1
    assert registry.stats.failed == 1
    registry.deliver(key, PeerSettled(0))
    await drain()
    assert len(registry) == 0
    assert room.done
    assert registry.tasks.escaped == []


async def test_a_post_chunk_that_raises_fails_the_sender_and_releases_its_handles() -> None:
    sink = RaisingSink(PostChunk)
    registry = Registry(sink, RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(23, 1)
    registry.spawn(key, Role.SENDER, pub)
    registry.deliver(key, DestinationReceived(DST, 5))
    registry.deliver(key, Initialized(num_pages=2, aux_index=1))
    registry.deliver(key, ChunkSubmitted(pages(0, 1)))
    await drain()
    assert pub.status is KVPoll.Failed
    assert "could not execute PostChunk" in pub.reason
    assert sink.of(key, ReleaseHandles)
    # The chunk may have been posted: the room settles only when the transport says so.
    assert not pub.settled
    registry.deliver(key, ChunkDone(0))
    await drain()
    assert pub.settled
    assert len(registry) == 0


class RaisingObserver:
    """An observer whose ``transition`` raises (a metrics bug)."""

    def spawned(self, role: Role) -> None:
        pass

    def transition(
        self, role: Role, before: KVPoll, after: KVPoll, reason: str, seconds: float
    ) -> None:
        raise RuntimeError("metrics backend exploded")

    def reaped(self, role: Role, state: KVPoll) -> None:
        raise RuntimeError("metrics backend exploded again")


async def test_a_raising_observer_costs_the_room_nothing_but_a_recorded_error() -> None:
    sink = ScriptedSink()
    registry = Registry(sink, RoomConfig(strict=True), observer=RaisingObserver())
    pub, key = Publication(), RoomKey(24, 1)
    registry.spawn(key, Role.SENDER, pub)
    registry.deliver(key, DestinationReceived(DST, 5))
    registry.deliver(key, AbortRequested("test"))
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.settled
    assert sink.of(key, ReportOutcome)  # the commands were executed all the same
    assert len(registry) == 0
    assert all("exploded" in str(error) for _, error in registry.errors)


async def test_an_exception_anywhere_in_the_task_fails_publishes_and_reaps_the_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = ScriptedSink()
    registry = Registry(sink, RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(25, 1)
    room = receiver_with_metadata(registry, key, pub)
    await drain()
    assert pub.status is KVPoll.Transferring
    assert key in registry.owners

    def broken(self: Room, event: object) -> None:
        raise KeyError("a bug in the room loop")

    monkeypatch.setattr(Room, "_apply", broken)
    registry.deliver(key, PeerSettled(0))
    await drain()
    assert pub.status is KVPoll.Failed
    assert "internal error: KeyError" in pub.reason
    assert sink.of(key, ReportOutcome) == [ReportOutcome(KVPoll.Failed, pub.reason)]
    assert len(registry) == 0  # reaped
    assert room.done
    assert registry.tasks.escaped == []  # nothing escaped the task
    assert registry.stats.task_errors == 1
    # The settlement event never reached the ledger: the pages are not claimed safe, and the
    # receiver's destinations stay held.
    assert not pub.settled
    assert key in registry.owners
    assert registry.stats.destinations_quarantined == 1


async def test_a_room_settled_when_its_task_died_keeps_its_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = Registry(ScriptedSink(), RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(26, 1)
    registry.spawn(key, Role.RECEIVER, pub)
    await drain()

    def broken(self: Room, event: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(Room, "_apply", broken)
    registry.deliver(key, Initialized(peer_rank=0))
    await drain()
    assert pub.status is KVPoll.Failed
    assert pub.settled  # it never exposed a page: nothing can touch them
    assert len(registry) == 0


async def test_cancellation_still_fails_the_room_when_its_commands_raise() -> None:
    registry = Registry(RaisingSink(ReportOutcome), RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(27, 1)
    room = registry.spawn(key, Role.SENDER, pub)
    registry.deliver(key, DestinationReceived(DST, 5))
    await drain()
    assert not room.done
    registry.tasks.cancel(room)  # what shutdown does to a room that outlives its grace
    assert room.done
    assert registry.tasks.escaped == []
    assert pub.status is KVPoll.Failed
    assert "engine shut down" in pub.reason
    assert len(registry) == 0


class _NotSuspend:
    """An await a room task must never make (a bug): it yields what a Future yields."""

    def __await__(self) -> Generator[None, None, None]:
        yield None


async def test_a_room_task_that_awaits_anything_else_fails_its_room_and_is_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The scheduler raises the error at that await; Room.run's own handler fails the room
    # (published Failed, law 3) instead of the room being left stranded, never resumed.
    import kvfsm.rooms._actor as actor

    registry = Registry(ScriptedSink(), RoomConfig(strict=True))
    pub, key = Publication(), RoomKey(29, 1)
    monkeypatch.setattr(actor, "SUSPEND", _NotSuspend())
    room = registry.spawn(key, Role.SENDER, pub)
    await drain()
    assert pub.status is KVPoll.Failed
    assert "not SUSPEND" in pub.reason
    assert room.done
    assert len(registry) == 0
    assert registry.stats.task_errors == 1
    assert [type(exc) for exc in registry.tasks.escaped] == [RuntimeError]
