"""What every kvfsm listener and connection shares: the raw stream, the accept loop, the
handshake's reads, heartbeats and liveness.

Three listeners accept connections from peers: prefill's control channel, the pipeline's stage
hub, and the bootstrap registry. Two kinds of link speak frames over them: control links and
stage links. They keep the same rules, written once here:

Rule 1: a connection is read only as far as asked until its peer is authenticated
        (``RawConnection``: one ``recv`` of at most the bytes asked for). What a stranger sends
        beyond that waits in the kernel's socket buffer, not in this process.
Rule 2: an accept error never ends a listener (``accept_forever``). Out of descriptors (EMFILE,
        ENFILE) or kernel memory (ENOBUFS, ENOMEM), the listener first lets its owner give
        something back (``shed``), then backs off, doubling to a cap, and accepts again as soon
        as descriptors return: a listener that stopped while its address is still advertised
        would fail every peer that comes later. Errors are counted, and logged at most once per
        ``log_every_s``, with one line when accepting works again (``AcceptErrors``).
Rule 3: a handshake reads one frame at a time (``next_frame``): frames behind the Hello stay in
        the reader, to be handled once the link exists. The handshake itself (``shake_hands``)
        is: send our hello, read and check theirs, and with a secret switch to session keys and
        exchange one sealed frame each way (key confirmation) before anything is registered.
Rule 4: an idle link sends a heartbeat every ``heartbeat_s`` (``send_or_beat``), and a peer
        silent for longer than its silence limit is lost (``Liveness``). Any frame is a sign of
        life.
Rule 5: a peer's failure is named: ``describe`` gives an exception's message, or its type where
        the message is empty (an ``EndOfStream`` says nothing by itself).
Rule 6: per-host bounds count a connection by ``peer_host``: its IPv4 address, or the /64 of
        its IPv6 address (a single host commonly holds a whole /64).

The frames themselves (their types, codecs and sessions) belong to the packages that speak them;
here they are only ``bytes`` in and items out, so the registry (HTTP, no frames) uses the accept
loop and the rest of the module costs it nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, TypeVar

import anyio
from anyio.abc import SocketStream

__all__ = [
    "PEER_ERRORS",
    "READ_BYTES",
    "RESOURCE_ERRNOS",
    "AcceptErrors",
    "Liveness",
    "RawConnection",
    "accept_forever",
    "describe",
    "next_frame",
    "peer_host",
    "send_or_beat",
    "shake_hands",
    "tune",
]

#: What a peer can end a connection with at the socket level: its silence, its hang-up, or the
#: socket's errors. A package that speaks frames adds its own frame error (``kvfsm.control``).
PEER_ERRORS: Final[tuple[type[BaseException], ...]] = (
    TimeoutError,
    OSError,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)

#: One ``recv`` of a connection that is read only as far as asked (Rule 1).
READ_BYTES: Final = 65536

#: accept() failures that mean "out of descriptors or buffers": the pending connection stays
#: queued in the kernel, so the listener frees a descriptor (or waits) and tries again.
RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def describe(exc: BaseException, *, typed: bool = False) -> str:
    """What happened, never empty: the message, or the exception's type if it has none.
    ``typed``: always with the type first (``ValueError: bad``), and without a dangling colon
    when the message is empty."""
    text = str(exc)
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if typed else text


def peer_host(sock: socket.socket) -> str:
    """Who a connection comes from, as per-host bounds count it (Rule 6): the peer's IPv4
    address (an IPv4-mapped IPv6 one too), the /64 network of an IPv6 address, or '' when the
    socket has no peer address any more (it was reset before this was asked)."""
    try:
        address = sock.getpeername()
    except OSError:
        return ""
    if not isinstance(address, tuple):
        return str(address)  # a Unix socket's path
    text = str(address[0]).split("%", 1)[0]  # without an IPv6 zone
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def tune(sock: socket.socket) -> None:
    """An accepted socket as every link uses it: non-blocking, no Nagle delay on small frames."""
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class RawConnection:
    """An accepted connection before it is authenticated: the raw non-blocking socket, read only
    as far as asked (Rule 1). After the handshake, :meth:`to_stream` hands it to anyio, whose
    streams read ahead (uvloop: up to 8 MiB per socket per wake-up)."""

    __slots__ = ("_loop", "sock")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self._loop = loop

    async def receive(self, max_bytes: int = READ_BYTES) -> bytes:
        data = await self._loop.sock_recv(self.sock, max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        await self._loop.sock_sendall(self.sock, item)

    async def aclose(self) -> None:
        self.sock.close()

    async def to_stream(self) -> SocketStream:
        return await SocketStream.from_socket(self.sock)


# -- accepting (Rule 2) ----------------------------------------------------------------------


class AcceptErrors:
    """Counts a listener's accept errors and logs them at most once per ``log_every_s``, with one
    line when accepting works again. ``count`` is the total; with ``stats``, it is also kept in
    ``stats["accept_errors"]``, the listener's own counters."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        log_every_s: float = 10.0,
        stats: dict[str, int] | None = None,
    ) -> None:
        self.count = 0
        self._stats = stats
        self._log = log
        self._what = what
        self._every = log_every_s
        self._unreported = 0
        self._next_log = 0.0
        self._failing = False
        self._recovery: asyncio.TimerHandle | None = None

    @property
    def failing(self) -> bool:
        return self._failing

    def failed(self, exc: OSError, holding: int | None = None) -> None:
        self.count += 1
        if self._stats is not None:
            self._stats["accept_errors"] = self._stats.get("accept_errors", 0) + 1
        self._unreported += 1
        self._failing = True
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + self._every
        held = "" if holding is None else f"; holding {holding} connection(s)"
        self._log.warning(
            "%s: accept() failed %d time(s) since the last report (%s), %d in all%s; backing off "
            "until it succeeds (one such line per %g s at most)",
            self._what,
            self._unreported,
            exc,
            self.count,
            held,
            self._every,
        )
        self._unreported = 0

    def succeeded(self) -> None:
        if not self._failing:
            return
        self._failing = False
        if self._recovery is None:
            delay = max(self._next_log - time.monotonic(), 0.0)
            self._recovery = asyncio.get_running_loop().call_later(delay, self._report_recovery)

    def _report_recovery(self) -> None:
        self._recovery = None
        if self._failing:  # failing again: its own line reports it
            return
        self._next_log = time.monotonic() + self._every
        self._log.warning(
            "%s: accepting connections again (%d accept error(s) since the last report, %d in all)",
            self._what,
            self._unreported,
            self.count,
        )
        self._unreported = 0

    def close(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            self._recovery = None


async def accept_forever(
    sock: socket.socket,
    accepted: Callable[[socket.socket], Awaitable[None]],
    errors: AcceptErrors,
    *,
    shed: Callable[[], bool] | None = None,
    holding: Callable[[], int] | None = None,
    backoff_min_s: float = 0.005,
    backoff_max_s: float = 0.25,
) -> None:
    """Accept on the listening ``sock`` until cancelled or the socket is closed, and await
    ``accepted(conn)`` for each connection (a listener that serves many at once starts a task
    there and returns). ``shed()``, called when descriptors ran out, frees one held connection
    if the owner has one to give (True: accept again at once)."""
    loop = asyncio.get_running_loop()
    backoff = backoff_min_s
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue  # the client gave up before we accepted: nothing to do
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return
        except OSError as exc:
            if sock.fileno() < 0:
                return  # the listener was closed under us
            errors.failed(exc, None if holding is None else holding())
            # Out of descriptors: what the owner holds idle is the cheapest thing to give back.
            # Its descriptor is free once the loop turns; if not yet, the next failure sheds
            # another.
            if shed is not None and exc.errno in RESOURCE_ERRNOS and shed():
                await asyncio.sleep(0)
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, backoff_max_s)
            continue
        backoff = backoff_min_s
        errors.succeeded()
        await accepted(conn)


