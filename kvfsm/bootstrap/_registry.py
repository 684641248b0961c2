"""The bootstrap registry: prefill ranks register where they listen; decode ranks look them up.

This is kvfsm's version of SGLang's bootstrap server (``PUT /route``, ``GET /route``, 503 until
every rank has registered, ``/health``, periodic entry cleanup); see
``research/sglang-contract.md`` §4. It is an aiohttp application that any asyncio loop can embed
(``BootstrapServer``), a small client (``BootstrapClient``), and between them JSON bodies that
``msgspec`` decodes against typed schemas.

What a rank publishes
---------------------

One ``RankInfo`` per rank of an *engine* (a deployment id): its topology coordinates, the address of
its control channel, its NIXL agent name, an opaque ``layout`` blob (msgpack of the rank's layout
summary; the registry stores and returns it, never reads it) and an ``incarnation`` that changes
whenever the rank restarts. Everything is validated on the way in: engine ids match
``ENGINE_PATTERN`` (they appear in URL paths), ``0 <= tp_rank < tp_size``, ranks and ports are in
range, strings carry no control characters, unknown fields are refused.

Routes (all bodies JSON; errors are ``{"error": "<what and which field>"}``)
--------------------------------------------------------------------------

``PUT /v1/ranks``                   register or refresh one rank. Re-registering *is* the
                                    heartbeat: it pushes the entry's expiry ``ttl_s`` out. Same
                                    incarnation and same fields: refreshed. New incarnation:
                                    replaces the old entry. Same incarnation, different fields:
                                    409 (two processes claim one rank). Also 409 if the rank's
                                    (tp, dp, pp) coordinates or its ``tp_size`` clash with another
                                    live rank of the engine; 400 if ``rank >= expected_ranks``.
``DELETE /v1/ranks/{engine}/{rank}`` remove one rank (``?incarnation=N``: only that incarnation,
                                    else 409; so a late goodbye from a dead process cannot remove
                                    its successor). 404 if unknown.
``GET /v1/ranks?engine=E``          every live rank of E, ordered by rank; **503** with
                                    ``"not ready: 3 of 4 ranks registered"`` until all
                                    ``expected_ranks`` are registered and unexpired.
``GET /v1/ranks/{engine}/{rank}``   one rank; 404 if unknown or expired.
``GET /health``                     200 while serving; the body says whether every known engine is
                                    ready (and false while no engine has registered at all), and
                                    carries the connection counters (``connections``).

Unknown routes are 404, wrong methods 405, bodies over ``MAX_BODY_BYTES`` (1 MiB) 413, bodies
that do not decode 400 naming the field. Nothing a client sends can stop the server: an
unexpected exception in a handler is logged and answered 500. At most ``MAX_ENGINES`` engines
are held at once (429 beyond), so an unauthenticated writer cannot grow memory without bound.

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
                                    answer had begun, it is cut off).

Request heads are held to aiohttp's limits (8190-byte request line and header fields) and bodies
to ``MAX_BODY_BYTES``. When ``accept()`` fails because descriptors ran out (EMFILE, ENFILE,
ENOBUFS, ENOMEM), the listener closes the connection idle the longest, if there is one, and tries
again at once; if there is none it backs off (5 ms doubling to 250 ms) and tries again, so it
serves again as soon as descriptors come back. Accept errors never end the listener; they are
counted and logged (at most one line per 10 s). The counters are ``BootstrapServer.stats`` and the
``connections`` field of ``/health``.

Expiry
------

An entry lives ``ttl_s`` (default 30 s) after its last registration, on the monotonic clock.
Expired entries are dropped lazily by every read (a lookup never returns a dead rank) and by a
sweep task every ``ttl_s / 2`` (at most 5 s), which also logs them. Ranks should re-register every
``ttl_s / 3`` or so; ``register`` returns the ttl so they need not be configured twice.

Security
--------

The default bind address is ``127.0.0.1``: nothing off the host can reach a registry started
without arguments. To serve a cluster pass ``host="0.0.0.0"`` (or a specific interface address;
``--host`` on the command line) and, unless the network is trusted, a shared ``secret``. With a
secret, every mutating request (PUT, DELETE) must carry a fresh HMAC signature (``_auth.py``);
unsigned, wrongly signed or stale requests get 401 and change nothing. Reads stay unsigned on
purpose: they reveal only what the ranks themselves publish to their peers (host, port, agent
name, layout geometry) and decode ranks must be able to read them with no more than an address.
A deployment that must hide those addresses should bind the registry to a private interface (or
put it behind an authenticating proxy). There is no TLS: secrecy of the traffic is the network's
job.

The table itself (``Registry``) is sans-IO: plain methods that take ``now``, so its rules can be
tested without sockets or sleeps; ``BootstrapServer`` adds HTTP and the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Annotated, Any, Final, Literal, Self, TypeVar, cast

import aiohttp
import msgspec
import yarl
from aiohttp import web
from aiohttp.typedefs import Middleware

from kvfsm.bootstrap._auth import AuthError, check_request, check_secret, request_headers

__all__ = [
    "DEFAULT_PORT",
    "ENGINE_PATTERN",
    "IDLE_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "MAX_ENGINES",
    "REQUEST_TIMEOUT_S",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "ConnectionStats",
    "EngineStatus",
    "Health",
    "NotFoundError",
    "NotReadyError",
    "RankInfo",
    "Registered",
    "Registry",
    "RejectedError",
    "UnauthorizedError",
    "UnreachableError",
]

_log = logging.getLogger("kvfsm.bootstrap")

#: The port ``kvfsm bootstrap`` listens on unless told otherwise (SGLang's bootstrap port).
DEFAULT_PORT: Final = 8998
#: Request bodies above this size are refused with 413.
MAX_BODY_BYTES: Final = 1024 * 1024
#: Engines held at once; registrations of further engines get 429.
MAX_ENGINES: Final = 1024
#: Engine ids: they are URL path segments, so a conservative alphabet.
ENGINE_PATTERN: Final = r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z"
#: Connections the server holds at once (see "Connections" above).
MAX_CONNECTIONS: Final = 512
#: An idle connection (no request in progress) is closed this long after it last had something
#: to do: its accept or its last response.
IDLE_TIMEOUT_S: Final = 5.0
#: A request must be read, handled and answered within this long of its head.
REQUEST_TIMEOUT_S: Final = 10.0
_MAX_RANKS: Final = 1 << 20
_MAX_LAYOUT_BYTES: Final = 512 * 1024
_SWEEP_MAX_S: Final = 5.0

_Engine = Annotated[str, msgspec.Meta(pattern=ENGINE_PATTERN)]
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_RANKS)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=_MAX_RANKS)]
# Host names, IPv4 and IPv6 literals (with brackets or zone ids); no spaces or control characters.
_Host = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9._:%\[\]-]{1,253}\Z")]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Agent = Annotated[str, msgspec.Meta(pattern=r"\A[^\x00-\x1f\x7f]{1,256}\Z")]
_Layout = Annotated[bytes, msgspec.Meta(max_length=_MAX_LAYOUT_BYTES)]
_Incarnation = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class RankInfo(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """What one rank publishes. ``layout`` is opaque here; it travels base64 in JSON."""

    engine: _Engine
    #: Global rank within the engine: ``0 <= rank < expected_ranks`` of the registry.
    rank: _Rank
    tp_rank: _Rank
    tp_size: _Size
    dp_rank: _Rank
    pp_rank: _Rank
    #: The rank's control-channel address.
    host: _Host
    port: _Port
    #: The rank's NIXL agent name.
    agent: _Agent
    #: msgpack of the rank's layout summary.
    layout: _Layout
    #: Changes whenever the rank restarts (a start time in ns, a random 63-bit number...).
    incarnation: _Incarnation
    #: Data-parallel width of the engine, so a decode rank can pick the DP rank serving a room.
    dp_size: _Size = 1
    #: Pipeline-parallel depth of the engine: decode reads each request from every stage.
    pp_size: _Size = 1
    #: Pipeline stage 0 only (``pp_size > 1``): where the other stages of its pipeline report
    #: their rooms' statuses (``_stages``); 0 otherwise.
    stage_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(
                f"tp_rank {self.tp_rank} out of range: 0 <= tp_rank < tp_size ({self.tp_size})"
            )
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank {self.dp_rank} out of range: 0 <= dp_rank < dp_size ({self.dp_size})"
            )
        if self.pp_rank >= self.pp_size:
            raise ValueError(
                f"pp_rank {self.pp_rank} out of range: 0 <= pp_rank < pp_size ({self.pp_size})"
            )

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)``: unique among the live ranks of an engine."""
        return (self.tp_rank, self.dp_rank, self.pp_rank)


