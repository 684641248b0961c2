"""Hostile bytes against a live prefill listener (law 7): random and mutated frames, before and
after a valid handshake. Whatever arrives, the engine keeps serving: afterwards a real decode
rank still completes a room through it, and nothing raised inside the engine."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm.bootstrap._control import ChannelConfig, ControlPlane
from kvfsm.bootstrap._frames import (
    PROTOCOL_VERSION,
    FrameCodec,
    Heartbeat,
    Hello,
    RoomAbort,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
)
from kvfsm.rooms import RoomEngine
from kvfsm.states import TERMINAL, KVPoll
from kvfsm.transport import Agent, Leases, NixlTransport
from kvfsm.transport._peer import make_buffers, make_layout, wait_for
from tests.bootstrap.prefill_process import SHAPE, fill_sources
from tests.bootstrap.test_control import Decode

CODEC = FrameCodec()


class LivePrefill:
    def __init__(self) -> None:
        self.kv, self.aux = make_buffers(SHAPE)
        fill_sources(self.kv, self.aux)
        self.agent = Agent(f"fuzz-prefill-{os.getpid()}", make_layout(self.kv, self.aux))
        self.transport = NixlTransport(self.agent, leases=Leases())
        self.control = ControlPlane(
            "prefill",
            0,
            self.agent,
            transport=self.transport,
            config=ChannelConfig(heartbeat_s=0.5),
        )
        self.engine = RoomEngine(self.control).start()
        self.engine.call(self.control.started())
        # A decode agent whose Hello passes, so that fuzzing also reaches the room frames.
        dkv, daux = make_buffers(SHAPE)
        self._decode_buffers = (dkv, daux)
        self.decode_agent = Agent(f"fuzz-decode-{os.getpid()}", make_layout(dkv, daux))
        self.hello = CODEC.encode(
            Hello(
                PROTOCOL_VERSION,
                "decode",
                5,
                self.decode_agent.name,
                self.decode_agent.metadata(),
                msgspec.msgpack.encode(self.decode_agent.layout.summary()),
                123,
            )
        )

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.agent.close()
        self.decode_agent.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LivePrefill]:
    prefill = LivePrefill()
    yield prefill
    prefill.close()


def blast(port: int, payload: bytes, handshake: bytes = b"") -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(0.2)
        if handshake:
            sock.sendall(handshake)
        try:
            sock.sendall(payload)
            sock.recv(1 << 16)  # whatever the listener says (its Hello, an Error) or EOF
        except OSError:
            pass


VALID = [
    CODEC.encode(Heartbeat(1)),
    CODEC.encode(RoomMetadata(77, 1, np.arange(4, dtype=np.int32).tobytes(), 0)),
    CODEC.encode(RoomOutcome(77, 1, 4, "")),
    CODEC.encode(RoomAbort(77, 1, "no")),
    CODEC.encode(RoomSettled(77, 1)),
]


def mutate(data: bytes, flips: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
    out = bytearray(data)
    for pos, bit in flips:
        out[pos % len(out)] ^= 1 << bit
    return bytes(out[: max(0, len(out) - cut)]) + tail


frames = st.builds(
    mutate,
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 7)), max_size=4),
    st.integers(0, 8),
    st.binary(max_size=16),
)
garbage = st.one_of(
    st.binary(max_size=256),
    frames,
    st.builds(
        lambda n, body: struct.pack(">I", n) + body,
        st.integers(0, 2**32 - 1),
        st.binary(max_size=32),
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=garbage, after_hello=st.booleans())
def test_hostile_bytes_never_hurt_the_listener(
    live: LivePrefill, payload: bytes, after_hello: bool
) -> None:
    blast(live.control.port, payload, live.hello if after_hello else b"")
    assert live.engine.registry_on_loop().errors == []


def test_the_listener_still_serves_a_real_decode_rank_afterwards(live: LivePrefill) -> None:
    decode = Decode({"port": live.control.port})
    try:
        sender = live.engine.sender(4242)
        receiver = decode.receive(4242, [30, 31], aux_row=2)
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
        sender.init(2, 3)
        sender.send([10, 11])
        wait_for(lambda: receiver.poll() in TERMINAL, timeout=10)
        assert receiver.poll() is KVPoll.Success, receiver.reason
        assert decode.landed([10, 11], [30, 31], 3, 2)
        stats = live.control.stats
        assert stats["links_opened"] >= 2
    finally:
        decode.close()


def test_a_room_frame_in_the_same_segment_as_the_hello_is_not_lost(live: LivePrefill) -> None:
    """A decode rank sends its first page list as soon as it has prefill's Hello; when prefill's
    side of the handshake is slow, that frame arrives in one read with decode's Hello. It used to
    be dropped there, leaving the room to its Bootstrapping deadline."""
    room = 4242
    pages = np.asarray([3, 4], np.int32).tobytes()
    metadata = CODEC.encode(RoomMetadata(room, 1, pages, 0))
    sender = live.engine.sender(room)
    with socket.create_connection(("127.0.0.1", live.control.port), timeout=5) as sock:
        sock.sendall(live.hello + metadata)  # one write: one segment on loopback
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
        sender.abort("test over")
        wait_for(lambda: sender.settled, timeout=10)
