"""The synchronous facade: what callers' threads (SGLang's scheduler) hold for each room.

Thread-safety, for every method below: callable from any thread, and never blocks.

* ``poll()`` reads the room's published status. No lock, no loop round trip (law 6).
* Every other call packs its arguments into an event and posts it to the engine's loop with
  ``call_soon_threadsafe``, then returns. Its effect shows in a later ``poll()``.
* A call whose arguments are wrong on their face fails the room at once, in the caller's
  thread: bad page indices, more pages than ``RoomConfig.max_pages`` (the page list would not
  fit a control frame), ``init`` with a negative or oversized page count, a negative aux row.
  ``poll()`` reports Failed when the call returns, with the reason; nothing reaches the wire.
* ``abort()`` is the one call whose effect is immediate for its caller: once it returns, this
  facade's ``poll()`` reports Failed, even before the room task has processed the abort. That
  local view never contradicts the room: ``abort()`` is a no-op on a room already published
  terminal, and a room that raced to Success meanwhile ends Failed for this caller (its pages
  are settled either way). The room's own task remains the only writer of its state.

A facade that belongs to one thread at a time (SGLang's case) needs nothing more. If two threads
share one facade, ``abort()`` from either is still safe; ``init``/``send`` from both is a usage
error (their order is whatever the threads make it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import numpy.typing as npt

from kvfsm.rooms._config import DEFAULT_MAX_PAGES
from kvfsm.states import (
    TERMINAL,
    AbortRequested,
    ChunkSubmitted,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    Part,
    Role,
    failure_reason,
)

if TYPE_CHECKING:
    from kvfsm.rooms._ports import Publication, RoomKey

__all__ = [
    "KVTransferError",
    "PageIndices",
    "ReceiverRoom",
    "SenderRoom",
    "StateRows",
    "pack_pages",
]

PageIndices = npt.NDArray[np.integer] | Sequence[int] | bytes


class StateRows(list[int]):
    """A request's state rows that also carry the live segments of its ring rows
    (``rings``: ``RING_FIELDS`` packed int32 per ring row, see :mod:`kvfsm.states`). A list,
    so that a caller that hands state rows along unchanged (the SGLang adapter's connections)
    hands the segments along with them; ``send`` and ``send_metadata`` read them from here."""

    __slots__ = ("rings",)

    def __init__(self, rows: Sequence[int] = (), rings: bytes = b"") -> None:
        super().__init__(rows)
        self.rings = rings


def _rings_of(state_indices: PageIndices | None) -> bytes:
    return state_indices.rings if isinstance(state_indices, StateRows) else b""


_PAGE_BYTES = 4  # packed int32


class KVTransferError(RuntimeError):
    """Why a room failed. ``failure_reason`` mirrors the attribute SGLang's scheduler reads."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.failure_reason = reason


def pack_pages(pages: PageIndices) -> bytes:
    """Page indices as packed native int32, the form they travel in."""
    if isinstance(pages, bytes):
        return pages
    array = np.asarray(pages)
    if array.ndim != 1:
        raise ValueError(f"page indices must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"page indices must be integers, got {array.dtype}")
    if array.dtype != np.int32:
        info = np.iinfo(np.int32)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError("page index out of int32 range")
        array = array.astype(np.int32)
    return array.tobytes()


Post = Callable[["RoomKey", Event], None]


class _RoomFacade:
    __slots__ = ("_local_failure", "_max_pages", "_pub", "_post", "key")

    role: Role

    def __init__(
        self,
        key: RoomKey,
        publication: Publication,
        post: Post,
        *,
        max_pages: int = DEFAULT_MAX_PAGES,
    ) -> None:
        self.key = key
        self._pub = publication
        self._post = post
        self._max_pages = max_pages
        #: Set by this caller's own abort (or its own bad call); makes poll() Failed at once.
        self._local_failure: str | None = None

    @property
    def room(self) -> int:
        return self.key.room

    def poll(self) -> KVPoll:
        """The room's status: a read of what its task published (plus this caller's abort)."""
        if self._local_failure is not None:
            return KVPoll.Failed
        return self._pub.status

    @property
    def settled(self) -> bool:
        """True once no transfer can touch this room's pages any more (law 4)."""
        return self._pub.settled

    @property
    def reason(self) -> str:
        """Why the room failed, or ``""``."""
        if self._pub.status is KVPoll.Failed:
            return self._pub.reason
        return self._local_failure or ""

    def abort(self, reason: str = "aborted by caller") -> None:
        """Fail the room. A no-op once the room is published terminal."""
        self._fail_locally(AbortRequested(reason))

    def reject(self, reason: str) -> None:
        """Fail the room because the caller's request cannot be served (an unsupported option,
        an unknown peer): like :meth:`abort`, but the reason reads as a rejection."""
        self._fail_locally(EventRejected(reason))

    def _fail_locally(self, event: AbortRequested | EventRejected) -> None:
        if self._local_failure is not None or self._pub.status in TERMINAL:
            return
        self._local_failure = failure_reason(event)
        self._post(self.key, event)

    def _pack(self, pages: PageIndices) -> bytes | None:
        """Pack for the wire; bad indices fail this room (not the caller's thread)."""
        try:
            return pack_pages(pages)
        except (TypeError, ValueError) as exc:
            self._fail_locally(EventRejected(f"bad page indices: {exc}"))
            return None

    def _too_long(self, call: str, pages: PageIndices) -> bool:
        """Refuse an over-long index list before packing it: packing is a copy on the caller's
        thread, 17 MB for the four million pages a frame can carry."""
        count = len(pages) // _PAGE_BYTES if isinstance(pages, bytes) else len(pages)
        if count <= self._max_pages:
            return False
        self._fail_locally(
            EventRejected(
                f"{call} with {count} pages: more than max_pages ({self._max_pages}) in one room"
            )
        )
        return True

    def _too_many(self, call: str, pages: bytes, state: bytes) -> bool:
        """More indices than one room may name: fail the room now (True)."""
        if len(pages) + len(state) <= self._max_pages * _PAGE_BYTES:
            return False
        rows = f" and {len(state) // _PAGE_BYTES} state rows" if state else ""
        self._fail_locally(
            EventRejected(
                f"{call} with {len(pages) // _PAGE_BYTES} pages{rows}: more than "
                f"max_pages ({self._max_pages}) in one room"
            )
        )
        return True

    def failure_exception(self) -> NoReturn:
        """Raise :class:`KVTransferError` with the room's reason (always raises)."""
        status = self.poll()
        if status is KVPoll.Failed:
            raise KVTransferError(self.key.room, self.reason or "failed")
        raise KVTransferError(
            self.key.room, f"failure_exception() called while the room is {status.name}"
        )

    def clear(self) -> None:
        """Done with this room. Aborts it if it is not terminal yet; idempotent."""
        if self.poll() not in TERMINAL:
            self.abort("cleared before completion")

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} room={self.key.room} gen={self.key.generation} "
            f"{self.poll().name}>"
        )


