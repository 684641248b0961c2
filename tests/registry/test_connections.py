"""The registry's connections (``kvfsm/registry/_connections.py``) under exhaustion: idle and
slow connections (the idle reaper), the connection cap, request timeouts (the limit the listener
counts; the 408 is written by ``kvfsm.registry._server``'s guard), and the accept loop running
out of descriptors.

Real sockets on loopback. The tests that exhaust descriptors run the registry in a child
process (``tests/helpers/registry_process.py``) whose soft RLIMIT_NOFILE is 1024, so only that
child runs out; this process raises its own soft limit to hold the 1,100 connections and
restores it afterwards.
Latencies are printed (``-s``), never asserted: a request must be answered, within a generous
client timeout, where the registry used to leave it unanswered until the connections let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kvfsm.registry import BootstrapClient, BootstrapServer, ConnectionStats, RankInfo
from tests.helpers.waiting import wait_until

ENGINE = "prefill-a"
HELPER = Path(__file__).resolve().parent.parent / "helpers" / "registry_process.py"
CHILD_NOFILE = 1024
IDLE_CONNECTIONS = 1100
#: Generous: the registry answers in about a millisecond; before the fix it did not answer.
ANSWER_TIMEOUT_S = 2.0
#: The child's event loop: asyncio's, and uvloop's where it is installed (kvfsm prefers it).
LOOPS = [
    pytest.param([], id="asyncio"),
    pytest.param(
        ["--uvloop"],
        id="uvloop",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
        ),
    ),
]


def info(rank: int = 0, *, tp_size: int = 1, layout: bytes = b"") -> RankInfo:
    return RankInfo(
        engine=ENGINE,
        rank=rank,
        tp_rank=rank,
        tp_size=tp_size,
        dp_rank=0,
        pp_rank=0,
        host="10.0.0.7",
        port=17000 + rank,
        agent=f"prefill-{rank}",
        layout=layout,
        incarnation=1,
    )


# -- helpers ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def nofile_at_least(needed: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE raised to ``needed`` (up to the hard limit), then back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) is below the {needed} descriptors needed")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Child:
    """The registry in a child process (``tests/helpers/registry_process.py``), driven over
    stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stderr = ""

    async def command(self, line: str) -> Any:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 30.0))

    async def stats(self) -> ConnectionStats:
        return msgspec.convert((await self.command("stats"))["stats"], ConnectionStats)


@contextlib.asynccontextmanager
async def child_registry(*options: str) -> AsyncIterator[Child]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HELPER),
        "--nofile",
        str(CHILD_NOFILE),
        *options,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    err_reader = asyncio.ensure_future(proc.stderr.read())
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60.0)
        if not line:
            raise AssertionError(f"the registry child died: {(await err_reader).decode()}")
        hello = json.loads(line)
        assert hello["nofile"][0] == CHILD_NOFILE
        child = Child(proc, hello["port"])
        yield child
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 30.0) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    child.stderr = (await err_reader).decode()