# -- handshakes (Rule 3) ---------------------------------------------------------------------

_Item = TypeVar("_Item")


class _Receiving(Protocol):
    async def receive(self, max_bytes: int = ...) -> bytes: ...


class _Sending(Protocol):
    async def send(self, item: bytes) -> None: ...


class _Stream(_Receiving, _Sending, Protocol):
    pass


class Reader(Protocol[_Item]):
    """A frame reader: bytes in, at most ``max_items`` decoded items out, the rest kept."""

    def feed(self, data: bytes | memoryview, max_items: int | None = ...) -> list[_Item]: ...


async def next_frame(stream: _Receiving, reader: Reader[_Item]) -> _Item:
    """The next item the reader decodes, reading only as far as it needs: whatever came behind
    it stays in the reader."""
    items = reader.feed(b"", max_items=1)
    while not items:
        items = reader.feed(await stream.receive(READ_BYTES), max_items=1)
    return items[0]


async def shake_hands(
    stream: _Stream,
    reader: Reader[_Item],
    hello: bytes,
    *,
    check: Callable[[_Item], object],
    session: Callable[[_Item], bytes | None],
    confirmed: Callable[[_Item], object],
) -> _Item:
    """Send ``hello``, read the peer's first frame and ``check`` it (raise to refuse). Then
    ``session(theirs)`` switches the reader (and the caller's sealer) to session keys and returns
    the sealed key confirmation to send, or None without a secret; the peer's own confirmation
    is read and passed to ``confirmed`` (raise to refuse). Returns the peer's hello."""
    await stream.send(hello)
    theirs = await next_frame(stream, reader)
    check(theirs)
    confirmation = session(theirs)
    if confirmation is not None:
        await stream.send(confirmation)
        confirmed(await next_frame(stream, reader))
    return theirs


# -- heartbeats and liveness (Rule 4) ----------------------------------------------------------


class Liveness:
    """When a peer was last heard from, and whether it has been silent too long. Sans-IO: every
    call takes ``now`` on the caller's clock."""

    __slots__ = ("last_seen", "silence_s")

    def __init__(self, now: float, silence_s: float) -> None:
        self.last_seen = now
        self.silence_s = silence_s

    def seen(self, now: float) -> None:
        self.last_seen = now

    def left(self, now: float) -> float:
        """Seconds until the peer counts as lost (<= 0: it does)."""
        return self.last_seen + self.silence_s - now

    def overdue(self, now: float, early_s: float = 0.0) -> bool:
        """Silent for longer than the limit (less ``early_s``, for a watchdog that ticks)."""
        return now - self.last_seen > self.silence_s - early_s

    def excuse(self, now: float) -> None:
        """This process stood still (SIGSTOP, a stall): the silence was its own, so the peer is
        judged from ``now`` on."""
        self.last_seen = max(self.last_seen, now)


async def send_or_beat(
    send: Callable[[bytes], Awaitable[None]],
    next_payload: Callable[[], Awaitable[bytes]],
    heartbeat_s: float,
    beat: Callable[[], bytes],
    *,
    open_: Callable[[], bool] = lambda: True,
) -> None:
    """A link's writer: send what ``next_payload`` gives, and a ``beat()`` whenever nothing came
    for ``heartbeat_s``, while ``open_()``. An empty payload is a wake-up (the link may have
    closed), not a frame. Returns when ``open_()`` is false; socket errors propagate."""
    while open_():
        try:
            with anyio.fail_after(heartbeat_s):
                payload = await next_payload()
        except TimeoutError:
            payload = beat()
        if payload:
            await send(payload)
