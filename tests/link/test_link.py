"""The link module (``kvfsm.link._link``) that every listener and connection uses: named failures,
liveness, the accept loop's rules under descriptor exhaustion, a handshake that reads no further
than it must, and heartbeats on an idle writer. Real sockets on loopback; the accept failures are
injected into the loop's ``sock_accept``, because an exhausted descriptor table is a process-wide
state the real-process tests (the registry's and the control channel's) already drive."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Iterator
from functools import partial

import anyio
import pytest

from kvfsm.link import (
    AcceptErrors,
    Liveness,
    RawConnection,
    accept_forever,
    describe,
    next_frame,
    peer_host,
    send_or_beat,
    shake_hands,
)

_log = logging.getLogger("tests.link")


def test_describe_names_an_exception_whose_message_is_empty() -> None:
    assert describe(anyio.EndOfStream()) == "EndOfStream"
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(OSError(errno.ECONNRESET, "Connection reset by peer")) == (
        "[Errno 104] Connection reset by peer"
    )


def test_describe_typed_names_the_type_and_leaves_no_dangling_colon() -> None:
    assert describe(ValueError("bad layout"), typed=True) == "ValueError: bad layout"
    assert describe(ValueError(), typed=True) == "ValueError"


def test_peer_host_is_the_address_per_host_bounds_count() -> None:
    """IPv4: the address; an IPv4-mapped IPv6 peer: its IPv4 address; IPv6: its /64 (one host
    commonly holds a whole /64); a socket reset before it is asked: ''."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.socket() as client:
            client.bind(("127.0.0.7", 0))
            client.connect(("127.0.0.1", port))
            accepted, _ = server.accept()
            with accepted:
                assert peer_host(accepted) == "127.0.0.7"
            assert peer_host(accepted) == ""  # closed: no peer address any more
    if not socket.has_ipv6:
        return
    try:
        server6 = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError:
        return  # no IPv6 on this host
    with server6:
        port = server6.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = server6.accept()
            with accepted:
                assert peer_host(accepted) == "127.0.0.1"  # ::ffff:127.0.0.1
        try:
            client6 = socket.create_connection(("::1", port))
        except OSError:
            return
        with client6:
            accepted, _ = server6.accept()
            with accepted:
                assert peer_host(accepted) == "::/64"


