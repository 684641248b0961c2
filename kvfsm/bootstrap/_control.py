"""``ControlPlane``: the control channel between prefill and decode ranks, as a ``CommandSink``.

One TCP connection per (prefill rank, decode rank) pair, opened by decode, reused by every room of
the pair. Each connection starts with a ``Hello`` each way (protocol version, rank, NIXL agent
metadata and layout, incarnation) and then carries typed frames (:mod:`kvfsm.bootstrap._frames`):

    decode  -> prefill   RoomMetadata (where to write), RoomAbort
    prefill -> decode    RoomOutcome (Success / Failed), RoomAbort, RoomSettled (abort ack)
    both ways            Heartbeat, Error

Rules:

* Frames become room events; nothing here writes a room's state (law 2). A frame is routed by
  (role, room id) to the current room, and a frame that names an older generation than the
  room's peer knows is dropped (law 5).
* Liveness: both sides send a heartbeat every ``heartbeat_s``; any frame counts as a sign of
  life. A peer silent for ``liveness_factor * heartbeat_s`` is lost: the connection is closed
  and every live room bound to it gets ``PeerLost`` (law 3: detection within 2x the interval by
  default). A closed or reset socket is the same, only faster.
* Bad input fails at most the room it names (law 7): a frame that cannot be decoded but names a
  room fails that room; a fatal error (bad MAC, oversized frame, wrong version) drops the
  connection, which is peer loss for its rooms. Nothing raises into the engine.
* Decode may send a room's metadata before prefill has created that room (SGLang does). Such
  metadata is held, bounded in count and time, and delivered when the sender room appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec
from anyio.abc import SocketStream

from kvfsm.bootstrap._frames import (
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameCodec,
    FrameError,
    FrameReader,
    Heartbeat,
    Hello,
    RoomAbort,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    check_hello,
)
from kvfsm.rooms._actor import Inbox, RoomKey
from kvfsm.rooms._registry import Registry
from kvfsm.states import (
    AbortRequested,
    Command,
    DestinationReceived,
    EventRejected,
    KVPoll,
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
    TransferConfirmed,
)
from kvfsm.transport._agent import Agent
from kvfsm.transport._layout import LayoutSummary
from kvfsm.transport._transport import NixlTransport

__all__ = ["ChannelConfig", "ControlPlane", "Resolver"]

_log = logging.getLogger("kvfsm.control")

#: Finds a prefill rank's control address: ``await resolve(peer) -> (host, port)``. ``peer`` is
#: what a receiver room's ``init(peer)`` named, normally the prefill rank. Where peer ids are not
#: ranks (one decode reading from several prefill instances, each with its own rank 0: the SGLang
#: adapter), the resolver returns ``(host, port, rank)`` and the Hello must carry that rank.
Resolver = Callable[[int], Awaitable[tuple[str, int] | tuple[str, int, int]]]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Control channel settings. The defaults bind to loopback only: a deployment across hosts
    sets ``host`` to the interface its peers reach, and should set ``secret``."""

    host: str = "127.0.0.1"
    port: int = 0  # prefill's listening port; 0 picks a free one (see ControlPlane.port)
    heartbeat_s: float = 1.0
    liveness_factor: float = 2.0
    connect_timeout_s: float = 5.0
    #: Longest wait between two connection attempts to an unreachable rank.
    reconnect_max_s: float = 2.0
    #: Shared secret: every frame is HMAC-signed and checked. None: no authentication.
    secret: bytes | None = None
    #: Metadata frames held for rooms that do not exist yet, at most this many, this long.
    pending_max: int = 4096
    pending_ttl_s: float = 60.0
    #: The decode side progresses its NIXL agent this often (the writer's flushes need it).
    progress_interval_s: float = 0.0005
    #: Decode: after a link to a prefill rank is lost, how long its rooms' pages stay unsettled
    #: (law 4). The lost prefill may still be alive (a partition): it notices within its
    #: liveness window, fails those rooms and releases their transfers, and a transfer that
    #: cannot be released ends at its chunk deadline and quarantine. Keep this above
    #: prefill's ``silence_s + TransferConfig.deadline_s(largest chunk) + quarantine_s``.
    peer_lost_grace_s: float = 20.0
    #: How long shutdown waits for frames already queued (outcomes, settle acks) to go out.
    flush_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0 and self.liveness_factor >= 1.0):
            raise ValueError("heartbeat_s must be > 0 and liveness_factor >= 1")
        if self.peer_lost_grace_s < 0 or self.flush_timeout_s < 0:
            raise ValueError("peer_lost_grace_s and flush_timeout_s must be >= 0")

    @property
    def silence_s(self) -> float:
        return self.heartbeat_s * self.liveness_factor


