"""The bounds on prefill's control links, on the real channel (law 7): real sockets on loopback,
a prefill rank with real NIXL, peers that complete valid handshakes from chosen loopback
addresses (127.0.0.0/8 is all this host's, so each address stands for a host).

* links: at most ``max_links_per_host`` from one address and ``max_links`` in all; a link over
  a bound is refused with an ``Error`` naming it (``links_refused``), never one already open,
  and a legit decode from another host keeps moving rooms; a freed place is taken again;
* handshakes: one host's flood of connections sheds only that host's (with a secret, a
  stranger never holds a link's place);
* a peer that never reads its answers stops being read (prefill's queue for it stays bounded)
  and falls silent;
* a peer that hangs up is named in the reason its rooms fail with (``EndOfStream``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvfsm.control import ChannelConfig, PrefillControl
from kvfsm.control._codec import FrameCodec, FrameReader, SessionCodec
from kvfsm.control._frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    RoomAbort,
    RoomClaim,
)
from kvfsm.manager import router_for
from kvfsm.rooms import RoomEngine
from kvfsm.states import TERMINAL, KVPoll
from kvfsm.transport import Agent, Leases, NixlTransport
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.control import Decode
from tests.helpers.prefill_process import SHAPE, PrefillProcess, fill_sources
from tests.helpers.waiting import wait_until_sync

SECRET = b"a shared secret of 32 bytes....."
FLOOD_A, FLOOD_B = "127.0.0.3", "127.0.0.4"  # the legit decode connects from 127.0.0.1


@pytest.fixture(scope="module")
def decode_agent() -> Iterator[Agent]:
    """The NIXL agent every hand-made peer names in its Hello (prefill loads its metadata once
    per link, as it would a flooding process's)."""
    kv, aux = make_buffers(SHAPE)
    agent = Agent(f"links-decode-{os.getpid()}", make_layout(kv, aux))
    agent.buffers = (kv, aux)  # type: ignore[attr-defined]  # kept alive with the agent
    yield agent
    agent.close()


def read_frame(sock: socket.socket, reader: FrameReader) -> Frame | None:
    """The next frame, or None once the far end closed the connection."""
    items = reader.feed(b"", max_items=1)
    while not items:
        try:
            data = sock.recv(1 << 16)
        except OSError:  # reset
            return None
        if not data:
            return None
        items = reader.feed(data, max_items=1)
    item = items[0]
    if isinstance(item, FrameError):
        raise item
    return item


class Peer:
    """One hand-made decode connection from ``source``: a valid Hello (and with a secret the key
    confirmation) under its own incarnation, then whatever the test sends."""

    def __init__(
        self,
        port: int,
        agent: Agent,
        incarnation: int,
        *,
        source: str,
        secret: bytes | None = None,
        rcvbuf: int | None = None,
    ) -> None:
        self.codec = FrameCodec(secret)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind((source, 0))
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.reader = FrameReader(self.codec)
        self.sealer: FrameCodec | SessionCodec = self.codec
        nonce = secrets.token_bytes(NONCE_BYTES) if secret is not None else b""
        hello = Hello(
            PROTOCOL_VERSION,
            "decode",
            5,
            agent.name,
            agent.metadata(),
            msgspec.msgpack.encode(agent.layout.summary()),
            incarnation,
            nonce=nonce,
        )
        self.sock.sendall(self.codec.encode(hello))
        theirs = read_frame(self.sock, self.reader)
        assert isinstance(theirs, Hello), theirs
        if secret is not None:
            session = self.codec.session("decode", nonce, theirs.nonce)
            self.sock.sendall(session.encode(Heartbeat(0)))
            self.reader.codec = session
            self.sealer = session

    def send(self, frame: Frame) -> None:
        self.sock.sendall(self.sealer.encode(frame))

    def refusal(self) -> str | None:
        """The reason of the Error prefill refused this link with, or None if it did not."""
        while True:
            frame = read_frame(self.sock, self.reader)
            if frame is None:
                return None
            if isinstance(frame, Error):
                return frame.reason

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)  # a clean end of stream, not a reset
        self.sock.close()


