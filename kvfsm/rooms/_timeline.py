"""A room's flight recorder: a bounded timeline of what happened to it, for operators.

Every room keeps a timeline. Its task records each event it applies (a frame in, a chunk done
or failed, a caller's call, a deadline, a lost link), each command it hands to its sink (a
frame out, a chunk posted) and each state change. When a room fails it logs one JSON line with
its timeline (:func:`failure_line`); when it is reaped the engine keeps its record in a
:class:`Finished` ring, so ``GET /rooms/<id>`` and ``kvfsm rooms --room`` tell its story after
the fact.

Why it looks like this: the recorder runs on the engine's loop thread, whose Python time is
taken from the caller's scheduler through the GIL, for every room of every request. So a
timeline is one plain list and recording is an append of what is already there:

* a ``float`` is a time (``time.monotonic()``): one per room step (an event and the commands
  and state change it caused share it), the first one the room's creation. A step's time is
  the room scheduler's clock (``RoomScheduler.now``, read once per few steps of a batch), not
  a clock read of its own: a room that was created inside a batch may see a first step a few
  microseconds "before" its creation, which the reading side shows as 0;
* an event or command *object* is itself the entry: it is immutable and already allocated, so
  keeping a reference costs a pointer. Those that carry page lists (which must not be kept
  alive) are encoded instead (:data:`ENCODERS`) as an ``int``;
* a small ``int`` is a state change (:data:`STATE_MARKS`, cached ints: no allocation).

Nothing is formatted until somebody asks (:func:`entries`). Bounded: a list past :data:`SLOTS`
is compacted (:func:`compact`, amortised over many steps) to the first :data:`HEAD` entries
(how the room began: its peer, its lease, its first chunks) and the latest (how it ended), at
most :data:`CAPACITY` entries in all, with a :class:`Dropped` marker saying how many went.

A reaped room's timeline is frozen (:func:`freeze`) into one msgpack ``bytes`` before its
:class:`RoomRecord` joins the :class:`Finished` ring, and the record is a ``gc=False`` struct.
Why: the ring holds the last thousand rooms, and each room that joins it pushes the oldest one
out. Kept as a list, that oldest room's list, its floats, ints and events (a dozen objects that
nobody touched since) were freed one by one, each a cache miss, and the record and its list
were traversed by every older garbage collection. Frozen, leaving the ring frees two objects
the collector never sees; encoding a short list is cheaper than those misses. The reading side
(:func:`entries`, :func:`dropped`) takes either form, and thaws a frozen one (:func:`thaw`).

Times are shown relative to the room's creation: real time, also under a virtual-time loop.
"""

from __future__ import annotations

import functools
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final, Union

import msgspec

from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    ChunkStalled,
    ChunkSubmitted,
    Command,
    DeadlineExpired,
    DestinationReceived,
    Event,
    EventRejected,
    Initialized,
    KVPoll,
    MetadataSubmitted,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
    TransferCompleted,
    TransferConfirmed,
    reason_kind,
)

__all__ = [
    "CAPACITY",
    "ENCODERS",
    "FINISHED_KEPT",
    "HEAD",
    "PAGED",
    "SLOTS",
    "STATE_MARKS",
    "Dropped",
    "Finished",
    "PeerNamer",
    "RoomRecord",
    "compact",
    "dropped",
    "entries",
    "failure_line",
    "freeze",
    "new_timeline",
    "pack",
    "thaw",
]

# Python 3.11's EnumType defines ``__getattr__``, which sends every attribute read on an enum
# class (``KVPoll.Failed``) through a slow slot hook: several times a module global's cost. What
# runs per room step reads these globals instead.
_FAILED: Final = KVPoll.Failed
_RECEIVER: Final = Role.RECEIVER

#: Entries a timeline shows at most: the first HEAD, then the latest.
CAPACITY: Final = 32
HEAD: Final = 8
#: List slots (times and entries) past which a timeline is compacted (what bounds its bytes).
SLOTS: Final = 48
#: Entries a compaction keeps (the head, the marker, the latest): fewer than CAPACITY, so that
#: a long room compacts every few steps rather than at each one.
_KEPT: Final = 20
#: Finished rooms an engine remembers (and failed ones, in a ring of their own: kept longer).
FINISHED_KEPT: Final = 1000

#: ``peer(role, agent, rank, fence)`` -> what the rank knows of that peer (engine, rank,
#: incarnation, agent), or None. Called only when a timeline is read.
PeerNamer = Callable[[Role, str, int, int], "dict[str, Any] | None"]


