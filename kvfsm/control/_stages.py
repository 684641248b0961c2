"""The PP status consensus channel: PP stages 1..N-1 of a prefill stream their senders' statuses
to stage 0, whose scheduler polls the consensus of every stage. This module holds its rules, its
frames and its two sans-IO cores (``StageBook`` on stage 0, ``StageFeed`` on the others); the
connections that carry them are ``kvfsm.control._stage_links`` (``StageHub``, ``StageLink``).

With pipeline parallelism (``--pp-size N``) each PP stage is its own process with its own sender
room per request, but SGLang polls only stage 0's senders (``poll_pp_consensus``). Stage 0 must
answer with the MIN of that request's status on every stage (SGLang 0.5.23
``check_status_pp_consensus``).

Rule 1: consensus is the MIN of stage 0's own status and each other stage's latest report (the
        ``KVPoll`` ints are ordered so that MIN is the pessimistic answer). A stage that is up but
        has not reported the room counts as Bootstrapping (SGLang's rule for ``None``); so does a
        stage that never joined (start-up). A stage that joined and was lost counts as Failed,
        with the reason it was lost: its senders can no longer be heard, and waiting for them
        would hang the request. A stage that rejoins starts empty: it must report again
        (``StageFeed.snapshot``).
Rule 2: the book is written only by the loop thread and read by the scheduler's thread without a
        lock: ``consensus`` does dict ``.get`` lookups and reads immutable values, and a lost or
        rejoined stage's state is replaced by one reference assignment, never cleared in place.
Rule 3: held state is bounded: at most ``max_rooms`` reports per stage (the oldest are evicted
        and counted), at most ``MAX_PENDING`` handshakes at once on the hub (a new one over the
        cap sheds the oldest), and frames of at most ``MAX_FRAME_BYTES`` (refused on their
        length prefix, ``FrameReader``).
Rule 4: hostile input costs at most its own connection. A connection is refused (closed, logged
        once at WARNING, counted) for garbage, an oversized length, a wrong group, a stage out
        of range, a bad MAC, or no hello within ``hello_timeout_s``. An *authenticated* feed that
        sends an invalid frame is dropped too (both ends are this module: the bytes are corrupt
        or the versions differ), which loses its stage.
Rule 5: liveness as on the control channel: each side sends ``StageBeat`` when it has sent
        nothing else for ``heartbeat_s``; a side silent for ``heartbeat_s * liveness_factor`` is
        lost. The link then reconnects (capped backoff) and sends a snapshot; the hub drops the
        stage's reports (``StageBook.lost``). A second authenticated feed for one stage replaces
        the first (a restarted stage, or a link that noticed the loss before the hub did).

Wire: the envelope of ``kvfsm.control._frames`` (length prefix, auth byte, MAC, session keys
and sequence numbers), with this module's frames as payload (``array_like``: tiny and frequent,
and every error is fatal anyway, so field names in messages are not needed). Each side sends
``StageHello`` at once (the hub as stage 0); the feed's must name a stage in ``1..stages-1``,
both must agree on ``stages`` and ``group``. With a secret both hellos carry a nonce, signed
under a key derived from the secret for this channel only (domain separation from the control
channel), and everything after them is sealed with the connection's session keys
(``_frames.session_keys`` of both nonces, a sequence number under the MAC). Each side's first
sealed frame is a ``StageBeat`` (key confirmation): the hub registers a feed only after it
verified, so a recorded connection replayed by a stranger registers nothing and replaces no one.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Annotated, Final, Literal, TypeAlias, cast

import msgspec

from kvfsm.control._codec import FrameCodec
from kvfsm.control._frames import Frame, FrameError, Room
from kvfsm.link import sign
from kvfsm.states import KVPoll

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_PENDING",
    "StageBeat",
    "StageBook",
    "StageFeed",
    "StageForget",
    "StageFrame",
    "StageHello",
    "StageStatus",
]

#: The largest frame body either side accepts: the frames are a few dozen bytes.
MAX_FRAME_BYTES: Final = 1024
#: Handshakes the hub runs at once; one more sheds the oldest.
MAX_PENDING: Final = 64
MAX_STAGES: Final = 1024
_FAILED: Final = int(KVPoll.Failed)
_BOOTSTRAPPING: Final = int(KVPoll.Bootstrapping)
_TERMINAL: Final = frozenset({int(KVPoll.Failed), int(KVPoll.Success)})
_STATUSES: Final = frozenset(int(s) for s in KVPoll)

_log = logging.getLogger("kvfsm.stages")

Status: TypeAlias = Literal[0, 1, 2, 3, 4]


class _StageFrame(Frame, frozen=True, array_like=True):
    """Base of this channel's frames (tagged by class name, positional)."""