class _Link:
    """One live connection after the Hello exchange (loop side)."""

    __slots__ = ("closed", "generation", "hello", "key", "last_seen", "outbox", "peer_id", "rooms")

    def __init__(self, hello: Hello, generation: int, peer_id: str, now: float) -> None:
        self.key: int | str = peer_id
        self.hello = hello
        self.generation = generation
        self.peer_id = peer_id
        self.last_seen = now
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.rooms: set[RoomKey] = set()
        self.closed = False


class ControlPlane:
    """The control channel for one engine of one role, plus the NIXL data path on prefill.

    Prefill: ``ControlPlane("prefill", rank, agent, transport=NixlTransport(agent))``; it listens
    on ``config.host:config.port`` (:attr:`port` once started). Decode:
    ``ControlPlane("decode", rank, agent, resolver=...)``; a receiver room's ``init(peer_rank)``
    resolves and connects that prefill rank (once per rank; the link is reused).
    """

    def __init__(
        self,
        role: Literal["prefill", "decode"],
        rank: int,
        agent: Agent,
        *,
        transport: NixlTransport | None = None,
        resolver: Resolver | None = None,
        config: ChannelConfig | None = None,
    ) -> None:
        if role == "prefill" and transport is None:
            raise ValueError("a prefill control plane needs its NixlTransport")
        if role == "decode" and resolver is None:
            raise ValueError("a decode control plane needs a resolver for prefill ranks")
        self.role = role
        self.rank = rank
        self.agent = agent
        self.transport = transport
        self.config = config if config is not None else ChannelConfig()
        self.incarnation = secrets.randbits(62)
        self._resolver = resolver
        self._codec = FrameCodec(self.config.secret)
        self._registry: Registry | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._tg: Any = None
        self._started: asyncio.Future[None] | None = None
        self._port = 0
        self._generations = itertools.count(1)
        # Decode keys its links by peer id as rooms name it, normally the prefill rank (one link
        # per rank it reads from). Prefill keys
        # them by peer id (role, rank, incarnation): several decode instances may each have a
        # rank 0, and a restarted decode rank must not take over its predecessor's link.
        self._links: dict[int | str, _Link] = {}
        self._connecting: dict[int, asyncio.Future[_Link]] = {}
        self._backoff: dict[int, float] = {}  # by peer rank: the last backoff step
        self._backoff_until: dict[int, float] = {}
        self._room_link: dict[RoomKey, _Link] = {}
        # A sender room knows only its own generation; decode's room generation, from its
        # metadata, is echoed in every frame about that room.
        self._decode_gen: dict[RoomKey, int] = {}
        self._pending: dict[int, tuple[float, _Link, RoomMetadata]] = {}
        # Sender rooms that failed before decode's page list arrived: (when, reason).
        self._tombstones: dict[int, tuple[float, str]] = {}
        # Rooms decode aborted before prefill created them: (when, reason).
        self._aborted_early: dict[int, tuple[float, str]] = {}
        self.stats: dict[str, int] = {
            "frames_in": 0,
            "frames_out": 0,
            "frames_rejected": 0,
            "links_opened": 0,
            "links_lost": 0,
            "pending_dropped": 0,
            "duplicates_refused": 0,
        }

    # -- CommandSink ---------------------------------------------------------------------------

    def attach(self, inbox: Inbox) -> None:
        if not isinstance(inbox, Registry):
            raise TypeError("ControlPlane routes by room id: it needs the engine's Registry")
        self._registry = inbox
        self._loop = asyncio.get_running_loop()
        if self.transport is not None:
            self.transport.attach(inbox)
        started: asyncio.Future[None] = self._loop.create_future()
        self._main = self._loop.create_task(self._run(started), name=f"kvfsm-control-{self.role}")
        self._started = started

    async def started(self) -> None:
        """Wait until the listener (prefill) and background tasks run."""
        if self._started is None:
            raise RuntimeError("control plane not attached")
        await asyncio.shield(self._started)

    @property
    def port(self) -> int:
        return self._port

    def submit(self, key: RoomKey, command: Command) -> None:
        if isinstance(command, (PostChunk, ReleaseHandles)):
            assert self.transport is not None
            self.transport.submit(key, command)
        elif isinstance(command, ResolvePeer):
            self._spawn(self._resolve(key, command.peer_rank))
        elif isinstance(command, SendMetadata):
            self._send_for(
                key,
                RoomMetadata(
                    key.room, key.generation, command.pages, command.aux_index, command.state
                ),
            )
        elif isinstance(command, ReportOutcome):
            self._report(key, command)
        elif isinstance(command, ReportSettled):
            link = self._room_link.get(key)
            if link is not None:
                self._send(link, RoomSettled(key.room, self._peer_generation(key)))
            self._unbind(key)
        else:  # pragma: no cover - a new command type must be wired here
            raise TypeError(f"unknown command {command!r}")

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        """Registry hook: deliver metadata that arrived before this sender room existed."""
        if role is Role.SENDER:
            self._tombstones.pop(key.room, None)  # a new room reuses the id
            aborted = self._aborted_early.pop(key.room, None)
            if aborted is not None:
                self._deliver(key, AbortRequested(aborted[1], origin="peer"))
                return
        held = self._pending.pop(key.room, None)
        if held is None or role is not Role.SENDER:
            return
        _, link, frame = held
        if not link.closed:
            self._bind_sender(key, link, frame)

    # -- outgoing ------------------------------------------------------------------------------

    def _report(self, key: RoomKey, command: ReportOutcome) -> None:
        link = self._room_link.get(key)
        if link is None:
            if self.role == "prefill" and command.status is KVPoll.Failed:
                # Failed before decode's page list came: answer that list when it comes.
                if len(self._tombstones) >= self.config.pending_max:
                    del self._tombstones[next(iter(self._tombstones))]  # the oldest
                self._tombstones[key.room] = (self._running_loop().time(), command.reason)
                self._pending.pop(key.room, None)
            return
        if self.role == "prefill":
            frame: Frame = RoomOutcome(
                key.room, self._peer_generation(key), int(command.status), command.reason
            )
            if command.status is KVPoll.Success:
                self._unbind(key)
        else:
            frame = RoomAbort(key.room, key.generation, command.reason or "aborted")
        self._send(link, frame)

    def _send_for(self, key: RoomKey, frame: Frame) -> None:
        link = self._room_link.get(key)
        if link is not None:
            self._send(link, frame)

    def _send(self, link: _Link, frame: Frame) -> None:
        if link.closed:
            return
        link.outbox.put_nowait(self._codec.encode(frame))
        self.stats["frames_out"] += 1

    def _peer_generation(self, key: RoomKey) -> int:
        return self._decode_gen.get(key, 0)

    # -- decode: resolving and connecting a prefill rank ------------------------------------

    async def _resolve(self, key: RoomKey, peer_rank: int) -> None:
        try:
            link = await self._link_to(peer_rank)
        except Exception as exc:
            self._deliver(key, PeerLost(f"cannot reach prefill rank {peer_rank}: {exc}"))
            return
        registry = self._registry
        assert registry is not None
        if registry.get(key) is None:
            return  # the room ended while its peer was being resolved: nothing to bind
        self._room_link[key] = link
        link.rooms.add(key)
        self._deliver(key, PeerResolved(peer_rank))

    async def _link_to(self, peer_rank: int) -> _Link:
        link = self._links.get(peer_rank)
        if link is not None and not link.closed:
            return link
        pending = self._connecting.get(peer_rank)
        if pending is not None:
            return await asyncio.shield(pending)
        loop = self._running_loop()
        future: asyncio.Future[_Link] = loop.create_future()
        self._connecting[peer_rank] = future
        try:
            # After a failed attempt, wait out a backoff (doubling to reconnect_max_s) before
            # the next one, so rooms aimed at a dead rank do not hammer its address. The
            # waiting room's own deadline still bounds it.
            delay = self._backoff_until.get(peer_rank, 0.0) - loop.time()
            if delay > 0:
                await anyio.sleep(delay)
            assert self._resolver is not None
            address = await self._resolver(peer_rank)
            host, port = address[0], address[1]
            expect_rank = address[2] if len(address) == 3 else peer_rank
            with anyio.fail_after(self.config.connect_timeout_s):
                stream = await anyio.connect_tcp(host, port)
            link = await self._handshake(stream, expect_rank=expect_rank, key=peer_rank)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                step = min(self.config.reconnect_max_s, 2 * self._backoff.get(peer_rank, 0.05))
                self._backoff[peer_rank] = step
                self._backoff_until[peer_rank] = loop.time() + step
                future.set_exception(exc)
                future.exception()
            raise
        finally:
            del self._connecting[peer_rank]
        self._backoff.pop(peer_rank, None)
        self._backoff_until.pop(peer_rank, None)
        future.set_result(link)
        return link

    # -- both sides: a connection's life -------------------------------------------------------

    async def _run(self, started: asyncio.Future[None]) -> None:
        listener: Any = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.role == "prefill":
                    listener = await anyio.create_tcp_listener(
                        local_host=self.config.host, local_port=self.config.port
                    )
                    self._port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
                    tg.start_soon(listener.serve, self._accepted)
                else:
                    tg.start_soon(self._progress)
                tg.start_soon(self._watchdog)
                started.set_result(None)
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise
        finally:
            if listener is not None:
                with anyio.CancelScope(shield=True):
                    await listener.aclose()

    def _spawn(self, coro: Awaitable[None]) -> None:
        tg = self._tg
        if tg is None:
            raise RuntimeError("control plane not started")

        async def run() -> None:
            await coro

        tg.start_soon(run)

    async def _accepted(self, stream: SocketStream) -> None:
        with contextlib.suppress(Exception):
            await self._handshake(stream, expect_rank=None, key=None)

    async def _handshake(
        self, stream: SocketStream, expect_rank: int | None, key: int | None
    ) -> _Link:
        """Exchange Hellos, register the link, and run its reader and writer in the group."""
        reader = FrameReader(self._codec)
        hello = Hello(
            PROTOCOL_VERSION,
            self.role,
            self.rank,
            self.agent.name,
            self.agent.metadata() if self.role == "decode" else b"",
            msgspec.msgpack.encode(self.agent.layout.summary()) if self.role == "decode" else b"",
            self.incarnation,
        )
        try:
            await stream.send(self._codec.encode(hello))
            with anyio.fail_after(self.config.connect_timeout_s):
                theirs, early = await self._first_frame(stream, reader)
            check_hello(theirs)
            if expect_rank is not None and theirs.rank != expect_rank:
                raise FrameError(
                    f"expected prefill rank {expect_rank}, got {theirs.rank}", None, True
                )
            peer_id = f"{theirs.role}-{theirs.rank}-{theirs.incarnation}"
            if self.role == "prefill":
                summary = msgspec.msgpack.decode(theirs.layout, type=LayoutSummary)
                assert self.transport is not None
                await self.transport.connect_peer(peer_id, theirs.agent_metadata, summary)
        except BaseException:
            await stream.aclose()
            raise
        loop = self._running_loop()
        link = _Link(theirs, next(self._generations), peer_id, loop.time())
        # Decode: the peer id its rooms named (the link is reused by every room naming it).
        link_key: int | str = key if key is not None else peer_id
        link.key = link_key
        old = self._links.get(link_key)
        if old is not None:
            self._lose(old, "replaced by a new connection")
        self._links[link_key] = link
        self.stats["links_opened"] += 1
        assert self._tg is not None
        if early and not self._take(link, early):
            self._lose(link, f"connection to {link.peer_id} closed: fatal frame after Hello")
            await stream.aclose()
            return link
        self._tg.start_soon(self._read, link, stream, reader)
        self._tg.start_soon(self._write, link, stream)
        return link

    async def _first_frame(
        self, stream: SocketStream, reader: FrameReader
    ) -> tuple[Hello, list[Frame | FrameError]]:
        """The peer's Hello, and whatever frames came in the same read after it: the peer may
        send its first room frames as soon as it has our Hello, and a slow handshake here (a
        NIXL connect, a loaded machine) lets them arrive in one segment with its Hello."""
        while True:
            data = await stream.receive()
            items = reader.feed(data)
            if not items:
                continue
            first = items[0]
            if isinstance(first, FrameError):
                raise first
            if not isinstance(first, Hello):
                raise FrameError(f"expected Hello, got {type(first).__name__}", None, True)
            return first, items[1:]

    def _take(self, link: _Link, items: list[Frame | FrameError]) -> bool:
        """Handle decoded frames in order; False after a fatal error (the link must go)."""
        for item in items:
            if isinstance(item, FrameError):
                self._rejected(link, item)
                if item.fatal:
                    return False
            else:
                self.stats["frames_in"] += 1
                self._on_frame(link, item)
        return True

    async def _read(self, link: _Link, stream: SocketStream, reader: FrameReader) -> None:
        loop = self._running_loop()
        try:
            while not link.closed:
                data = await stream.receive()
                link.last_seen = loop.time()
                items = reader.feed(data)
                if not self._take(link, items):
                    raise next(i for i in items if isinstance(i, FrameError) and i.fatal)
        except (
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            OSError,
            FrameError,
        ) as exc:
            self._lose(link, f"connection to {link.peer_id} closed: {exc or type(exc).__name__}")
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _write(self, link: _Link, stream: SocketStream) -> None:
        beat = itertools.count()
        try:
            while not link.closed:
                try:
                    with anyio.fail_after(self.config.heartbeat_s):
                        data = await link.outbox.get()
                except TimeoutError:
                    data = self._codec.encode(Heartbeat(next(beat)))
                await stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._lose(link, f"connection to {link.peer_id} broken: {exc or type(exc).__name__}")
        finally:
            # A lost link closes its socket: the peer sees the loss at once, and the reader
            # blocked in receive() wakes up and ends.
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _watchdog(self) -> None:
        loop = self._running_loop()
        tick = self.config.heartbeat_s / 10
        # Declared lost one tick early, so detection never takes longer than silence_s.
        limit = self.config.silence_s - tick
        while True:
            await anyio.sleep(tick)
            now = loop.time()
            for link in list(self._links.values()):
                if now - link.last_seen > limit:
                    self._lose(
                        link, f"{link.peer_id} silent for more than {self.config.silence_s:g}s"
                    )
            self._expire_pending(now)

    async def _progress(self) -> None:
        # Decode is a WRITE target; with progress threads off its UCX worker only advances when
        # polled, and the writer's completion flushes wait for it.
        progress = self.agent.nixl.get_new_notifs
        busy, idle = self.config.progress_interval_s, max(self.config.progress_interval_s, 0.05)
        while True:
            progress()
            # Fast only while some room expects writes; an idle decode rank costs ~nothing.
            await anyio.sleep(busy if self._room_link else idle)

    def _lose(self, link: _Link, reason: str) -> None:
        if link.closed:
            return
        link.closed = True
        self.stats["links_lost"] += 1
        if self._links.get(link.key) is link:
            del self._links[link.key]
        _log.warning("control link lost: %s", reason)
        lost = list(link.rooms)
        for key in lost:
            self._room_link.pop(key, None)
            self._decode_gen.pop(key, None)
            self._deliver(key, PeerLost(reason))
        link.rooms.clear()
        link.outbox.put_nowait(b"")  # wake the writer so it notices
        if self.role == "decode" and lost:
            # No acknowledgement can come over a lost link. Once the lost rank can no longer
            # be writing (peer_lost_grace_s), the rooms' pages are settled; a room that heard
            # the real acknowledgement first, or is gone, drops this as a late event.
            self._running_loop().call_later(
                self.config.peer_lost_grace_s, self._settle_lost, lost, link.hello.rank
            )

    def _settle_lost(self, keys: list[RoomKey], rank: int) -> None:
        registry = self._registry
        if registry is None:
            return
        for key in keys:
            registry.deliver(key, PeerSettled(rank))

    # -- incoming frames -----------------------------------------------------------------------

    def _on_frame(self, link: _Link, frame: Frame) -> None:
        if isinstance(frame, Heartbeat):
            return
        registry = self._registry
        assert registry is not None
        if isinstance(frame, RoomMetadata):
            key = registry.current(Role.SENDER, frame.room)
            tombstone = self._tombstones.pop(frame.room, None)
            if key is not None and key in self._room_link:
                if self._room_link[key] is link and self._decode_gen.get(key) == frame.generation:
                    # The same page list again (a retransmission): the room is bound already.
                    # Refusing it as a duplicate would tell decode its pages are settled while
                    # this room still writes into them.
                    registry.stats.stale_events += 1
                    return
                # The room already has a receiver: a second decode room with the same id (ids
                # come from clients and can collide). Refuse the newcomer, keep the bound one.
                self._refuse_duplicate(link, frame)
            elif key is not None:
                self._bind_sender(key, link, frame)
            elif tombstone is not None:
                # The sender already failed; nothing was ever posted to these pages.
                self._send(
                    link,
                    RoomOutcome(frame.room, frame.generation, int(KVPoll.Failed), tombstone[1]),
                )
                self._send(link, RoomSettled(frame.room, frame.generation))
            else:
                self._hold(link, frame)
        elif isinstance(frame, RoomAbort):
            role = Role.SENDER if self.role == "prefill" else Role.RECEIVER
            key = registry.current(role, frame.room)
            if key is not None:
                self._deliver(key, AbortRequested(frame.reason, origin="peer"))
            elif self.role == "prefill":
                # Decode gave up on a room prefill has not created yet: nothing was written
                # to its pages (acknowledge now), and the room, if it comes, fails at once.
                self._pending.pop(frame.room, None)
                self._aborted_early[frame.room] = (self._running_loop().time(), frame.reason)
                self._send(link, RoomSettled(frame.room, frame.generation))
        elif isinstance(frame, (RoomOutcome, RoomSettled)):
            key = registry.current(Role.RECEIVER, frame.room)
            if key is None or key.generation != frame.generation:
                registry.stats.stale_events += 1
                return
            if isinstance(frame, RoomSettled):
                self._deliver(key, PeerSettled(link.hello.rank))
                self._unbind(key)
            elif frame.status == KVPoll.Success:
                self._deliver(key, TransferConfirmed(link.hello.rank))
                self._unbind(key)
            else:
                self._deliver(key, PeerFailed(frame.reason))
        elif isinstance(frame, Error):
            _log.warning("peer %s reported: %s", link.peer_id, frame.reason)

    def _bind_sender(self, key: RoomKey, link: _Link, frame: RoomMetadata) -> None:
        self._room_link[key] = link
        self._decode_gen[key] = frame.generation
        link.rooms.add(key)
        self._deliver(
            key, DestinationReceived(frame.pages, frame.aux_index, link.peer_id, frame.state)
        )

    def _unbind(self, key: RoomKey) -> None:
        self._decode_gen.pop(key, None)
        link = self._room_link.pop(key, None)
        if link is not None:
            link.rooms.discard(key)

    def _refuse_duplicate(self, link: _Link, frame: RoomMetadata) -> None:
        self.stats["duplicates_refused"] += 1
        reason = f"duplicate room id {frame.room}: prefill already serves another receiver"
        self._send(link, RoomOutcome(frame.room, frame.generation, int(KVPoll.Failed), reason))
        self._send(link, RoomSettled(frame.room, frame.generation))  # nothing was written

    def _hold(self, link: _Link, frame: RoomMetadata) -> None:
        held = self._pending.get(frame.room)
        if held is not None and (held[1] is not link or held[2].generation != frame.generation):
            self._refuse_duplicate(link, frame)
            return
        if len(self._pending) >= self.config.pending_max:
            self.stats["pending_dropped"] += 1
            self._send(
                link,
                RoomOutcome(
                    frame.room,
                    frame.generation,
                    int(KVPoll.Failed),
                    "prefill holds too many rooms' metadata",
                ),
            )
            self._send(link, RoomSettled(frame.room, frame.generation))  # nothing was written
            return
        self._pending[frame.room] = (self._running_loop().time(), link, frame)

    def _expire_pending(self, now: float) -> None:
        ttl = self.config.pending_ttl_s
        for marks in (self._tombstones, self._aborted_early):
            for room, (since, _) in list(marks.items()):
                if now - since > ttl:
                    del marks[room]
        for room, (since, link, frame) in list(self._pending.items()):
            if now - since > ttl:
                del self._pending[room]
                self.stats["pending_dropped"] += 1
                self._send(
                    link,
                    RoomOutcome(
                        room,
                        frame.generation,
                        int(KVPoll.Failed),
                        f"no prefill room {room} within {ttl:g}s",
                    ),
                )
                # Nothing was written into its pages: without this the receiver, failed by its
                # peer, would wait for an acknowledgement that never comes.
                self._send(link, RoomSettled(room, frame.generation))

    def _rejected(self, link: _Link, error: FrameError) -> None:
        self.stats["frames_rejected"] += 1
        _log.warning("frame from %s rejected: %s", link.peer_id, error.reason)
        if error.room is not None:
            registry = self._registry
            assert registry is not None
            for role in (Role.SENDER, Role.RECEIVER):
                key = registry.current(role, error.room)
                if key is None or self._room_link.get(key) is not link:
                    continue
                # Only the room the frame was about: not a newer room that reuses the id.
                ours = key.generation if role is Role.RECEIVER else self._peer_generation(key)
                if error.generation is None or error.generation == ours:
                    self._deliver(key, EventRejected(f"bad frame: {error.reason}"))
        if not error.fatal and error.tag != "Error":  # never answer an Error with an Error
            self._send(link, Error(error.room, error.reason[:1024]))

    def _deliver(self, key: RoomKey, event: Any) -> None:
        registry = self._registry
        assert registry is not None
        registry.deliver(key, event)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("control plane not attached")
        return self._loop

    async def drop_links(self, reason: str) -> None:
        """Close every link at once, as a crash or a cut cable would (tests, operators)."""
        for link in list(self._links.values()):
            self._lose(link, reason)

    async def aclose(self) -> None:
        """Engine shutdown hook: let queued frames go out (the rooms' last outcomes and settle
        acknowledgements, which spare the peer its grace period), then close links and stop
        background tasks."""
        loop = self._running_loop()
        give_up = loop.time() + self.config.flush_timeout_s
        # Polled: the queues have no "drained" event, and this runs once per engine lifetime.
        while loop.time() < give_up and any(  # noqa: ASYNC110
            not link.closed and not link.outbox.empty() for link in self._links.values()
        ):
            await anyio.sleep(0.005)
        for link in list(self._links.values()):
            self._lose(link, "engine shutting down")
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
        if self.transport is not None:
            await self.transport.aclose()