# -- encoded entries ---------------------------------------------------------------------------
#
# ``what | detail << 6``; ``what`` 1 is a state change (detail: the state), the others below
# stand for an object whose page list is not kept (detail: its page count; a posted chunk's
# also its index, in the low 20 bits; a lease: its fence).
_WHAT: Final = 0x3F
_CHUNK_BITS: Final = 20
_STATE: Final = 1
_DESTINATION: Final = 2
_LEASE: Final = 3
_SEND: Final = 4
_METADATA: Final = 5
_POST: Final = 6
_METADATA_OUT: Final = 7

#: A state change's entry, per state (ints under 257: CPython's cached ones).
STATE_MARKS: Final[Mapping[KVPoll, int]] = {s: _STATE | int(s) << 6 for s in KVPoll}


# The recorder (kvfsm.rooms._actor) encodes inline, from :data:`PAGED`, without a Python call
# per event or command; :data:`ENCODERS` is the same encoding as functions, for everything else.

#: The code of each event and command whose page list (``pages``; a posted chunk's ``src``) is
#: not kept: ``code | pages << 6``, where ``pages`` is the packed int32 list's length over 4 (a
#: posted chunk's also holds its index, in the low 20 bits; a destination that came under a
#: write lease is ``_LEASE | fence << 6``).
PAGED: Final[Mapping[type[Any], int]] = {
    DestinationReceived: _DESTINATION,
    ChunkSubmitted: _SEND,
    MetadataSubmitted: _METADATA,
    PostChunk: _POST,
    SendMetadata: _METADATA_OUT,
}


def _destination(e: DestinationReceived) -> int:
    # Its fence is the write lease the destination came under: the lease grant a room sees.
    return _LEASE | e.fence << 6 if e.fence else _DESTINATION | len(e.pages) >> 2 << 6


def _post(c: PostChunk) -> int:
    return _POST | (c.chunk & 0xFFFFF | len(c.src) >> 2 << _CHUNK_BITS) << 6


#: Events and commands that carry page lists are recorded as an int, not kept.
ENCODERS: Final[Mapping[type[Any], Callable[[Any], int]]] = {
    DestinationReceived: _destination,
    ChunkSubmitted: lambda e: _SEND | len(e.pages) >> 2 << 6,
    MetadataSubmitted: lambda e: _METADATA | len(e.pages) >> 2 << 6,
    PostChunk: _post,
    SendMetadata: lambda c: _METADATA_OUT | len(c.pages) >> 2 << 6,
}


class Dropped(msgspec.Struct, frozen=True, tag=True, gc=False, array_like=True):
    """Where :func:`compact` took entries out of a timeline, and how many (a struct like the
    events, so that a frozen timeline encodes it)."""

    count: int


#: What :func:`freeze` encodes with (the registry calls it inline: a Python call less a room).
pack: Final = msgspec.msgpack.Encoder().encode
_encode: Final = pack


def new_timeline() -> list[object]:
    """A room's timeline at its creation."""
    return [time.monotonic()]


def freeze(timeline: list[object]) -> list[object] | bytes:
    """``timeline`` as one ``bytes`` (msgpack: times stay floats, encoded entries ints, events
    and commands tagged structs, as ``[tag, fields...]`` arrays: no field names), or the list
    itself if something in it does not encode."""
    try:
        return _encode(timeline)
    except (TypeError, OverflowError):  # not an event or command (a test's object): keep it
        return timeline


def _subclasses(base: type[Any]) -> list[type[Any]]:
    found = []
    for cls in base.__subclasses__():
        found += [cls, *_subclasses(cls)]
    return found


@functools.cache
def _decoder() -> msgspec.msgpack.Decoder[list[object]]:
    # Built on first read, once every event and command class exists.
    kinds = (float, int, Dropped, *_subclasses(Event), *_subclasses(Command))
    return msgspec.msgpack.Decoder(list[Union[kinds]])  # type: ignore[valid-type]  # noqa: UP007


def thaw(timeline: list[object] | bytes) -> list[object]:
    """A frozen timeline as the list it was (a live one as it is)."""
    if type(timeline) is bytes:
        return _decoder().decode(timeline)
    assert isinstance(timeline, list)
    return timeline


def _steps(timeline: list[object] | bytes) -> list[tuple[float, object]]:
    """(time, entry) pairs, oldest first (Dropped markers included)."""
    out: list[tuple[float, object]] = []
    now = 0.0
    for item in thaw(timeline):
        if type(item) is float:
            now = item
        else:
            out.append((now, item))
    return out


