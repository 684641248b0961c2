"""The bootstrap registry's client (``BootstrapClient``) and the errors it raises: one
``BootstrapError`` subclass per kind of answer (not ready, not found, unauthorized, rejected,
unreachable). The routes and their answers are ``_server``'s module doc."""

from __future__ import annotations

from types import TracebackType
from typing import Final, Self, TypeVar

import aiohttp
import msgspec
import yarl

from kvfsm.link import check_secret, request_headers
from kvfsm.registry._connections import IDLE_TIMEOUT_S
from kvfsm.registry._schemas import (
    ENGINE_PATTERN,
    ENGINE_RE,
    DpRankQuery,
    DpRankRegistration,
    ErrorBody,
    Health,
    RankInfo,
    RankList,
    Registered,
)

__all__ = [
    "BootstrapClient",
    "BootstrapError",
    "NotFoundError",
    "NotReadyError",
    "RejectedError",
    "UnauthorizedError",
    "UnreachableError",
]

_encode = msgspec.json.Encoder().encode


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

    async def register_dp_rank(self, room: int, dp_rank: int) -> None:
        """Room ``room`` is served by DP rank ``dp_rank`` (for engines that do not pick DP ranks
        by room id); the registry keeps it ``_dp_ranks.DP_RANK_TTL_S``."""
        body = _encode(DpRankRegistration(room, dp_rank))
        await self._call("POST", "/register_dp_rank", DpRankRegistration, body=body, signed=True)

    async def query_dp_ranks(self, rooms: list[int]) -> dict[int, int]:
        """The DP rank of each of ``rooms`` registered; unknown rooms are left out."""
        body = _encode(DpRankQuery(rooms))
        found = await self._call("POST", "/query_dp_ranks", dict[str, int], body=body)
        return {int(room): rank for room, rank in found.items()}

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
        self,
        method: str,
        path: str,
        schema: type[_T],
        *,
        body: bytes | None = None,
        signed: bool = False,
    ) -> _T:
        """``schema``: what a 200 answer decodes to. ``signed``: a write (PUT and DELETE
        always are)."""
        if self._closed:
            raise BootstrapError("the bootstrap client is closed")
        if self._session is None:
            # A pooled connection is dropped well before a registry with the default idle
            # timeout closes it, so that a request is not sent into the server's close (the race
            # of aio-libs/aiohttp#2682 and #9138).
            connector = aiohttp.TCPConnector(keepalive_timeout=_CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        headers = {"Content-Type": "application/json"} if body else {}
        if self._secret is not None and (signed or method in ("PUT", "DELETE")):
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
            error = msgspec.json.decode(payload, type=ErrorBody)
        except msgspec.DecodeError:
            error = ErrorBody(f"HTTP {status}: {payload[:200]!r}")
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
    if not ENGINE_RE.match(engine):
        raise ValueError(f"invalid engine id {engine!r}: it must match {ENGINE_PATTERN}")
    return engine
