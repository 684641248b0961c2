"""The PP status consensus channel (``kvfsm.control._stages``): the sans-IO book and feed, then
a hub and links over real loopback sockets, with hostile connections beside a good link."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._frames import FrameError
from kvfsm.control._stage_links import StageHub, StageLink
from kvfsm.control._stages import (
    MAX_FRAME_BYTES,
    StageBeat,
    StageBook,
    StageFeed,
    StageForget,
    StageHello,
    StageStatus,
    _Codec,
)
from kvfsm.states import KVPoll
from tests.helpers.waiting import wait_until

B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)
SECRET = b"a shared secret of 32 bytes....."
GROUP = "dp0-tp1"
FAST = {"heartbeat_s": 0.05, "liveness_factor": 3.0}


# --------------------------------------------------------------------------- the book


def test_consensus_is_min_and_missing_stages_bootstrap() -> None:
    book = StageBook(3)
    # Nobody joined yet (start-up): the other stages count as Bootstrapping.
    assert book.consensus(7, S) == (B, "")
    book.joined(1)
    book.joined(2)
    book.report(1, 7, T)
    assert book.consensus(7, S) == (B, "")  # stage 2 has not reported room 7
    book.report(2, 7, S)
    assert book.consensus(7, S) == (T, "")
    assert book.consensus(7, W) == (W, "")  # own is lower
    book.report(1, 7, S)
    assert book.consensus(7, S) == (S, "")
    assert book.consensus(8, S) == (B, "")  # another room: nothing reported
    assert book.consensus(7, F) == (F, "")  # own failure: the caller knows why


def test_failed_reports_and_lost_stages_name_the_stage() -> None:
    book = StageBook(3)
    book.joined(1)
    book.joined(2)
    book.report(2, 5, F)
    assert book.consensus(5, T) == (F, "failed on PP stage 2")
    book.report(1, 6, W)
    book.lost(1, "silent for 2s")
    assert book.consensus(6, T) == (F, "PP stage 1 lost: silent for 2s")
    assert book.consensus(99, T) == (F, "PP stage 1 lost: silent for 2s")
    book.report(1, 6, T)  # a late frame of the lost feed
    assert book.stats["ignored"] == 1
    # Rejoined: the old reports are gone, the stage must report again.
    book.joined(1)
    assert book.rooms(1) == 0
    assert book.consensus(6, T) == (B, "")
    book.report(1, 6, T)
    book.report(2, 6, S)
    assert book.consensus(6, T) == (T, "")


def test_forget_drop_and_eviction_bound() -> None:
    book = StageBook(3, max_rooms=4)
    book.joined(1)
    book.joined(2)
    book.report(1, 1, S)
    book.report(2, 1, S)
    book.forget(1, 1)
    assert book.consensus(1, S) == (B, "")  # stage 1 released it: no report any more
    book.drop(1)
    assert (book.rooms(1), book.rooms(2)) == (0, 0)
    book = StageBook(2, max_rooms=4)  # one other stage: its reports alone decide
    book.joined(1)
    for room in range(10, 16):
        book.report(1, room, T)
    book.report(1, 14, W)  # an update keeps its place in the eviction order
    assert book.rooms(1) == 4
    assert book.stats["evicted"] == 2
    assert [book.consensus(r, S)[0] for r in range(10, 16)] == [B, B, T, T, W, T]
    with pytest.raises(ValueError, match="stage 3"):
        book.report(3, 1, S)
    with pytest.raises(ValueError, match="stage 0"):
        book.joined(0)
    with pytest.raises(ValueError, match="KVPoll"):
        book.report(1, 1, 9)


def test_consensus_from_another_thread_while_the_loop_mutates() -> None:
    """The scheduler thread reads while the loop thread reports, loses and rejoins: every answer
    is one the rules allow, and nothing raises."""
    book = StageBook(3, max_rooms=64)
    book.joined(1)
    book.joined(2)
    stop = threading.Event()
    seen: set[tuple[KVPoll, str]] = set()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                for room in range(128):
                    seen.add(book.consensus(room, S))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    # A count, not a stretch of time: the same work on any machine, many GIL switches long.
    for i in range(30_000):
        book.report(1, i % 128, T)
        book.report(2, i % 128, S)
        if i % 500 == 0:
            book.lost(2, "gone")
            book.joined(2)
        if i % 333 == 0:
            book.drop(i % 128)
    stop.set()
    thread.join()
    assert not errors
    allowed = {(B, ""), (T, ""), (S, ""), (F, "PP stage 2 lost: gone")}
    assert seen <= allowed
    assert (T, "") in seen


# --------------------------------------------------------------------------- the feed


class Cell:
    """A sender's published status."""

    def __init__(self, status: int = 1) -> None:
        self.status = status

    def __call__(self) -> int:
        return self.status