Outcome = Literal["registered", "refreshed", "replaced"]


class Registered(msgspec.Struct, frozen=True):
    """The answer to a registration. Re-register well within ``ttl_s`` (every ``ttl_s / 3``)."""

    outcome: Outcome
    ttl_s: float


class RankList(msgspec.Struct, frozen=True):
    engine: str
    ranks: list[RankInfo]


class EngineStatus(msgspec.Struct, frozen=True):
    registered: int
    expected: int
    ready: bool


class ConnectionStats(msgspec.Struct, frozen=True):
    """The listener's connections now and its counters since it started."""

    #: Connections held now (their descriptors: one being closed counts until it is), and the
    #: most held open for use (``max_connections``).
    open: int
    limit: int
    #: Of the open ones, those running a request.
    busy: int
    accepted: int
    #: Closed to make room: beyond ``limit`` (the one idle the longest, else the one busy the
    #: longest), or when accept() ran out of descriptors (idle ones only).
    shed: int
    #: Closed after ``idle_timeout_s`` with no request in progress.
    idle_closed: int
    #: Requests cut off after ``request_timeout_s``.
    request_timeouts: int
    #: Failed accept() calls (EMFILE, ENFILE...); each was followed by shedding or a back-off.
    accept_errors: int


class Health(msgspec.Struct, frozen=True):
    """``ready``: at least one engine is known and every known engine has all its ranks.

    ``connections``: the server's ``ConnectionStats`` (``None`` from the table alone).
    """

    ready: bool
    detail: str
    engines: dict[str, EngineStatus]
    connections: ConnectionStats | None = None


