"""The connections of the PP status consensus channel: ``StageHub`` on stage 0 accepts one feed
per later stage and writes what they report into its ``StageBook``; ``StageLink`` on stage k
keeps a connection to the hub and streams its ``StageFeed`` over it. The rules (consensus,
bounds, hostile input, liveness, the wire) are :mod:`kvfsm.control._stages`; the raw stream,
accept loop, handshake and heartbeats are the ones every listener uses (:mod:`kvfsm.link`)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable
from typing import Final, Literal

import anyio
from anyio.abc import SocketStream

from kvfsm.control._channel import PEER_ERRORS, Sealer
from kvfsm.control._codec import FrameReader
from kvfsm.control._frames import NONCE_BYTES, Frame, FrameError
from kvfsm.control._stages import (
    MAX_PENDING,
    MAX_STAGES,
    StageBeat,
    StageBook,
    StageFeed,
    StageForget,
    StageHello,
    StageStatus,
    _Codec,
)
from kvfsm.link import (
    AcceptErrors,
    Liveness,
    RawConnection,
    accept_forever,
    describe,
    next_frame,
    send_or_beat,
    shake_hands,
    tune,
)

__all__ = ["StageHub", "StageLink"]

_READ_BYTES: Final = 4096

_log = logging.getLogger("kvfsm.stages")


async def _handshake(
    conn: SocketStream | RawConnection,
    codec: _Codec,
    own: StageHello,
    refusal: Callable[[StageHello], str | None],
) -> tuple[StageHello, Sealer, FrameReader]:
    """Send ``own``, read and check the peer's hello (``refusal``: a reason, or None), and with
    a secret switch to session keys and exchange one sealed ``StageBeat`` (key confirmation).
    Returns the peer's hello, this connection's sealer and its reader. Every error is fatal."""
    reader = FrameReader(codec)
    sealer: Sealer = codec

    def check(item: Frame | FrameError) -> None:
        if isinstance(item, FrameError):
            raise item
        if not isinstance(item, StageHello):
            raise FrameError(f"expected StageHello, got {type(item).__name__}", None, True)
        reason = refusal(item)
        if reason is not None:
            raise FrameError(reason, None, True)

    def session(item: Frame | FrameError) -> bytes | None:
        nonlocal sealer
        assert isinstance(item, StageHello)
        if codec.secret is None:
            return None
        if len(item.nonce) != NONCE_BYTES:
            raise FrameError(f"nonce of {len(item.nonce)} bytes, not {NONCE_BYTES}", None, True)
        # The hub plays "prefill", the feed "decode": one key per direction.
        role: Literal["prefill", "decode"] = "prefill" if own.stage == 0 else "decode"
        reader.codec = sealer = codec.session(role, own.nonce, item.nonce)
        return sealer.encode(StageBeat())

    def confirmed(item: Frame | FrameError) -> None:
        if isinstance(item, FrameError):
            raise item
        if not isinstance(item, StageBeat):
            raise FrameError("expected StageBeat (key confirmation)", None, True)

    theirs = await shake_hands(
        conn, reader, codec.encode(own), check=check, session=session, confirmed=confirmed
    )
    assert isinstance(theirs, StageHello)
    return theirs, sealer, reader


def _nonce(secret: bytes | None) -> bytes:
    return b"" if secret is None else secrets.token_bytes(NONCE_BYTES)


class _Feed:
    __slots__ = ("conn", "liveness", "reason", "scope", "sealer", "stage")

    def __init__(
        self,
        stage: int,
        conn: RawConnection,
        sealer: Sealer,
        scope: anyio.CancelScope,
        silence_s: float,
    ) -> None:
        self.stage = stage
        self.conn = conn
        self.sealer = sealer
        self.scope = scope
        self.liveness = Liveness(anyio.current_time(), silence_s)
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
        self._accept_errors = AcceptErrors(_log, "PP stage hub", stats=self.stats)

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

                async def accepted(sock: socket.socket) -> None:
                    tune(sock)
                    self.stats["accepted"] += 1
                    tg.start_soon(self._accepted, RawConnection(sock, loop))

                await accept_forever(listener, accepted, self._accept_errors, backoff_max_s=1.0)
        finally:
            self._accept_errors.close()
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

    async def _accepted(self, conn: RawConnection) -> None:
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
                except PEER_ERRORS as exc:
                    self.stats["refused"] += 1
                    reason = (
                        f"no hello within {self.hello_timeout_s:g}s"
                        if isinstance(exc, TimeoutError)
                        else describe(exc)
                    )
                    _log.warning("PP stage feed refused: %s", reason)
                    return
                finally:
                    self._pending.pop(scope, None)
                await self._serve(hello.stage, conn, sealer, reader, scope)
        finally:
            conn.sock.close()

    async def _serve(
        self,
        stage: int,
        conn: RawConnection,
        sealer: Sealer,
        reader: FrameReader,
        scope: anyio.CancelScope,
    ) -> None:
        old = self._feeds.get(stage)
        if old is not None:
            old.reason = "replaced by a new connection"
            old.scope.cancel()
            self.stats["replaced"] += 1
        feed = _Feed(stage, conn, sealer, scope, self.silence_s)
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
                feed.liveness.seen(anyio.current_time())
                self.stats["frames"] += 1
                if isinstance(item, StageStatus):
                    book.report(stage, item.room, item.status)
                elif isinstance(item, StageForget):
                    book.forget(stage, item.room)
                elif not isinstance(item, StageBeat):
                    return f"unexpected {type(item).__name__} after the handshake"
            left = feed.liveness.left(anyio.current_time())
            if left <= 0:
                return f"silent for {self.silence_s:g}s"
            data = b""
            with anyio.move_on_after(left):
                try:
                    data = await feed.conn.receive(_READ_BYTES)
                except PEER_ERRORS as exc:
                    return f"connection closed ({describe(exc)})"
            items = reader.feed(data) if data else []

    async def _beat(self, feed: _Feed) -> str:
        """The hub sends nothing but heartbeats."""
        sealer = feed.sealer

        async def send(payload: bytes) -> None:
            with anyio.fail_after(self.silence_s):
                await feed.conn.send(payload)

        nothing: asyncio.Queue[bytes] = asyncio.Queue()  # the hub has nothing else to say
        try:
            await send_or_beat(
                send, nothing.get, self.heartbeat_s, lambda: sealer.encode(StageBeat())
            )
        except PEER_ERRORS as exc:
            return f"cannot send ({describe(exc)})"
        return "closed"  # pragma: no cover - send_or_beat returns only once closed


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
            except PEER_ERRORS as exc:
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
        except PEER_ERRORS as exc:
            return f"handshake failed: {describe(exc)}"
        self.connected = True
        self.stats["connects"] += 1
        hub = Liveness(anyio.current_time(), self.silence_s)
        reason = ""

        async def reading() -> None:
            nonlocal reason
            try:
                while True:
                    item = await next_frame(stream, reader)
                    if isinstance(item, FrameError) or not isinstance(item, StageBeat):
                        reason = f"bad frame from the hub: {item}"
                        return
                    hub.seen(anyio.current_time())
            except PEER_ERRORS as exc:
                reason = f"connection closed ({describe(exc)})"
            finally:
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(reading)
            sent = anyio.current_time()
            frames = self.feed.snapshot()
            while True:
                now = anyio.current_time()
                if hub.overdue(now):
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
                    except PEER_ERRORS as exc:
                        reason = f"cannot send ({describe(exc)})"
                        break
                    self.stats["frames"] += len(frames)
                    sent = now
                await anyio.sleep(self.idle_interval_s if self.feed.idle else self.scan_interval_s)
                frames = self.feed.scan()
            tg.cancel_scope.cancel()
        return reason or "closed"