def test_feed_scans_only_changes_and_not_terminal_rooms() -> None:
    feed = StageFeed()
    assert feed.idle
    a, b = Cell(1), Cell(2)
    feed.track(1, a)
    feed.track(2, b)
    assert not feed.idle
    assert feed.scan() == [StageStatus(1, 1), StageStatus(2, 2)]
    assert feed.scan() == []  # nothing changed
    a.status = 3
    assert feed.scan() == [StageStatus(1, 3)]
    a.status, b.status = 4, 0
    assert feed.scan() == [StageStatus(1, 4), StageStatus(2, 0)]
    assert feed.idle  # both terminal and sent
    calls = 0

    def counting() -> int:
        nonlocal calls
        calls += 1
        return 4

    feed.track(3, counting)
    feed.scan()
    feed.scan()
    feed.scan()
    assert calls == 1  # a terminal room sent once is never read again
    feed.untrack(1)
    assert not feed.idle
    assert feed.scan() == [StageForget(1)]
    assert feed.idle


def test_feed_untrack_before_send_and_reuse_of_a_room_id() -> None:
    feed = StageFeed()
    feed.track(1, Cell(2))
    feed.untrack(1)
    assert feed.scan() == []  # never reported: nothing to forget
    feed.track(2, Cell(4))
    assert feed.scan() == [StageStatus(2, 4)]
    feed.untrack(2)
    feed.track(2, Cell(1))  # the id is reused by a new sender
    # The forget goes first, so the hub ends up with the new sender's status.
    assert feed.scan() == [StageForget(2), StageStatus(2, 1)]


def test_feed_read_errors_and_bad_values_report_failed() -> None:
    feed = StageFeed()

    def broken() -> int:
        raise RuntimeError("boom")

    feed.track(1, broken)
    feed.track(2, lambda: 17)
    assert feed.scan() == [StageStatus(1, 0), StageStatus(2, 0)]
    assert feed.stats["read_errors"] == 1


def test_snapshot_resends_everything_and_drops_pending_forgets() -> None:
    feed = StageFeed()
    a, b = Cell(3), Cell(4)
    feed.track(1, a)
    feed.track(2, b)
    feed.track(3, Cell(2))
    feed.scan()
    feed.untrack(3)  # pending forget: the hub lost everything anyway
    a.status = 2
    assert feed.snapshot() == [StageStatus(1, 2), StageStatus(2, 4)]
    assert feed.scan() == []