def stats(prefill: PrefillProcess) -> dict[str, int]:
    result: dict[str, int] = prefill.ask("stats")
    return result


def decided(prefill: PrefillProcess, n: int) -> bool:
    """Prefill has opened or refused ``n`` links in all."""
    counters = stats(prefill)
    return counters["links_opened"] + counters["links_refused"] >= n


def move(prefill: PrefillProcess, decode: Decode, rooms: range) -> dict[int, str]:
    """Move each room (half the page lists before prefill's room exists); the reason of each
    that did not succeed with the right bytes."""
    plan = []
    for slot, room in enumerate(rooms):
        src, dst = [100 + slot], [slot]
        if room % 2:
            receiver = decode.receive(room, dst, aux_row=slot)
            prefill.ask("send", room, src, 1, slot)
        else:
            prefill.ask("send", room, src, 1, slot)
            receiver = decode.receive(room, dst, aux_row=slot)
        plan.append((receiver, src, dst, slot))
    wait_until_sync(lambda: all(r.poll() in TERMINAL for r, *_ in plan), timeout=30)
    failed = {}
    for receiver, src, dst, slot in plan:
        if receiver.poll() is not KVPoll.Success:
            failed[receiver.room] = receiver.reason
        elif not decode.landed(src, dst, slot, slot):
            failed[receiver.room] = "succeeded, but the bytes differ"
    wait_until_sync(lambda: decode.engine.stats()["live"] == 0, timeout=30)
    return failed


def open_peers(
    prefill: PrefillProcess,
    agent: Agent,
    source: str,
    n: int,
    first: int,
    *,
    secret: bytes | None = None,
) -> list[Peer]:
    """``n`` links from ``source``, one at a time (each decided before the next opens)."""
    peers = []
    for i in range(n):
        before = stats(prefill)
        target = before["links_opened"] + before["links_refused"] + 1
        peers.append(Peer(prefill.port, agent, first + i, source=source, secret=secret))
        wait_until_sync(functools.partial(decided, prefill, target), timeout=10)
    return peers


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_links_are_bounded_per_host_and_in_all_and_a_legit_decode_keeps_its_own(
    decode_agent: Agent, secret: bytes | None
) -> None:
    """Nine links from one host (the shape of the flood that evicted a legit decode's marks),
    at four per host and six in all: four are opened, five refused by name. A legit decode
    from another host gets in and moves its rooms; a second flooding host gets the one place
    left and is refused the rest; a place freed is taken again."""
    # A long silence limit: the hand-made peers send no heartbeats.
    config = ChannelConfig(
        heartbeat_s=0.5,
        liveness_factor=60.0,
        max_links=6,
        max_links_per_host=4,
        secret=secret,
    )
    prefill = PrefillProcess(config)
    decode: Decode | None = None
    peers: list[Peer] = []
    try:
        peers += open_peers(prefill, decode_agent, FLOOD_A, 9, 1000, secret=secret)
        counters = stats(prefill)
        assert (counters["links_opened"], counters["links_refused"]) == (4, 5), counters
        for peer in peers[4:]:
            reason = peer.refusal()
            assert reason is not None
            assert f"refused a control link from {FLOOD_A}" in reason, reason
            assert "4 control links from 127.0.0.3 already" in reason, reason
            assert "ChannelConfig.max_links_per_host 4" in reason, reason
        # The legit decode, from 127.0.0.1: its link is the fifth.
        decode = Decode({"port": prefill.port}, config)
        assert move(prefill, decode, range(1, 11)) == {}
        # Another host: one place is left in all.
        peers += open_peers(prefill, decode_agent, FLOOD_B, 3, 2000, secret=secret)
        counters = stats(prefill)
        assert (counters["links_opened"], counters["links_refused"]) == (6, 7), counters
        for peer in peers[-2:]:
            reason = peer.refusal()
            assert reason is not None
            assert "6 control links already (ChannelConfig.max_links 6)" in reason, reason
        assert move(prefill, decode, range(11, 21)) == {}
        assert counters["links_lost"] == 0
        # A link closed frees its place: host B gets it.
        peers[0].close()
        wait_until_sync(lambda: stats(prefill)["links_lost"] == 1, timeout=10)
        peers += open_peers(prefill, decode_agent, FLOOD_B, 1, 3000, secret=secret)
        assert stats(prefill)["links_opened"] == 7
        assert move(prefill, decode, range(21, 31)) == {}
    finally:
        for peer in peers:
            peer.close()
        if decode is not None:
            decode.close()
        prefill.close()


