"""The bootstrap registry: prefill ranks register where they listen; decode ranks look them up.

This is kvfsm's version of SGLang's bootstrap server (``PUT /route``, ``GET /route``, 503 until
every rank has registered, ``/health``, periodic entry cleanup: SGLang's
``disaggregation/common/conn.py``). It is an aiohttp application that any asyncio loop can embed
(``BootstrapServer``, here), a small client (``BootstrapClient``, ``_client``), and
between them JSON bodies that ``msgspec`` decodes against typed schemas (``_schemas``: what a rank
publishes). The table behind the routes is sans-IO (``RankTable``, ``_rank_table``: its rules and
expiry); the connections are held to limits by the server's own accept loop (``_connections``).

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
``POST /register_dp_rank``          ``{"bootstrap_room": R, "dp_rank": D}``: room R is served by
                                    DP rank D; the answer echoes it (``_dp_ranks``: a prefill
                                    instance that does not pick DP ranks by room id registers
                                    each room's).
``POST /query_dp_ranks``            ``{"bootstrap_rooms": [R, ...]}`` answered
                                    ``{"<R>": D, ...}`` for the rooms registered and unexpired.
                                    SGLang's routes and bodies: its decode scheduler asks here.
``GET /health``                     200 while serving; the body says whether every known engine is
                                    ready (and false while no engine has registered at all), and
                                    carries the connection counters (``connections``).

Unknown routes are 404, wrong methods 405, bodies over ``MAX_BODY_BYTES`` (1 MiB) 413, bodies
that do not decode 400 naming the field. Nothing a client sends can stop the server: an
unexpected exception in a handler is logged and answered 500. At most ``MAX_ENGINES`` engines
are held at once (429 beyond), so an unauthenticated writer cannot grow memory without bound.

Security
--------

The default bind address is ``127.0.0.1``: nothing off the host can reach a registry started
without arguments. To serve a cluster pass ``host="0.0.0.0"`` (or a specific interface address;
``--host`` on the command line) and, unless the network is trusted, a shared ``secret``. With a
secret, every mutating request (PUT, DELETE, ``POST /register_dp_rank``) must carry a fresh
HMAC signature (``kvfsm.link``);
unsigned, wrongly signed or stale requests get 401 and change nothing. Reads stay unsigned on
purpose: they reveal only what the ranks themselves publish to their peers (host, port, agent
name, layout geometry) and decode ranks must be able to read them with no more than an address.
A deployment that must hide those addresses should bind the registry to a private interface (or
put it behind an authenticating proxy). There is no TLS: secrecy of the traffic is the network's
job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Final, Self

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from kvfsm._tasks import cancel_and_wait
from kvfsm.link import AuthError, check_request, check_secret
from kvfsm.registry._connections import IDLE_TIMEOUT_S, MAX_CONNECTIONS, Listener, bind
from kvfsm.registry._dp_ranks import DpRankTable
from kvfsm.registry._rank_table import RankTable, RefusedError
from kvfsm.registry._schemas import (
    ENGINE_PATTERN,
    ENGINE_RE,
    MAX_RANKS,
    ConnectionStats,
    DpRankQuery,
    DpRankRegistration,
    ErrorBody,
    RankInfo,
    RankList,
    Registered,
)

__all__ = ["DEFAULT_PORT", "MAX_BODY_BYTES", "REQUEST_TIMEOUT_S", "BootstrapServer"]

_log = logging.getLogger("kvfsm.registry")

#: The port ``kvfsm bootstrap`` listens on unless told otherwise (SGLang's bootstrap port).
DEFAULT_PORT: Final = 8998
#: Request bodies above this size are refused with 413.
MAX_BODY_BYTES: Final = 1024 * 1024
#: A request must be read, handled and answered within this long of its head.
REQUEST_TIMEOUT_S: Final = 10.0
_SWEEP_MAX_S: Final = 5.0
# How long a 408 may take to write before the connection is closed regardless.
_LATE_ANSWER_S: Final = 1.0
# aiohttp's own defaults, pinned here because _connections' module doc promises them.
_MAX_LINE_SIZE: Final = 8190
_MAX_FIELD_SIZE: Final = 8190

_encode = msgspec.json.Encoder().encode
_decode_rank_info = msgspec.json.Decoder(RankInfo).decode
_decode_dp_registration = msgspec.json.Decoder(DpRankRegistration).decode
_decode_dp_query = msgspec.json.Decoder(DpRankQuery).decode
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


def _engine_param(value: str | None) -> str:
    if value is None:
        raise RefusedError(400, "missing query parameter: engine")
    if not ENGINE_RE.match(value):
        raise RefusedError(400, f"invalid engine id: it must match {ENGINE_PATTERN}")
    return value


def _int_param(name: str, value: str, upper: int) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 19 and int(value) < upper):
        raise RefusedError(400, f"invalid {name}: expected an integer in 0..{upper - 1}")
    return int(value)


async def _body(request: web.Request) -> bytes:
    """The request's body; 413 before reading one that says it is over ``MAX_BODY_BYTES``."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise RefusedError(413, f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
    return await request.read()


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every refusal and every aiohttp error (404, 405, 413...) becomes a JSON error body."""
    try:
        return await handler(request)
    except RefusedError as exc:
        body = ErrorBody(exc.message, exc.registered, exc.expected)
        return _json(body, exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else ""
        response = _json(ErrorBody(message or exc.reason), exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionError as exc:
        # The client is gone mid-request (it hung up, or its connection was shed or timed out):
        # nobody to answer, and nothing unexpected about it. The answer goes nowhere.
        _log.debug("bootstrap: %s %s: connection lost: %s", request.method, request.path, exc)
        return _json(ErrorBody("connection lost"), 400)
    except Exception:
        _log.exception("bootstrap: unexpected error in %s %s", request.method, request.path)
        return _json(ErrorBody("internal error"), 500)


def _guard(listener: Listener, timeout_s: float) -> Middleware:
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
            late = _json(ErrorBody(f"request not completed within {timeout_s:.3g} s"), 408)
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
    (at least 16 bytes), writes (PUT, DELETE, ``POST /register_dp_rank``) must be signed
    (``kvfsm.link``); reads (GETs, ``POST /query_dp_ranks``) never need to be.
    ``max_connections``, ``idle_timeout_s`` and ``request_timeout_s`` bound what clients can hold
    (``_connections``' module doc, "Connections"); ``stats`` counts what they did. ``table``
    is the sans-IO ``RankTable`` the routes read and write, with this server's clock.
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
        self.table = RankTable(expected_ranks=expected_ranks, ttl_s=ttl_s)
        #: Rooms' DP ranks, for engines that do not pick them by room id (``_dp_ranks``).
        self.dp_ranks = DpRankTable()
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
        self._listener: Listener | None = None
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
        return self.table.expected_ranks

    @property
    def ttl_s(self) -> float:
        return self.table.ttl_s

    @property
    def stats(self) -> ConnectionStats:
        """Connections held now and the listener's counters (zeros before ``start()``)."""
        return self._stats if self._listener is None else self._listener.stats()

    def _idle_stats(self) -> ConnectionStats:
        return ConnectionStats(0, self.max_connections, 0, 0, 0, 0, 0, 0)

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the bootstrap server is already started")
        listener = Listener(
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
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
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
            sockets = await bind(self._host, self._port)
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
        await cancel_and_wait(sweeper)
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
                now = time.monotonic()
                self.table.expire(now)
                self.dp_ranks.expire(now)
            except Exception:  # never let the sweep die; reads still expire lazily
                _log.exception("bootstrap: expiry sweep failed")

    async def _signed_body(self, request: web.Request) -> bytes:
        body = await _body(request)
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
        outcome = self.table.register(info, time.monotonic())
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
        rank = _int_param("rank", request.match_info["rank"], MAX_RANKS)
        raw = request.query.get("incarnation")
        incarnation = None if raw is None else _int_param("incarnation", raw, 2**63)
        info = self.table.deregister(engine, rank, time.monotonic(), incarnation=incarnation)
        _log.info("deregistered: engine %s rank %d incarnation %d", engine, rank, info.incarnation)
        return _json(info)

    async def _get_ranks(self, request: web.Request) -> web.Response:
        engine = _engine_param(request.query.get("engine"))
        return _json(RankList(engine, self.table.ranks(engine, time.monotonic())))

    async def _get_rank(self, request: web.Request) -> web.Response:
        engine = _engine_param(request.match_info["engine"])
        rank = _int_param("rank", request.match_info["rank"], MAX_RANKS)
        return _json(self.table.rank(engine, rank, time.monotonic()))

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        body = await self._signed_body(request)
        try:
            entry = _decode_dp_registration(body)
        except msgspec.DecodeError as exc:
            raise RefusedError(400, f"invalid DP rank registration: {exc}") from None
        self.dp_ranks.register(entry.bootstrap_room, entry.dp_rank, time.monotonic())
        _log.debug("room %d: DP rank %d", entry.bootstrap_room, entry.dp_rank)
        return _json(entry)

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        try:
            query = _decode_dp_query(await _body(request))
        except msgspec.DecodeError as exc:
            raise RefusedError(400, f"invalid DP rank query: {exc}") from None
        return _json(self.dp_ranks.lookup(query.bootstrap_rooms, time.monotonic()))

    async def _health(self, request: web.Request) -> web.Response:
        health = self.table.health(time.monotonic())
        return _json(msgspec.structs.replace(health, connections=self.stats))