class _ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    error: str
    registered: int | None = None
    expected: int | None = None


# -- the table (sans-IO) ---------------------------------------------------------------------------


class RefusedError(Exception):
    """The registry refuses a request; ``status`` is the HTTP status that says why."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        registered: int | None = None,
        expected: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.registered = registered
        self.expected = expected


@dataclass(slots=True)
class _Entry:
    info: RankInfo
    expires_at: float


class Registry:
    """The rank table. No IO and no clock: every method takes ``now`` (monotonic seconds)."""

    def __init__(
        self, *, expected_ranks: int, ttl_s: float, max_engines: int = MAX_ENGINES
    ) -> None:
        if not 1 <= expected_ranks <= _MAX_RANKS:
            raise ValueError(f"expected_ranks must be in 1..{_MAX_RANKS}, got {expected_ranks}")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        self.expected_ranks = expected_ranks
        self.ttl_s = ttl_s
        self.max_engines = max_engines
        self._engines: dict[str, dict[int, _Entry]] = {}

    def register(self, info: RankInfo, now: float) -> Outcome:
        """Add, refresh or replace ``info``'s entry; raise ``RefusedError`` if it cannot be held."""
        if info.rank >= self.expected_ranks:
            raise RefusedError(
                400,
                f"rank {info.rank} out of range: this registry expects ranks "
                f"0..{self.expected_ranks - 1} per engine",
            )
        entries = self._live(info.engine, now)
        if entries is None and len(self._engines) >= self.max_engines:
            raise RefusedError(429, f"registry full: {self.max_engines} engines registered")
        entries = entries or {}
        old = entries.get(info.rank)
        if old is not None and old.info.incarnation == info.incarnation and old.info != info:
            raise RefusedError(
                409,
                f"rank {info.rank} of engine {info.engine!r} is registered with incarnation "
                f"{info.incarnation} and different fields; a restarted rank must use a new "
                "incarnation",
            )
        for rank, entry in entries.items():
            if rank == info.rank:
                continue
            if entry.info.tp_size != info.tp_size:
                raise RefusedError(
                    409,
                    f"tp_size {info.tp_size} of rank {info.rank} disagrees with live rank {rank} "
                    f"of engine {info.engine!r} (tp_size {entry.info.tp_size})",
                )
            if entry.info.coords == info.coords:
                raise RefusedError(
                    409,
                    f"rank {info.rank} claims (tp_rank, dp_rank, pp_rank) = {info.coords}, "
                    f"already held by live rank {rank} of engine {info.engine!r}",
                )
        entries[info.rank] = _Entry(info, now + self.ttl_s)
        self._engines[info.engine] = entries
        if old is None:
            return "registered"
        return "refreshed" if old.info == info else "replaced"

    def deregister(
        self, engine: str, rank: int, now: float, *, incarnation: int | None = None
    ) -> RankInfo:
        """Remove a rank, return its info. ``RefusedError``: 404 unknown, 409 other incarnation."""
        entries = self._live(engine, now)
        entry = None if entries is None else entries.get(rank)
        if entries is None or entry is None:
            raise RefusedError(404, f"rank {rank} of engine {engine!r} is not registered")
        if incarnation is not None and entry.info.incarnation != incarnation:
            raise RefusedError(
                409,
                f"rank {rank} of engine {engine!r} is registered with incarnation "
                f"{entry.info.incarnation}, not {incarnation}",
            )
        del entries[rank]
        if not entries:
            del self._engines[engine]
        return entry.info

    def ranks(self, engine: str, now: float) -> list[RankInfo]:
        """Every live rank of ``engine`` by rank; ``RefusedError`` 503 unless all are registered."""
        entries = self._live(engine, now) or {}
        if len(entries) < self.expected_ranks:
            raise RefusedError(
                503,
                f"not ready: {len(entries)} of {self.expected_ranks} ranks registered",
                registered=len(entries),
                expected=self.expected_ranks,
            )
        return [entries[rank].info for rank in sorted(entries)]

    def rank(self, engine: str, rank: int, now: float) -> RankInfo:
        entries = self._live(engine, now)
        entry = None if entries is None else entries.get(rank)
        if entry is None:
            raise RefusedError(404, f"rank {rank} of engine {engine!r} is not registered")
        return entry.info

    def health(self, now: float) -> Health:
        self.expire(now)
        engines = {
            name: EngineStatus(len(e), self.expected_ranks, len(e) >= self.expected_ranks)
            for name, e in sorted(self._engines.items())
        }
        waiting = [name for name, s in engines.items() if not s.ready]
        if not engines:
            return Health(False, "not ready: no ranks registered", engines)
        if waiting:
            return Health(False, f"not ready: {len(waiting)} engine(s) waiting for ranks", engines)
        return Health(True, "ready", engines)

    def expire(self, now: float) -> list[RankInfo]:
        """Drop every expired entry; return what was dropped."""
        dropped: list[RankInfo] = []
        for engine in list(self._engines):
            dropped.extend(self._expire_engine(engine, now))
        return dropped

    def __len__(self) -> int:
        return sum(len(e) for e in self._engines.values())

    def _live(self, engine: str, now: float) -> dict[int, _Entry] | None:
        self._expire_engine(engine, now)
        return self._engines.get(engine)

    def _expire_engine(self, engine: str, now: float) -> list[RankInfo]:
        entries = self._engines.get(engine)
        if entries is None:
            return []
        dead = [rank for rank, entry in entries.items() if entry.expires_at <= now]
        dropped = [entries.pop(rank).info for rank in dead]
        for info in dropped:
            _log.info(
                "expired: engine %s rank %d (incarnation %d, %s:%d)",
                info.engine,
                info.rank,
                info.incarnation,
                info.host,
                info.port,
            )
        if not entries:
            del self._engines[engine]
        return dropped


