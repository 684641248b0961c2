"""The control-channel fault proxy: each frame fault provably fires on a real TCP stream, and a
real prefill-decode pair behind it answers as law 7 and law 5 say."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.chaos._control_proxy import ControlProxy, ProxyThread
from kvfsm.chaos._plan import ControlRates, FaultPlan
from kvfsm.control import ChannelConfig
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.states import TERMINAL
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

FRAMES = [struct.pack(">I", 5) + bytes([i]) * 5 for i in range(6)]


async def through_proxy(rates: ControlRates, frames: list[bytes]) -> bytes:
    """Send ``frames`` decode->prefill through a proxy; return what the far end received."""
    got = bytearray()
    closed = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            got.extend(data)
        writer.close()
        closed.set()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    upstream = server.sockets[0].getsockname()[:2]
    proxy = ControlProxy(FaultPlan(5, control=rates))
    port = await proxy.listen(upstream)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for frame in frames:
            writer.write(frame)
            await writer.drain()
    except ConnectionError:
        pass  # the proxy cut the connection (cut, truncate)
    writer.close()
    await asyncio.wait_for(closed.wait(), 10)
    await proxy.aclose()
    server.close()
    await server.wait_closed()
    return bytes(got)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        (ControlRates(), b"".join(FRAMES)),
        (ControlRates(drop=1.0), b""),
        (ControlRates(duplicate=1.0), b"".join(f + f for f in FRAMES)),
        (ControlRates(reorder=1.0, hold_max_s=5.0), b"".join(FRAMES[i ^ 1] for i in range(6))),
        (ControlRates(cut=1.0), b""),
    ],
    ids=["none", "drop", "duplicate", "reorder", "cut"],
)
async def test_frame_faults_fire(rates: ControlRates, expected: bytes) -> None:
    assert await through_proxy(rates, FRAMES) == expected


@pytest.mark.asyncio
async def test_corrupt_flips_one_body_byte_and_truncate_cuts() -> None:
    got = await through_proxy(ControlRates(corrupt=1.0), FRAMES[:1])
    assert len(got) == len(FRAMES[0])
    assert got[:4] == FRAMES[0][:4]  # the length prefix is left alone
    assert sum(a != b for a, b in zip(got, FRAMES[0], strict=True)) == 1
    got = await through_proxy(ControlRates(truncate=1.0), FRAMES)
    assert FRAMES[0].startswith(got)
    assert len(got) < len(FRAMES[0])


# -- a real pair behind the proxy ------------------------------------------------------------

SECRET = b"chaos-test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    with running_registry(ttl_s=3) as url:
        yield url


class ProxiedPair:
    def __init__(self, url: str, rates: ControlRates, secret: bytes | None = SECRET) -> None:
        config = ManagerConfig(
            channel=ChannelConfig(heartbeat_s=0.25, connect_timeout_s=2.0),
            register_interval_s=0.5,
            secret=secret,
        )
        self.src_kv, self.src_aux = make_buffers(SHAPE)
        fill_sources(self.src_kv, self.src_aux)
        self.dst_kv, self.dst_aux = make_buffers(SHAPE)
        self.proxy = ProxyThread(FaultPlan(11, control=rates)).start()
        self.prefill = PrefillManager(
            make_layout(self.src_kv, self.src_aux), url, engine_id="px", config=config
        )
        port = self.prefill.port

        async def direct(rank: int) -> tuple[str, int]:
            return ("127.0.0.1", port)

        self.decode = DecodeManager(
            make_layout(self.dst_kv, self.dst_aux),
            url,
            engine_id="px",
            resolver=self.proxy.resolver(direct),
            config=config,
        )

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.proxy.close()


@pytest.fixture
def pairs(registry: str) -> Iterator[list[ProxiedPair]]:
    made: list[ProxiedPair] = []
    yield made
    for pair in made:
        pair.close()


def test_a_corrupted_frame_is_refused_with_a_clear_error(
    registry: str, pairs: list[ProxiedPair]
) -> None:
    pair = ProxiedPair(registry, ControlRates(corrupt=1.0))
    pairs.append(pair)
    receiver = pair.decode.receiver(7)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() in TERMINAL, timeout=30)
    assert receiver.poll() is KVPoll.Failed
    assert "peer lost" in receiver.reason  # the link was refused: no room was bound to it
    # Both sides send their Hello at once, and each arrives altered: whichever side reads one
    # first refuses it (bad MAC) and drops the connection, and the proxy may end the other
    # direction before it framed the other Hello. So one corruption at least, either way.
    stats = pair.proxy.stats()
    assert stats.get("to_prefill:corrupt", 0) + stats.get("to_decode:corrupt", 0) >= 1, stats
    if "bad MAC" not in receiver.reason:  # decode did not see prefill's: prefill saw decode's
        assert stats.get("to_prefill:corrupt", 0) >= 1, stats
    # Prefill registered no link and failed no room: it dropped that connection, nothing else.
    assert pair.prefill.stats()["control"]["links_opened"] == 0
    assert pair.prefill.stats()["rooms"]["failed"] == 0


def test_duplicated_frames_to_decode_resurrect_nothing(
    registry: str, pairs: list[ProxiedPair]
) -> None:
    # Unsigned: without a secret frames carry no sequence number, so the copies are delivered
    # and the routing rules must make them harmless (with one, see the test after the next).
    pair = ProxiedPair(registry, ControlRates(duplicate=1.0), secret=None)
    pairs.append(pair)
    receiver = pair.decode.receiver(8)
    receiver.init(0)
    sender = pair.prefill.sender(8)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    receiver.send_metadata(np.asarray([3, 4], np.int32), aux_index=1)
    wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping, timeout=10)
    if sender.poll() is KVPoll.WaitingForInput:
        sender.init(2, aux_index=0)
        sender.send(np.asarray([1, 2], np.int32))
    wait_until_sync(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL, timeout=30)
    wait_until_sync(lambda: receiver.settled and sender.settled, timeout=30)
    first = (receiver.poll(), sender.poll())
    wait_until_sync(lambda: pair.proxy.stats().get("to_decode:duplicate", 0) >= 4, timeout=10)
    assert (receiver.poll(), sender.poll()) == first  # terminal is final


def test_a_duplicated_page_list_does_not_settle_pages_still_written(
    registry: str, pairs: list[ProxiedPair]
) -> None:
    """Law 4 (the long campaign's late writes): every decode->prefill frame is duplicated, so
    the room's RoomMetadata reaches prefill twice on the same link. The copy is a
    retransmission, not a second receiver: prefill must ignore it (counted stale), not refuse it
    as a duplicate room id, which would tell decode its pages are free while the sender is about
    to write them. The room then transfers and succeeds, bytes intact. Unsigned: with a secret
    the copy breaks the session's sequence and costs the link instead (the next test)."""
    pair = ProxiedPair(registry, ControlRates(duplicate=1.0), secret=None)
    pairs.append(pair)
    receiver = pair.decode.receiver(9)
    receiver.init(0)
    sender = pair.prefill.sender(9)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput, timeout=10)
    dst = [5, 6]
    receiver.send_metadata(np.asarray(dst, np.int32), aux_index=2)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
    # Both copies have reached prefill's plane once a lease grant sent after them has: the proxy
    # writes a frame and its copy back to back, and the stream keeps its order. The copy was
    # dropped by the routing core as a repeat (counted stale), not refused as a duplicate id.
    granted = pair.prefill.stats()["control"]["leases_granted"]
    wait_until_sync(lambda: pair.prefill.stats()["control"]["leases_granted"] > granted, timeout=10)
    control = pair.prefill.stats()["control"]
    assert control["stale_frames"] >= 1
    assert control["duplicates_refused"] == 0
    assert receiver.poll() not in TERMINAL
    assert not receiver.settled  # the sender has not even started writing
    src = [1, 2]
    sender.init(len(src), aux_index=0)
    sender.send(np.asarray(src, np.int32))
    wait_until_sync(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL, timeout=30)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    for got, want in zip(pair.dst_kv, pair.src_kv, strict=True):
        assert np.array_equal(got[dst], want[src])
    assert np.array_equal(pair.dst_aux[2], pair.src_aux[0])