def compact(timeline: list[object], kept: int = _KEPT) -> None:
    """Cut ``timeline`` (in place) to its first HEAD entries, a Dropped marker and its latest
    entries, ``kept`` rows in all."""
    born = timeline[0]
    steps = _steps(timeline)
    recorded = [(t, e) for t, e in steps if type(e) is not Dropped]
    already = sum(e.count for _, e in steps if type(e) is Dropped)
    if len(recorded) + (1 if already else 0) <= kept:
        return
    keep_tail = kept - HEAD - 1  # the marker is a row too
    cut = len(recorded) - HEAD - keep_tail
    gap = (recorded[HEAD][0], Dropped(already + cut))
    rows = [*recorded[:HEAD], gap, *recorded[-keep_tail:]]
    rebuilt: list[object] = [born]
    last: object = born
    for t, entry in rows:
        if t != last:
            rebuilt.append(t)
            last = t
        rebuilt.append(entry)
    timeline[:] = rebuilt


def dropped(timeline: list[object] | bytes) -> int:
    """Entries compaction took out of ``timeline``."""
    return sum(item.count for item in thaw(timeline) if type(item) is Dropped)


# -- reading -------------------------------------------------------------------------------------

#: What an operator filters on, and what happened, per recorded type.
_KINDS: Final[Mapping[type[Any], tuple[str, str]]] = {
    Initialized: ("caller", "init"),
    ChunkDone: ("chunk_done", "chunk done"),
    ChunkFailed: ("chunk_failed", "chunk failed"),
    ChunkStalled: ("chunk_failed", "chunk stalled past its deadline"),
    PeerResolved: ("link", "prefill rank resolved, link up"),
    TransferConfirmed: ("frame_in", "RoomOutcome in: Success"),
    PeerSettled: ("frame_in", "RoomSettled in: the sender's handles settled"),
    TransferCompleted: ("state", "transfer complete"),
    AbortRequested: ("caller", "abort"),
    DeadlineExpired: ("deadline", "deadline expired"),
    PeerLost: ("link", "peer lost"),
    PeerFailed: ("frame_in", "peer failed (RoomOutcome or Error in)"),
    EventRejected: ("rejected", "event rejected"),
    ReleaseHandles: ("chunk_released", "release in-flight chunks"),
    ResolvePeer: ("link", "resolve prefill rank"),
    ReportOutcome: ("frame_out", "RoomOutcome out"),
    ReportSettled: ("frame_out", "RoomSettled out: every handle settled"),
}
_ENCODED: Final[Mapping[int, tuple[str, str]]] = {
    _DESTINATION: ("frame_in", "RoomMetadata in: destination pages"),
    _LEASE: ("lease", "lease granted with the destination pages (RoomMetadata in)"),
    _SEND: ("caller", "send"),
    _METADATA: ("caller", "send_metadata"),
    _POST: ("chunk_posted", "chunk posted"),
    _METADATA_OUT: ("frame_out", "RoomMetadata out: destination pages"),
}


def _encoded_row(code: int, row: dict[str, Any], pages_of: dict[int, int]) -> None:
    what, detail = code & _WHAT, code >> 6
    row["kind"], row["what"] = _ENCODED.get(what, ("other", f"code {what}"))
    if what == _POST:
        chunk, pages = detail & 0xFFFFF, detail >> _CHUNK_BITS
        pages_of[chunk] = pages
        row.update(chunk=chunk, pages=pages)
    elif what == _LEASE:
        row["fence"] = detail
    else:
        row["pages"] = detail


def _object_row(item: object, role: Role, row: dict[str, Any]) -> None:
    row["kind"], row["what"] = _KINDS.get(type(item), ("other", type(item).__name__))
    if isinstance(item, ChunkDone | ChunkFailed | ChunkStalled):
        row["chunk"] = item.chunk
        if not isinstance(item, ChunkDone):
            row["reason"] = item.reason
            if "write lease" in item.reason:
                row["kind"], row["what"] = "fenced", "chunk refused: its write lease is gone"
    elif isinstance(item, Initialized):
        if role is _RECEIVER:
            row["rank"] = item.peer_rank
        else:
            row.update(pages=item.num_pages, aux=item.aux_index)
    elif isinstance(item, PeerResolved | TransferConfirmed | PeerSettled | ResolvePeer):
        row["rank"] = item.peer_rank
    elif isinstance(item, AbortRequested):
        row["reason"] = item.reason
        if item.origin == "peer":
            row["kind"], row["what"] = "frame_in", "RoomAbort in: the peer aborted"
    elif isinstance(item, PeerLost | PeerFailed | EventRejected):
        row["reason"] = item.reason
    elif isinstance(item, DeadlineExpired):
        row["state"] = item.state.name
        row["what"] = f"deadline of {item.state.name} expired ({item.seconds:g}s)"
    elif isinstance(item, ReportOutcome):
        row["what"] = f"RoomOutcome out: {item.status.name}"
        if item.reason:
            row["reason"] = item.reason


#: Entries after which a room knows its peer.
_PEER_KINDS: Final = frozenset({"lease", "link"})


