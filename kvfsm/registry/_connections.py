"""The bootstrap registry's connections: its own accept loops, the connection cap and the idle
reaper (``Listener``), under ``BootstrapServer``'s aiohttp application.

Connections
-----------

The registry does its own accepting so that nobody can hold it with connections that send
nothing (the process's descriptors are shared with whatever embeds it). Every limit is a
``BootstrapServer`` argument (and a ``kvfsm bootstrap`` flag):

``max_connections`` (``MAX_CONNECTIONS``, 512)   connections held at once. A connection accepted
                                    beyond it makes room: the connection idle the longest is
                                    closed (*shed*); if none is idle, the one running a request
                                    the longest; never the newcomer. Idle means no request in
                                    progress: just connected, partway through a request head, or
                                    kept alive after a response. 512 leaves half of a common
                                    1024-descriptor limit to the embedding process.
``idle_timeout_s`` (``IDLE_TIMEOUT_S``, 5 s)     an idle connection is closed this long after it
                                    was accepted or answered its last request. So a request head
                                    must be complete within it (a slow sender gains nothing by
                                    trickling bytes) and keep-alive lasts as long.
``request_timeout_s`` (``REQUEST_TIMEOUT_S``, 10 s) from a complete request head to the end of
                                    the response: reading the body, handling, writing. Past it
                                    the request gets 408 and the connection is closed (or, if the
                                    answer had begun, it is cut off). This one is the server's
                                    outermost middleware (``_server``).

Request heads are held to aiohttp's limits (8190-byte request line and header fields) and bodies
to ``MAX_BODY_BYTES``. When ``accept()`` fails because descriptors ran out (EMFILE, ENFILE,
ENOBUFS, ENOMEM), the listener closes the connection idle the longest, if there is one, and tries
again at once; if there is none it backs off (5 ms doubling to 250 ms) and tries again, so it
serves again as soon as descriptors come back. Accept errors never end the listener; they are
counted and logged (at most one line per 10 s). The counters are ``BootstrapServer.stats`` and the
``connections`` field of ``/health``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any, Final, cast

from kvfsm._tasks import cancel_and_wait
from kvfsm.link import AcceptErrors, accept_forever
from kvfsm.registry._schemas import ConnectionStats

__all__ = ["IDLE_TIMEOUT_S", "MAX_CONNECTIONS", "Connection", "Listener", "bind"]

_log = logging.getLogger("kvfsm.registry")

#: Connections the server holds at once (see "Connections" above).
MAX_CONNECTIONS: Final = 512
#: An idle connection (no request in progress) is closed this long after it last had something
#: to do: its accept or its last response.
IDLE_TIMEOUT_S: Final = 5.0

# How long setting up an accepted connection (transport and protocol) may take.
_CONNECT_TIMEOUT_S: Final = 5.0
# Connections a burst may queue in the kernel (no descriptor of ours) while the accept loop
# drains them; the kernel caps it at net.core.somaxconn.
_BACKLOG: Final = 1024


def _now() -> float:
    """The running loop's clock: the reaper sleeps on it, so the times it compares are on the
    same clock as its sleeps (and a virtual loop clock runs the whole tracker)."""
    return asyncio.get_running_loop().time()


class Connection(asyncio.Protocol):
    """aiohttp's protocol for one accepted connection, wrapped so that the listener sees it open
    and close. Everything else is passed through unchanged."""

    __slots__ = ("_inner", "_listener", "requests", "transport")

    def __init__(self, inner: asyncio.Protocol, listener: Listener) -> None:
        self._inner = inner
        self._listener = listener
        #: Requests in progress (aiohttp runs one at a time per connection; a count is safer).
        self.requests = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports do not derive from asyncio's.
        self.transport = cast("asyncio.Transport", transport)
        self._listener.opened(self)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.lost(self)
        self._inner.connection_lost(exc)


class Listener:
    """The accept loops, the connection cap and the idle reaper of one server.

    aiohttp (through ``asyncio``'s ``create_server``) would accept for us, but then nothing
    bounds the connections a client can hold, and asyncio's accept loop (3.11) answers EMFILE
    by logging an error and scheduling a retry for every attempt of its accept burst, so the
    retries multiply: about 200,000 log lines in 30 s with 1,100 connections held at a 1024
    descriptor limit, and no count we could read. So the loop here is ours: ``sock_accept``,
    then ``connect_accepted_socket`` with aiohttp's protocol factory, one connection at a time.

    Idle connections are kept in a dict in the order they became idle, so the one idle the
    longest (the next to time out, the first to shed) is always first.
    """

    def __init__(self, *, max_connections: int, idle_timeout_s: float) -> None:
        self._factory: Callable[[], asyncio.Protocol] | None = None
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        #: Idle connections -> when they became idle (:func:`_now`), oldest first; and the busy
        #: ones -> when their request began, oldest first.
        self._idle: dict[Connection, float] = {}
        self._busy: dict[Connection, float] = {}
        self._by_transport: dict[asyncio.BaseTransport, Connection] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.accepted = 0
        self.shed = 0
        self.idle_closed = 0
        self.request_timeouts = 0
        # Counted, and logged at most once per 10 s with a line when accepting works again.
        self._errors = AcceptErrors(_log, "bootstrap")

    # -- the counters -------------------------------------------------------------------------

    @property
    def accept_errors(self) -> int:
        return self._errors.count

    def stats(self) -> ConnectionStats:
        return ConnectionStats(
            open=len(self._by_transport),
            limit=self.max_connections,
            busy=len(self._busy),
            accepted=self.accepted,
            shed=self.shed,
            idle_closed=self.idle_closed,
            request_timeouts=self.request_timeouts,
            accept_errors=self.accept_errors,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, factory: Callable[[], asyncio.Protocol], sockets: list[socket.socket]) -> None:
        """Accept on ``sockets``; each connection gets a protocol from ``factory`` (aiohttp's)."""
        self._factory = factory
        for sock in sockets:
            name = f"kvfsm-bootstrap-accept-{sock.getsockname()[1]}"
            self._tasks.append(asyncio.create_task(self._accept(sock), name=name))
        self._tasks.append(asyncio.create_task(self._reap(), name="kvfsm-bootstrap-reaper"))

    async def stop(self) -> None:
        """Stop accepting and reaping; the connections themselves are aiohttp's to close."""
        self._errors.close()
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)

    # -- the protocol's and the middleware's calls --------------------------------------------

    def opened(self, conn: Connection) -> None:
        assert conn.transport is not None
        self.accepted += 1
        self._by_transport[conn.transport] = conn
        self._idle[conn] = _now()

    def lost(self, conn: Connection) -> None:
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)
        self._idle.pop(conn, None)
        self._busy.pop(conn, None)

    def connection(self, transport: asyncio.BaseTransport | None) -> Connection | None:
        return None if transport is None else self._by_transport.get(transport)

    def request_started(self, conn: Connection) -> None:
        conn.requests += 1
        if self._idle.pop(conn, None) is not None:
            self._busy[conn] = _now()

    def request_done(self, conn: Connection) -> None:
        conn.requests -= 1
        # Not back in the table if it was closed meanwhile (shed, or lost).
        if conn.requests == 0 and self._busy.pop(conn, None) is not None:
            self._idle[conn] = _now()  # last in the dict: the newest idle

    # -- closing ------------------------------------------------------------------------------

    def _close(self, conn: Connection) -> None:
        """Close ``conn`` now; it leaves the table at once (its ``connection_lost`` comes later)."""
        self._idle.pop(conn, None)
        self._busy.pop(conn, None)
        transport = conn.transport
        if transport is None:
            return
        # close() waits to flush unsent bytes, which a client that does not read can make
        # forever (a close already under way, too); an idle connection normally has none, so
        # this only cuts off such a reader.
        if transport.get_write_buffer_size():
            transport.abort()
        elif not transport.is_closing():
            transport.close()

    def _shed_one(self) -> bool:
        """Close the connection idle the longest; False if none is idle."""
        if not self._idle:
            return False
        self._close(next(iter(self._idle)))
        self.shed += 1
        return True

    def _enforce_cap(self, newest: Connection) -> None:
        """Beyond the cap, close the connection idle the longest, else the one busy the longest;
        never the newcomer. Refusing newcomers instead would let whoever holds max_connections
        idle connections (or as many slow request bodies) lock everyone else out."""
        while len(self._idle) + len(self._busy) > self.max_connections:
            victim = _oldest(self._idle, newest) or _oldest(self._busy, newest)
            if victim is None:  # only the newcomer: cannot happen with max_connections >= 1
                return
            self._close(victim)
            self.shed += 1

    async def _reap(self) -> None:
        """Close idle connections ``idle_timeout_s`` after they became idle, oldest first."""
        while True:
            now = _now()
            deadline = now - self.idle_timeout_s
            while self._idle:
                conn, since = next(iter(self._idle.items()))
                if since > deadline:
                    break
                self._close(conn)
                self.idle_closed += 1
            # The first idle connection times out first; any that become idle later, later.
            first = next(iter(self._idle.values()), now)
            await asyncio.sleep(max(first + self.idle_timeout_s - _now(), 0.001))

    # -- accepting ----------------------------------------------------------------------------

    async def _accept(self, sock: socket.socket) -> None:
        await accept_forever(
            sock,
            self._connect,
            self._errors,
            shed=self._shed_one,
            holding=lambda: len(self._idle) + len(self._busy),
        )

    async def _connect(self, raw: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Bounded: on uvloop a protocol whose connection_made raised leaves this waiting
            # forever, and the listener must not stop for one connection.
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                _, protocol = await loop.connect_accepted_socket(self._wrap, raw)
        except OSError as exc:  # reset already, say; the listener goes on regardless
            _log.debug("bootstrap: dropped a connection at accept: %s", exc)
            raw.close()
            return
        except TimeoutError:
            _log.error("bootstrap: an accepted connection was not set up; dropped it")
            raw.close()
            return
        assert isinstance(protocol, Connection)
        self._enforce_cap(protocol)

    def _wrap(self) -> Connection:
        assert self._factory is not None
        return Connection(self._factory(), self)


def _oldest(table: dict[Connection, float], other_than: Connection) -> Connection | None:
    """The first connection of ``table`` (oldest first) that is not ``other_than``."""
    for conn in table:
        if conn is not other_than:
            return conn
    return None


async def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host`` (every address it resolves to), non-blocking. As asyncio's
    ``create_server`` does: SO_REUSEADDR, IPv6 sockets v6-only, ``""`` for every interface; and
    with ``port=0`` every socket takes the port the first one got."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, resolved in infos:
            if (family, resolved) in seen:
                continue
            seen.add((family, resolved))
            address = resolved
            if port == 0 and sockets:
                address = (resolved[0], sockets[0].getsockname()[1], *resolved[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"error while attempting to bind on address {address!r}: {exc.strerror}",
                ) from None
            sock.listen(_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise OSError(f"no address to bind for host {host!r}")
    return sockets