# -- the HTTP server -------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode
_decode_rank_info = msgspec.json.Decoder(RankInfo).decode
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_engine_re = re.compile(ENGINE_PATTERN)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


def _engine_param(value: str | None) -> str:
    if value is None:
        raise RefusedError(400, "missing query parameter: engine")
    if not _engine_re.match(value):
        raise RefusedError(400, f"invalid engine id: it must match {ENGINE_PATTERN}")
    return value


def _int_param(name: str, value: str, upper: int) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 19 and int(value) < upper):
        raise RefusedError(400, f"invalid {name}: expected an integer in 0..{upper - 1}")
    return int(value)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every refusal and every aiohttp error (404, 405, 413...) becomes a JSON error body."""
    try:
        return await handler(request)
    except RefusedError as exc:
        body = _ErrorBody(exc.message, exc.registered, exc.expected)
        return _json(body, exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else ""
        response = _json(_ErrorBody(message or exc.reason), exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionError as exc:
        # The client is gone mid-request (it hung up, or its connection was shed or timed out):
        # nobody to answer, and nothing unexpected about it. The answer goes nowhere.
        _log.debug("bootstrap: %s %s: connection lost: %s", request.method, request.path, exc)
        return _json(_ErrorBody("connection lost"), 400)
    except Exception:
        _log.exception("bootstrap: unexpected error in %s %s", request.method, request.path)
        return _json(_ErrorBody("internal error"), 500)


# -- connections -----------------------------------------------------------------------------------

# accept() failures that mean "out of descriptors or buffers": the pending connection stays queued
# in the kernel, so the listener frees a descriptor (or waits) and tries again.
_RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_BACKOFF_MIN_S: Final = 0.005
_ACCEPT_BACKOFF_MAX_S: Final = 0.25
_ACCEPT_LOG_EVERY_S: Final = 10.0
# How long a 408 may take to write before the connection is closed regardless.
_LATE_ANSWER_S: Final = 1.0
# How long setting up an accepted connection (transport and protocol) may take.
_CONNECT_TIMEOUT_S: Final = 5.0
# Connections a burst may queue in the kernel (no descriptor of ours) while the accept loop
# drains them; the kernel caps it at net.core.somaxconn.
_BACKLOG: Final = 1024
# aiohttp's own defaults, pinned here because the module doc promises them.
_MAX_LINE_SIZE: Final = 8190
_MAX_FIELD_SIZE: Final = 8190


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one accepted connection, wrapped so that the listener sees it open
    and close. Everything else is passed through unchanged."""

    __slots__ = ("_inner", "_listener", "requests", "transport")

    def __init__(self, inner: asyncio.Protocol, listener: _Listener) -> None:
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


