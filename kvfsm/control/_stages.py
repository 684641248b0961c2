"""The PP status consensus channel: PP stages 1..N-1 of a prefill stream their senders' statuses
to stage 0, whose scheduler polls the consensus of every stage.

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

import asyncio
import collections
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable
from typing import Annotated, Final, Literal, Protocol, TypeAlias, cast

import anyio
import msgspec
from anyio.abc import SocketStream

from kvfsm.control._codec import FrameCodec, FrameReader, SessionCodec
from kvfsm.control._frames import NONCE_BYTES, Frame, FrameError, Room
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
    "StageHub",
    "StageLink",
    "StageStatus",
]

#: The largest frame body either side accepts: the frames are a few dozen bytes.
MAX_FRAME_BYTES: Final = 1024
#: Handshakes the hub runs at once; one more sheds the oldest.
MAX_PENDING: Final = 64
MAX_STAGES: Final = 1024
_READ_BYTES: Final = 4096
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


# --------------------------------------------------------------------------- IO


#: What a peer can end a connection with: its bytes, its silence, its hang-up, socket errors.
_PEER_ERRORS: Final = (
    FrameError,
    TimeoutError,
    OSError,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)
_Sealer: TypeAlias = FrameCodec | SessionCodec


class _Conn(Protocol):
    async def receive(self, max_bytes: int = ...) -> bytes: ...
    async def send(self, item: bytes) -> None: ...


class _Raw:
    """An accepted socket read only as far as asked: what a peer sends beyond one ``recv``
    waits in the kernel, not here (the hub never reads ahead for a stranger)."""

    __slots__ = ("_loop", "sock")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self._loop = loop

    async def receive(self, max_bytes: int = _READ_BYTES) -> bytes:
        data = await self._loop.sock_recv(self.sock, max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        await self._loop.sock_sendall(self.sock, item)


async def _next_frame(conn: _Conn, reader: FrameReader) -> Frame:
    """One frame, or a fatal ``FrameError`` (every error is fatal here)."""
    items = reader.feed(b"", max_items=1)
    while not items:
        items = reader.feed(await conn.receive(_READ_BYTES), max_items=1)
    item = items[0]
    if isinstance(item, FrameError):
        raise item
    return item


async def _handshake(
    conn: _Conn, codec: _Codec, own: StageHello, check: Callable[[StageHello], str | None]
) -> tuple[StageHello, _Sealer, FrameReader]:
    """Send ``own``, read and ``check`` the peer's hello (a refusal reason, or None), and with a
    secret switch to session keys and exchange one sealed ``StageBeat`` (key confirmation).
    Returns the peer's hello, this connection's sealer and its reader."""
    reader = FrameReader(codec)
    await conn.send(codec.encode(own))
    theirs = await _next_frame(conn, reader)
    if not isinstance(theirs, StageHello):
        raise FrameError(f"expected StageHello, got {type(theirs).__name__}", None, True)
    refusal = check(theirs)
    if refusal is not None:
        raise FrameError(refusal, None, True)
    sealer: _Sealer = codec
    if codec.secret is not None:
        if len(theirs.nonce) != NONCE_BYTES:
            raise FrameError(f"nonce of {len(theirs.nonce)} bytes, not {NONCE_BYTES}", None, True)
        # The hub plays "prefill", the feed "decode": one key per direction.
        role: Literal["prefill", "decode"] = "prefill" if own.stage == 0 else "decode"
        session = codec.session(role, own.nonce, theirs.nonce)
        reader.codec = sealer = session
        await conn.send(session.encode(StageBeat()))
        confirmation = await _next_frame(conn, reader)
        if not isinstance(confirmation, StageBeat):
            raise FrameError("expected StageBeat (key confirmation)", None, True)
    return theirs, sealer, reader


def _nonce(secret: bytes | None) -> bytes:
    return b"" if secret is None else secrets.token_bytes(NONCE_BYTES)


class _Feed:
    __slots__ = ("conn", "last_seen", "reason", "scope", "sealer", "stage")

    def __init__(self, stage: int, conn: _Raw, sealer: _Sealer, scope: anyio.CancelScope) -> None:
        self.stage = stage
        self.conn = conn
        self.sealer = sealer
        self.scope = scope
        self.last_seen = anyio.current_time()
        self.reason = ""


class StageHub:
    """Stage 0's end: accepts one feed per stage and writes what they report into ``book``."""

    def __init__(
        self,
        book: StageBook,
        *,
        stages: int,
        group: str,
        host: str = "127.0.0.1",
        secret: bytes | None = None,
        heartbeat_s: float = 1.0,
        liveness_factor: float = 2.0,
        hello_timeout_s: float = 5.0,
    ) -> None:
        if book.stages != stages:
            raise ValueError(f"the book has {book.stages} stages, not {stages}")
        if heartbeat_s <= 0 or liveness_factor <= 1 or hello_timeout_s <= 0:
            raise ValueError("heartbeat_s and hello_timeout_s must be > 0, liveness_factor > 1")
        self.book = book
        self.stages = stages
        self.group = group
        self.host = host
        self.heartbeat_s = heartbeat_s
        self.silence_s = heartbeat_s * liveness_factor
        self.hello_timeout_s = hello_timeout_s
        self._codec = _Codec(secret)
        self._secret = secret
        self._listener: socket.socket | None = None
        self._feeds: dict[int, _Feed] = {}
        self._pending: dict[anyio.CancelScope, None] = {}  # insertion order: oldest first
        self.stats: dict[str, int] = dict.fromkeys(
            ("accepted", "joined", "replaced", "refused", "shed", "lost", "frames"), 0
        )

    @property
    def feeds(self) -> frozenset[int]:
        """The stages with a live feed."""
        return frozenset(self._feeds)

    async def bind(self) -> int:
        """Listen on ``host`` (a free port); return the port."""
        if self._listener is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, 0))
                sock.listen(128)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            self._listener = sock
        return int(self._listener.getsockname()[1])

    async def run(self) -> None:
        """Serve until cancelled; every socket is closed on the way out."""
        await self.bind()
        listener = self._listener
        assert listener is not None
        loop = asyncio.get_running_loop()
        try:
            async with anyio.create_task_group() as tg:
                backoff = 0.0
                while True:
                    try:
                        sock, _ = await loop.sock_accept(listener)
                    except OSError as exc:  # EMFILE and friends: back off, never stop serving
                        backoff = min(1.0, max(0.01, 2 * backoff))
                        _log.warning("accept failed (%s): retrying in %.2fs", exc, backoff)
                        await anyio.sleep(backoff)
                        continue
                    backoff = 0.0
                    sock.setblocking(False)
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.stats["accepted"] += 1
                    tg.start_soon(self._accepted, _Raw(sock, loop))
        finally:
            self._listener = None
            listener.close()

    def _check(self, hello: StageHello) -> str | None:
        if hello.group != self.group:
            return f"wrong group {hello.group[:64]!r} (this hub serves {self.group!r})"
        if hello.stages != self.stages:
            return f"{hello.stages} stages announced, this hub has {self.stages}"
        if not 1 <= hello.stage < self.stages:
            return f"stage {hello.stage} is not in [1, {self.stages - 1}]"
        return None

    async def _accepted(self, conn: _Raw) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._pending[scope] = None
                if len(self._pending) > MAX_PENDING:  # Rule 3: shed the oldest handshake
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    oldest.cancel()
                    self.stats["shed"] += 1
                own = StageHello(0, self.stages, self.group, _nonce(self._secret))
                try:
                    with anyio.fail_after(self.hello_timeout_s):
                        hello, sealer, reader = await _handshake(
                            conn, self._codec, own, self._check
                        )
                except _PEER_ERRORS as exc:
                    self.stats["refused"] += 1
                    reason = (
                        f"no hello within {self.hello_timeout_s:g}s"
                        if isinstance(exc, TimeoutError)
                        else str(exc) or type(exc).__name__
                    )
                    _log.warning("PP stage feed refused: %s", reason)
                    return
                finally:
                    self._pending.pop(scope, None)
                await self._serve(hello.stage, conn, sealer, reader, scope)
        finally:
            conn.sock.close()

    async def _serve(
        self, stage: int, conn: _Raw, sealer: _Sealer, reader: FrameReader, scope: anyio.CancelScope
    ) -> None:
        old = self._feeds.get(stage)
        if old is not None:
            old.reason = "replaced by a new connection"
            old.scope.cancel()
            self.stats["replaced"] += 1
        feed = _Feed(stage, conn, sealer, scope)
        self._feeds[stage] = feed
        self.book.joined(stage)  # drops what the old connection reported (Rule 5)
        self.stats["joined"] += 1
        try:
            async with anyio.create_task_group() as tg:

                async def reading() -> None:
                    feed.reason = feed.reason or await self._read(feed, reader)
                    tg.cancel_scope.cancel()

                async def beating() -> None:
                    feed.reason = feed.reason or await self._beat(feed)
                    tg.cancel_scope.cancel()

                tg.start_soon(reading)
                tg.start_soon(beating)
        finally:
            if self._feeds.get(stage) is feed:  # not replaced: the stage is lost
                del self._feeds[stage]
                reason = feed.reason or "the hub stopped"
                self.book.lost(stage, reason)
                self.stats["lost"] += 1
                _log.warning("PP stage %d lost: %s", stage, reason)

    async def _read(self, feed: _Feed, reader: FrameReader) -> str:
        """Take the feed's frames until it ends; return why it ended."""
        book, stage = self.book, feed.stage
        items = reader.feed(b"")  # what came right after the key confirmation
        while True:
            for item in items:
                if isinstance(item, FrameError):
                    return f"bad frame: {item.reason}"
                feed.last_seen = anyio.current_time()
                self.stats["frames"] += 1
                if isinstance(item, StageStatus):
                    book.report(stage, item.room, item.status)
                elif isinstance(item, StageForget):
                    book.forget(stage, item.room)
                elif not isinstance(item, StageBeat):
                    return f"unexpected {type(item).__name__} after the handshake"
            left = feed.last_seen + self.silence_s - anyio.current_time()
            if left <= 0:
                return f"silent for {self.silence_s:g}s"
            data = b""
            with anyio.move_on_after(left):
                try:
                    data = await feed.conn.receive(_READ_BYTES)
                except _PEER_ERRORS as exc:
                    return f"connection closed ({exc or type(exc).__name__})"
            items = reader.feed(data) if data else []

    async def _beat(self, feed: _Feed) -> str:
        beat = StageBeat()
        while True:
            await anyio.sleep(self.heartbeat_s)
            try:
                with anyio.fail_after(self.silence_s):
                    await feed.conn.send(feed.sealer.encode(beat))
            except _PEER_ERRORS as exc:
                return f"cannot send ({exc or type(exc).__name__})"