def test_liveness_is_judged_on_the_callers_clock() -> None:
    live = Liveness(10.0, 2.0)
    assert live.left(11.0) == 1.0
    assert not live.overdue(12.0)
    assert live.overdue(12.01)
    # A watchdog that ticks every 0.1 s declares the loss one tick early.
    assert live.overdue(11.95, early_s=0.1)
    live.seen(12.0)
    assert not live.overdue(13.9)
    # Its own stall excuses the silence: judged from now on, never moved back.
    live.excuse(20.0)
    assert live.last_seen == 20.0
    assert not live.overdue(21.0)
    live.excuse(15.0)
    assert live.last_seen == 20.0


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.mark.asyncio
async def test_accept_errors_shed_then_back_off_and_the_listener_serves_on(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    real_accept = loop.sock_accept
    failures = [
        OSError(errno.EMFILE, "Too many open files"),
        OSError(errno.EMFILE, "Too many open files"),
        OSError(errno.ECONNABORTED, "aborted"),  # the peer gave up: not an error at all
        OSError(errno.EPROTO, "protocol error"),  # not a resource error: backs off, no shed
    ]

    async def flaky_accept(sock: socket.socket) -> tuple[socket.socket, object]:
        if failures:
            raise failures.pop(0)
        return await real_accept(sock)

    monkeypatch.setattr(loop, "sock_accept", flaky_accept)
    shed_calls: list[int] = []
    accepted: list[socket.socket] = []
    got_one = asyncio.Event()

    def shed() -> bool:
        shed_calls.append(1)
        return len(shed_calls) == 1  # the first time something was given back, then nothing

    async def on_accept(conn: socket.socket) -> None:
        accepted.append(conn)
        got_one.set()

    errors = AcceptErrors(_log, "test listener", stats={})
    with caplog.at_level(logging.WARNING, logger="tests.link"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(accept_forever, listener, on_accept, errors, shed=shed))
            with socket.create_connection(listener.getsockname()):
                with anyio.fail_after(10):
                    await got_one.wait()
            tg.cancel_scope.cancel()
    for conn in accepted:
        conn.close()
    errors.close()
    # ECONNABORTED is not counted; EMFILE twice and EPROTO once are.
    assert errors.count == 3
    assert errors._stats == {"accept_errors": 3}
    # Shed asked for each resource error only.
    assert len(shed_calls) == 2
    assert len(accepted) == 1
    # One line for the burst (at most one per 10 s), not one per failure.
    lines = [r for r in caplog.records if "accept() failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


class _Reader:
    """A frame reader of newline-terminated items that records how much it was fed."""

    def __init__(self) -> None:
        self.buffer = b""
        self.fed: list[bytes] = []

    def feed(self, data: bytes | memoryview, max_items: int | None = None) -> list[bytes]:
        self.fed.append(bytes(data))
        self.buffer += bytes(data)
        out: list[bytes] = []
        while b"\n" in self.buffer and (max_items is None or len(out) < max_items):
            item, _, self.buffer = self.buffer.partition(b"\n")
            out.append(item)
        return out


@pytest.mark.asyncio
async def test_a_handshake_reads_one_frame_at_a_time_and_keeps_the_rest() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    loop = asyncio.get_running_loop()
    ours, theirs = RawConnection(a, loop), RawConnection(b, loop)
    try:
        # The peer sends its hello, its confirmation and a first room frame in one segment.
        await theirs.send(b"HELLO\nCONFIRM\nROOM 1\n")
        reader = _Reader()
        checked: list[bytes] = []
        confirmations: list[bytes] = []
        hello = await shake_hands(
            ours,
            reader,
            b"OUR HELLO\n",
            check=checked.append,
            session=lambda item: b"OUR CONFIRM\n",
            confirmed=confirmations.append,
        )
        assert hello == b"HELLO"
        assert checked == [b"HELLO"]
        assert confirmations == [b"CONFIRM"]
        # The room frame stays in the reader for the link to take once it exists.
        assert reader.feed(b"") == [b"ROOM 1"]
        assert await theirs.receive() == b"OUR HELLO\nOUR CONFIRM\n"
        # A refused hello ends the handshake before anything else is sent.
        await theirs.send(b"BAD\n")

        def refuse(item: bytes) -> None:
            raise ValueError(f"refused {item!r}")

        with pytest.raises(ValueError, match="refused b'BAD'"):
            await shake_hands(
                ours,
                _Reader(),
                b"AGAIN\n",
                check=refuse,
                session=lambda item: b"NEVER\n",
                confirmed=confirmations.append,
            )
        assert await theirs.receive() == b"AGAIN\n"
        # A hang-up mid-handshake is EndOfStream, which describe() names.
        await theirs.aclose()
        with pytest.raises(anyio.EndOfStream) as caught:
            await next_frame(ours, _Reader())
        assert describe(caught.value) == "EndOfStream"
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio
@pytest.mark.looptime
async def test_an_idle_writer_beats_every_heartbeat_and_sends_what_comes() -> None:
    sent: list[tuple[float, bytes]] = []
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    open_ = [True]
    loop = asyncio.get_running_loop()

    async def send(payload: bytes) -> None:
        sent.append((loop.time(), payload))
        if len(sent) == 4:
            open_[0] = False
            queue.put_nowait(b"")  # the wake-up a closing link queues

    async def producer() -> None:
        await asyncio.sleep(2.5)
        queue.put_nowait(b"frame")

    start = loop.time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        await send_or_beat(send, queue.get, 1.0, lambda: b"beat", open_=lambda: open_[0])
    assert [p for _, p in sent] == [b"beat", b"beat", b"frame", b"beat"]
    assert [round(t - start, 3) for t, _ in sent] == [1.0, 2.0, 2.5, 3.5]