class StageHello(_StageFrame, frozen=True):
    """Each side's first frame: the feed's names its stage (1..stages-1), the hub's stage 0.
    ``group``: an opaque deployment label both must share. ``nonce``: 16 fresh bytes with a
    secret, empty without."""

    stage: Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]
    stages: Annotated[int, msgspec.Meta(ge=2, le=MAX_STAGES)]
    group: Annotated[str, msgspec.Meta(max_length=256)]
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""

    def __post_init__(self) -> None:
        if self.stage >= self.stages:
            raise ValueError(f"stage {self.stage} is not below stages {self.stages}")


class StageStatus(_StageFrame, frozen=True):
    """Feed → hub: the stage's sender for ``room`` now has ``status`` (a ``KVPoll`` int)."""

    room: Room
    status: Status


class StageForget(_StageFrame, frozen=True):
    """Feed → hub: the stage released its sender for ``room``; drop its report."""

    room: Room


class StageBeat(_StageFrame, frozen=True):
    """Either way: a sign of life on an otherwise idle connection."""


StageFrame: TypeAlias = StageHello | StageStatus | StageForget | StageBeat


class _Codec(FrameCodec):
    """``FrameCodec``'s envelope (and, through ``session``, ``SessionCodec``'s) around this
    channel's frames. Every rejected payload is fatal (Rule 4)."""

    __slots__ = ("_stage_decoder",)

    def __init__(self, secret: bytes | None) -> None:
        # A key for this channel only: a frame of the control channel (same secret) never
        # verifies here, nor one of these there.
        key = None if secret is None else sign(secret, b"kvfsm pp stages v1")
        super().__init__(key, MAX_FRAME_BYTES)
        self._stage_decoder = msgspec.msgpack.Decoder(StageFrame)

    def parse(self, payload: bytes | memoryview) -> Frame:
        try:
            frame: Frame = self._stage_decoder.decode(payload)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise FrameError(f"invalid stage frame: {str(exc)[:200]}", None, True) from None
        return frame


# --------------------------------------------------------------------------- stage 0: the book


class _Stage:
    """One stage's state as the scheduler's thread sees it: replaced whole, never reset in
    place, so a reader holding the old one reads a consistent (if stale) answer."""

    __slots__ = ("down", "reports")

    def __init__(self, down: str | None) -> None:
        self.down = down  # None: up or never joined; a str: lost after joining, why
        self.reports: dict[int, int] = {}  # room -> latest status, insertion order


class StageBook:
    """Stage 0's record of what stages 1..stages-1 reported (sans-IO; Rules 1-3).

    Every method but ``consensus`` is for the loop thread; ``consensus`` is safe from any thread.
    """

    def __init__(self, stages: int, *, max_rooms: int = 65536) -> None:
        if not 1 <= stages <= MAX_STAGES:
            raise ValueError(f"stages must be in [1, {MAX_STAGES}], not {stages}")
        if max_rooms < 1:
            raise ValueError(f"max_rooms must be at least 1, not {max_rooms}")
        self.stages = stages
        self.max_rooms = max_rooms
        # Index 0 is stage 0 itself (never read): indices are stage numbers. The list itself is
        # never resized; its items are swapped by one assignment (Rule 2).
        self._state: list[_Stage] = [_Stage(None) for _ in range(stages)]
        self._others: Final = range(1, stages)  # immutable: iterating it is thread-safe
        self.stats: dict[str, int] = dict.fromkeys(
            ("joined", "lost", "reports", "forgets", "evicted", "ignored"), 0
        )

    def _check(self, stage: int) -> None:
        if not 1 <= stage < self.stages:
            raise ValueError(f"stage {stage} is not in [1, {self.stages - 1}]")

    def joined(self, stage: int) -> None:
        """A feed for ``stage`` authenticated: the stage is up, with no reports (a replaced
        connection's leftovers are dropped here too, in the same assignment)."""
        self._check(stage)
        self._state[stage] = _Stage(None)
        self.stats["joined"] += 1

    def lost(self, stage: int, reason: str) -> None:
        """``stage``'s feed is gone: drop its reports; until it rejoins its rooms read Failed."""
        self._check(stage)
        self._state[stage] = _Stage(reason or "no reason given")
        self.stats["lost"] += 1

    def report(self, stage: int, room: int, status: int) -> None:
        self._check(stage)
        if status not in _STATUSES:
            raise ValueError(f"status {status!r} is not a KVPoll int")
        state = self._state[stage]
        if state.down is not None:  # a late frame of a lost feed
            self.stats["ignored"] += 1
            return
        reports = state.reports
        if room not in reports and len(reports) >= self.max_rooms:
            # The oldest first report goes. Its room then reads Bootstrapping for this stage,
            # which stalls it until stage 0's own deadline fails it: bounded, and counted.
            del reports[next(iter(reports))]
            self.stats["evicted"] += 1
        reports[room] = status  # an update keeps its place: eviction order is first report
        self.stats["reports"] += 1

    def forget(self, stage: int, room: int) -> None:
        """``stage`` released its sender for ``room``."""
        self._check(stage)
        self._state[stage].reports.pop(room, None)
        self.stats["forgets"] += 1

    def drop(self, room: int) -> None:
        """Stage 0 released its own sender for ``room``: nothing will ask about it again."""
        for stage in self._others:
            self._state[stage].reports.pop(room, None)

    def rooms(self, stage: int) -> int:
        """How many reports ``stage`` holds (loop thread; for tests and metrics)."""
        self._check(stage)
        return len(self._state[stage].reports)

    def consensus(self, room: int, own: KVPoll) -> tuple[KVPoll, str]:
        """The MIN of ``own`` and every other stage's status for ``room`` (Rule 1), and why it
        is Failed when another stage made it so ("" otherwise, and when ``own`` is Failed: the
        caller knows its own reason). Any thread, no lock: it reads each stage's state once
        (one list index), then one ``dict.get`` and immutable ints and strings (Rule 2)."""
        best = int(own)
        if best == _FAILED:
            return KVPoll.Failed, ""
        state = self._state
        for stage in self._others:
            one = state[stage]
            down = one.down
            if down is not None:
                return KVPoll.Failed, f"PP stage {stage} lost: {down}"
            status = one.reports.get(room, _BOOTSTRAPPING)
            if status == _FAILED:
                return KVPoll.Failed, f"failed on PP stage {stage}"
            best = min(best, status)
        return KVPoll(best), ""


