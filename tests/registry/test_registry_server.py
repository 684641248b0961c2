"""The registry's HTTP server (``kvfsm/registry/_server.py``), end to end with its
client: the routes, readiness, the server's own clock and sweep, auth, its arguments, the
connection counters in ``/health``, and hostile input.

Servers bind 127.0.0.1 on a free port. How long an entry lives is the table's rule
(``test_rank_table.py``); one test here checks the server's own clock and sweep, without
measuring time.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from kvfsm.link._auth import (
    request_headers,
)
from kvfsm.registry import (
    BootstrapClient,
    BootstrapServer,
    NotFoundError,
    NotReadyError,
    RejectedError,
    UnauthorizedError,
)
from kvfsm.registry._server import MAX_BODY_BYTES
from tests.helpers.rank_info import ENGINE, SECRET, as_json, info
from tests.helpers.waiting import wait_until


@pytest_asyncio.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with BootstrapServer(expected_ranks=2) as s:
        yield s


@pytest_asyncio.fixture
async def client(server: BootstrapServer) -> AsyncIterator[BootstrapClient]:
    async with BootstrapClient(server.url) as c:
        yield c


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


# -- over HTTP -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_register_and_lookup(server: BootstrapServer, client: BootstrapClient) -> None:
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"
    first = await client.register(info(1))
    assert (first.outcome, first.ttl_s) == ("registered", 30.0)
    assert (await client.register(info(1))).outcome == "refreshed"
    await client.register(info(0))
    ranks = await client.ranks(ENGINE)
    assert ranks == [info(0), info(1)]
    assert msgspec.msgpack.decode(ranks[1].layout) == {"kv": [1, 4096]}
    assert await client.rank(ENGINE, 1) == info(1)
    with pytest.raises(NotFoundError, match="rank 1 of engine 'other' is not registered"):
        await client.rank("other", 1)
    with pytest.raises(ValueError, match="invalid engine id"):
        await client.rank("no/slashes", 0)


@pytest.mark.asyncio
async def test_not_ready_until_expected_ranks(http: aiohttp.ClientSession) -> None:
    async with BootstrapServer(expected_ranks=3) as server, BootstrapClient(server.url) as client:
        health = await client.health()
        assert (health.ready, health.detail) == (False, "not ready: no ranks registered")
        with pytest.raises(NotReadyError, match="not ready: 0 of 3 ranks registered"):
            await client.ranks(ENGINE)
        await client.register(info(0, tp_size=3))
        await client.register(info(2, tp_size=3))
        with pytest.raises(NotReadyError) as exc:
            await client.ranks(ENGINE)
        assert (exc.value.status, exc.value.registered, exc.value.expected) == (503, 2, 3)
        async with http.get(f"{server.url}/v1/ranks", params={"engine": ENGINE}) as resp:
            assert resp.status == 503
            assert await resp.json() == {
                "error": "not ready: 2 of 3 ranks registered",
                "registered": 2,
                "expected": 3,
            }
        health = await client.health()
        assert not health.ready
        assert health.engines[ENGINE].registered == 2
        # One rank can be looked up before the engine is ready.
        assert (await client.rank(ENGINE, 2)).port == 17002
        await client.register(info(1, tp_size=3))
        assert [i.rank for i in await client.ranks(ENGINE)] == [0, 1, 2]
        assert (await client.health()).ready


@pytest.mark.asyncio
async def test_the_server_expires_entries_on_its_own_clock() -> None:
    """The server's wiring of the table: registrations and reads share its clock, and its sweep
    task drops entries that nobody reads. (How long an entry lives is the table's rule, tested
    with explicit ``now`` values in test_rank_table.py; nothing here measures time.)"""
    async with (
        BootstrapServer(expected_ranks=2, ttl_s=0.5) as server,
        BootstrapClient(server.url) as client,
    ):
        await client.register(info(0))
        assert (await client.rank(ENGINE, 0)).rank == 0
        # Nobody reads now: the sweep task alone empties the table.
        await wait_until(
            lambda: len(server.table) == 0,
            timeout=30.0,
            interval=0.02,
            message="the sweep to expire the entry",
        )
        with pytest.raises(NotFoundError):
            await client.rank(ENGINE, 0)
        # An expired rank registers afresh.
        assert (await client.register(info(0))).outcome == "registered"


@pytest.mark.asyncio
async def test_new_incarnation_replaces_the_old(client: BootstrapClient) -> None:
    await client.register(info(0, incarnation=1))
    restarted = info(0, incarnation=2, port=18000, agent="prefill-0-b", layout=b"\x01")
    assert (await client.register(restarted)).outcome == "replaced"
    assert await client.rank(ENGINE, 0) == restarted
    # Same incarnation with different fields: two processes claim one rank. Refused, no change.
    with pytest.raises(RejectedError, match="different fields") as exc:
        await client.register(info(0, incarnation=2, port=19000))
    assert exc.value.status == 409
    assert await client.rank(ENGINE, 0) == restarted


@pytest.mark.asyncio
async def test_delete(client: BootstrapClient) -> None:
    await client.register(info(0, incarnation=7))
    await client.register(info(1))
    # A late goodbye from an old incarnation does not remove its successor.
    with pytest.raises(RejectedError, match="incarnation 7, not 6") as exc:
        await client.deregister(ENGINE, 0, incarnation=6)
    assert exc.value.status == 409
    assert await client.deregister(ENGINE, 0, incarnation=7)
    with pytest.raises(NotFoundError):
        await client.rank(ENGINE, 0)
    assert not await client.deregister(ENGINE, 0)
    with pytest.raises(NotReadyError, match="1 of 2"):
        await client.ranks(ENGINE)
    assert await client.deregister(ENGINE, 1)
    assert (await client.health()).engines == {}


# -- rooms' DP ranks (SGLang's routes) -------------------------------------------------------------


@pytest.mark.asyncio
async def test_dp_ranks_registered_are_answered_in_sglangs_shape(
    server: BootstrapServer, client: BootstrapClient, http: aiohttp.ClientSession
) -> None:
    await client.register_dp_rank(11, 1)
    await client.register_dp_rank(2**63 - 1, 0)
    await client.register_dp_rank(11, 0)  # the room id reused: the latest rank wins
    assert await client.query_dp_ranks([11, 12, 2**63 - 1]) == {11: 0, 2**63 - 1: 0}
    # What SGLang's decode scheduler sends and reads (CommonKVReceiver.query_prefill_dp_ranks).
    query = {"bootstrap_rooms": [11, 12]}
    async with http.post(f"{server.url}/query_dp_ranks", json=query) as resp:
        assert resp.status == 200
        assert await resp.json() == {"11": 0}
    # And what SGLang's prefill sends to register one.
    entry = {"bootstrap_room": 12, "dp_rank": 3}
    async with http.post(f"{server.url}/register_dp_rank", json=entry) as resp:
        assert resp.status == 200
        assert await resp.json() == entry
    assert len(server.dp_ranks) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("register_dp_rank", {"bootstrap_room": -1, "dp_rank": 0}, "invalid DP rank registration"),
        ("register_dp_rank", {"bootstrap_room": 2**63, "dp_rank": 0}, "invalid DP rank"),
        ("register_dp_rank", {"bootstrap_room": 1, "dp_rank": "0"}, "Expected `int`"),
        ("register_dp_rank", {"bootstrap_room": 1}, "missing required field `dp_rank`"),
        ("register_dp_rank", {"bootstrap_room": 1, "dp_rank": 0, "x": 1}, "unknown field"),
        ("query_dp_ranks", {"bootstrap_rooms": 5}, "invalid DP rank query"),
        ("query_dp_ranks", {"bootstrap_rooms": [1, "a"]}, "invalid DP rank query"),
        ("query_dp_ranks", {"bootstrap_rooms": list(range(70_000))}, "length <= 65536"),
        ("query_dp_ranks", {}, "missing required field `bootstrap_rooms`"),
    ],
)
async def test_bad_dp_rank_bodies_get_a_400_naming_the_field(
    server: BootstrapServer,
    http: aiohttp.ClientSession,
    route: str,
    body: dict[str, object],
    message: str,
) -> None:
    async with http.post(f"{server.url}/{route}", json=body) as resp:
        assert resp.status == 400
        assert message in (await resp.json())["error"]
    assert len(server.dp_ranks) == 0
    # Wrong methods are 405, as on every route.
    async with http.get(f"{server.url}/{route}") as resp:
        assert resp.status == 405


@pytest.mark.asyncio
async def test_dp_rank_registrations_are_signed_writes_and_queries_unsigned_reads(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        BootstrapServer(expected_ranks=1, secret=SECRET) as server,
        BootstrapClient(server.url, secret=SECRET) as signed,
        BootstrapClient(server.url) as unsigned,
    ):
        with pytest.raises(UnauthorizedError, match="requires signed writes"):
            await unsigned.register_dp_rank(5, 1)
        async with http.post(
            f"{server.url}/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 1}
        ) as resp:
            assert resp.status == 401
        assert len(server.dp_ranks) == 0
        await signed.register_dp_rank(5, 1)
        # SGLang's decode asks without a signature.
        assert await unsigned.query_dp_ranks([5]) == {5: 1}


@pytest.mark.asyncio
async def test_the_sweep_expires_dp_ranks_too() -> None:
    async with BootstrapServer(expected_ranks=1, ttl_s=0.5) as server:
        server.dp_ranks.ttl_s = 0.2
        async with BootstrapClient(server.url) as client:
            await client.register_dp_rank(1, 0)
            assert len(server.dp_ranks) == 1
            await wait_until(
                lambda: len(server.dp_ranks) == 0,
                timeout=30.0,
                interval=0.02,
                message="the sweep to expire the DP rank",
            )


# -- auth ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_auth_refuses_unsigned_wrong_and_stale_writes(http: aiohttp.ClientSession) -> None:
    async with (
        BootstrapServer(expected_ranks=1, secret=SECRET) as server,
        BootstrapClient(server.url, secret=SECRET) as signed,
        BootstrapClient(server.url) as unsigned,
        BootstrapClient(server.url, secret=b"another-secret-of-16+bytes") as wrong,
    ):
        with pytest.raises(UnauthorizedError, match="requires signed writes"):
            await unsigned.register(info(0, tp_size=1))
        with pytest.raises(UnauthorizedError, match="bad signature"):
            await wrong.register(info(0, tp_size=1))
        body = msgspec.json.encode(info(0, tp_size=1))
        for skew in (-120, 120):
            headers = request_headers(SECRET, "PUT", "/v1/ranks", body, now=time.time() + skew)
            async with http.put(f"{server.url}/v1/ranks", data=body, headers=headers) as resp:
                assert resp.status == 401
                assert "stale" in (await resp.json())["error"]
        # A signature of another body does not carry over.
        headers = request_headers(SECRET, "PUT", "/v1/ranks", b"{}")
        async with http.put(f"{server.url}/v1/ranks", data=body, headers=headers) as resp:
            assert resp.status == 401
        assert len(server.table) == 0
        assert (await signed.health()).engines == {}

        assert (await signed.register(info(0, tp_size=1))).outcome == "registered"
        # Reads need no signature.
        assert [i.rank for i in await unsigned.ranks(ENGINE)] == [0]
        with pytest.raises(UnauthorizedError):
            await unsigned.deregister(ENGINE, 0)
        with pytest.raises(UnauthorizedError):
            await wrong.deregister(ENGINE, 0)
        # A signed DELETE for one path does not authorise another.
        headers = request_headers(SECRET, "DELETE", "/v1/ranks/other/0", b"")
        async with http.delete(f"{server.url}/v1/ranks/{ENGINE}/0", headers=headers) as resp:
            assert resp.status == 401
        assert (await unsigned.rank(ENGINE, 0)).rank == 0
        assert await signed.deregister(ENGINE, 0, incarnation=1)
        assert len(server.table) == 0


def test_server_refuses_a_short_secret() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        BootstrapServer(expected_ranks=1, secret=b"short")


def test_server_refuses_bad_connection_limits() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_connections"):
            BootstrapServer(expected_ranks=1, max_connections=bad)  # type: ignore[arg-type]
    for name in ("idle_timeout_s", "request_timeout_s"):
        for value in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=name):
                BootstrapServer(expected_ranks=1, **{name: value})


@pytest.mark.asyncio
async def test_health_carries_the_connection_counters(http: aiohttp.ClientSession) -> None:
    server = BootstrapServer(expected_ranks=1, max_connections=7)
    assert server.stats.limit == 7
    assert server.stats.accepted == 0
    async with server, BootstrapClient(server.url) as client:
        health = await client.health()
        assert health.connections is not None
        # This request's own connection: open and busy while it is answered.
        assert (health.connections.open, health.connections.busy) == (1, 1)
        assert (health.connections.limit, health.connections.accepted) == (7, 1)
        async with http.get(f"{server.url}/health") as resp:
            body = await resp.json()
        assert body["connections"]["accepted"] == 2
        assert set(body["connections"]) == {
            "open",
            "limit",
            "busy",
            "accepted",
            "shed",
            "idle_closed",
            "request_timeouts",
            "accept_errors",
        }
    # The counters outlive the server; nothing is open any more.
    assert (server.stats.open, server.stats.accepted) == (0, 2)


# -- hostile input ---------------------------------------------------------------------------------

GOOD = as_json(info(0))

HOSTILE_PUTS: list[tuple[str, bytes, int, str]] = [
    ("garbage", b"\x00\xffnot json{{{", 400, "JSON is malformed"),
    ("empty", b"", 400, "truncated"),
    ("array", b"[1, 2, 3]", 400, "Expected `object`, got `array`"),
    ("string rank", json.dumps({**GOOD, "rank": "0"}).encode(), 400, "$.rank"),
    ("float port", json.dumps({**GOOD, "port": 1.5}).encode(), 400, "$.port"),
    ("negative rank", json.dumps({**GOOD, "rank": -1}).encode(), 400, ">= 0 - at `$.rank`"),
    ("huge incarnation", json.dumps({**GOOD, "incarnation": 2**70}).encode(), 400, "incarnation"),
    ("port 0", json.dumps({**GOOD, "port": 0}).encode(), 400, "$.port"),
    ("port 70000", json.dumps({**GOOD, "port": 70000}).encode(), 400, "$.port"),
    ("tp_rank >= tp_size", json.dumps({**GOOD, "tp_rank": 4}).encode(), 400, "tp_rank 4"),
    ("unknown field", json.dumps({**GOOD, "evil": 1}).encode(), 400, "unknown field `evil`"),
    ("missing field", json.dumps({"engine": ENGINE}).encode(), 400, "missing required field"),
    ("bad base64", json.dumps({**GOOD, "layout": "!!"}).encode(), 400, "$.layout"),
    ("newline host", json.dumps({**GOOD, "host": "a\nb"}).encode(), 400, "$.host"),
    ("rank too big", json.dumps({**GOOD, "rank": 5}).encode(), 400, "ranks 0..1"),
    ("huge body", b"x" * (MAX_BODY_BYTES + 1), 413, "exceeds the limit"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "status", "words"),
    [case[1:] for case in HOSTILE_PUTS],
    ids=[case[0] for case in HOSTILE_PUTS],
)
async def test_hostile_registrations_are_refused(
    server: BootstrapServer,
    http: aiohttp.ClientSession,
    body: bytes,
    status: int,
    words: str,
) -> None:
    # aiohttp warns about large raw bytes bodies (they are written in one go); a file object is not.
    async with http.put(f"{server.url}/v1/ranks", data=io.BytesIO(body)) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
        assert words in error
    assert len(server.table) == 0
    async with http.put(f"{server.url}/v1/ranks", json=GOOD) as resp:
        assert resp.status == 200


@pytest.mark.asyncio
async def test_chunked_oversized_body_is_refused(
    server: BootstrapServer, http: aiohttp.ClientSession
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b" " * (MAX_BODY_BYTES // 2)

    async with http.put(f"{server.url}/v1/ranks", data=chunks()) as resp:
        assert resp.status == 413
        assert "Maximum request body size" in (await resp.json())["error"]


HOSTILE_REQUESTS: list[tuple[str, str, int, str]] = [
    ("GET", "/nope", 404, "Not Found"),
    ("POST", "/v1/ranks", 405, "Method Not Allowed"),
    ("GET", "/v1/ranks", 400, "missing query parameter: engine"),
    ("GET", "/v1/ranks?engine=a%20b", 400, "invalid engine id"),
    ("GET", "/v1/ranks?engine=%0A", 400, "invalid engine id"),
    ("GET", f"/v1/ranks/{ENGINE}/x", 400, "invalid rank"),
    ("GET", f"/v1/ranks/{ENGINE}/-1", 400, "invalid rank"),
    ("GET", f"/v1/ranks/{ENGINE}/99999999999999999999999", 400, "invalid rank"),
    ("GET", f"/v1/ranks/{ENGINE}/0/extra", 404, "Not Found"),
    ("DELETE", f"/v1/ranks/{ENGINE}/0?incarnation=x", 400, "invalid incarnation"),
    ("DELETE", f"/v1/ranks/{ENGINE}/0", 404, "not registered"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case", HOSTILE_REQUESTS, ids=[f"{m} {p}" for m, p, _, _ in HOSTILE_REQUESTS]
)
async def test_hostile_requests_get_json_errors(
    server: BootstrapServer, http: aiohttp.ClientSession, case: tuple[str, str, int, str]
) -> None:
    method, path, status, words = case
    async with http.request(method, f"{server.url}{path}") as resp:
        assert resp.status == status
        assert resp.content_type == "application/json"
        assert words in (await resp.json())["error"]


@pytest.mark.asyncio
async def test_raw_garbage_does_not_stop_the_server(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    junk = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),  # a TLS hello
        b"GARBAGE / HTTP/9.9\r\n\r\n",
        b"PUT /v1/ranks HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"PUT /v1/ranks HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n",
        b"PUT /v1/ranks HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{",  # then hang up
    ]
    for data in junk:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        await reader.read()  # whatever the server answers, up to its close
        writer.close()
        await writer.wait_closed()
    assert not (await client.health()).ready
    assert (await client.register(info(0))).outcome == "registered"