def test_track_from_another_thread_while_scanning() -> None:
    """The scheduler's thread tracks and releases rooms while the loop thread scans: the frames,
    replayed in order into a model of the hub, leave exactly the live rooms reported."""
    feed = StageFeed()
    n = 5000

    # Every 50 rooms the scheduler waits for one scan, so that scans and tracks interleave
    # however the two threads are scheduled.
    scanned = threading.Event()

    def scheduler() -> None:
        for room in range(n):
            feed.track(room, Cell(4 if room % 2 else 2))
            if room % 3 == 0:
                feed.untrack(room)
            if room % 50 == 0:
                scanned.clear()
                assert scanned.wait(10), "the loop thread stopped scanning"

    hub: dict[int, int] = {}

    def apply(frames: list[object]) -> None:
        for frame in frames:
            if isinstance(frame, StageStatus):
                hub[frame.room] = frame.status
            else:
                assert isinstance(frame, StageForget)
                del hub[frame.room]  # a forget only ever follows a status

    thread = threading.Thread(target=scheduler)
    thread.start()
    scans = 0
    while thread.is_alive():
        apply(feed.scan())  # type: ignore[arg-type]
        scans += 1
        scanned.set()
    thread.join()
    apply(feed.scan())  # type: ignore[arg-type]
    live = {room for room in range(n) if room % 3}
    assert hub == {room: 4 if room % 2 else 2 for room in live}
    assert len(feed) == len(live)
    assert scans > 1


# --------------------------------------------------------------------------- IO


class Rig:
    def __init__(self, hub: StageHub, port: int, tasks: set[asyncio.Task[None]]) -> None:
        self.hub = hub
        self.book = hub.book
        self.port = port
        self.tasks = tasks
        self.secret: bytes | None = None

    def link(self, stage: int, **kw: object) -> tuple[StageFeed, StageLink, asyncio.Task[None]]:
        feed = StageFeed()
        options: dict[str, object] = {"secret": self.secret, "scan_interval_s": 0.002, **FAST}
        options.update(kw)
        link = StageLink(
            feed,
            stage=stage,
            stages=3,
            group=GROUP,
            address=("127.0.0.1", self.port),
            **options,  # type: ignore[arg-type]
        )
        task = asyncio.create_task(link.run())
        self.tasks.add(task)
        return feed, link, task


@contextlib.asynccontextmanager
async def rig(secret: bytes | None = None, **kw: float) -> AsyncIterator[Rig]:
    book = StageBook(3)
    hub = StageHub(book, stages=3, group=GROUP, secret=secret, **{**FAST, **kw})  # type: ignore[arg-type]
    port = await hub.bind()
    tasks: set[asyncio.Task[None]] = {asyncio.create_task(hub.run())}
    r = Rig(hub, port, tasks)
    r.secret = secret
    try:
        yield r
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [None, SECRET])
async def test_statuses_flow_and_consensus_converges(secret: bytes | None) -> None:
    async with rig(secret) as r:
        f1, _, _ = r.link(1)
        f2, _, _ = r.link(2)
        cells = {(stage, room): Cell(1) for stage in (1, 2) for room in range(20)}
        for (stage, room), cell in cells.items():
            (f1 if stage == 1 else f2).track(room, cell)
        await wait_until(lambda: r.hub.feeds == {1, 2})
        await wait_until(lambda: r.book.rooms(1) == r.book.rooms(2) == 20)
        assert r.book.consensus(3, S) == (B, "")
        for room in range(20):
            cells[1, room].status = 3
            cells[2, room].status = 4
        await wait_until(lambda: all(r.book.consensus(room, S) == (T, "") for room in range(20)))
        cells[2, 5].status = 0  # terminal Success is final in the feed; this is a new sender
        f2.untrack(5)
        f2.track(5, cells[2, 5])
        await wait_until(lambda: r.book.consensus(5, S) == (F, "failed on PP stage 2"))
        f1.untrack(0)
        await wait_until(lambda: r.book.rooms(1) == 19)
        assert r.hub.stats["refused"] == 0


@pytest.mark.asyncio
async def test_a_killed_link_fails_consensus_and_a_restart_restores_it() -> None:
    async with rig() as r:
        f1, _, t1 = r.link(1)
        f2, _, _ = r.link(2)
        f1.track(1, Cell(3))
        f2.track(1, Cell(3))
        await wait_until(lambda: r.book.consensus(1, S) == (T, ""))
        t1.cancel()  # the stage's task dies: its socket closes
        await wait_until(lambda: r.book.consensus(1, S)[0] == F)
        _, reason = r.book.consensus(1, S)
        assert reason.startswith("PP stage 1 lost: connection closed")
        # A restarted stage 1 with a new sender: its snapshot restores consensus.
        g1, _, _ = r.link(1)
        g1.track(2, Cell(4))
        f2.track(2, Cell(4))
        await wait_until(lambda: r.book.consensus(2, S) == (S, ""))
        assert r.book.consensus(1, S) == (B, "")  # the old room's report is gone


