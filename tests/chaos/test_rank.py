"""``kvfsm.chaos._rank``: the rank's own checks, on real facades (no processes)."""

from __future__ import annotations

import numpy as np

from kvfsm.chaos._rank import max_pages_refusal_problem
from kvfsm.rooms import ReceiverRoom, RoomKey
from kvfsm.rooms._ports import Publication
from kvfsm.states import Event, KVPoll

MAX_PAGES = 8


def receiver(
    status: KVPoll = KVPoll.WaitingForInput, reason: str = ""
) -> tuple[ReceiverRoom, list[Event]]:
    pub = Publication()
    pub.status, pub.reason = status, reason
    posted: list[Event] = []
    room = ReceiverRoom(
        RoomKey(7, 1), pub, lambda key, event: posted.append(event), max_pages=MAX_PAGES
    )
    return room, posted


def oversized(room: ReceiverRoom) -> None:
    room.send_metadata(np.arange(MAX_PAGES + 1, dtype=np.int32), aux_index=0)


def test_the_refusal_itself_is_no_problem() -> None:
    room, posted = receiver()
    oversized(room)
    assert max_pages_refusal_problem(room, MAX_PAGES + 1) is None
    assert "max_pages" in room.reason
    assert [type(e).__name__ for e in posted] == ["EventRejected"]  # the page list never went


def test_a_room_that_failed_by_itself_just_before_the_call_is_no_problem() -> None:
    """Campaign seed 20261204 (300 s, 40 rooms): decode room 1272 read WaitingForInput, its
    control link was lost (a replayed frame) and the room published Failed on the loop thread,
    then the rank's oversized call came: a no-op on a terminal room, Failed with the link's
    reason. The rank took the missing "max_pages" for a violation."""
    room, posted = receiver(KVPoll.Failed, "peer lost: connection closed")
    oversized(room)
    assert max_pages_refusal_problem(room, MAX_PAGES + 1) is None
    assert room.reason == "peer lost: connection closed"
    assert posted == []


def test_a_room_that_failed_by_itself_just_after_the_refusal_is_no_problem() -> None:
    room, _ = receiver()
    oversized(room)
    room._pub.status, room._pub.reason = KVPoll.Failed, "peer lost: silent"  # the loop, now
    assert max_pages_refusal_problem(room, MAX_PAGES + 1) is None
    assert room.reason == "peer lost: silent"  # the published reason wins


def test_a_call_that_was_not_refused_is_a_problem() -> None:
    room, posted = receiver()
    room.send_metadata(np.arange(MAX_PAGES, dtype=np.int32), aux_index=0)  # within the limit
    problem = max_pages_refusal_problem(room, MAX_PAGES)
    assert problem == f"{MAX_PAGES} pages: WaitingForInput after the call ('')"
    assert [type(e).__name__ for e in posted] == ["MetadataSubmitted"]
