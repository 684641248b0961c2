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
                                    ready (and false while no engine has registered at all).

Unknown routes are 404, wrong methods 405, bodies over ``MAX_BODY_BYTES`` (1 MiB) 413, bodies
that do not decode 400 naming the field. Nothing a client sends can stop the server: an
unexpected exception in a handler is logged and answered 500. At most ``MAX_ENGINES`` engines
are held at once (429 beyond), so an unauthenticated writer cannot grow memory without bound.

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
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Annotated, Any, Final, Literal, Self, TypeVar

import aiohttp
import msgspec
import yarl
from aiohttp import web

from kvfsm.bootstrap._auth import AuthError, check_request, check_secret, request_headers

__all__ = [
    "DEFAULT_PORT",
    "ENGINE_PATTERN",
    "MAX_BODY_BYTES",
    "MAX_ENGINES",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
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

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(
                f"tp_rank {self.tp_rank} out of range: 0 <= tp_rank < tp_size ({self.tp_size})"
            )
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank {self.dp_rank} out of range: 0 <= dp_rank < dp_size ({self.dp_size})"
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


class Health(msgspec.Struct, frozen=True):
    """``ready``: at least one engine is known and every known engine has all its ranks."""

    ready: bool
    detail: str
    engines: dict[str, EngineStatus]


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
    except Exception:
        _log.exception("bootstrap: unexpected error in %s %s", request.method, request.path)
        return _json(_ErrorBody("internal error"), 500)


class BootstrapServer:
    """The registry over HTTP; embeddable in any running asyncio loop.

    ``host`` defaults to ``127.0.0.1`` (reachable from this machine only); pass ``"0.0.0.0"``,
    ``"::"`` or an interface address to serve other hosts, and then consider a ``secret``.
    ``port=0`` picks a free port; ``port`` reads the bound one after ``start()``. With ``secret``
    (at least 16 bytes), PUT and DELETE must be signed (``_auth.py``); GETs never need to be.
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
    ) -> None:
        self.registry = Registry(expected_ranks=expected_ranks, ttl_s=ttl_s)
        self._host = host
        self._port = port
        self._secret = None if secret is None else check_secret(secret)
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

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

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the bootstrap server is already started")
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_put("/v1/ranks", self._put_rank)
        app.router.add_get("/v1/ranks", self._get_ranks, allow_head=False)
        app.router.add_get("/v1/ranks/{engine}/{rank}", self._get_rank, allow_head=False)
        app.router.add_delete("/v1/ranks/{engine}/{rank}", self._delete_rank)
        app.router.add_get("/health", self._health, allow_head=False)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        address = runner.addresses[0]
        self._port = int(address[1])
        self._sweeper = asyncio.create_task(self._sweep(), name="kvfsm-bootstrap-sweep")
        _log.info(
            "bootstrap registry listening on %s (expecting %d ranks per engine, ttl %.3g s, %s)",
            self.url,
            self.expected_ranks,
            self.ttl_s,
            "signed writes" if self._secret else "unsigned writes",
        )

    async def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

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
        return _json(self.registry.health(time.monotonic()))


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
            self._session = aiohttp.ClientSession(timeout=self._timeout)
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