class _Listener:
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
        #: Idle connections -> when they became idle (monotonic), oldest first; and the busy
        #: ones -> when their request began, oldest first.
        self._idle: dict[_Connection, float] = {}
        self._busy: dict[_Connection, float] = {}
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.accepted = 0
        self.shed = 0
        self.idle_closed = 0
        self.request_timeouts = 0
        self.accept_errors = 0
        # Accept-error logging: one line at most every _ACCEPT_LOG_EVERY_S, and one when
        # accepting works again (once the next line is due, if it still works then).
        self._failing = False
        self._unreported = 0
        self._next_log = 0.0
        self._recovery_check: asyncio.TimerHandle | None = None

    # -- the counters -------------------------------------------------------------------------

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
        if self._recovery_check is not None:
            self._recovery_check.cancel()
            self._recovery_check = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the protocol's and the middleware's calls --------------------------------------------

    def opened(self, conn: _Connection) -> None:
        assert conn.transport is not None
        self.accepted += 1
        self._by_transport[conn.transport] = conn
        self._idle[conn] = time.monotonic()

    def lost(self, conn: _Connection) -> None:
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)
        self._idle.pop(conn, None)
        self._busy.pop(conn, None)

    def connection(self, transport: asyncio.BaseTransport | None) -> _Connection | None:
        return None if transport is None else self._by_transport.get(transport)

    def request_started(self, conn: _Connection) -> None:
        conn.requests += 1
        if self._idle.pop(conn, None) is not None:
            self._busy[conn] = time.monotonic()

    def request_done(self, conn: _Connection) -> None:
        conn.requests -= 1
        # Not back in the table if it was closed meanwhile (shed, or lost).
        if conn.requests == 0 and self._busy.pop(conn, None) is not None:
            self._idle[conn] = time.monotonic()  # last in the dict: the newest idle

    # -- closing ------------------------------------------------------------------------------

    def _close(self, conn: _Connection) -> None:
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

    def _enforce_cap(self, newest: _Connection) -> None:
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
            now = time.monotonic()
            deadline = now - self.idle_timeout_s
            while self._idle:
                conn, since = next(iter(self._idle.items()))
                if since > deadline:
                    break
                self._close(conn)
                self.idle_closed += 1
            # The first idle connection times out first; any that become idle later, later.
            first = next(iter(self._idle.values()), now)
            await asyncio.sleep(max(first + self.idle_timeout_s - time.monotonic(), 0.001))

    # -- accepting ----------------------------------------------------------------------------

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = _ACCEPT_BACKOFF_MIN_S
        while True:
            try:
                raw, _ = await loop.sock_accept(sock)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # the client gave up before we accepted: nothing to do
            except OSError as exc:
                self._accept_failed(exc)
                # Out of descriptors: a connection idle the longest is the cheapest thing this
                # process can give back. Its descriptor is free once the loop turns (asyncio
                # closes the socket in a call_soon); if not yet, the next failure sheds another.
                if exc.errno in _RESOURCE_ERRNOS and self._shed_one():
                    await asyncio.sleep(0)
                    continue
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_MAX_S)
                continue
            backoff = _ACCEPT_BACKOFF_MIN_S
            if self._failing:
                self._accepting_again()
            try:
                # Bounded: on uvloop a protocol whose connection_made raised leaves this waiting
                # forever, and the listener must not stop for one connection.
                async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                    _, protocol = await loop.connect_accepted_socket(self._wrap, raw)
            except OSError as exc:  # reset already, say; the listener goes on regardless
                _log.debug("bootstrap: dropped a connection at accept: %s", exc)
                raw.close()
                continue
            except TimeoutError:
                _log.error("bootstrap: an accepted connection was not set up; dropped it")
                raw.close()
                continue
            assert isinstance(protocol, _Connection)
            self._enforce_cap(protocol)

    def _wrap(self) -> _Connection:
        assert self._factory is not None
        return _Connection(self._factory(), self)

    def _accept_failed(self, exc: OSError) -> None:
        self.accept_errors += 1
        self._unreported += 1
        self._failing = True
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + _ACCEPT_LOG_EVERY_S
        _log.warning(
            "bootstrap: accept() failed %d time(s) since the last report (%s), %d in all; "
            "holding %d connection(s); shedding idle ones and backing off until it succeeds "
            "(one such line per %g s at most)",
            self._unreported,
            exc,
            self.accept_errors,
            len(self._idle) + len(self._busy),
            _ACCEPT_LOG_EVERY_S,
        )
        self._unreported = 0

    def _accepting_again(self) -> None:
        self._failing = False
        if self._recovery_check is None:
            delay = max(self._next_log - time.monotonic(), 0.0)
            loop = asyncio.get_running_loop()
            self._recovery_check = loop.call_later(delay, self._report_recovery)

    def _report_recovery(self) -> None:
        self._recovery_check = None
        if self._failing:  # failing again: its own line reports it
            return
        self._next_log = time.monotonic() + _ACCEPT_LOG_EVERY_S
        _log.warning(
            "bootstrap: accepting connections again (%d accept error(s) since the last report, "
            "%d in all)",
            self._unreported,
            self.accept_errors,
        )
        self._unreported = 0


