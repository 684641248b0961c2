"""The bootstrap registry: the table's rules, the HTTP surface, auth, hostile input, the CLI.

Servers bind 127.0.0.1 on a free port. Expiry is the table's rule, driven with explicit ``now``
values; one server test checks the server's own clock and sweep, without measuring time.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from kvfsm.bootstrap import (
    BootstrapClient,
    BootstrapError,
    BootstrapServer,
    NotFoundError,
    NotReadyError,
    RankInfo,
    RejectedError,
    UnauthorizedError,
    UnreachableError,
)
from kvfsm.bootstrap._auth import (
    request_headers,
)
from kvfsm.bootstrap._rank_table import RankTable, RefusedError
from kvfsm.bootstrap._registry_server import MAX_BODY_BYTES

ENGINE = "prefill-a"
SECRET = b"0123456789abcdef-test-secret"


def info(rank: int = 0, *, engine: str = ENGINE, incarnation: int = 1, **kw: Any) -> RankInfo:
    fields: dict[str, Any] = {
        "engine": engine,
        "rank": rank,
        "tp_rank": rank,
        "tp_size": 4,
        "dp_rank": 0,
        "pp_rank": 0,
        "host": "10.0.0.7",
        "port": 17000 + rank,
        "agent": f"prefill-{rank}",
        "layout": msgspec.msgpack.encode({"kv": [rank, 4096]}),
        "incarnation": incarnation,
    }
    fields.update(kw)
    return RankInfo(**fields)


def as_json(i: RankInfo) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(msgspec.json.encode(i))
    return out


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


# -- the table, without IO -------------------------------------------------------------------------


def test_rank_info_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="tp_rank 4 out of range"):
        info(tp_rank=4)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.engine"):
        msgspec.json.decode(
            msgspec.json.encode({**as_json(info()), "engine": "a b"}), type=RankInfo
        )
    # msgspec's pattern uses re.search; an anchored "$" would let a trailing newline through.
    bad = {**as_json(info()), "engine": "a\n"}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(bad), type=RankInfo)


def test_registry_rules_without_io() -> None:
    reg = RankTable(expected_ranks=2, ttl_s=10.0)
    assert reg.register(info(0), now=0.0) == "registered"
    assert reg.register(info(0), now=5.0) == "refreshed"
    assert reg.register(info(0, incarnation=2, port=9), now=6.0) == "replaced"
    with pytest.raises(RefusedError) as exc:
        reg.ranks(ENGINE, now=6.0)
    assert (exc.value.status, exc.value.registered, exc.value.expected) == (503, 1, 2)
    reg.register(info(1), now=7.0)
    assert [i.rank for i in reg.ranks(ENGINE, now=7.0)] == [0, 1]
    assert reg.health(now=7.0).ready
    # rank 0 was last registered at 6.0: it expires at 16.0; rank 1 at 17.0.
    assert reg.rank(ENGINE, 0, now=15.9).port == 9
    assert [i.rank for i in reg.expire(now=16.0)] == [0]
    assert [i.rank for i in reg.expire(now=17.0)] == [1]
    assert len(reg) == 0
    assert reg.health(now=17.0).detail == "not ready: no ranks registered"
    with pytest.raises(ValueError, match="expected_ranks"):
        RankTable(expected_ranks=0, ttl_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        RankTable(expected_ranks=1, ttl_s=float("nan"))


def test_registry_refuses_clashes_and_bounds_engines() -> None:
    reg = RankTable(expected_ranks=4, ttl_s=10.0, max_engines=2)
    reg.register(info(0), now=0.0)
    cases = [
        (info(0, port=1), 409, "different fields"),  # same incarnation, other fields
        (info(1, tp_rank=0), 409, "already held by live rank 0"),
        (info(1, tp_size=8), 409, "tp_size 8"),
        (info(4, tp_rank=0, tp_size=1), 400, "ranks 0..3"),
    ]
    for bad, status, words in cases:
        with pytest.raises(RefusedError, match=words) as exc:
            reg.register(bad, now=1.0)
        assert exc.value.status == status
    assert reg.rank(ENGINE, 0, now=1.0) == info(0)
    reg.register(info(0, engine="b"), now=1.0)
    with pytest.raises(RefusedError, match="registry full") as exc:
        reg.register(info(0, engine="c"), now=1.0)
    assert exc.value.status == 429


def test_entries_expire_unless_refreshed() -> None:
    reg = RankTable(expected_ranks=2, ttl_s=10.0)
    reg.register(info(0), now=0.0)
    reg.register(info(1), now=0.0)
    assert len(reg.ranks(ENGINE, now=0.0)) == 2
    # Heartbeats keep rank 0 alive across several ttls; rank 1 goes silent (expires at 10.0).
    for beat in (4.0, 8.0, 12.0, 16.0, 20.0):
        assert reg.register(info(0), now=beat) == "refreshed"
    assert reg.rank(ENGINE, 0, now=20.0).rank == 0
    with pytest.raises(RefusedError, match="rank 1 of engine 'prefill-a' is not registered") as exc:
        reg.rank(ENGINE, 1, now=20.0)
    assert exc.value.status == 404
    with pytest.raises(RefusedError, match="1 of 2") as exc:
        reg.ranks(ENGINE, now=20.0)
    assert exc.value.status == 503
    # Nobody reads now: the sweep's expire() alone empties the table (rank 0 expires at 30.0).
    assert reg.expire(now=29.9) == []
    assert [i.rank for i in reg.expire(now=30.0)] == [0]
    assert len(reg) == 0
    # An expired rank registers afresh.
    assert reg.register(info(1), now=31.0) == "registered"


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
    with explicit ``now`` values above; nothing here measures time.)"""
    async with (
        BootstrapServer(expected_ranks=2, ttl_s=0.5) as server,
        BootstrapClient(server.url) as client,
    ):
        await client.register(info(0))
        assert (await client.rank(ENGINE, 0)).rank == 0
        # Nobody reads now: the sweep task alone empties the table.
        deadline = time.monotonic() + 30.0
        while len(server.table) != 0:
            assert time.monotonic() < deadline, "the sweep never expired the entry"
            await asyncio.sleep(0.02)
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