def hold_idle(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that never complete a request: half send nothing at all, half a
    request head without its final blank line (a slow sender that has stopped)."""
    held: list[socket.socket] = []
    try:
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10.0)
            held.append(sock)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: registry\r\n")
    except BaseException:
        release(held)
        raise
    return held


def release(held: list[socket.socket]) -> None:
    for sock in held:
        sock.close()
    held.clear()


async def timed_get(url: str, timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[int | str, float]:
    """GET on a new connection (so the accept path is measured too): (status or error, ms)."""
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        try:
            async with session.get(url) as resp:
                await resp.read()
                outcome: int | str = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = type(exc).__name__
    return outcome, (time.perf_counter() - start) * 1000


async def eof_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` (whatever it sends first)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    deadline = loop.time() + timeout_s
    with contextlib.suppress(TimeoutError):
        while True:
            async with asyncio.timeout_at(deadline):
                try:
                    data = await loop.sock_recv(sock, 65536)
                except ConnectionResetError:
                    return True
            if not data:
                return True
    return False


def still_open(sock: socket.socket) -> bool:
    """No EOF or reset has arrived on ``sock`` (nothing is expected to be sent on it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False


async def until_quiet(child: Child) -> None:
    """Until the child holds no connection (the descriptors of those just closed too)."""

    async def quiet() -> bool:
        return (await child.stats()).open == 0

    await wait_until(quiet, timeout=10, message="the registry to hold no connection")


async def raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    sock.setblocking(False)
    return sock


# -- 1,100 idle connections at a 1024-descriptor limit --------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", LOOPS)
async def test_health_and_lookups_answer_while_1100_idle_connections_are_held(
    loop: list[str],
) -> None:
    with nofile_at_least(IDLE_CONNECTIONS + 256):
        async with child_registry(*loop) as child:
            async with BootstrapClient(child.url) as client:
                await client.register(info(0))
            held = await asyncio.to_thread(hold_idle, child.port, IDLE_CONNECTIONS)
            try:
                latencies: dict[str, list[tuple[int | str, float]]] = {}
                for path in ("/health", f"/v1/ranks/{ENGINE}/0", f"/v1/ranks?engine={ENGINE}"):
                    latencies[path] = [await timed_get(child.url + path) for _ in range(5)]
                # A client that keeps its connection (the heartbeat's way) is served too.
                async with BootstrapClient(child.url, timeout_s=ANSWER_TIMEOUT_S) as client:
                    assert (await client.rank(ENGINE, 0)).port == 17000
                    assert (await client.health()).ready
                stats = await child.stats()
            finally:
                release(held)
            for path, results in latencies.items():
                print(f"{path}: {[f'{status} {ms:.1f} ms' for status, ms in results]}")
                assert [status for status, _ in results] == [200] * 5, path
            print(stats)
            # The connections beyond the cap were shed, and it was not descriptors that ran out.
            assert stats.open <= stats.limit == 512
            assert stats.shed >= IDLE_CONNECTIONS - stats.limit
            assert stats.accept_errors == 0
        assert "Traceback" not in child.stderr, child.stderr


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", LOOPS)
async def test_accept_errors_are_counted_and_the_listener_serves_on(loop: list[str]) -> None:
    # A cap above the descriptor limit: accept() itself runs out, and the listener sheds the
    # connection idle the longest to get a descriptor back.
    with nofile_at_least(IDLE_CONNECTIONS + 256):
        async with child_registry("--max-connections", "4096", *loop) as child:
            held = await asyncio.to_thread(hold_idle, child.port, IDLE_CONNECTIONS)
            try:
                during = [await timed_get(child.url + "/health") for _ in range(5)]
                stats = await child.stats()
            finally:
                release(held)
            print(f"/health while out of descriptors: {during}; {stats}")
            assert [status for status, _ in during] == [200] * 5
            assert stats.accept_errors > 0
            assert stats.shed >= stats.accept_errors
            assert stats.open < CHILD_NOFILE
            after = [await timed_get(child.url + "/health") for _ in range(3)]
            assert [status for status, _ in after] == [200] * 3

            # Descriptors taken by something else: nothing idle to give back. The listener
            # backs off and answers once they are released.
            await until_quiet(child)
            assert (await child.command("hog"))["hogged"] > 0
            pending = asyncio.ensure_future(timed_get(child.url + "/health", timeout_s=30.0))

            async def refused_while_hogged() -> bool:
                return (await child.stats()).accept_errors > stats.accept_errors

            # The listener tried to accept it and could not: no descriptor is left.
            await wait_until(refused_while_hogged, timeout=10)
            assert not pending.done()
            await child.command("release")
            status, ms = await pending
            print(f"/health queued while out of descriptors answered {ms:.0f} ms after sending")
            assert status == 200
            assert (await timed_get(child.url + "/health"))[0] == 200
        # Counted, and logged without a storm (asyncio's own accept loop logged ~200,000 lines
        # for the same 1,100 connections): one line per 10 s at most.
        failures = child.stderr.count("accept() failed")
        assert 1 <= failures <= 3, child.stderr
        assert "Traceback" not in child.stderr, child.stderr


# -- timeouts and the cap, in this process --------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.looptime  # the idle timeout, the trickle and the client's pace on the loop's clock
async def test_idle_and_slow_connections_are_closed_after_the_idle_timeout() -> None:
    async with (
        BootstrapServer(expected_ranks=1, idle_timeout_s=1.0) as server,
        BootstrapClient(server.url) as client,
    ):
        silent = await raw_connection(server.port)
        kept_alive = await raw_connection(server.port)
        kept_alive.send(b"GET /health HTTP/1.1\r\nHost: registry\r\n\r\n")
        trickling = await raw_connection(server.port)
        head = b"GET /health HTTP/1.1\r\nHost: registry\r\nX-Slow: " + b"a" * 200

        async def trickle() -> None:
            # One byte every 50 ms: activity, but never a complete head.
            for byte in head:
                try:
                    trickling.send(bytes([byte]))
                except OSError:
                    return
                await asyncio.sleep(0.05)

        # A connection in steady use outlives the timeout: it is idle only between requests.
        async def busy_client() -> None:
            for _ in range(25):
                await client.health()
                await asyncio.sleep(0.1)

        trickler = asyncio.ensure_future(trickle())
        user = asyncio.ensure_future(busy_client())
        closed = await asyncio.gather(
            eof_within(silent, 10.0), eof_within(kept_alive, 10.0), eof_within(trickling, 10.0)
        )
        trickler.cancel()
        await user
        assert closed == [True, True, True]
        stats = server.stats
        assert stats.idle_closed >= 3
        assert stats.open <= 1  # the client's own connection, kept between its requests
        assert stats.shed == 0
        for sock in (silent, kept_alive, trickling):
            sock.close()


@pytest.mark.asyncio
async def test_a_slow_request_body_gets_408_and_the_connection_closed() -> None:
    async with (
        BootstrapServer(expected_ranks=1, request_timeout_s=0.3) as server,
        BootstrapClient(server.url) as client,
    ):
        slow = await raw_connection(server.port)
        slow.send(b"PUT /v1/ranks HTTP/1.1\r\nHost: registry\r\nContent-Length: 100\r\n\r\n{")
        loop = asyncio.get_running_loop()
        answer = b""
        async with asyncio.timeout(10.0):
            while chunk := await loop.sock_recv(slow, 65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"request not completed within 0.3 s" in answer
        assert server.stats.request_timeouts == 1
        # Closed with the answer, not later for idleness (aiohttp would have lingered over the
        # rest of the body).
        assert server.stats.idle_closed == 0
        assert len(server.table) == 0
        assert (await client.register(info(0))).outcome == "registered"
        slow.close()


@pytest.mark.asyncio
async def test_a_client_that_does_not_read_its_answer_is_cut_off() -> None:
    ranks = 16
    async with (
        BootstrapServer(expected_ranks=ranks, request_timeout_s=0.5) as server,
        BootstrapClient(server.url) as client,
    ):
        # 16 ranks with the largest layout: an answer of about 11 MB, more than the socket
        # buffers between us hold.
        for rank in range(ranks):
            await client.register(info(rank, tp_size=ranks, layout=b"\x00" * 512 * 1024))
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", server.port))
        reader.sendall(f"GET /v1/ranks?engine={ENGINE} HTTP/1.1\r\nHost: registry\r\n\r\n".encode())
        await wait_until(lambda: server.stats.request_timeouts == 1)
        assert server.stats.busy == 0
        # Reading now drains what the kernel held, then the connection ends, short of the answer.
        reader.setblocking(False)
        loop = asyncio.get_running_loop()
        received = 0
        async with asyncio.timeout(10.0):
            with contextlib.suppress(ConnectionResetError):
                while chunk := await loop.sock_recv(reader, 1 << 20):
                    received += len(chunk)
        assert 0 < received < ranks * 512 * 1024
        reader.close()
        assert len(await client.ranks(ENGINE)) == ranks


@pytest.mark.asyncio
async def test_beyond_the_cap_the_connection_idle_longest_is_shed() -> None:
    async with (
        BootstrapServer(expected_ranks=1, max_connections=4) as server,
        BootstrapClient(server.url) as client,
    ):
        socks = [await raw_connection(server.port) for _ in range(4)]
        await wait_until(lambda: server.stats.open == 4)
        health = await client.health()
        # The client's connection was the fifth: the first one opened went to make room.
        assert health.connections is not None
        assert (health.connections.open, health.connections.busy) == (4, 1)
        assert health.connections.shed == 1
        assert await eof_within(socks[0], 10.0)
        assert [still_open(s) for s in socks[1:]] == [True, True, True]
        assert (server.stats.open, server.stats.shed) == (4, 1)
        # A sixth: the next oldest idle goes (the client's connection is the newest idle).
        sixth = await raw_connection(server.port)
        assert await eof_within(socks[1], 10.0)
        assert [still_open(s) for s in (*socks[2:], sixth)] == [True, True, True]
        assert (await client.health()).connections is not None  # the client's was kept
        for sock in (*socks, sixth):
            sock.close()


@pytest.mark.asyncio
async def test_when_every_connection_is_busy_the_longest_busy_is_shed() -> None:
    async with (
        BootstrapServer(expected_ranks=1, max_connections=2) as server,
        BootstrapClient(server.url) as client,
    ):
        # Two requests whose bodies never come: busy until the request timeout (10 s).
        slow: list[socket.socket] = []
        for n in (1, 2):
            sock = await raw_connection(server.port)
            sock.send(b"PUT /v1/ranks HTTP/1.1\r\nHost: registry\r\nContent-Length: 100\r\n\r\n")
            slow.append(sock)
            await wait_until(lambda n=n: server.stats.busy == n)  # type: ignore[misc]
        # A newcomer is not refused: the one busy the longest makes room.
        assert not (await client.health()).ready
        assert await eof_within(slow[0], 10.0)
        assert still_open(slow[1])
        assert server.stats.shed == 1
        assert server.stats.request_timeouts == 0
        for sock in slow:
            sock.close()