def _oldest(table: dict[_Connection, float], other_than: _Connection) -> _Connection | None:
    """The first connection of ``table`` (oldest first) that is not ``other_than``."""
    for conn in table:
        if conn is not other_than:
            return conn
    return None


async def _bind(host: str, port: int) -> list[socket.socket]:
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


def _guard(listener: _Listener, timeout_s: float) -> Middleware:
    """The outermost middleware: marks the connection busy for the request and bounds the
    request, response writing included, to ``timeout_s``."""

    @web.middleware
    async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        conn = listener.connection(request.transport)
        if conn is not None:
            listener.request_started(conn)
        response: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await handler(request)
                # Written here, not after the middlewares return as aiohttp would (it then finds
                # the response sent), so that the timeout and the busy mark cover the writing: a
                # client that does not read its answer is cut off like one that does not send.
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            listener.request_timeouts += 1
            _log.warning(
                "bootstrap: %s %s from %s not completed within %.3g s; closing the connection",
                request.method,
                request.path,
                request.remote,
                timeout_s,
            )
            if response is not None and response.prepared:
                if request.transport is not None:
                    request.transport.abort()
                return response
            late = _json(_ErrorBody(f"request not completed within {timeout_s:.3g} s"), 408)
            late.force_close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(_LATE_ANSWER_S):
                    await late.prepare(request)
                    await late.write_eof()
            # Closed now: left to itself, aiohttp would first linger up to 10 s reading the
            # rest of a body that is not coming. (A client that does not read even the 408
            # keeps the close waiting until the idle reaper aborts it.)
            request.protocol.force_close()
            return late
        except ConnectionError:
            if response is None:
                raise
            # The client went away mid-answer; aiohttp sees the same when it finishes the
            # response, and closes quietly.
            return response
        finally:
            if conn is not None:
                listener.request_done(conn)
        return response

    return guard


