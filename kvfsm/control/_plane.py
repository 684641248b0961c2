"""``ControlPlane``: the control channel between prefill and decode ranks, as a ``CommandSink``.

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

This module is the IO around two sans-IO cores: every rule about which room a frame belongs to,
what the peer must be told and when a lost link's pages settle lives in
:mod:`kvfsm.control._routing` (``PrefillRouting``, ``DecodeRouting``); here are sockets, the
handshake, heartbeats, the clock and the execution of the cores' actions.

Rules kept here:

* Frames become room events; nothing here writes a room's state (law 2).
* Liveness: both sides send a heartbeat every ``heartbeat_s``; any frame counts as a sign of
  life. A peer silent for ``liveness_factor * heartbeat_s`` is lost: the connection is closed
  and every room bound to it gets ``PeerLost`` (law 3: detection within 2x the interval by
  default). A closed or reset socket is the same, only faster.
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
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import anyio
import msgspec
from anyio.abc import SocketStream

from kvfsm._tasks import cancel_and_wait
from kvfsm.control._codec import FrameCodec, FrameReader, SessionCodec
from kvfsm.control._fingerprint import (
    Fingerprint,
    link_plan,
    link_slot,
    mismatch,
    stage_buffers,
)
from kvfsm.control._frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    check_hello,
    clip_reason,
)
from kvfsm.control._routing import (
    Action,
    DecodeRouting,
    Deliver,
    GrantLease,
    PrefillRouting,
    RevokeLease,
    RoutingConfig,
    Send,
)
from kvfsm.rooms import CommandSink, Inbox, RoomKey
from kvfsm.states import (
    Command,
    EventRejected,
    KVPoll,
    PeerLost,
    ReportOutcome,
    ReportSettled,
    ResolvePeer,
    Role,
    SendMetadata,
)
from kvfsm.transport import NO_KV, Agent, LayoutSummary, NixlTransport, ProgressWatch

__all__ = ["ChannelConfig", "ControlPlane", "Resolver"]

#: What a peer can make a handshake fail with: its bytes (``FrameError``), its silence
#: (``TimeoutError``), its hang-up or the socket's errors. Anything else is a bug.
_PEER_ERRORS: Final = (
    FrameError,
    TimeoutError,
    OSError,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)

_log = logging.getLogger("kvfsm.control")
#: What seals a link's frames: the shared codec, or the connection's session (with a secret).
Sealer: TypeAlias = FrameCodec | SessionCodec

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
    #: Claims and page lists held for rooms that do not exist yet: at most this many per link,
    #: this long (tombstones and early-abort marks: as many, as long).
    pending_max: int = 4096
    pending_ttl_s: float = 60.0
    #: The decode side progresses its NIXL agent this often while writes are expected (the
    #: writer's flushes need it; ``kvfsm.transport.AgentProgress``).
    progress_interval_s: float = 0.0005
    #: Decode grants prefill write leases of this length; prefill renews every quarter of it.
    #: A lost link's pages settle ``lease_s + fence_margin_s`` after the last lease decode
    #: granted on it (law 4), however long the prefill process stays frozen.
    lease_s: float = 2.0
    #: What a write checked against its lease just before posting may still take (the rest of
    #: one ``transfer()`` call; docs/reliability.md says what it covers and what it cannot).
    fence_margin_s: float = 1.0
    #: How long shutdown waits for frames already queued (outcomes, settle acks) to go out.
    flush_timeout_s: float = 1.0
    #: Prefill: connections still in their handshake (not authenticated) at most; a new one
    #: over the cap sheds the oldest. Each may buffer at most ``hello_max_bytes`` (its Hello and
    #: the key confirmation): the pre-authentication memory is bounded by their product.
    max_unauthenticated: int = 64
    hello_max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0 and self.liveness_factor >= 1.0):
            raise ValueError("heartbeat_s must be > 0 and liveness_factor >= 1")
        if not self.lease_s > 0 or self.fence_margin_s < 0 or self.flush_timeout_s < 0:
            raise ValueError("lease_s must be > 0, fence_margin_s and flush_timeout_s >= 0")
        if self.max_unauthenticated < 1 or self.hello_max_bytes < 4096:
            raise ValueError("max_unauthenticated must be >= 1 and hello_max_bytes >= 4096")

    @property
    def silence_s(self) -> float:
        return self.heartbeat_s * self.liveness_factor

    @property
    def settle_after_loss_s(self) -> float:
        """Longest a lost link's pages stay unsettled on decode: the fence's bound."""
        return self.lease_s + self.fence_margin_s

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            pending_max=self.pending_max,
            pending_ttl_s=self.pending_ttl_s,
            lease_s=self.lease_s,
            fence_margin_s=self.fence_margin_s,
        )


class _RawConnection:
    """An accepted connection before it is authenticated: the raw non-blocking socket, read only
    as far as asked (``receive(max_bytes)`` is one ``recv`` of at most that many bytes), so what
    the peer sends beyond that waits in the kernel's socket buffer, not in this process. After
    the handshake, :meth:`to_stream` hands the socket to anyio."""

    __slots__ = ("_loop", "sock")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self._loop = loop

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await self._loop.sock_recv(self.sock, max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, data: bytes) -> None:
        await self._loop.sock_sendall(self.sock, data)

    async def aclose(self) -> None:
        self.sock.close()

    async def to_stream(self) -> SocketStream:
        return await SocketStream.from_socket(self.sock)


class _Link:
    """One live connection after the Hello exchange (loop side). ``generation`` names it to the
    routing core, and is the fence id of the writes made under its leases."""

    __slots__ = (
        "closed",
        "codec",
        "error",
        "generation",
        "hello",
        "key",
        "last_seen",
        "outbox",
        "peer_id",
    )

    def __init__(
        self, hello: Hello, generation: int, peer_id: str, now: float, codec: Sealer
    ) -> None:
        self.key: int | str = peer_id
        #: Seals this connection's frames (its session keys and sequence, with a secret).
        self.codec = codec
        self.hello = hello
        self.generation = generation
        self.peer_id = peer_id
        self.last_seen = now
        #: Payloads (``FrameCodec.payload``), sealed by the writer as they go out: with a
        #: session the sequence number is the order on the wire.
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False
        #: The peer's last Error frame that named no room (a refusal of the link itself, such as
        #: NIXL refusing our agent): it is the reason the link is lost, if it is.
        self.error = ""


class ControlPlane(CommandSink):
    """The control channel for one engine of one role.

    Prefill: ``ControlPlane("prefill", rank, agent, transport=NixlTransport(agent, ...))``; it
    listens on ``config.host:config.port`` (:attr:`port` once started), connects each decode
    link's agent through the transport, and its transport's ``leases`` fence every write by the
    lease of the decode link that sent the pages. Decode: ``ControlPlane("decode", rank, agent,
    resolver=...)``; a receiver room's ``init(peer_rank)`` resolves and connects that prefill
    rank (once per rank; the link is reused) and claims the room there.

    Either way the engine's sink is ``kvfsm.manager.router_for(control)``: it sends the data
    path's commands to the transport, the rest here, and on decode runs the agent's progress.
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
        fingerprint: Fingerprint | None = None,
    ) -> None:
        if role == "prefill" and (transport is None or transport.leases is None):
            # Unfenced writes would break law 4 under a freeze: refuse to run that way.
            raise ValueError("a prefill control plane needs its NixlTransport, with leases")
        if role == "decode" and resolver is None:
            raise ValueError("a decode control plane needs a resolver for prefill ranks")
        self.role = role
        self.rank = rank
        self.agent = agent
        self.transport = transport
        self.config = config if config is not None else ChannelConfig()
        #: What every peer must agree on; checked on both sides of each handshake.
        self.fingerprint = fingerprint if fingerprint is not None else Fingerprint()
        self.incarnation = secrets.randbits(62)
        self._resolver = resolver
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
        self._links: dict[int | str, _Link] = {}
        self._by_generation: dict[int, _Link] = {}
        self._connecting: dict[int, asyncio.Future[_Link]] = {}
        self._backoff: dict[int, float] = {}  # by peer rank: the last backoff step
        self._backoff_until: dict[int, float] = {}
        # Prefill: connections in their handshake, oldest first (shed over the cap).
        self._unauthenticated: dict[anyio.CancelScope, None] = {}
        self.stats: dict[str, int] = {
            "accept_errors": 0,
            "unauthenticated_shed": 0,
            "handshakes_failed": 0,
            "frames_in": 0,
            "frames_out": 0,
            "frames_rejected": 0,
            "frames_unencodable": 0,
            "links_opened": 0,
            "links_lost": 0,
            "handshakes_refused": 0,
            "unexpected_errors": 0,
            "own_stalls": 0,
            "reconnects_owed": 0,
        }
        routing = self.config.routing()
        self._prefill = PrefillRouting(routing, self.stats) if role == "prefill" else None
        self._decode = DecodeRouting(routing, self.stats) if role == "decode" else None
        self._leases = transport.leases if transport is not None else None
        #: Decode: when its agent was progressed (``router_for`` hands it to the progress
        #: loop). A lost link's pages settle only after a steady stretch of progress of
        #: ``fence_margin_s``: a rank that was frozen has bytes queued for it still to take.
        # (A gap limit above the idle progress interval, 50 ms: an idle rank is steady too.)
        self.progress_watch = ProgressWatch(max(self.config.fence_margin_s / 4, 0.1))
        #: Decode: peer ranks a reconnect task is running for (``_owed``).
        self._reconnecting: set[int] = set()
        #: Shutting down: a link lost now is not reconnected for what it owed.
        self._closing = False
        self._owed_tasks: set[asyncio.Task[None]] = set()

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
        return self._decode is not None and self._decode.expecting_writes

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
        core = self._prefill if self._prefill is not None else self._decode
        assert core is not None
        return core.entries()

    def submit(self, key: RoomKey, command: Command) -> None:
        """The control commands; ``PostChunk`` and ``ReleaseHandles`` are the transport's (the
        router never sends them here) and raise like any command this side does not know."""
        if isinstance(command, ResolvePeer):
            self._spawn(self._resolve(key, command.peer_rank))
        elif isinstance(command, SendMetadata):
            assert self._decode is not None
            frame = RoomMetadata(
                key.room,
                key.generation,
                command.pages,
                command.aux_index,
                command.state,
                command.part,
                prefix=command.prefix,
            )
            self._do(self._decode.metadata(key, frame))
        elif isinstance(command, ReportOutcome):
            if self._prefill is not None:
                now = self._now()
                self._do(self._prefill.sender_outcome(key, command.status, command.reason, now))
            elif command.status is KVPoll.Failed:
                assert self._decode is not None
                self._do(self._decode.receiver_failed(key, command.reason))
        elif isinstance(command, ReportSettled):
            assert self._prefill is not None
            self._do(self._prefill.sender_settled(key, self._now()))
        else:  # pragma: no cover - a new command type must be wired here
            raise TypeError(f"unknown command {command!r}")

    def room_spawned(self, key: RoomKey, role: Role) -> None:
        """Registry hook: a claim or page list may be waiting for this sender room."""
        if self._prefill is not None and role is Role.SENDER:
            assert self._registry is not None
            leg = self._registry.leg_of(key)
            self._do(self._prefill.sender_spawned(key, self._now(), leg))

    def room_reaped(self, key: RoomKey, role: Role) -> None:
        """Registry hook: forget everything kept for this room."""
        if self._prefill is not None and role is Role.SENDER:
            self._do(self._prefill.sender_reaped(key))
        elif self._decode is not None and role is Role.RECEIVER:
            self._do(self._decode.receiver_reaped(key))

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
            elif isinstance(action, GrantLease):
                if self._leases is not None:
                    self._leases.grant(action.fence, action.until, action.margin_s)
            elif isinstance(action, RevokeLease) and self._leases is not None:
                self._leases.revoke(action.fence)

    def _run_woken(self) -> None:
        """The rooms a whole frame (or a tick) woke run now, not on the loop's next iteration
        (``Inbox.run_woken``). Called only where the control plane is done with that frame or
        tick, never from ``_do``: ``_do`` also runs inside rooms' commands and hooks."""
        registry = self._registry
        if registry is not None:
            registry.run_woken()

    def _send(self, link: _Link, frame: Frame) -> None:
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
        self.stats["frames_out"] += 1

    def _fail_named(self, link: _Link, room: int, gen: int | None, reason: str) -> None:
        """Fail the local rooms that a frame on ``link`` about ``(room, gen)`` concerns."""
        registry = self._registry
        assert registry is not None
        core = self._prefill if self._prefill is not None else self._decode
        assert core is not None
        for key in core.rooms_named(link.generation, room, gen):
            registry.deliver(key, EventRejected(reason))

    def _now(self) -> float:
        # One clock for everything the cores compare: leases are checked on the poster thread
        # with time.monotonic(), which the loop's own clock need not be (uvloop caches its own).
        return time.monotonic()

    # -- decode: resolving and connecting a prefill rank ------------------------------------

    async def _resolve(self, key: RoomKey, peer_rank: int) -> None:
        registry = self._registry
        assert registry is not None
        assert self._decode is not None
        try:
            link = await self._link_to(peer_rank)
        except Exception as exc:
            why = str(exc) or type(exc).__name__  # a timeout's str() is empty
            registry.deliver(key, PeerLost(f"cannot reach prefill rank {peer_rank}: {why}"))
            return
        if registry.ended(key):
            return  # the room ended while its peer was being resolved: nothing to claim
        self._do(self._decode.bind(key, link.generation, peer_rank))

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

    async def _owed(self, peer_rank: int, peer: str) -> None:
        """Decode: reconnect to a prefill rank this side owes something (lost rooms to
        reconcile, aborts to tell) without waiting for a new room to need the link, so a
        prefill room whose decode room failed meanwhile is told within one reconnect. Gives
        up once nothing is owed (what is owed expires with its TTL, or settles)."""
        assert self._decode is not None
        try:
            while self._decode.owes(peer):
                link = self._links.get(peer_rank)
                if link is not None and not link.closed:
                    return  # connected again (a room needed it): the link paid what was owed
                try:
                    await self._link_to(peer_rank)
                except Exception as exc:
                    _log.info("reconnecting to prefill rank %d failed: %s", peer_rank, exc)
                    await anyio.sleep(self.config.reconnect_max_s / 4)
                else:
                    self.stats["reconnects_owed"] += 1
                    return
        finally:
            self._reconnecting.discard(peer_rank)

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
                    for one in listener.listeners:
                        tg.start_soon(self._serve, one)
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

    async def _serve(self, listener: Any) -> None:
        """Accept for ever. An accept error (out of file descriptors: EMFILE, ENFILE; kernel
        memory: ENOBUFS, ENOMEM; a connection reset while queued) never ends the listener: it is
        counted and logged, and accepting resumes after a backoff (doubling to 1 s), when the
        descriptors come back. Refusing to serve while the registry still advertises this port
        would fail every room of every decode."""
        raw = listener.extra(anyio.abc.SocketAttribute.raw_socket)
        loop = self._running_loop()
        backoff = 0.0
        while True:
            try:
                # Accepted on the raw socket, not through anyio's listener: its streams start
                # reading at once (uvloop: up to 8 MiB per socket per wake-up), which is memory
                # an unauthenticated peer would choose. Until it is authenticated, a connection
                # is read only as far as the handshake asks (_RawConnection).
                sock, _ = await loop.sock_accept(raw)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:
                self.stats["accept_errors"] += 1
                backoff = min(1.0, max(0.01, 2 * backoff))
                if self.stats["accept_errors"] in (1, 10, 100) or backoff == 1.0:
                    _log.warning("accept failed (%s): retrying in %.2fs", exc, backoff)
                await anyio.sleep(backoff)
                continue
            backoff = 0.0
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert self._tg is not None
            self._tg.start_soon(self._accepted, _RawConnection(sock, loop))

    def _spawn(self, coro: Awaitable[None]) -> None:
        tg = self._tg
        if tg is None:
            raise RuntimeError("control plane not started")

        async def run() -> None:
            await coro

        tg.start_soon(run)

    async def _accepted(self, stream: _RawConnection) -> None:
        """One connection to prefill's port, until it is authenticated or gone. At most
        ``max_unauthenticated`` wait at once: a new one over the cap sheds the oldest (a flood
        of idle or slow connections cannot keep out the decode ranks that come later)."""
        with anyio.CancelScope() as scope:
            self._unauthenticated[scope] = None
            if len(self._unauthenticated) > self.config.max_unauthenticated:
                oldest = next(iter(self._unauthenticated))
                del self._unauthenticated[oldest]
                oldest.cancel()
                self.stats["unauthenticated_shed"] += 1
            try:
                await self._handshake(stream, expect_rank=None, key=None, scope=scope)
            except _PEER_ERRORS as exc:  # the peer's doing: bad bytes, a timeout, a hang-up
                self.stats["handshakes_failed"] += 1
                _log.debug("handshake failed: %s", exc)
            except Exception as exc:
                self.stats["handshakes_failed"] += 1
                self._unexpected("in a handshake", exc)
            finally:
                self._unauthenticated.pop(scope, None)
        if scope.cancelled_caught:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _handshake(
        self,
        stream: SocketStream | _RawConnection,
        expect_rank: int | None,
        key: int | None,
        scope: anyio.CancelScope | None = None,
    ) -> _Link:
        """Exchange Hellos, authenticate, register the link, run its reader and writer.

        With a secret, the Hellos carry nonces, both sides switch to this connection's session
        keys, and each sends one sealed frame (a Heartbeat) as key confirmation. Nothing is
        registered, and prefill loads no NIXL metadata, before the peer's confirmation verified:
        a recorded Hello replayed by a stranger costs one handshake slot and touches no link.
        Until then the reader accepts frames of at most ``hello_max_bytes``."""
        reader = FrameReader(self._codec, limit=self.config.hello_max_bytes)
        nonce = secrets.token_bytes(NONCE_BYTES) if self.config.secret is not None else b""
        hello = Hello(
            PROTOCOL_VERSION,
            self.role,
            self.rank,
            self.agent.name,
            self.agent.metadata() if self.role == "decode" else b"",
            msgspec.msgpack.encode(self.agent.layout.summary()) if self.role == "decode" else b"",
            self.incarnation,
            round(self.config.lease_s * 1000) if self.role == "decode" else 0,
            nonce,
            self.fingerprint,
            max(1, round(self.config.fence_margin_s * 1000)) if self.role == "decode" else 0,
        )
        # Prefill: decode's Hello answers ours, so it is the link's first lease, counted from
        # before ours went out.
        hello_sent = self._now()
        codec: Sealer = self._codec
        try:
            await stream.send(self._codec.encode(hello))
            with anyio.fail_after(self.config.connect_timeout_s):
                theirs = await self._handshake_frame(stream, reader)
                if not isinstance(theirs, Hello):
                    raise FrameError(f"expected Hello, got {type(theirs).__name__}", None, True)
                check_hello(theirs)
                if expect_rank is not None and theirs.rank != expect_rank:
                    raise FrameError(
                        f"expected prefill rank {expect_rank}, got {theirs.rank}", None, True
                    )
                if self.config.secret is not None:
                    if len(theirs.nonce) != NONCE_BYTES:
                        raise FrameError(
                            f"the peer's Hello has a nonce of {len(theirs.nonce)} bytes, "
                            f"not {NONCE_BYTES}",
                            None,
                            True,
                            tag="Hello",
                        )
                    codec = reader.codec = self._codec.session(self.role, nonce, theirs.nonce)
                    await stream.send(codec.encode(Heartbeat(0)))  # key confirmation
                    await self._handshake_frame(stream, reader)  # any sealed frame proves it
            # Authenticated: from here on the peer may send full-sized frames, and this
            # connection no longer counts against the unauthenticated cap.
            reader.limit = self._codec.max_frame_bytes
            if scope is not None:
                self._unauthenticated.pop(scope, None)
            peer_id = f"{theirs.role}-{theirs.rank}-{theirs.incarnation}"
            await self._check_fingerprint(stream, codec, theirs)
            if self.role == "prefill":
                await self._connect_data_path(stream, codec, peer_id, theirs)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        early = reader.feed(b"")  # whatever came after the Hello (and confirmation)
        if isinstance(stream, _RawConnection):  # authenticated: a stream that reads ahead
            try:
                stream = await stream.to_stream()
            except BaseException:
                await stream.aclose()
                raise
        loop = self._running_loop()
        link = _Link(theirs, next(self._generations), peer_id, loop.time(), codec)
        # Decode: the peer id its rooms named (the link is reused by every room naming it).
        link_key: int | str = key if key is not None else peer_id
        link.key = link_key
        old = self._links.get(link_key)
        if old is not None:
            self._lose(old, "replaced by a new connection")
        self._links[link_key] = link
        self._by_generation[link.generation] = link
        self.stats["links_opened"] += 1
        now = self._now()
        if self._prefill is not None:
            leg, legs = link_slot(self.fingerprint, theirs.fingerprint)
            self._do(
                self._prefill.link_opened(
                    link.generation,
                    peer_id,
                    now,
                    hello_sent,
                    theirs.lease_ms,
                    leg=leg,
                    legs=legs,
                    margin_ms=theirs.fence_margin_ms,
                )
            )
        else:
            assert self._decode is not None
            self._do(self._decode.link_opened(link.generation, peer_id, theirs.rank, now))
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

    async def _check_fingerprint(
        self, stream: SocketStream | _RawConnection, codec: Sealer, theirs: Hello
    ) -> None:
        """Refuse a peer whose fingerprint does not pair with ours, before prefill loads its
        NIXL metadata and before any room frame: both sides find the same reason (the roles
        go in a fixed order), log it, count it and tell the other in an ``Error`` frame."""
        if self.role == "prefill":
            reason = mismatch(self.fingerprint, theirs.fingerprint)
        else:
            reason = mismatch(theirs.fingerprint, self.fingerprint)
        if reason is None:
            return
        self.stats["handshakes_refused"] += 1
        reason = clip_reason(
            f"{self.role} rank {self.rank} refused {theirs.role} rank {theirs.rank}: {reason}"
        )
        _log.warning("handshake refused: %s", reason)
        with contextlib.suppress(Exception):
            with anyio.fail_after(1.0):
                await stream.send(codec.encode(Error(None, reason)))
        raise FrameError(reason, None, True)

    async def _connect_data_path(
        self, stream: SocketStream | _RawConnection, codec: Sealer, peer_id: str, theirs: Hello
    ) -> None:
        """Prefill: load decode's NIXL metadata. A refusal is told to decode in an ``Error``
        frame naming NIXL's error (two decode processes with one agent name get
        ``NIXL_ERR_NOT_ALLOWED``): otherwise it would see only a closed connection."""
        assert self.transport is not None
        try:
            summary = msgspec.msgpack.decode(theirs.layout, type=LayoutSummary)
            # A pipeline stage: its buffers pair with its span of decode's layers only.
            local_kv = len(self.agent.layout.kv)
            buffers = stage_buffers(self.fingerprint, theirs.fingerprint, local_kv, len(summary.kv))
            if isinstance(buffers, str):
                raise ValueError(buffers)
            if buffers is not None:
                summary = summary.select_kv(buffers)
            # Unequal attention TP: the head slice of each page this rank writes there.
            plan = link_plan(self.fingerprint, theirs.fingerprint)
            piece = NO_KV if plan == "none" else plan
            assert not isinstance(piece, str)
            await self.transport.connect_peer(peer_id, theirs.agent_metadata, summary, piece)
        except Exception as exc:
            self.stats["handshakes_refused"] += 1
            reason = clip_reason(
                f"prefill rank {self.rank} refused decode agent {theirs.agent!r}: "
                f"{type(exc).__name__}: {exc}"
            )
            _log.warning("handshake refused: %s", reason)
            with contextlib.suppress(Exception):
                with anyio.fail_after(1.0):
                    await stream.send(codec.encode(Error(None, reason)))
            raise FrameError(reason, None, True) from exc

    async def _handshake_frame(
        self, stream: SocketStream | _RawConnection, reader: FrameReader
    ) -> Frame:
        """The peer's next frame during the handshake: its Hello, then (with a secret) the first
        sealed frame, which proves it holds the secret. Frames behind it stay in the reader: the
        peer may send its first room frames at once, and a slow handshake here (a NIXL connect,
        a loaded machine) lets them arrive in one segment with it."""
        data = b""
        while True:
            items = reader.feed(data, max_items=1)
            if items:
                first = items[0]
                if isinstance(first, FrameError):
                    # A fresh error: the reader keeps the one it died of, and raising that one
                    # would tie the reader's buffers to its traceback (a reference cycle that
                    # only the cyclic GC frees).
                    raise FrameError(first.reason, None, True, tag=first.tag)
                if isinstance(first, Error):  # the peer refused this handshake and says why
                    raise FrameError(f"handshake refused: {first.reason}", None, True, tag="Error")
                return first
            data = await stream.receive()

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
                    fatal = next(i for i in items if isinstance(i, FrameError) and i.fatal)
                    raise FrameError(fatal.reason, None, True)  # fresh: see _handshake_frame
        except (
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            OSError,
            FrameError,
        ) as exc:
            self._lose(link, f"connection to {link.peer_id} closed: {exc or type(exc).__name__}")
        except Exception as exc:
            # A bug reached by one peer's frames costs that link, not every link of the engine.
            self._unexpected(f"reading from {link.peer_id}", exc)
            self._lose(link, f"connection to {link.peer_id} closed: internal error: {exc!r}")
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _write(self, link: _Link, stream: SocketStream) -> None:
        beat = itertools.count()
        try:
            while not link.closed:
                try:
                    with anyio.fail_after(self.config.heartbeat_s):
                        payload = await link.outbox.get()
                except TimeoutError:
                    payload = self._codec.payload(Heartbeat(next(beat)))
                if not payload:  # the wake-up a lost link queues
                    continue
                await stream.send(link.codec.seal(payload))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._lose(link, f"connection to {link.peer_id} broken: {exc or type(exc).__name__}")
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
            if now - last > limit:
                # This process stood still (SIGSTOP, a VM or GC stall): its peers' silence is
                # its own. Judge them from now on, once what they sent meanwhile is read.
                self.stats["own_stalls"] += 1
                for link in self._links.values():
                    link.last_seen = max(link.last_seen, now)
            last = now
            for link in list(self._links.values()):
                if now - link.last_seen > limit:
                    self._lose(
                        link, f"{link.peer_id} silent for more than {self.config.silence_s:g}s"
                    )
                elif self._prefill is not None:
                    # Leases are asked for on a timer, not when idle: a busy link must renew.
                    self._do(self._prefill.lease_due(link.generation, mono))
            if self._prefill is not None:
                self._do(self._prefill.tick(mono))
            else:
                assert self._decode is not None
                self._do(self._decode.tick(mono, self.progress_watch.steady_for(mono)))
            self._run_woken()

    def _lose(self, link: _Link, reason: str) -> None:
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
        core = self._prefill if self._prefill is not None else self._decode
        assert core is not None
        self._do(core.link_lost(link.generation, reason, self._now()))
        link.outbox.put_nowait(b"")  # wake the writer so it notices
        decode = self._decode
        if (
            decode is not None
            and isinstance(link.key, int)
            and link.key not in self._reconnecting
            and decode.owes(link.peer_id)
            and self._loop is not None
            and not self._closing
        ):
            # A task of its own, not the task group's: _lose also runs from plain callbacks,
            # and aclose cancels and awaits it.
            self._reconnecting.add(link.key)
            task = self._loop.create_task(self._owed(link.key, link.peer_id))
            self._owed_tasks.add(task)
            task.add_done_callback(self._owed_tasks.discard)

    # -- incoming frames -----------------------------------------------------------------------

    def _on_frame(self, link: _Link, frame: Frame) -> None:
        if isinstance(frame, Heartbeat):
            return
        gen, now = link.generation, self._now()
        prefill, decode = self._prefill, self._decode
        actions: list[Action] | None = None
        if prefill is not None:
            if isinstance(frame, LeaseGrant):
                actions = prefill.lease_granted(gen, frame.seq, frame.lease_ms, now)
            elif isinstance(frame, RoomClaim):
                actions = prefill.on_claim(gen, frame, now)
            elif isinstance(frame, RoomMetadata):
                actions = prefill.on_metadata(gen, frame, now)
            elif isinstance(frame, RoomAbort):
                actions = prefill.on_abort(gen, frame, now)
            elif isinstance(frame, Reconcile):
                actions = prefill.on_reconcile(gen, frame, now)
            elif isinstance(frame, Error):
                _log.warning("peer %s reported: %s", link.peer_id, frame.reason)
                if frame.room is None:
                    link.error = frame.reason
                actions = prefill.on_error(gen, frame)
        else:
            assert decode is not None
            if isinstance(frame, LeaseRequest):
                actions = decode.lease_requested(gen, frame, now)
            elif isinstance(frame, RoomOutcome):
                actions = decode.on_outcome(gen, frame)
            elif isinstance(frame, RoomSettled):
                actions = decode.on_settled(gen, frame)
            elif isinstance(frame, RoomAbort):
                actions = decode.on_abort(gen, frame)
            elif isinstance(frame, Error):
                _log.warning("peer %s reported: %s", link.peer_id, frame.reason)
                if frame.room is None:
                    link.error = frame.reason
                actions = decode.on_error(gen, frame)
        if actions is None:
            # A valid frame that this role never receives: the peer is confused, not hostile.
            self.stats["frames_rejected"] += 1
            room = getattr(frame, "room", None)
            reason = f"{type(frame).__name__} is not sent to a {self.role} rank"
            self._send(link, Error(room, reason, getattr(frame, "generation", None)))
            return
        self._do(actions)
        self._run_woken()

    def _rejected(self, link: _Link, error: FrameError) -> None:
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
        for task in list(self._owed_tasks):
            await cancel_and_wait(task)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