def entries(
    timeline: list[object] | bytes,
    role: Role,
    peer: Mapping[str, Any] | None = None,
    page_bytes: int = 0,
) -> list[dict[str, Any]]:
    """The timeline as rows for people: ``t_ms`` since creation, ``kind``, ``what``, and where
    they apply ``chunk``, ``pages``, ``bytes`` (with ``page_bytes``, the KV bytes of one page),
    ``state``, ``fence``, ``rank``, ``reason``, and ``peer`` (once the room knew it)."""
    timeline = thaw(timeline)
    steps = _steps(timeline)
    if len(steps) > CAPACITY:  # read between two compactions: show what one would keep
        copy = list(timeline)
        compact(copy, CAPACITY)
        steps = _steps(copy)
    born = timeline[0]
    assert isinstance(born, float)
    rows: list[dict[str, Any]] = []
    pages_of: dict[int, int] = {}
    knows_peer = False
    for t, item in steps:
        # (a step's time may precede the creation's by a few steps' work: see the module doc)
        row: dict[str, Any] = {"t_ms": round(max(t - born, 0.0) * 1000, 3)}
        if type(item) is Dropped:
            row.update(kind="dropped", what=f"{item.count} entries not kept")
        elif type(item) is int and item & _WHAT == _STATE:
            name = KVPoll(item >> 6).name
            row.update(kind="state", what=f"entered {name}", state=name)
        elif type(item) is int:
            _encoded_row(item, row, pages_of)
        else:
            _object_row(item, role, row)
        chunk = row.get("chunk")
        if chunk is not None and "pages" not in row and chunk in pages_of:
            row["pages"] = pages_of[chunk]
        if page_bytes and "pages" in row and "chunk" in row:
            row["bytes"] = row["pages"] * page_bytes
        knows_peer = knows_peer or row["kind"] in _PEER_KINDS or "rank" in row
        knows_peer = knows_peer or row["what"].startswith("RoomMetadata in")
        if knows_peer and peer is not None:
            row["peer"] = peer
        rows.append(row)
    return rows


class RoomRecord(msgspec.Struct, gc=False):
    """What an engine keeps of a reaped room. A ``gc=False`` struct: built in one C call (a
    NamedTuple through ``tuple.__new__`` took several times as long), and never tracked by the
    garbage collector, so a full ring costs no collection anything."""

    room: int
    generation: int
    role: Role
    state: KVPoll
    reason: str
    settled: bool
    #: Frozen (:func:`freeze`) when the registry keeps it.
    timeline: list[object] | bytes
    #: ``time.monotonic()`` when it was reaped (its last step's time: RoomScheduler.now).
    reaped: float
    #: The peer the room named: its agent (sender), prefill rank (receiver) and fence.
    agent: str
    rank: int
    fence: int

    @property
    def born(self) -> float:
        born = thaw(self.timeline)[0]
        assert isinstance(born, float)
        return born

    @property
    def duration_s(self) -> float:
        """From creation to reaping (never negative: ``reaped`` is the scheduler's clock,
        which a room created and reaped within a few steps may not have seen move)."""
        return max(self.reaped - self.born, 0.0)

    @property
    def created(self) -> float:
        """``time.time()`` at creation, for people."""
        return time.time() - (time.monotonic() - self.born)


class Finished:
    """The last :data:`FINISHED_KEPT` reaped rooms, and as many failed ones in a ring of their
    own (a burst of successes does not push a failure out). Loop thread only."""

    __slots__ = ("failed", "recent")

    def __init__(self, kept: int = FINISHED_KEPT) -> None:
        self.recent: deque[RoomRecord] = deque(maxlen=kept)
        self.failed: deque[RoomRecord] = deque(maxlen=kept)

    def add(self, record: RoomRecord) -> None:
        if record.state is _FAILED:
            self.failed.append(record)
        else:
            self.recent.append(record)

    def find(self, room: int) -> list[RoomRecord]:
        """Every kept record of room id ``room``, newest first."""
        found = [r for r in self.recent if r.room == room]
        found += [r for r in self.failed if r.room == room]
        found.sort(key=lambda r: r.generation, reverse=True)
        return found


def failure_line(
    room: int,
    generation: int,
    role: Role,
    *,
    reason: str,
    duration_s: float,
    timeline: list[object] | bytes,
    peer: Mapping[str, Any] | None = None,
    page_bytes: int = 0,
) -> str:
    """The one JSON line a failed room logs (``kvfsm explain`` reads it back)."""
    return json.dumps(
        {
            "event": "room_failed",
            "room": room,
            "generation": generation,
            "role": role.value,
            "reason": reason,
            "reason_kind": reason_kind(reason),
            "duration_s": round(duration_s, 6),
            "peer": peer,
            "dropped": dropped(timeline),
            "timeline": entries(timeline, role, peer, page_bytes),
        },
        separators=(",", ":"),
    )