class StageLink:
    """Stage k's end: keeps a connection to the hub and streams ``feed`` over it."""

    def __init__(
        self,
        feed: StageFeed,
        *,
        stage: int,
        stages: int,
        group: str,
        address: tuple[str, int],
        secret: bytes | None = None,
        heartbeat_s: float = 1.0,
        liveness_factor: float = 2.0,
        scan_interval_s: float = 0.002,
        idle_interval_s: float = 0.05,
        reconnect_max_s: float = 2.0,
    ) -> None:
        if not 1 <= stage < stages <= MAX_STAGES:
            raise ValueError(f"stage {stage} of {stages}: need 1 <= stage < stages")
        if heartbeat_s <= 0 or liveness_factor <= 1:
            raise ValueError("heartbeat_s must be > 0 and liveness_factor > 1")
        self.feed = feed
        self.stage = stage
        self.stages = stages
        self.group = group
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.silence_s = heartbeat_s * liveness_factor
        self.scan_interval_s = scan_interval_s
        self.idle_interval_s = idle_interval_s
        self.reconnect_max_s = reconnect_max_s
        self._codec = _Codec(secret)
        self._secret = secret
        self.connected = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("connects", "connect_failures", "frames", "beats", "losses"), 0
        )

    def _check(self, hello: StageHello) -> str | None:
        if hello.stage != 0 or hello.stages != self.stages or hello.group != self.group:
            return (
                f"the hub is stage {hello.stage} of {hello.stages} in group "
                f"{hello.group[:64]!r}, expected stage 0 of {self.stages} in {self.group!r}"
            )
        return None

    async def run(self) -> None:
        """Connect, stream, reconnect on loss, until cancelled."""
        backoff = 0.0
        while True:
            try:
                with anyio.fail_after(max(self.silence_s, 1.0)):
                    stream = await anyio.connect_tcp(*self.address)
            except _PEER_ERRORS as exc:
                self.stats["connect_failures"] += 1
                _log.debug("cannot reach the PP stage hub at %s: %s", self.address, exc)
            else:
                async with stream:
                    reason = await self._session(stream)
                self.connected = False
                self.stats["losses"] += 1
                _log.warning("PP stage %d: link to stage 0 lost: %s", self.stage, reason)
                backoff = 0.0
            # No link: drain track/untrack (the next snapshot resends everything anyway).
            self.feed.snapshot()
            backoff = min(self.reconnect_max_s, max(0.01, 2 * backoff))
            await anyio.sleep(backoff)

    async def _session(self, stream: SocketStream) -> str:
        own = StageHello(self.stage, self.stages, self.group, _nonce(self._secret))
        try:
            with anyio.fail_after(max(self.silence_s, 1.0)):
                _, sealer, reader = await _handshake(stream, self._codec, own, self._check)
        except _PEER_ERRORS as exc:
            return f"handshake failed: {exc or type(exc).__name__}"
        self.connected = True
        self.stats["connects"] += 1
        last_seen = anyio.current_time()
        reason = ""

        async def reading() -> None:
            nonlocal last_seen, reason
            items = reader.feed(b"")
            try:
                while True:
                    for item in items:
                        if isinstance(item, FrameError) or not isinstance(item, StageBeat):
                            reason = f"bad frame from the hub: {item}"
                            return
                        last_seen = anyio.current_time()
                    items = reader.feed(await stream.receive(_READ_BYTES))
            except _PEER_ERRORS as exc:
                reason = f"connection closed ({exc or type(exc).__name__})"
            finally:
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(reading)
            sent = anyio.current_time()
            frames = self.feed.snapshot()
            while True:
                now = anyio.current_time()
                if now - last_seen > self.silence_s:
                    reason = f"the hub was silent for {self.silence_s:g}s"
                    break
                if not frames and now - sent >= self.heartbeat_s:
                    frames = [StageBeat()]
                    self.stats["beats"] += 1
                if frames:
                    data = b"".join(sealer.encode(frame) for frame in frames)
                    try:
                        with anyio.fail_after(self.silence_s):
                            await stream.send(data)
                    except _PEER_ERRORS as exc:
                        reason = f"cannot send ({exc or type(exc).__name__})"
                        break
                    self.stats["frames"] += len(frames)
                    sent = now
                await anyio.sleep(self.idle_interval_s if self.feed.idle else self.scan_interval_s)
                frames = self.feed.scan()
            tg.cancel_scope.cancel()
        return reason or "closed"