class SenderRoom(_RoomFacade):
    """The prefill side of a room: ``poll`` until WaitingForInput, ``init``, ``send`` chunks."""

    __slots__ = ()
    role = Role.SENDER

    @property
    def part(self) -> Part:
        """Which part of its decode request this room carries, once its destination arrived
        (``Part.WHOLE`` before): with unequal TP a prefill rank may carry only a KV slice
        (send no state rows) or nothing at all (a dummy: send no pages)."""
        return Part(self._pub.part)

    @property
    def legs(self) -> int:
        """How many decode ranks this room's request goes to, once its destination arrived
        (1 before): with decode's attention TP larger than prefill's, each gets its own room
        (a leg, ``PrefillManager.sender(room, leg=...)``)."""
        return self._pub.legs

    @property
    def decode_prefix(self) -> int:
        """Prompt tokens the receiver already holds (decode prefix caching): its page list
        starts after them, so the caller sends only the pages that follow, and ``init`` counts
        only those. Known once ``poll()`` reports WaitingForInput (published before it); 0
        before, and when the receiver holds no prefix."""
        return self._pub.prefix

    def init(self, num_pages: int, aux_index: int = -1) -> None:
        """Announce how many pages will be sent in total and the aux row to copy at the end."""
        num_pages = int(num_pages)
        if not 0 <= num_pages <= self._max_pages:
            what = "negative" if num_pages < 0 else f"more than max_pages ({self._max_pages})"
            self._fail_locally(EventRejected(f"init with {num_pages} pages: {what}"))
            return
        self._post(self.key, Initialized(num_pages=num_pages, aux_index=int(aux_index)))

    def send(self, page_indices: PageIndices, state_indices: PageIndices | None = None) -> None:
        """Send one chunk of source pages. The chunk that brings the total to ``num_pages`` is
        the last one and also carries the aux row and, if given, the state rows (with their
        ring rows' live segments when they are :class:`StateRows`); it may be empty."""
        if self._too_long("send", page_indices):
            return
        packed = self._pack(page_indices)
        state = b"" if state_indices is None else self._pack(state_indices)
        if packed is not None and state is not None and not self._too_many("send", packed, state):
            self._post(self.key, ChunkSubmitted(packed, state, _rings_of(state_indices)))


class ReceiverRoom(_RoomFacade):
    """The decode side of a room: ``init``, ``poll`` until WaitingForInput, ``send_metadata``."""

    __slots__ = ()
    role = Role.RECEIVER

    def init(self, peer_rank: int = 0) -> None:
        """Name the prefill rank that serves this room; the engine resolves it."""
        self._post(self.key, Initialized(peer_rank=int(peer_rank)))

    def send_metadata(
        self,
        page_indices: PageIndices,
        aux_index: int,
        state_indices: PageIndices | None = None,
        part: Part = Part.WHOLE,
        prefix: int = 0,
    ) -> None:
        """Tell the sender which pages to write, which aux row and which state rows to fill.

        ``part``: for one leg of a request fed by several prefill ranks, ``Part.KV`` (pages,
        and state rows when state is sharded; ``aux_index`` -1), ``Part.STATE`` (state rows
        only) or ``Part.NONE`` (a dummy: nothing at all).
        ``prefix``: prompt tokens this side holds already (decode prefix caching); the pages
        are those that follow them, and the sender sees it as ``SenderRoom.decode_prefix``."""
        aux_index, prefix = int(aux_index), int(prefix)
        if aux_index < 0 and part is Part.WHOLE:
            self._fail_locally(EventRejected(f"aux row {aux_index} is negative"))
            return
        if prefix < 0:
            self._fail_locally(EventRejected(f"decode prefix of {prefix} tokens is negative"))
            return
        if self._too_long("send_metadata", page_indices):
            return
        packed = self._pack(page_indices)
        state = b"" if state_indices is None else self._pack(state_indices)
        if packed is None or state is None or self._too_many("send_metadata", packed, state):
            return
        rings = _rings_of(state_indices)
        self._post(self.key, MetadataSubmitted(packed, aux_index, state, int(part), prefix, rings))
