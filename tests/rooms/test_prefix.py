"""Decode prefix caching in the room layer: the receiver's prefix (prompt tokens it holds already)
rides with its page list, and the sender publishes it no later than its WaitingForInput.

The cores are driven directly; the publication order is checked on a real loop with a scripted
sink, the facades through a loopback engine."""

from __future__ import annotations

import pytest

from kvfsm.rooms import IllegalEventError, RoomConfig, RoomCore, RoomKey
from kvfsm.rooms._engine import RoomEngine
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._ports import Publication
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    ChunkSubmitted,
    DestinationReceived,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerResolved,
    PostChunk,
    Role,
    SendMetadata,
)
from tests.helpers.rooms import DST, ScriptedSink, drain, pages
from tests.helpers.waiting import wait_until_sync

# -- the cores ---------------------------------------------------------------------------------


def test_the_receiver_sends_its_prefix_with_its_page_list() -> None:
    core = RoomCore(Role.RECEIVER, strict=True)
    core.handle(Initialized(peer_rank=0))
    core.handle(PeerResolved(0))
    commands = core.handle(MetadataSubmitted(DST, 5, prefix=48))
    assert commands == (SendMetadata(DST, 5, b"", prefix=48),)
    assert core.prefix == 48
    assert core.state is KVPoll.Transferring


def test_the_sender_learns_the_prefix_with_the_pages_that_follow_it() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    assert core.prefix == 0
    assert core.handle(DestinationReceived(pages(20, 21), 5, prefix=96)) == ()
    assert core.state is KVPoll.WaitingForInput
    assert core.prefix == 96
    # The caller counts and sends only the pages past the prefix: they map onto the
    # receiver's list from its first entry.
    core.handle(Initialized(num_pages=2, aux_index=1))
    (post,) = core.handle(ChunkSubmitted(pages(7, 8)))
    assert isinstance(post, PostChunk)
    assert (post.src, post.dst, post.is_last) == (pages(7, 8), pages(20, 21), True)


def test_a_full_hit_moves_no_page_and_still_completes_with_the_aux_row() -> None:
    core = RoomCore(Role.SENDER, strict=True)
    core.handle(DestinationReceived(b"", 5, prefix=64))  # decode holds the whole prompt
    core.handle(Initialized(num_pages=0, aux_index=1))
    (post,) = core.handle(ChunkSubmitted(b""))
    assert isinstance(post, PostChunk)
    assert (post.src, post.is_last, post.src_aux, post.dst_aux) == (b"", True, 1, 5)


def test_init_for_the_whole_prompt_against_a_prefixed_destination_fails_the_room() -> None:
    """A prefill that ignored the prefix would count every page of the prompt: refused."""
    core = RoomCore(Role.SENDER)
    core.handle(DestinationReceived(pages(20), 5, prefix=32))
    core.handle(Initialized(num_pages=3, aux_index=1))
    assert core.state is KVPoll.Failed
    assert "init for 3 pages but the receiver reserved 1" in core.reason


@pytest.mark.parametrize("role", [Role.SENDER, Role.RECEIVER])
def test_a_negative_prefix_fails_the_room(role: Role) -> None:
    if role is Role.SENDER:
        core, event = RoomCore(role), DestinationReceived(DST, 5, prefix=-16)
    else:
        core = RoomCore(role)
        core.handle(Initialized(peer_rank=0))
        core.handle(PeerResolved(0))
        event = MetadataSubmitted(DST, 5, prefix=-16)  # type: ignore[assignment]
    assert core.handle(event)[-1:] != ()  # tells the peer (or the control plane) it failed
    assert core.state is KVPoll.Failed
    assert "decode prefix of -16 tokens is negative" in core.reason
    strict = RoomCore(Role.SENDER, strict=True)
    with pytest.raises(IllegalEventError, match="negative"):
        strict.handle(DestinationReceived(DST, 5, prefix=-1))


# -- publication order -------------------------------------------------------------------------


class _Watching(Publication):
    """Records the prefix visible at the moment each status is published."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[KVPoll, int]] = []

    @property  # type: ignore[override]
    def status(self) -> KVPoll:
        value: KVPoll = Publication.status.__get__(self)  # type: ignore[attr-defined]
        return value

    @status.setter
    def status(self, value: KVPoll) -> None:
        if hasattr(self, "seen"):
            self.seen.append((value, self.prefix))
        Publication.status.__set__(self, value)  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_the_prefix_is_published_before_the_senders_waiting_for_input() -> None:
    registry = Registry(ScriptedSink(), RoomConfig(strict=True))
    pub = _Watching()
    key = RoomKey(7, 1)
    registry.spawn(key, Role.SENDER, pub)
    await drain()
    assert pub.prefix == 0
    registry.deliver(key, DestinationReceived(DST, 5, prefix=80))
    await drain()
    assert pub.seen == [(KVPoll.WaitingForInput, 80)]
    registry.deliver(key, Initialized(num_pages=0, aux_index=1))
    registry.deliver(key, ChunkSubmitted(b""))
    await drain()
    assert pub.prefix == 80
    assert pub.status is KVPoll.Transferring


# -- the facades, end to end through a loopback engine -------------------------------------------


def test_facades_carry_the_prefix_from_send_metadata_to_the_sender() -> None:
    with RoomEngine(LoopbackSink(), RoomConfig(strict=True)) as engine:
        receiver, sender = engine.receiver(9), engine.sender(9)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
        assert sender.decode_prefix == 0
        receiver.send_metadata([3, 4], 2, prefix=32)
        wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
        assert sender.poll() is KVPoll.WaitingForInput
        assert sender.decode_prefix == 32
        sender.init(2, 1)
        sender.send([5, 6])
        wait_until_sync(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() is KVPoll.Success, receiver.reason


def test_a_negative_prefix_fails_the_receiver_in_the_callers_thread() -> None:
    with RoomEngine(LoopbackSink(), RoomConfig(strict=True)) as engine:
        receiver = engine.receiver(9)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([3], 2, prefix=-1)
        assert receiver.poll() is KVPoll.Failed
        assert "decode prefix of -1 tokens is negative" in receiver.reason
