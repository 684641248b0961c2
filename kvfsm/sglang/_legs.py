"""``Legs``: the receiver rooms of one decode request that several prefill ranks feed.

With equal attention TP a decode rank's request is one room with one prefill rank. When
prefill's attention TP is a multiple of decode's, the request hears from several prefill ranks
(``_slices.legs``): each writes its heads into the request's pages, one of them also the aux and
state rows, and the prefill ranks that hold none of this rank's heads are told they are dummies.
Each is a room of its own, a *leg*, with its own link, deadlines, fence and settle (laws 3 and
4 hold per leg); the legs share the request's page claim (``DestinationOwners`` group).

What the scheduler sees is one room:

* ``poll()`` is the MIN over the legs, SGLang's own all-reduce rule one level down: Success
  only once every leg succeeded, Failed as soon as one failed. It stays a read of what the
  legs published, except that the first Failed seen aborts the legs still running (posted to
  kvfsm's loop, never waited for), so they end and settle instead of waiting out deadlines.
* ``reason`` is the first failed leg's reason, naming its prefill rank.
* ``settled`` only once every leg settled: no prefill rank can still write into the pages.
* ``abort``/``reject`` end every leg.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from kvfsm.rooms import ReceiverRoom, SenderRoom
from kvfsm.states import TERMINAL, KVPoll

_Room = TypeVar("_Room", ReceiverRoom, SenderRoom)

__all__ = ["Legs"]


class Legs(Generic[_Room]):
    """The legs of one request on one rank; leg 0 exists from the start. Decode: one receiver
    room per prefill rank that feeds the request. Prefill (decode's attention TP larger): one
    sender room per decode rank the request goes to."""

    __slots__ = ("_ended", "_first", "rooms", "sources")

    def __init__(self, first: _Room) -> None:
        self.rooms: list[_Room] = [first]
        #: Decode: which prefill rank each leg hears from, in words (known once ``init`` ran):
        #: "prefill attention-TP rank 2", "prefill pipeline stage 1, attention-TP rank 0".
        self.sources: list[str] = []
        self._ended = False
        self._first = ""

    def add(self, room: _Room) -> None:
        self.rooms.append(room)

    def poll(self) -> KVPoll:
        rooms = self.rooms
        if len(rooms) == 1:
            return rooms[0].poll()
        status = min(room.poll() for room in rooms)
        if status is KVPoll.Failed and not self._ended:
            self._ended = True
            self._end_others()
        return status

    def _end_others(self) -> None:
        why = self.reason
        for room in self.rooms:
            if room.poll() not in TERMINAL:
                room.abort(f"another leg of this request failed: {why}")
        self._first = why

    @property
    def reason(self) -> str:
        if self._first:  # the first failure, not the aborts it caused in the other legs
            return self._first
        for i, room in enumerate(self.rooms):
            if room.poll() is KVPoll.Failed:
                if len(self.rooms) == 1:
                    return room.reason
                if i < len(self.sources):  # decode: named by the prefill rank it hears from
                    return f"{room.reason} (leg from {self.sources[i]})"
                return f"{room.reason} (leg {i} of {len(self.rooms)})"
        return ""

    @property
    def settled(self) -> bool:
        return all(room.settled for room in self.rooms)

    def abort(self, reason: str) -> None:
        for room in self.rooms:
            room.abort(reason)

    def reject(self, reason: str) -> None:
        for room in self.rooms:
            room.reject(reason)
