"""``ControlPlane``: the control channel between prefill and decode ranks, as a ``CommandSink``.
This module is what both ends share; :class:`~kvfsm.control.PrefillControl` (it listens) and
:class:`~kvfsm.control.DecodeControl` (it connects) are the two ends.

It executes the rooms' control commands (``ResolvePeer``, ``SendMetadata``, ``ReportOutcome``,
``ReportSettled``); the data path's commands go to the transport, side by side with it behind a
rank's router (``kvfsm.manager.CommandRouter``), and neither passes commands to the other. The
transport is still used here for what the handshake and the fence need of it: connecting a
peer's agent and granting write leases. Progressing decode's agent is the transport package's
(``kvfsm.transport.AgentProgress``), told by :attr:`ControlPlane.expecting_writes` when to hurry.

One TCP connection per (prefill rank, decode rank) pair, opened by decode, reused by every room of
the pair. Each connection starts with a ``Hello`` each way (protocol version, rank, NIXL agent
metadata and layout, incarnation) and then carries typed frames (:mod:`kvfsm.control._frames`):

    decode  -> prefill   RoomClaim, RoomMetadata (where to write), RoomAbort, LeaseGrant,
                         Reconcile
    prefill -> decode    RoomOutcome (Success / Failed), RoomSettled (abort ack), LeaseRequest
    both ways            Heartbeat, Error

Each end is the IO around a sans-IO core: every rule about which room a frame belongs to, what
the peer must be told and when a lost link's pages settle lives in
:mod:`kvfsm.control._routing` (``PrefillRouting``, ``DecodeRouting``); here are sockets, the
handshake, heartbeats, the clock and the execution of the cores' actions. What each end does with
a command or a frame is a table (``COMMANDS``, ``FRAMES``) on its class.

Rules kept here:

* Frames become room events; nothing here writes a room's state (law 2).
* Liveness: both sides send a heartbeat every ``heartbeat_s``; any frame counts as a sign of
  life. A peer silent for ``liveness_factor * heartbeat_s`` is lost: the connection is closed
  and every room bound to it gets ``PeerLost`` (law 3: detection within 2x the interval by
  default). A closed or reset socket is the same, only faster. Heartbeats and the lease
  exchange also measure the link's round trip (``Link.round_trip``,
  :mod:`kvfsm.control._round_trip`).
* Fencing (law 4): prefill writes into a decode link's pages only under a lease that link
  granted (``LeaseRequest`` / ``LeaseGrant``, see the cores); the transport checks it right
  before each post. A lost link's lease is revoked at once.
* Bad input fails at most the room it names (law 7): a frame that cannot be decoded but names a
  room fails that room; a fatal error (bad MAC, oversized frame, wrong version) drops the
  connection, which is peer loss for its rooms. A frame that cannot be *encoded* (a page list
  over the frame limit) fails the room it is about. Nothing raises into the engine.
* A handshake the local NIXL refuses (``add_remote_agent``) is answered with an ``Error`` frame
  naming NIXL's error before the connection closes, so the peer's rooms fail with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal, Protocol

import anyio
from anyio.abc import SocketStream

from kvfsm._tasks import cancel_and_wait
from kvfsm.control._channel import ChannelConfig, Link, Sealer
from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._fingerprint import Fingerprint, mismatch
from kvfsm.control._frames import (
    NONCE_BYTES,
    Error,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    check_hello,
    clip_reason,
)
from kvfsm.control._routing import Action, Deliver, GrantLease, RevokeLease, Send
from kvfsm.link import RawConnection, describe, send_or_beat, shake_hands
from kvfsm.rooms import CommandSink, Inbox, RoomKey
from kvfsm.states import Command, EventRejected, Role
from kvfsm.transport import Agent, NixlTransport

__all__ = ["ControlPlane"]

_log = logging.getLogger("kvfsm.control")

#: A command or frame handler of one end: the end, then what it handles.
_CommandHandler = Callable[[Any, RoomKey, Any], None]
_FrameHandler = Callable[[Any, Link, Any, float], "list[Action]"]


class _Core(Protocol):
    """What the plane asks of either routing core."""

    def entries(self) -> dict[str, int]: ...
    def rooms_named(self, link: int, room: int, gen: int | None) -> list[RoomKey]: ...
    def link_lost(self, link: int, reason: str, now: float) -> Iterable[Action]: ...
    def on_error(self, link: int, frame: Error) -> list[Action]: ...


class ControlPlane(CommandSink):
    """The control channel for one engine of one role; build a :class:`PrefillControl` or a
    :class:`DecodeControl`. Either way the engine's sink is ``kvfsm.manager.router_for(control)``:
    it sends the data path's commands to the transport, the rest here, and on decode runs the
    agent's progress."""

    role: ClassVar[Literal["prefill", "decode"]]
    #: What this end does with each control command a room sends it.
    COMMANDS: ClassVar[Mapping[type[Command], _CommandHandler]]
    #: What this end does with each frame type it receives (Heartbeat and Error: both ends).
    FRAMES: ClassVar[Mapping[type[Frame], _FrameHandler]]

    def __init__(
        self,
        rank: int,
        agent: Agent,
        core: _Core,
        stats: dict[str, int],
        *,
        transport: NixlTransport | None,
        config: ChannelConfig,
        fingerprint: Fingerprint | None,
    ) -> None:
        self.rank = rank
        self.agent = agent
        self.transport = transport
        self.config = config
        #: What every peer must agree on; checked on both sides of each handshake.
        self.fingerprint = fingerprint if fingerprint is not None else Fingerprint()
        self.incarnation = secrets.randbits(62)
        self._core = core
        self._codec = FrameCodec(self.config.secret)
        #: The engine's rooms as sinks see them (the registry, through the Inbox port).
        self._registry: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._tg: Any = None
        self._started: asyncio.Future[None] | None = None
        self._port = 0
        self._generations = itertools.count(1)
        # Decode keys its links by peer id as rooms name it, normally the prefill rank (one link
        # per rank it reads from). Prefill keys them by peer id (role, rank, incarnation):
        # several decode instances may each have a rank 0, and a restarted decode rank must not
        # take over its predecessor's link.
        self._links: dict[int | str, Link] = {}
        self._by_generation: dict[int, Link] = {}
        #: The channel's counters, shared with the routing core (which adds its own).
        self.stats = stats
        #: Shutting down: a link lost now is not reconnected for what it owed.
        self._closing = False
        #: Bytes queued for one link past which its reader waits (prefill's
        #: ``outbox_max_bytes``); None: never (decode's outbox holds its own rooms' frames,
        #: page lists included, and prefill's frames ask it for little).
        self._outbox_max: int | None = None

    # -- CommandSink ---------------------------------------------------------------------------

    def attach(self, inbox: Inbox) -> None:
        self._registry = inbox
        self._loop = asyncio.get_running_loop()
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

    @property
    def expecting_writes(self) -> bool:
        """Decode: some room's pages are exposed to a live link, so a WRITE may come now (the
        agent's progress loop hurries while this holds). Always False on prefill."""
        return False

    @property
    def running(self) -> bool:
        """The control plane's task is alive (it ends only when the engine closes it)."""
        return self._main is not None and not self._main.done()

    def _unexpected(self, where: str, exc: BaseException) -> None:
        """An exception no rule expects (a bug, not a peer's bad input): counted, logged with
        its traceback, and confined to the one connection it came from."""
        self.stats["unexpected_errors"] += 1
        _log.error("unexpected error %s", where, exc_info=exc)

    def entries(self) -> dict[str, int]:
        """Per-room entries the routing core keeps (all 0 once every room is gone)."""
        return self._core.entries()

    def submit(self, key: RoomKey, command: Command) -> None:
        """The control commands of this end (``COMMANDS``). ``PostChunk`` and ``ReleaseHandles``
        are the transport's (the router never sends them here) and raise like any command this
        end does not take."""
        handler = self.COMMANDS.get(type(command))
        if handler is None:
            raise TypeError(f"a {self.role} control plane does not take {command!r}")
        handler(self, key, command)

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        """Registry hook: a room of this engine was created."""

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        """Registry hook: a room of this engine is gone."""

    # -- executing the cores' actions ------------------------------------------------------------

    def _do(self, actions: Iterable[Action]) -> None:
        registry = self._registry
        assert registry is not None
        for action in actions:
            if isinstance(action, Send):
                link = self._by_generation.get(action.link)
                if link is not None:
                    self._send(link, action.frame)
            elif isinstance(action, Deliver):
                registry.deliver(action.key, action.event)
            elif isinstance(action, GrantLease | RevokeLease):
                self._lease(action)

    def _lease(self, action: GrantLease | RevokeLease) -> None:
        """Prefill's: the fence. Decode's core never asks for it."""
        raise TypeError(f"a {self.role} control plane keeps no leases: {action!r}")

    def _run_woken(self) -> None:
        """The rooms a whole frame (or a tick) woke run now, not on the loop's next iteration
        (``Inbox.run_woken``). Called only where the control plane is done with that frame or
        tick, never from ``_do``: ``_do`` also runs inside rooms' commands and hooks."""
        registry = self._registry
        if registry is not None:
            registry.run_woken()

    def _send(self, link: Link, frame: Frame) -> None:
        if link.closed:
            return
        try:
            data = self._codec.payload(frame)
        except FrameError as exc:
            # A frame this side cannot send (a page list over the frame limit): fail the room
            # it is about (law 3), never the link or the engine.
            self.stats["frames_unencodable"] += 1
            _log.warning("cannot send %s to %s: %s", type(frame).__name__, link.peer_id, exc)
            if exc.room is not None:
                self._fail_named(link, exc.room, exc.generation, f"cannot send: {exc.reason}")
            return
        link.outbox.put_nowait(data)
        link.queued += len(data)
        self.stats["frames_out"] += 1
        limit = self._outbox_max
        if limit is not None and link.queued > limit and link.drained.is_set():
            # Its peer does not take what it is sent as fast as it asks for more: stop reading
            # it until half went out (``_read``), so its answers cannot grow without bound.
            link.drained.clear()
            self.stats["reads_paused"] += 1

    def _fail_named(self, link: Link, room: int, gen: int | None, reason: str) -> None:
        """Fail the local rooms that a frame on ``link`` about ``(room, gen)`` concerns."""
        registry = self._registry
        assert registry is not None
        for key in self._core.rooms_named(link.generation, room, gen):
            registry.deliver(key, EventRejected(reason))

    def _now(self) -> float:
        # One clock for everything the cores compare: leases are checked on the poster thread
        # with time.monotonic(), which the loop's own clock need not be (uvloop caches its own).
        return time.monotonic()

    # -- a connection's life -------------------------------------------------------------------

    async def _run(self, started: asyncio.Future[None]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await self._listen(tg)
                tg.start_soon(self._watchdog)
                started.set_result(None)
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    async def _listen(self, tg: Any) -> None:
        """Prefill's: bind and start accepting. Decode listens on nothing."""

    def _spawn(self, coro: Awaitable[None]) -> None:
        tg = self._tg
        if tg is None:
            raise RuntimeError("control plane not started")

        async def run() -> None:
            await coro

        tg.start_soon(run)

    def _hello(self, nonce: bytes) -> Hello:
        """This end's Hello (decode's carries its agent, its layout and the first lease)."""
        raise NotImplementedError

    async def _handshake(
        self,
        stream: SocketStream | RawConnection,
        expect_rank: int | None,
        key: int | None,
        scope: anyio.CancelScope | None = None,
    ) -> Link:
        """Exchange Hellos, authenticate, register the link, run its reader and writer.

        With a secret, the Hellos carry nonces, both sides switch to this connection's session
        keys, and each sends one sealed frame (a Heartbeat) as key confirmation. Nothing is
        registered, and prefill loads no NIXL metadata, before the peer's confirmation verified:
        a recorded Hello replayed by a stranger costs one handshake slot and touches no link.
        Until then the reader accepts frames of at most ``hello_max_bytes``."""
        reader = FrameReader(self._codec, limit=self.config.hello_max_bytes)
        secret = self.config.secret
        nonce = secrets.token_bytes(NONCE_BYTES) if secret is not None else b""
        # Prefill: decode's Hello answers ours, so it is the link's first lease, counted from
        # before ours went out.
        hello_sent = self._now()
        codec: Sealer = self._codec

        def check(item: Frame | FrameError) -> None:
            theirs = _handshake_item(item)
            if not isinstance(theirs, Hello):
                raise FrameError(f"expected Hello, got {type(theirs).__name__}", None, True)
            check_hello(theirs)
            if expect_rank is not None and theirs.rank != expect_rank:
                raise FrameError(
                    f"expected prefill rank {expect_rank}, got {theirs.rank}", None, True
                )

        def session(item: Frame | FrameError) -> bytes | None:
            nonlocal codec
            assert isinstance(item, Hello)
            if secret is None:
                return None
            if len(item.nonce) != NONCE_BYTES:
                raise FrameError(
                    f"the peer's Hello has a nonce of {len(item.nonce)} bytes, not {NONCE_BYTES}",
                    None,
                    True,
                    tag="Hello",
                )
            codec = reader.codec = self._codec.session(self.role, nonce, item.nonce)
            return codec.encode(Heartbeat(0))  # key confirmation

        try:
            with anyio.fail_after(self.config.connect_timeout_s):
                hello = await shake_hands(
                    stream,
                    reader,
                    self._codec.encode(self._hello(nonce)),
                    check=check,
                    session=session,
                    # Any sealed frame proves the peer holds the secret.
                    confirmed=_handshake_item,
                )
            theirs = hello
            assert isinstance(theirs, Hello)
            # Authenticated: from here on the peer may send full-sized frames.
            reader.limit = self._codec.max_frame_bytes
            self._authenticated(scope)
            peer_id = f"{theirs.role}-{theirs.rank}-{theirs.incarnation}"
            await self._check_fingerprint(stream, codec, theirs)
            await self._admit(stream, codec, peer_id, theirs, scope)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        early = reader.feed(b"")  # whatever came after the Hello (and confirmation)
        if isinstance(stream, RawConnection):  # authenticated: a stream that reads ahead
            try:
                stream = await stream.to_stream()
            except BaseException:
                await stream.aclose()
                raise
        loop = self._running_loop()
        link = Link(
            theirs,
            next(self._generations),
            peer_id,
            loop.time(),
            codec,
            silence_s=self.config.silence_s,
        )
        # Decode: the peer id its rooms named (the link is reused by every room naming it).
        link.key = key if key is not None else peer_id
        old = self._links.get(link.key)
        if old is not None:
            self._lose(old, "replaced by a new connection")
        self._links[link.key] = link
        self._by_generation[link.generation] = link
        self._registered(link, scope)
        self.stats["links_opened"] += 1
        self._do(self._opened(link, hello_sent, self._now()))
        assert self._tg is not None
        if early:
            try:
                taken = self._take(link, early)
            except Exception as exc:  # as in _read: a bug costs this link, and closes it
                self._unexpected(f"in frames from {link.peer_id} after its Hello", exc)
                taken = False
            if not taken:
                self._lose(link, f"connection to {link.peer_id} closed: fatal frame after Hello")
                await stream.aclose()
                return link
        self._tg.start_soon(self._read, link, stream, reader)
        self._tg.start_soon(self._write, link, stream)
        return link

    def _authenticated(self, scope: anyio.CancelScope | None) -> None:
        """The peer proved it holds the secret (or none is set)."""

    async def _admit(
        self,
        stream: SocketStream | RawConnection,
        codec: Sealer,
        peer_id: str,
        theirs: Hello,
        scope: anyio.CancelScope | None,
    ) -> None:
        """Prefill's: take the link's place within the link bounds, and load the peer's NIXL
        metadata, before the link exists."""

    def _registered(self, link: Link, scope: anyio.CancelScope | None) -> None:
        """The link is registered (prefill: the place its handshake took is its own now)."""

    def _opened(self, link: Link, hello_sent: float, now: float) -> Iterable[Action]:
        raise NotImplementedError

    def _pair(self, theirs: Fingerprint) -> tuple[Fingerprint, Fingerprint]:
        """(prefill's, decode's) fingerprints: both ends check the pair in the same order."""
        raise NotImplementedError

    async def _check_fingerprint(
        self, stream: SocketStream | RawConnection, codec: Sealer, theirs: Hello
    ) -> None:
        """Refuse a peer whose fingerprint does not pair with ours, before prefill loads its
        NIXL metadata and before any room frame: both sides find the same reason (the roles
        go in a fixed order), log it, count it and tell the other in an ``Error`` frame."""
        reason = mismatch(*self._pair(theirs.fingerprint))
        if reason is None:
            return
        self.stats["handshakes_refused"] += 1
        reason = clip_reason(
            f"{self.role} rank {self.rank} refused {theirs.role} rank {theirs.rank}: {reason}"
        )
        await self._refuse(stream, codec, reason)

    async def _refuse(
        self, stream: SocketStream | RawConnection, codec: Sealer, reason: str, *, log: bool = True
    ) -> None:
        """Tell the peer why its handshake is refused, then fail it (``log``: False where the
        caller logs it, throttled)."""
        if log:
            _log.warning("handshake refused: %s", reason)
        with contextlib.suppress(Exception):
            with anyio.fail_after(1.0):
                await stream.send(codec.encode(Error(None, reason)))
        raise FrameError(reason, None, True)

    def _take(self, link: Link, items: list[Frame | FrameError]) -> bool:
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

    async def _read(self, link: Link, stream: SocketStream, reader: FrameReader) -> None:
        loop = self._running_loop()
        try:
            while not link.closed:
                if not link.drained.is_set():
                    await link.drained.wait()  # backpressure: see _send
                    continue
                data = await stream.receive()
                link.liveness.seen(loop.time())
                items = reader.feed(data)
                if not self._take(link, items):
                    fatal = next(i for i in items if isinstance(i, FrameError) and i.fatal)
                    raise FrameError(fatal.reason, None, True)  # fresh: see _handshake_item
        except (
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            OSError,
            FrameError,
        ) as exc:
            self._lose(link, f"connection to {link.peer_id} closed: {describe(exc)}")
        except Exception as exc:
            # A bug reached by one peer's frames costs that link, not every link of the engine.
            self._unexpected(f"reading from {link.peer_id}", exc)
            self._lose(link, f"connection to {link.peer_id} closed: internal error: {exc!r}")
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _write(self, link: Link, stream: SocketStream) -> None:
        async def send(payload: bytes) -> None:
            await stream.send(link.codec.seal(payload))

        limit = self._outbox_max

        async def next_payload() -> bytes:
            payload = await link.outbox.get()
            link.queued -= len(payload)
            if limit is not None and link.queued <= limit // 2:
                link.drained.set()
            return payload

        try:
            await send_or_beat(
                send,
                next_payload,
                self.config.heartbeat_s,
                lambda: self._codec.payload(link.round_trip.beat(self._now())),
                open_=lambda: not link.closed,
            )
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._lose(link, f"connection to {link.peer_id} broken: {describe(exc)}")
        finally:
            # A lost link closes its socket: the peer sees the loss at once, and the reader
            # blocked in receive() wakes up and ends.
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _watchdog(self) -> None:
        loop = self._running_loop()
        tick = min(self.config.heartbeat_s, self.config.lease_s) / 10
        # Declared lost one tick early, so detection never takes longer than silence_s.
        limit = self.config.silence_s - tick
        last = loop.time()
        while True:
            await anyio.sleep(tick)
            now, mono = loop.time(), self._now()
            # Slept past its tick by more than a tick: the loop, or the process, stood still.
            stalled = now - last - tick if now - last > 2 * tick else 0.0
            if now - last > limit:
                # This process stood still (SIGSTOP, a VM or GC stall): its peers' silence is
                # its own. Judge them from now on, once what they sent meanwhile is read.
                self.stats["own_stalls"] += 1
                for link in self._links.values():
                    link.liveness.excuse(now)
            last = now
            for link in list(self._links.values()):
                if link.liveness.overdue(now, early_s=tick):
                    self._lose(
                        link, f"{link.peer_id} silent for more than {self.config.silence_s:g}s"
                    )
                else:
                    self._do(self._link_due(link, mono))
            self._do(self._tick(mono, stalled))
            self._run_woken()

    def _link_due(self, link: Link, now: float) -> Iterable[Action]:
        """What a live link needs on each watchdog tick (prefill: its lease renewed)."""
        return ()

    def _tick(self, now: float, stalled_s: float) -> Iterable[Action]:
        """The routing core's tick; ``stalled_s``: for how long this process stood still just
        before it (0 if it did not)."""
        raise NotImplementedError

    def _lose(self, link: Link, reason: str) -> None:
        if link.closed:
            return
        link.closed = True
        self.stats["links_lost"] += 1
        if self._links.get(link.key) is link:
            del self._links[link.key]
        self._by_generation.pop(link.generation, None)
        if link.error:
            reason = f"{reason} (the peer said: {link.error})"
        _log.warning("control link lost: %s", reason)
        self._do(self._core.link_lost(link.generation, reason, self._now()))
        link.outbox.put_nowait(b"")  # wake the writer so it notices
        link.drained.set()  # and a reader waiting for it to drain
        self._lost(link)

    def _lost(self, link: Link) -> None:
        """After a link's loss is told to the core (decode: reconnect for what it owed)."""

    # -- incoming frames -----------------------------------------------------------------------

    def _on_frame(self, link: Link, frame: Frame) -> None:
        if isinstance(frame, Heartbeat):
            link.round_trip.heard(frame, self._now())
            return
        handler = self.FRAMES.get(type(frame))
        if handler is None:
            # A valid frame that this role never receives: the peer is confused, not hostile.
            self.stats["frames_rejected"] += 1
            room = getattr(frame, "room", None)
            reason = f"{type(frame).__name__} is not sent to a {self.role} rank"
            self._send(link, Error(room, reason, getattr(frame, "generation", None)))
            return
        self._do(handler(self, link, frame, self._now()))
        self._run_woken()

    def _on_error(self, link: Link, frame: Error, now: float) -> list[Action]:
        _log.warning("peer %s reported: %s", link.peer_id, frame.reason)
        if frame.room is None:
            link.error = frame.reason
        return self._core.on_error(link.generation, frame)

    def _rejected(self, link: Link, error: FrameError) -> None:
        self.stats["frames_rejected"] += 1
        _log.warning("frame from %s rejected: %s", link.peer_id, error.reason)
        if error.room is not None:
            # Only the room the frame was about: not a newer room that reuses the id.
            self._fail_named(link, error.room, error.generation, f"bad frame: {error.reason}")
        if not error.fatal and error.tag != "Error":  # never answer an Error with an Error
            self._send(link, Error(error.room, clip_reason(error.reason), error.generation))

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
        background tasks. The transport is the router's to close, after this."""
        self._closing = True
        loop = self._running_loop()
        give_up = loop.time() + self.config.flush_timeout_s
        # Polled: the queues have no "drained" event, and this runs once per engine lifetime.
        while loop.time() < give_up and any(  # noqa: ASYNC110
            not link.closed and not link.outbox.empty() for link in self._links.values()
        ):
            await anyio.sleep(0.005)
        for link in list(self._links.values()):
            self._lose(link, "engine shutting down")
        await self._stop_tasks()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main

    async def _stop_tasks(self) -> None:
        """Tasks of this end's own, outside the task group (decode's reconnects)."""


def new_stats() -> dict[str, int]:
    """The channel's own counters, all 0 (each end's routing core adds its own to the dict)."""
    return dict.fromkeys(
        (
            "accept_errors",
            "unauthenticated_shed",
            "handshakes_failed",
            "frames_in",
            "frames_out",
            "frames_rejected",
            "frames_unencodable",
            "links_opened",
            "links_lost",
            "handshakes_refused",
            "unexpected_errors",
            "own_stalls",
            "reconnects_owed",
            "links_refused",
            "reads_paused",
        ),
        0,
    )


def _handshake_item(item: Frame | FrameError) -> Frame:
    """The peer's next frame during the handshake: its Hello, then (with a secret) the first
    sealed frame, which proves it holds the secret. A refusal (an ``Error`` frame) or a bad
    frame ends the handshake."""
    if isinstance(item, FrameError):
        # A fresh error: the reader keeps the one it died of, and raising that one would tie the
        # reader's buffers to its traceback (a reference cycle that only the cyclic GC frees).
        raise FrameError(item.reason, None, True, tag=item.tag)
    if isinstance(item, Error):  # the peer refused this handshake and says why
        raise FrameError(f"handshake refused: {item.reason}", None, True, tag="Error")
    return item


async def cancel_tasks(tasks: Iterable[asyncio.Task[None]]) -> None:
    for task in list(tasks):
        await cancel_and_wait(task)