def test_a_peer_reconnecting_at_its_hosts_bound_replaces_its_link(decode_agent: Agent) -> None:
    """The same decode incarnation connecting again (its old link not yet found dead) replaces
    that link: it is not counted twice against its host's bound."""
    config = ChannelConfig(heartbeat_s=0.5, liveness_factor=60.0, max_links_per_host=2)
    prefill = PrefillProcess(config)
    peers: list[Peer] = []
    try:
        peers += open_peers(prefill, decode_agent, FLOOD_A, 2, 1000)
        peers += open_peers(prefill, decode_agent, FLOOD_A, 1, 1001)  # 1001 again
        counters = stats(prefill)
        assert (counters["links_opened"], counters["links_refused"]) == (3, 0), counters
        wait_until_sync(lambda: stats(prefill)["links_lost"] == 1, timeout=10)  # replaced
        peers += open_peers(prefill, decode_agent, FLOOD_A, 1, 1002)  # a third: refused
        assert stats(prefill)["links_refused"] == 1
    finally:
        for peer in peers:
            peer.close()
        prefill.close()


def test_a_decode_refused_for_a_bound_fails_its_rooms_naming_it(decode_agent: Agent) -> None:
    """What a refused decode's operator sees: its rooms fail with prefill's reason, which names
    the setting to raise."""
    config = ChannelConfig(heartbeat_s=0.5, liveness_factor=60.0, max_links=2)
    prefill = PrefillProcess(config)
    decode: Decode | None = None
    peers: list[Peer] = []
    try:
        peers += open_peers(prefill, decode_agent, FLOOD_A, 2, 1000)
        decode = Decode({"port": prefill.port}, config)
        receiver = decode.engine.receiver(1)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=20)
        assert "2 control links already (ChannelConfig.max_links 2)" in receiver.reason, (
            receiver.reason
        )
        assert stats(prefill)["links_refused"] >= 1
    finally:
        for peer in peers:
            peer.close()
        if decode is not None:
            decode.close()
        prefill.close()


def test_one_hosts_flood_of_handshakes_sheds_only_its_own(decode_agent: Agent) -> None:
    """With a secret, a host keeps opening connections that never finish their handshake: at
    most ``max_unauthenticated_per_host`` of its own wait at once (it sheds its oldest), none
    holds a link's place, and a decode with the secret connecting from another host meanwhile
    is never shed: its rooms move."""
    config = ChannelConfig(
        heartbeat_s=0.2, liveness_factor=10.0, secret=SECRET, max_unauthenticated_per_host=4
    )
    prefill = PrefillProcess(config)
    decode: Decode | None = None
    stop = threading.Event()
    opened: list[socket.socket] = []

    def crowd() -> None:
        while not stop.is_set() and len(opened) < 400:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((FLOOD_A, 0))
            try:
                sock.connect(("127.0.0.1", prefill.port))
            except OSError:
                sock.close()
                continue
            opened.append(sock)
            time.sleep(0.002)  # real time on purpose: a steady stream of new connections

    flood = threading.Thread(target=crowd, name="crowd", daemon=True)
    try:
        flood.start()
        wait_until_sync(lambda: stats(prefill)["unauthenticated_shed"] >= 20, timeout=20)
        decode = Decode({"port": prefill.port}, config)  # connects while the crowd comes
        assert move(prefill, decode, range(1, 21)) == {}
        stop.set()
        flood.join(10)
        counters = stats(prefill)
        assert counters["links_opened"] == 1, counters  # the decode's: strangers hold none
        assert counters["links_refused"] == 0, counters
        assert counters["unauthenticated_shed"] >= len(opened) - 4 - 20, counters
    finally:
        stop.set()
        for sock in opened:
            sock.close()
        if decode is not None:
            decode.close()
        prefill.close()