@pytest.mark.asyncio
async def test_a_silent_feed_is_lost_and_its_link_reconnects_with_a_snapshot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with rig() as r:
        # This link beats only every 10 s: idle, it is silent past the hub's 0.15 s limit.
        f1, link, _ = r.link(1, heartbeat_s=10.0, liveness_factor=2.0)
        r.link(2)
        f1.track(9, Cell(4))
        with caplog.at_level("WARNING", logger="kvfsm.stages"):
            await wait_until(lambda: r.book.rooms(1) == 1 and r.hub.feeds == {1, 2})
            await wait_until(lambda: link.stats["losses"] >= 1 and link.stats["connects"] >= 2)
            # The hub closed it; it reconnected and its snapshot restored room 9.
            await wait_until(lambda: r.book.rooms(1) == 1)
        assert "PP stage 1 lost: silent for 0.15s" in caplog.text
        assert r.book.consensus(9, S) == (B, "")  # stage 2 (up) has not reported room 9
        assert r.hub.stats["lost"] >= 1


async def raw(port: int, data: bytes = b"") -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    if data:
        await loop.sock_sendall(sock, data)
    return sock


def body(obj: object) -> bytes:
    """An unsigned frame of any msgpack value."""
    payload = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(payload) + 1) + b"\x00" + payload


def hello_bytes(
    stage: int, group: str = GROUP, stages: int = 3, secret: bytes | None = None
) -> bytes:
    codec = _Codec(secret)
    nonce = b"n" * 16 if secret else b""
    return codec.encode(StageHello(stage, stages, group, nonce))


#: Hostile-connection tests judge whether a good link survives the hostile ones, not how fast a
#: silent one is found: 1 s of silence, not 0.15 s (a clean-clone CI run on this loaded 2-vCPU
#: machine once lost the good link to a 0.15 s scheduling stall, not to anything hostile).
PATIENT = 20.0  # liveness_factor


#: Long enough that the 100 silent connections below are all pending at once however slowly
#: this machine opens them, so the handshake cap must shed (rule 3). At 0.3 s a clean-clone CI
#: run on a loaded machine had the early ones time out before the later ones arrived: 1 shed.
SILENT_HELLO_S = 3.0


@pytest.mark.asyncio
async def test_hostile_connections_leave_a_good_link_alone() -> None:
    socks: list[socket.socket] = []
    async with rig(hello_timeout_s=SILENT_HELLO_S, liveness_factor=PATIENT) as r:
        try:
            f1, link, _ = r.link(1, liveness_factor=PATIENT)
            f2, _, _ = r.link(2, liveness_factor=PATIENT)
            cell = Cell(2)
            f1.track(1, cell)
            f2.track(1, Cell(3))
            await wait_until(lambda: r.book.consensus(1, S) == (W, ""))
            socks += [
                await raw(r.port, b"\x00\x00\x00\x05garbage-garbage"),
                await raw(r.port, struct.pack(">I", 2**31) + b"x" * 100),  # oversized length
                await raw(r.port, hello_bytes(1, group="dp1-tp0")),  # wrong group
                await raw(r.port, hello_bytes(3, stages=4)),  # another parallel shape
                await raw(r.port, body(["StageHello", 5, 3, GROUP, b""])),  # stage out of range
                await raw(r.port, hello_bytes(0)),  # stage 0 is the hub
                await raw(r.port, hello_bytes(1, secret=SECRET)),  # signed, hub has no secret
            ]
            socks += [await raw(r.port) for _ in range(100)]  # never say hello
            await wait_until(
                lambda: r.hub.stats["shed"] + r.hub.stats["refused"] >= 107,
                timeout=SILENT_HELLO_S + 5,
            )
            cell.status = 3
            await wait_until(lambda: r.book.consensus(1, S) == (T, ""))
            assert link.stats["losses"] == 0
            assert r.hub.feeds == {1, 2}
            assert r.hub.stats["shed"] >= 100 - 64
        finally:  # (a failure must not leave 107 sockets to the next test's GC)
            for sock in socks:
                sock.close()


