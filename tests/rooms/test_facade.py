"""The facades on their own: a fake publication and a recording post, no loop. ``poll`` is a
read, ``abort`` shows at once and only once, calls whose arguments are wrong on their face fail
the room in the caller's thread with a reason and post only that, and everything else becomes
exactly one event."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.rooms import KVTransferError, ReceiverRoom, RoomKey, SenderRoom
from kvfsm.rooms._facade import pack_pages
from kvfsm.rooms._ports import Publication
from kvfsm.states import (
    AbortRequested,
    ChunkSubmitted,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    Part,
)

KEY = RoomKey(7, 1)


class Posted(list[tuple[RoomKey, Event]]):
    def __call__(self, key: RoomKey, event: Event) -> None:
        self.append((key, event))

    @property
    def events(self) -> list[Event]:
        return [event for _, event in self]


def sender(max_pages: int = 16) -> tuple[SenderRoom, Publication, Posted]:
    pub, posted = Publication(), Posted()
    return SenderRoom(KEY, pub, posted, max_pages=max_pages), pub, posted


def receiver(max_pages: int = 16) -> tuple[ReceiverRoom, Publication, Posted]:
    pub, posted = Publication(), Posted()
    return ReceiverRoom(KEY, pub, posted, max_pages=max_pages), pub, posted


def test_poll_reads_the_publication_and_posts_nothing() -> None:
    room, pub, posted = sender()
    assert room.poll() is KVPoll.Bootstrapping
    pub.status = KVPoll.Transferring
    assert room.poll() is KVPoll.Transferring
    pub.settled = True
    assert room.settled
    assert posted == []


def test_abort_is_failed_at_once_posts_one_event_and_is_a_no_op_after() -> None:
    room, pub, posted = sender()
    room.abort("client went away")
    assert room.poll() is KVPoll.Failed  # before any task processed it
    assert room.reason == "aborted (local): client went away"
    room.abort("again")
    room.reject("and a rejection")
    assert posted.events == [AbortRequested("client went away")]
    # the room's own reason wins once it publishes Failed
    pub.reason, pub.status = "peer lost: gone", KVPoll.Failed
    assert room.reason == "peer lost: gone"


def test_abort_of_a_room_published_terminal_does_nothing() -> None:
    room, pub, posted = receiver()
    pub.status = KVPoll.Success
    room.abort()
    room.clear()
    assert room.poll() is KVPoll.Success
    assert posted == []


def test_clear_aborts_an_unfinished_room_once() -> None:
    room, _pub, posted = receiver()
    room.clear()
    room.clear()
    assert room.poll() is KVPoll.Failed
    assert posted.events == [AbortRequested("cleared before completion")]


def test_failure_exception_always_raises_with_the_reason() -> None:
    room, pub, _posted = sender()
    with pytest.raises(KVTransferError, match="while the room is Bootstrapping"):
        room.failure_exception()
    pub.reason, pub.status = "deadline: WaitingForInput for more than 5s", KVPoll.Failed
    with pytest.raises(KVTransferError) as info:
        room.failure_exception()
    assert info.value.failure_reason == "deadline: WaitingForInput for more than 5s"
    assert info.value.room == 7


def test_sender_calls_become_one_event_each() -> None:
    room, _pub, posted = sender()
    room.init(3, aux_index=2)
    room.send(np.asarray([4, 5], np.int64))  # any integer dtype, packed as int32
    room.send([6], state_indices=[1])
    assert posted.events == [
        Initialized(num_pages=3, aux_index=2),
        ChunkSubmitted(pack_pages([4, 5]), b""),
        ChunkSubmitted(pack_pages([6]), pack_pages([1])),
    ]
    assert room.poll() is KVPoll.Bootstrapping  # their effect shows in a later poll


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda r: r.init(-1), "init with -1 pages: negative"),
        (lambda r: r.init(17), "init with 17 pages: more than max_pages (16)"),
        (lambda r: r.send(np.zeros((2, 2), np.int32)), "page indices must be one-dimensional"),
        (lambda r: r.send(np.asarray([1.5])), "page indices must be integers"),
        (lambda r: r.send([2**40]), "page index out of int32 range"),
        (lambda r: r.send(list(range(17))), "send with 17 pages: more than max_pages (16)"),
        (
            lambda r: r.send(list(range(10)), state_indices=list(range(7))),
            "send with 10 pages and 7 state rows: more than max_pages (16)",
        ),
    ],
)
def test_bad_sender_arguments_fail_the_room_in_the_callers_thread(
    call: object, reason: str
) -> None:
    room, _pub, posted = sender()
    assert callable(call)
    call(room)
    assert room.poll() is KVPoll.Failed
    assert reason in room.reason
    assert len(posted) == 1
    assert isinstance(posted.events[0], EventRejected)  # the room learns why; nothing else


def test_receiver_calls_become_one_event_each() -> None:
    room, _pub, posted = receiver()
    room.init(3)
    room.send_metadata([9, 8], 4, state_indices=[2], prefix=32)
    room.send_metadata(b"", -1, None, Part.NONE)
    assert posted.events == [
        Initialized(peer_rank=3),
        MetadataSubmitted(pack_pages([9, 8]), 4, pack_pages([2]), int(Part.WHOLE), 32),
        MetadataSubmitted(b"", -1, b"", int(Part.NONE), 0),
    ]


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda r: r.send_metadata([1], -1), "aux row -1 is negative"),
        (lambda r: r.send_metadata([1], 0, prefix=-16), "decode prefix of -16 tokens is negative"),
        (lambda r: r.send_metadata(list(range(17)), 0), "send_metadata with 17 pages"),
        (lambda r: r.send_metadata(["x"], 0), "bad page indices"),
    ],
)
def test_bad_receiver_arguments_fail_the_room_in_the_callers_thread(
    call: object, reason: str
) -> None:
    room, _pub, posted = receiver()
    assert callable(call)
    call(room)
    assert room.poll() is KVPoll.Failed
    assert reason in room.reason
    assert [type(e) for e in posted.events] == [EventRejected]


def test_a_kv_only_leg_may_name_no_aux_row() -> None:
    room, _pub, posted = receiver()
    room.send_metadata([1, 2], -1, None, Part.KV)
    assert room.poll() is KVPoll.Bootstrapping
    assert posted.events == [MetadataSubmitted(pack_pages([1, 2]), -1, b"", int(Part.KV), 0)]


def test_published_parts_legs_and_prefix_read_through() -> None:
    room, pub, _posted = sender()
    assert (room.part, room.legs, room.decode_prefix) == (Part.WHOLE, 1, 0)
    pub.part, pub.legs, pub.prefix = int(Part.KV), 2, 48
    assert (room.part, room.legs, room.decode_prefix) == (Part.KV, 2, 48)
    assert "room=7 gen=1 Bootstrapping" in repr(room)