# --------------------------------------------------------------------------- stages 1..: the feed


class _Tracked:
    __slots__ = ("done", "read", "sent")

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.sent: int | None = None  # the status last handed out in a frame
        self.done = False  # a terminal status was handed out: never read again


_Op: TypeAlias = tuple[int, Callable[[], int] | None]  # (room, reader) tracks, (room, None) drops


class StageFeed:
    """What a stage k > 0 tells stage 0 (sans-IO).

    ``track``/``untrack`` may be called from any thread (SGLang's scheduler): they only append
    to a deque (atomic), which ``scan``/``snapshot`` drain on the loop thread, in order.
    """

    def __init__(self) -> None:
        self._ops: collections.deque[_Op] = collections.deque()
        self._rooms: dict[int, _Tracked] = {}
        self._forgets: list[int] = []
        self._live = 0  # tracked rooms not yet done
        self.stats: dict[str, int] = dict.fromkeys(("statuses", "forgets", "read_errors"), 0)

    def track(self, room: int, read_status: Callable[[], int]) -> None:
        """A live sender room; ``read_status()`` reads its published status (cheap, any
        thread). Tracking a room id again replaces the old reader."""
        self._ops.append((room, read_status))

    def untrack(self, room: int) -> None:
        """The sender of ``room`` was released: stage 0 is told to forget it."""
        self._ops.append((room, None))

    @property
    def idle(self) -> bool:
        """Nothing to send until ``track``/``untrack`` is called again."""
        return not self._ops and not self._forgets and self._live == 0

    def __len__(self) -> int:
        return len(self._rooms)

    def _drain(self) -> None:
        ops, rooms = self._ops, self._rooms
        while ops:
            room, read = ops.popleft()
            old = rooms.pop(room, None)
            if old is not None:
                self._live -= 0 if old.done else 1
                if old.sent is not None:
                    self._forgets.append(room)
            if read is not None:
                rooms[room] = _Tracked(read)
                self._live += 1

    def _read(self, tracked: _Tracked) -> int:
        try:
            status = tracked.read()
        except Exception:  # a sender whose status cannot be read is a failed sender
            self.stats["read_errors"] += 1
            return _FAILED
        return int(status) if status in _STATUSES else _FAILED

    def _emit(self, room: int, tracked: _Tracked, status: int, out: list[_StageFrame]) -> None:
        out.append(StageStatus(room, cast("Status", status)))  # a KVPoll int: see _read
        tracked.sent = status
        if status in _TERMINAL and not tracked.done:
            tracked.done = True
            self._live -= 1
        self.stats["statuses"] += 1

    def scan(self) -> list[_StageFrame]:
        """Forgets, then the status of every live room that changed since it was last sent.
        Forgets first: a room id released and tracked again must end up reported."""
        self._drain()
        out: list[_StageFrame] = [StageForget(room) for room in self._forgets]
        self.stats["forgets"] += len(self._forgets)
        self._forgets = []
        if self._live:
            for room, tracked in self._rooms.items():
                if tracked.done:
                    continue
                status = self._read(tracked)
                if status != tracked.sent:
                    self._emit(room, tracked, status, out)
        return out

    def snapshot(self) -> list[_StageFrame]:
        """After a (re)connect: the current status of every tracked room, terminal ones
        included. Pending forgets are dropped: the hub dropped the stage's reports when it
        lost the link. Also drains ``track``/``untrack`` while there is no link."""
        self._drain()
        self._forgets = []
        out: list[_StageFrame] = []
        for room, tracked in self._rooms.items():
            status = tracked.sent if tracked.done and tracked.sent is not None else None
            self._emit(room, tracked, self._read(tracked) if status is None else status, out)
        return out