@pytest.mark.asyncio
async def test_client_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        async with BootstrapClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as client:
            with pytest.raises(UnreachableError, match="unreachable"):
                await client.health()
    client = BootstrapClient("http://127.0.0.1:1")
    await client.close()
    with pytest.raises(BootstrapError, match="closed"):
        await client.health()
    with pytest.raises(ValueError, match="base_url"):
        BootstrapClient("127.0.0.1:8998")


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


# -- the command line ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _wait_healthy(client: BootstrapClient, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        try:
            await client.health()
            return
        except UnreachableError:
            if proc.returncode is not None or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.parametrize("signed", [False, True], ids=["open", "secret-file"])
async def test_cli_serves_until_sigint(tmp_path: Path, signed: bool) -> None:
    port = _free_port()
    args = ["-m", "kvfsm.bootstrap._cli", "--port", str(port), "--expected-ranks", "1"]
    args += ["--max-connections", "64", "--idle-timeout", "3", "--request-timeout", "4"]
    secret: bytes | None = None
    if signed:
        secret = SECRET
        (tmp_path / "secret").write_bytes(SECRET + b"\n")
        args += ["--secret-file", str(tmp_path / "secret")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with BootstrapClient(f"http://127.0.0.1:{port}", secret=secret) as client:
            await _wait_healthy(client, proc)
            await client.register(info(0, tp_size=1))
            assert await client.ranks(ENGINE) == [info(0, tp_size=1)]
            assert (await client.health()).ready
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = err.decode()
    assert proc.returncode == 0, log
    assert f"listening on http://127.0.0.1:{port}" in log
    assert "at most 64 connections, idle timeout 3 s, request timeout 4 s" in log
    assert f"registered: engine {ENGINE} rank 0" in log
    assert ("signed writes" if signed else "unsigned writes") in log
    assert "Traceback" not in log


@pytest.mark.asyncio
async def test_cli_reports_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"short\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            (["--expected-ranks", "0"], 2, "expected_ranks"),
            (
                ["--expected-ranks", "1", "--secret-file", str(tmp_path / "secret")],
                2,
                "at least 16",
            ),
            (["--expected-ranks", "1", "--secret-file", str(tmp_path / "none")], 2, "No such file"),
            (["--expected-ranks", "1", "--port", str(busy.getsockname()[1])], 1, "cannot serve"),
            (["--expected-ranks", "1", "--max-connections", "0"], 2, "max_connections"),
            (["--expected-ranks", "1", "--idle-timeout", "0"], 2, "idle_timeout_s"),
        ]
        for extra, rc, words in cases:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvfsm.bootstrap._cli",
                "--port",
                "0",
                *extra,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
            assert proc.returncode == rc, err
            assert words in err.decode()