def test_with_a_secret_a_repeated_frame_costs_the_link_and_the_room_still_settles(
    registry: str, pairs: list[ProxiedPair]
) -> None:
    """Protocol v3: every frame after the Hellos carries a sequence number under its MAC, so a
    frame the proxy duplicates (or drops, or reorders) is refused as out of sequence and the
    link is dropped. What the campaign relies on: the room fails with that reason, and still
    settles (its page list was exposed, so by the lease, or by prefill's acknowledgement once
    decode reconnects)."""
    pair = ProxiedPair(registry, ControlRates(duplicate=1.0))
    pairs.append(pair)
    receiver = pair.decode.receiver(10)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() in TERMINAL, timeout=30)
    assert receiver.poll() is KVPoll.Failed
    assert "peer lost" in receiver.reason
    wait_until_sync(lambda: receiver.settled, timeout=10)
    assert pair.proxy.stats().get("to_prefill:duplicate", 0) >= 1

    # The first repeat is the key confirmation's or a room frame's: the connection dies in its
    # handshake (nothing registered) or as a link. Prefill counts it on its own loop, which may
    # run after decode has already failed the room.
    def prefill_counted_the_loss() -> bool:
        control = pair.prefill.stats()["control"]
        return bool(control["handshakes_failed"] + control["links_lost"] >= 1)

    wait_until_sync(prefill_counted_the_loss, timeout=10)