class BootstrapServer:
    """The registry over HTTP; embeddable in any running asyncio loop.

    ``host`` defaults to ``127.0.0.1`` (reachable from this machine only); pass ``"0.0.0.0"``,
    ``"::"`` or an interface address to serve other hosts, and then consider a ``secret``.
    ``port=0`` picks a free port; ``port`` reads the bound one after ``start()``. With ``secret``
    (at least 16 bytes), PUT and DELETE must be signed (``_auth.py``); GETs never need to be.
    ``max_connections``, ``idle_timeout_s`` and ``request_timeout_s`` bound what clients can hold
    (module doc, "Connections"); ``stats`` counts what they did.
    Use ``async with BootstrapServer(...) as server:`` or ``start()``/``stop()``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        expected_ranks: int,
        ttl_s: float = 30.0,
        secret: bytes | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.registry = Registry(expected_ranks=expected_ranks, ttl_s=ttl_s)
        if isinstance(max_connections, bool) or not (
            isinstance(max_connections, int) and max_connections >= 1
        ):
            raise ValueError(f"max_connections must be a positive integer, got {max_connections}")
        for name, value in (
            ("idle_timeout_s", idle_timeout_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        self.max_connections = max_connections
        self.idle_timeout_s = float(idle_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self._host = host
        self._port = port
        self._secret = None if secret is None else check_secret(secret)
        self._runner: web.AppRunner | None = None
        self._listener: _Listener | None = None
        self._sockets: list[socket.socket] = []
        self._sweeper: asyncio.Task[None] | None = None
        # Counters survive stop() (a restarted server starts them again).
        self._stats = self._idle_stats()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The bound port once started (the port asked for before that)."""
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port``; for a wildcard bind, the loopback address of the same family."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    @property
    def expected_ranks(self) -> int:
        return self.registry.expected_ranks

    @property
    def ttl_s(self) -> float:
        return self.registry.ttl_s

    @property
    def stats(self) -> ConnectionStats:
        """Connections held now and the listener's counters (zeros before ``start()``)."""
        return self._stats if self._listener is None else self._listener.stats()

    def _idle_stats(self) -> ConnectionStats:
        return ConnectionStats(0, self.max_connections, 0, 0, 0, 0, 0, 0)

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the bootstrap server is already started")
        listener = _Listener(
            max_connections=self.max_connections, idle_timeout_s=self.idle_timeout_s
        )
        # The guard outermost, so that its busy mark and timeout cover every handler and every
        # error body.
        app = web.Application(
            middlewares=[_guard(listener, self.request_timeout_s), _errors],
            client_max_size=MAX_BODY_BYTES,
        )
        app.router.add_put("/v1/ranks", self._put_rank)
        app.router.add_get("/v1/ranks", self._get_ranks, allow_head=False)
        app.router.add_get("/v1/ranks/{engine}/{rank}", self._get_rank, allow_head=False)
        app.router.add_delete("/v1/ranks/{engine}/{rank}", self._delete_rank)
        app.router.add_get("/health", self._health, allow_head=False)
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=1.0,
            max_line_size=_MAX_LINE_SIZE,
            max_field_size=_MAX_FIELD_SIZE,
            # Our reaper closes idle connections: aiohttp's keep-alive timer covers a connection
            # that never sent a request only in recent versions (aio-libs/aiohttp#13681), and we
            # accept aiohttp 3.9. Its timer, at twice the time, is a backstop.
            keepalive_timeout=2 * self.idle_timeout_s,
        )
        await runner.setup()
        try:
            sockets = await _bind(self._host, self._port)
        except BaseException:
            await runner.cleanup()
            raise
        server = runner.server
        assert server is not None
        self._runner, self._listener, self._sockets = runner, listener, sockets
        self._port = int(sockets[0].getsockname()[1])
        listener.start(server, sockets)
        self._sweeper = asyncio.create_task(self._sweep(), name="kvfsm-bootstrap-sweep")
        _log.info(
            "bootstrap registry listening on %s (expecting %d ranks per engine, ttl %.3g s, %s; "
            "at most %d connections, idle timeout %.3g s, request timeout %.3g s)",
            self.url,
            self.expected_ranks,
            self.ttl_s,
            "signed writes" if self._secret else "unsigned writes",
            self.max_connections,
            self.idle_timeout_s,
            self.request_timeout_s,
        )

    async def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.stop()
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if listener is not None:  # what it counted; nothing is open any more
            self._stats = msgspec.structs.replace(listener.stats(), open=0, busy=0)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _sweep(self) -> None:
        interval = min(max(self.ttl_s / 2, 0.01), _SWEEP_MAX_S)
        while True:
            await asyncio.sleep(interval)
            try:
                self.registry.expire(time.monotonic())
            except Exception:  # never let the sweep die; reads still expire lazily
                _log.exception("bootstrap: expiry sweep failed")

    async def _signed_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            raise RefusedError(413, f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        body = await request.read()
        if self._secret is not None:
            try:
                check_request(self._secret, request.method, request.raw_path, body, request.headers)
            except AuthError as exc:
                _log.warning(
                    "refused %s %s from %s: %s", request.method, request.path, request.remote, exc
                )
                raise RefusedError(401, str(exc)) from None
        return body

    async def _put_rank(self, request: web.Request) -> web.Response:
        body = await self._signed_body(request)
        try:
            info = _decode_rank_info(body)
        except msgspec.DecodeError as exc:
            raise RefusedError(400, f"invalid rank registration: {exc}") from None
        outcome = self.registry.register(info, time.monotonic())
        level = logging.DEBUG if outcome == "refreshed" else logging.INFO
        _log.log(
            level,
            "%s: engine %s rank %d (tp %d/%d dp %d pp %d) at %s:%d agent %s incarnation %d",
            outcome,
            info.engine,
            info.rank,
            info.tp_rank,
            info.tp_size,
            info.dp_rank,
            info.pp_rank,
            info.host,
            info.port,
            info.agent,
            info.incarnation,
        )
        return _json(Registered(outcome, self.ttl_s))

    async def _delete_rank(self, request: web.Request) -> web.Response:
        await self._signed_body(request)
        engine = _engine_param(request.match_info["engine"])
        rank = _int_param("rank", request.match_info["rank"], _MAX_RANKS)
        raw = request.query.get("incarnation")
        incarnation = None if raw is None else _int_param("incarnation", raw, 2**63)
        info = self.registry.deregister(engine, rank, time.monotonic(), incarnation=incarnation)
        _log.info("deregistered: engine %s rank %d incarnation %d", engine, rank, info.incarnation)
        return _json(info)

    async def _get_ranks(self, request: web.Request) -> web.Response:
        engine = _engine_param(request.query.get("engine"))
        return _json(RankList(engine, self.registry.ranks(engine, time.monotonic())))

    async def _get_rank(self, request: web.Request) -> web.Response:
        engine = _engine_param(request.match_info["engine"])
        rank = _int_param("rank", request.match_info["rank"], _MAX_RANKS)
        return _json(self.registry.rank(engine, rank, time.monotonic()))

    async def _health(self, request: web.Request) -> web.Response:
        health = self.registry.health(time.monotonic())
        return _json(msgspec.structs.replace(health, connections=self.stats))


# -- the client ------------------------------------------------------------------------------------


class BootstrapError(Exception):
    """Base of every error ``BootstrapClient`` raises. ``status``: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotReadyError(BootstrapError):
    """503: the engine has fewer live ranks than the registry expects."""

    def __init__(self, message: str, registered: int, expected: int) -> None:
        super().__init__(message, 503)
        self.registered = registered
        self.expected = expected


class NotFoundError(BootstrapError):
    """404: no such rank (or route)."""


class UnauthorizedError(BootstrapError):
    """401: the registry wants signed writes and this one was unsigned, wrong or stale."""


class RejectedError(BootstrapError):
    """Any other refusal (400, 409, 413, 429, 5xx); the message is the registry's."""


class UnreachableError(BootstrapError):
    """No answer: connection refused or reset, DNS failure, timeout."""


_T = TypeVar("_T")
#: How long the client keeps an idle connection for reuse: half the server's idle timeout.
_CLIENT_KEEPALIVE_S: Final = IDLE_TIMEOUT_S / 2


class BootstrapClient:
    """Talks to one registry. One ``aiohttp.ClientSession``, opened on first use; ``close()`` it
    (or use ``async with``). Every method raises a ``BootstrapError`` subclass, nothing else.

    ``base_url`` is ``http://host:port``. With ``secret``, writes are signed; reads never are.
    """

    def __init__(
        self, base_url: str, *, secret: bytes | None = None, timeout_s: float = 2.0
    ) -> None:
        url = yarl.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/"):
            raise ValueError(f"base_url must be http://host:port, got {base_url!r}")
        self._base = str(url.origin())
        self._secret = None if secret is None else check_secret(secret)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def base_url(self) -> str:
        return self._base

    async def register(self, info: RankInfo) -> Registered:
        """Register or refresh ``info`` (call again every ``ttl_s / 3`` as the heartbeat)."""
        return await self._call("PUT", "/v1/ranks", Registered, body=_encode(info))

    async def deregister(self, engine: str, rank: int, *, incarnation: int | None = None) -> bool:
        """Remove a rank (only ``incarnation``, if given). False if it was not registered."""
        path = f"/v1/ranks/{_segment(engine)}/{int(rank)}"
        if incarnation is not None:
            path += f"?incarnation={int(incarnation)}"
        try:
            await self._call("DELETE", path, RankInfo, body=b"")
        except NotFoundError:
            return False
        return True

    async def ranks(self, engine: str) -> list[RankInfo]:
        """Every rank of ``engine``, by rank; ``NotReadyError`` until all have registered."""
        path = f"/v1/ranks?engine={_segment(engine)}"
        return (await self._call("GET", path, RankList)).ranks

    async def rank(self, engine: str, rank: int) -> RankInfo:
        """One rank; ``NotFoundError`` if it is not registered (or expired)."""
        return await self._call("GET", f"/v1/ranks/{_segment(engine)}/{int(rank)}", RankInfo)

    async def health(self) -> Health:
        return await self._call("GET", "/health", Health)

    async def close(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _call(
        self, method: str, path: str, schema: type[_T], *, body: bytes | None = None
    ) -> _T:
        if self._closed:
            raise BootstrapError("the bootstrap client is closed")
        if self._session is None:
            # A pooled connection is dropped well before a registry with the default idle
            # timeout closes it, so that a request is not sent into the server's close (the race
            # of aio-libs/aiohttp#2682 and #9138).
            connector = aiohttp.TCPConnector(keepalive_timeout=_CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        headers = {"Content-Type": "application/json"} if body else {}
        if self._secret is not None and method in ("PUT", "DELETE"):
            headers.update(request_headers(self._secret, method, path, body or b""))
        url = yarl.URL(self._base + path, encoded=True)
        try:
            async with self._session.request(method, url, data=body, headers=headers) as resp:
                status = resp.status
                payload = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UnreachableError(
                f"bootstrap registry {self._base} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if status == 200:
            try:
                return msgspec.json.decode(payload, type=schema)
            except msgspec.DecodeError as exc:
                raise BootstrapError(
                    f"invalid answer from {self._base} to {method} {path}: {exc}", status
                ) from None
        try:
            error = msgspec.json.decode(payload, type=_ErrorBody)
        except msgspec.DecodeError:
            error = _ErrorBody(f"HTTP {status}: {payload[:200]!r}")
        message = f"{method} {path}: {error.error}"
        if status == 503 and error.registered is not None and error.expected is not None:
            raise NotReadyError(message, error.registered, error.expected)
        if status == 404:
            raise NotFoundError(message, status)
        if status == 401:
            raise UnauthorizedError(message, status)
        raise RejectedError(message, status)


def _segment(engine: str) -> str:
    """``engine`` checked against ``ENGINE_PATTERN`` (so it needs no escaping in a URL)."""
    if not _engine_re.match(engine):
        raise ValueError(f"invalid engine id {engine!r}: it must match {ENGINE_PATTERN}")
    return engine