# -- in this process: what prefill queues for a peer, and how a hang-up is named -------------


class LivePrefill:
    """A prefill rank in this process, so that the test can read its links."""

    def __init__(self, config: ChannelConfig) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        fill_sources(self.kv, self.aux)
        self.agent = Agent(f"links-prefill-{os.getpid()}", make_layout(self.kv, self.aux))
        self.transport = NixlTransport(self.agent, leases=Leases())
        self.control = PrefillControl(0, self.agent, transport=self.transport, config=config)
        self.engine = RoomEngine(router_for(self.control)).start()
        self.engine.call(self.control.started())

    def entries(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            return self.control.entries()

        result: dict[str, int] = self.engine.call(read())
        return result

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.agent.close()


def test_a_peer_that_never_reads_its_answers_stops_being_read(decode_agent: Agent) -> None:
    """A peer floods aborts of rooms prefill does not have (each answered with a RoomSettled)
    and never reads: prefill stops reading it once ``outbox_max_bytes`` wait for it, so what
    it queues stays within that plus the answers to one read; the peer then falls silent and
    its link is lost."""
    limit = 1 << 16
    config = ChannelConfig(heartbeat_s=0.2, liveness_factor=5.0, outbox_max_bytes=limit)
    prefill = LivePrefill(config)
    stop = threading.Event()
    peer = Peer(prefill.control.port, decode_agent, 7, source=FLOOD_A, rcvbuf=4096)
    wait_until_sync(lambda: prefill.control.stats["links_opened"] == 1, timeout=10)
    link = next(iter(prefill.control._links.values()))
    most = [0]

    def watch() -> None:
        while not stop.is_set():
            most[0] = max(most[0], link.queued)
            stop.wait(0.001)  # the sampling period

    watcher = threading.Thread(target=watch, name="watch", daemon=True)
    watcher.start()
    try:
        peer.sock.settimeout(0.5)
        sent = 0
        # Prefill stopped reading: TCP holds us back (the timeout), or, on a loaded host
        # where filling both socket buffers takes longer than the liveness window, prefill
        # has already dropped the silent link and the kernel answers with a reset.
        with contextlib.suppress(TimeoutError, ConnectionResetError, BrokenPipeError):
            for i in range(1_000_000):
                peer.send(RoomAbort(10_000 + i, 1, "flood"))
                sent += 1
        assert sent > 5000
        wait_until_sync(lambda: prefill.control.stats["reads_paused"] >= 1, timeout=10)
        wait_until_sync(lambda: prefill.control.stats["links_lost"] == 1, timeout=10)
        stop.set()
        watcher.join(10)
        # Answers to one read (64 KiB of 30-byte aborts) are about 2,200 frames of ~40 bytes.
        assert most[0] <= limit + 128 * 1024, most[0]
        assert link.closed
    finally:
        stop.set()
        peer.close()
        prefill.close()


def test_a_peer_that_hangs_up_is_named_in_its_rooms_reason(decode_agent: Agent) -> None:
    """A decode that closes its connection cleanly: the reader's ``EndOfStream`` has no
    message, and the rooms bound to that link fail naming it, never with an empty cause."""
    prefill = LivePrefill(ChannelConfig(heartbeat_s=0.5, liveness_factor=60.0))
    peer = Peer(prefill.control.port, decode_agent, 9, source=FLOOD_A)
    try:
        sender = prefill.engine.sender(77)
        peer.send(RoomClaim(77, 1))
        wait_until_sync(lambda: prefill.entries()["bound"] == 1, timeout=10)
        peer.close()
        wait_until_sync(lambda: sender.poll() is KVPoll.Failed, timeout=10)
        assert sender.reason.endswith("closed: EndOfStream"), sender.reason
        assert "peer lost" in sender.reason, sender.reason
    finally:
        peer.close()
        prefill.close()