@pytest.mark.asyncio
async def test_a_duplicate_stage_replaces_the_older_connection() -> None:
    async with rig() as r:
        f1, old, old_task = r.link(1)
        f1.track(1, Cell(3))
        await wait_until(lambda: r.book.rooms(1) == 1)
        first = r.hub._feeds[1]
        f2, _, _ = r.link(2)
        f2.track(2, Cell(4))
        g1, _, _ = r.link(1)  # a second process claiming stage 1
        g1.track(2, Cell(4))
        await wait_until(lambda: r.hub.stats["replaced"] >= 1)
        assert r.hub._feeds[1] is not first
        await wait_until(lambda: old.stats["losses"] >= 1)  # the hub closed the older connection
        # Replacement is a rejoin, never a loss: stage 1 never read Failed meanwhile.
        assert r.book.stats["lost"] == 0
        old_task.cancel()
        # The newer connection's reports alone remain (once the old one's last retry is gone).
        await wait_until(lambda: r.book.consensus(2, S) == (S, "") and r.book.rooms(1) == 1)
        assert r.book.consensus(1, S) == (B, "")


@pytest.mark.asyncio
async def test_with_a_secret_wrong_secrets_and_bad_macs_are_refused() -> None:
    async with rig(SECRET, hello_timeout_s=0.3, liveness_factor=PATIENT) as r:
        f1, good, _ = r.link(1, liveness_factor=PATIENT)
        f1.track(1, Cell(3))
        await wait_until(lambda: r.book.rooms(1) == 1)
        _, wrong, _ = r.link(2, secret=b"another secret of 32 bytes......")
        unsigned = await raw(r.port, hello_bytes(2))
        forged = bytearray(hello_bytes(2, secret=SECRET))
        forged[-1] ^= 1  # a flipped payload bit: the MAC no longer verifies
        bad_mac = await raw(r.port, bytes(forged))
        # A genuine hello replayed by a stranger: it verifies, but no key confirmation follows.
        replay = await raw(r.port, hello_bytes(2, secret=SECRET))
        await wait_until(lambda: r.hub.stats["refused"] >= 4 and wrong.stats["losses"] >= 1)
        assert r.hub.feeds == {1}
        assert wrong.stats["connects"] == 0  # its handshakes never completed
        assert r.book.consensus(1, S) == (B, "")  # stage 2 never joined
        assert good.stats["losses"] == 0
        for sock in (unsigned, bad_mac, replay):
            sock.close()


def test_frames_are_validated_and_bounded() -> None:
    codec = _Codec(None)
    reader = FrameReader(codec)
    assert reader.feed(codec.encode(StageStatus(2**63 - 1, 4))) == [StageStatus(2**63 - 1, 4)]
    for bad in (
        ["StageStatus", 2**63, 4],  # room out of range
        ["StageStatus", 1, 5],  # not a KVPoll int
        ["StageHello", 3, 3, GROUP, b""],  # stage not below stages
        ["StageBeat", 1],  # an extra field
        ["Hello", 1],  # a control-channel frame
    ):
        (err,) = FrameReader(codec).feed(body(bad))
        assert isinstance(err, FrameError), bad
        assert err.fatal
    (err,) = FrameReader(codec).feed(struct.pack(">I", MAX_FRAME_BYTES + 1))
    assert "exceeds the limit" in str(err)
    # A control frame sealed under the same secret does not verify on this channel.
    control = FrameCodec(SECRET).seal(msgspec.msgpack.encode(StageBeat()))
    (err,) = FrameReader(_Codec(SECRET)).feed(control)
    assert "bad MAC" in str(err)
