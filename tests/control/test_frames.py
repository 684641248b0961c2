"""The control channel's wire format: every frame round-trips, every rule rejects what it should
with a message that names the field, the MAC holds, the reader reassembles any split of a stream,
and no input (random or a mutated valid frame) makes the codec or the reader raise anything but
``FrameError``."""

from __future__ import annotations

import itertools
import pickle
import re
import tracemalloc
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._frames import (
    FRAME_TYPES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Error,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    check_hello,
    clip_reason,
    pack_refs,
    unpack_refs,
)
from kvfsm.link import _auth

SECRET = b"correct horse battery staple!!!!"
OTHER_SECRET = b"incorrect horse battery staple!!"
MAX63 = 2**63 - 1

HELLO = Hello(PROTOCOL_VERSION, "decode", 3, "decode-3", b"\x00nixl-md\xff", b"\x81\xa1k\x01", 42)

FRAMES: list[Frame] = [
    HELLO,
    Hello(PROTOCOL_VERSION, "prefill", 0, "p", b"", b"", 0),
    Heartbeat(0),
    Heartbeat(MAX63),
    Heartbeat(5, 4, 1500),
    Heartbeat(1, 0),
    Heartbeat(MAX63, MAX63, MAX63),
    LeaseRequest(1),
    LeaseRequest(2, 1, 499_000),
    LeaseGrant(1, 2000),
    RoomClaim(7, 1),
    RoomClaim(MAX63, MAX63),
    Reconcile(b""),
    Reconcile(pack_refs([(7, 1), (MAX63, MAX63)])),
    RoomMetadata(7, 1, bytes(range(16)), 5),
    RoomMetadata(MAX63, MAX63, b"", 0, b"\x01\x00\x00\x00"),
    RoomMetadata(0, 0, bytes(4 * 4096), 2**31 - 1, bytes(8)),
    # Decode's live segments of a ring row (position 1 among the state rows): wrapped.
    RoomMetadata(
        7, 1, bytes(8), 5, bytes(8), rings=np.asarray([1, 9, 2, 0, 3, 11], "<i4").tobytes()
    ),
    RoomOutcome(7, 1, 4),
    RoomOutcome(7, 1, 0, "transfer error: remote disconnect"),
    RoomAbort(7, 1, "aborted by the scheduler"),
    RoomAbort(0, 0, ""),
    RoomSettled(7, 1),
    Error(None, "malformed frame"),
    Error(7, "invalid RoomMetadata frame", 1),
]


def body(payload: Any, auth: bytes = b"\x00") -> bytes:
    """A body (no length prefix) around an arbitrary msgpack payload."""
    return auth + msgspec.msgpack.encode(payload)


def signed_body(payload: bytes, secret: bytes = SECRET) -> bytes:
    return b"\x01" + _auth.sign(secret, payload) + payload


def fields(frame: Frame) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(frame))
    return out


META = fields(RoomMetadata(7, 1, bytes(8), 5))
HELLO_FIELDS = fields(HELLO)


# -- round trips -------------------------------------------------------------------------------


def test_every_frame_type_is_covered() -> None:
    assert {type(frame) for frame in FRAMES} == set(FRAME_TYPES)
    assert all(not cls.__subclasses__() for cls in FRAME_TYPES)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: Frame, secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    wire = codec.encode(frame)
    assert int.from_bytes(wire[:4], "big") == len(wire) - 4
    assert codec.decode(wire[4:]) == frame
    assert codec.decode(memoryview(wire)[4:]) == frame
    assert codec.decode(bytearray(wire[4:])) == frame


def test_wire_layout_plain() -> None:
    payload = msgspec.msgpack.encode({"t": "Heartbeat", "seq": 9})
    wire = FrameCodec().encode(Heartbeat(9))
    assert wire == (1 + len(payload)).to_bytes(4, "big") + b"\x00" + payload


def test_heartbeat_echo_fields_travel_only_once_there_is_an_echo() -> None:
    assert msgspec.msgpack.decode(FrameCodec().encode(Heartbeat(9))[5:]) == {
        "t": "Heartbeat",
        "seq": 9,
    }
    assert msgspec.msgpack.decode(FrameCodec().encode(LeaseRequest(3))[5:]) == {
        "t": "LeaseRequest",
        "seq": 3,
    }
    assert msgspec.msgpack.decode(FrameCodec().encode(Heartbeat(9, 8, 250))[5:]) == {
        "t": "Heartbeat",
        "seq": 9,
        "echo": 8,
        "held_us": 250,
    }


def test_wire_layout_signed() -> None:
    payload = msgspec.msgpack.encode({"t": "RoomSettled", "room": 7, "generation": 1})
    wire = FrameCodec(SECRET).encode(RoomSettled(7, 1))
    assert wire[:4] == (33 + len(payload)).to_bytes(4, "big")
    assert wire[4:5] == b"\x01"
    assert _auth.verify(SECRET, wire[5:37], payload)
    assert wire[37:] == payload


def test_frames_are_frozen_and_hashable() -> None:
    frame = RoomAbort(7, 1, "x")
    with pytest.raises(AttributeError):
        frame.room = 8  # type: ignore[misc]
    assert len({frame, RoomAbort(7, 1, "x")}) == 1


# -- validation: decoding is validation -----------------------------------------------------------


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not _DROP}


_DROP = object()

# (payload, message, room named, generation named)
INVALID: list[tuple[str, dict[str, Any] | list[Any], str, int | None, int | None]] = [
    ("room<0", _with(META, room=-1), "Expected `int` >= 0 - at `$.room`", None, 1),
    (
        "room>=2**63",
        _with(META, room=2**63),
        "Expected `int` <= 9223372036854775807 - at `$.room`",
        None,
        1,
    ),
    ("room str", _with(META, room="7"), "Expected `int`, got `str` - at `$.room`", None, 1),
    ("room bool", _with(META, room=True), "Expected `int`, got `bool` - at `$.room`", None, 1),
    ("room float", _with(META, room=7.0), "Expected `int`, got `float` - at `$.room`", None, 1),
    ("generation<0", _with(META, generation=-2), "at `$.generation`", 7, None),
    ("aux<-1", _with(META, aux_index=-2), "Expected `int` >= -1 - at `$.aux_index`", 7, 1),
    ("aux<0 whole", _with(META, aux_index=-1), "aux_index -1 with part 0", 7, 1),
    ("aux with KV leg", _with(META, part=1), "aux_index 5 with part 1", 7, 1),
    ("part>3", _with(META, part=4), "Expected `int` <= 3 - at `$.part`", 7, 1),
    ("aux>int32", _with(META, aux_index=2**31), "<= 2147483647 - at `$.aux_index`", 7, 1),
    ("pages%4", _with(META, pages=b"12345"), "`pages` is 5 bytes, not a multiple of 4", 7, 1),
    ("state%4", _with(META, state=b"123"), "`state` is 3 bytes, not a multiple of 4", 7, 1),
    ("pages list", _with(META, pages=[1, 2]), "Expected `bytes`, got `array` - at `$.pages`", 7, 1),
    (
        "missing",
        _with(META, generation=_DROP),
        "Object missing required field `generation`",
        7,
        None,
    ),
    ("unknown field", _with(META, extra=1), "Object contains unknown field `extra`", 7, 1),
    ("unknown type", _with(META, t="Bogus"), "unknown frame type 'Bogus'", 7, 1),
    ("no tag", _with(META, t=_DROP), "Object missing required field `t`", 7, 1),
    ("not a map", [1, 2, 3], "invalid frame: Expected `object`, got `array`", None, None),
    (
        "status",
        {"t": "RoomOutcome", "room": 7, "generation": 1, "status": 3},
        "`status` must be 4 (Success) or 0 (Failed), not 3",
        7,
        1,
    ),
    (
        "reason length",
        {"t": "RoomAbort", "room": 7, "generation": 1, "reason": "x" * 1025},
        "Expected `str` of length <= 1024 - at `$.reason`",
        7,
        1,
    ),
    ("heartbeat", {"t": "Heartbeat", "seq": -1}, "Expected `int` >= 0 - at `$.seq`", None, None),
    (
        "heartbeat echo",
        {"t": "Heartbeat", "seq": 1, "echo": -1},
        "Expected `int` >= 0 - at `$.echo`",
        None,
        None,
    ),
    (
        "lease request echo",
        {"t": "LeaseRequest", "seq": 2, "echo": "1"},
        "Expected `int | null`, got `str` - at `$.echo`",
        None,
        None,
    ),
    (
        "heartbeat held",
        {"t": "Heartbeat", "seq": 1, "echo": 0, "held_us": -5},
        "Expected `int` >= 0 - at `$.held_us`",
        None,
        None,
    ),
    (
        "error room",
        {"t": "Error", "room": "x", "reason": ""},
        "Expected `int | null`, got `str` - at `$.room`",
        None,
        None,
    ),
    (
        "settled",
        {"t": "RoomSettled", "room": 9, "generation": "1"},
        "Expected `int`, got `str` - at `$.generation`",
        9,
        None,
    ),
]


@pytest.mark.parametrize(
    ("payload", "message", "room", "generation"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_frame_names_field_and_room(
    payload: Any, message: str, room: int | None, generation: int | None
) -> None:
    with pytest.raises(FrameError, match=re.escape(message)) as info:
        FrameCodec().decode(body(payload))
    error = info.value
    assert (error.room, error.generation, error.fatal) == (room, generation, False)
    assert str(error) == error.reason
    assert len(error.reason) <= 1024  # fits an Error frame as is


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"role": "router"}, "Invalid enum value 'router' - at `$.role`"),
        ({"agent": ""}, "Expected `str` of length >= 1 - at `$.agent`"),
        ({"agent": "a" * 257}, "Expected `str` of length <= 256 - at `$.agent`"),
        ({"rank": -1}, "Expected `int` >= 0 - at `$.rank`"),
        ({"layout": "text"}, "Expected `bytes`, got `str` - at `$.layout`"),
        ({"incarnation": _DROP}, "Object missing required field `incarnation`"),
    ],
)
def test_invalid_hello_is_fatal(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(FrameError, match=re.escape(message)) as info:
        FrameCodec().decode(body(_with(HELLO_FIELDS, **changes)))
    assert info.value.fatal
    assert info.value.tag == "Hello"


def test_hello_of_another_version_is_a_fatal_version_mismatch() -> None:
    # A future Hello may carry fields this version does not know: the version still wins.
    theirs = _with(HELLO_FIELDS, version=PROTOCOL_VERSION + 1, cookie=b"\x00" * 16)
    mismatch = (
        f"the peer speaks version {PROTOCOL_VERSION + 1}, this side speaks version "
        f"{PROTOCOL_VERSION}"
    )
    with pytest.raises(FrameError, match=mismatch) as info:
        FrameCodec().decode(body(theirs))
    assert info.value.fatal


def test_check_hello() -> None:
    check_hello(HELLO)
    other = PROTOCOL_VERSION + 3
    with pytest.raises(
        FrameError,
        match=f"peer speaks version {other}, this side speaks version {PROTOCOL_VERSION}",
    ) as e:
        check_hello(Hello(other, "prefill", 0, "p", b"", b"", 0))
    assert e.value.fatal
    assert e.value.room is None


def test_ring_segments_travel_as_packed_int32_and_a_malformed_field_fails_its_room_only() -> None:
    rings = np.asarray([[0, 5, 3, 0, 0, 11], [2, 9, 2, 0, 3, 11]], "<i4").tobytes()
    frame = RoomMetadata(7, 1, bytes(8), 5, bytes(12), rings=rings)
    codec = FrameCodec()
    back = codec.decode(codec.encode(frame)[4:])
    assert isinstance(back, RoomMetadata)
    assert np.frombuffer(back.rings, "<i4").reshape(-1, 6).tolist() == [
        [0, 5, 3, 0, 0, 11],
        [2, 9, 2, 0, 3, 11],
    ]
    # Not whole entries, or more entries than state rows: the frame is refused, naming its
    # room (the caller fails that room), and the connection stays.
    for bad, state in ((rings[:-4], bytes(12)), (rings, bytes(4))):
        with pytest.raises(FrameError, match="`rings` is") as info:
            codec.decode(body(_with(META, room=9, generation=3, state=state, rings=bad)))
        assert (info.value.room, info.value.generation, info.value.fatal) == (9, 3, False)


def test_post_init_rules_hold_for_frames_built_here() -> None:
    with pytest.raises(ValueError, match="`pages` is 3 bytes"):
        RoomMetadata(1, 1, b"abc", 0)
    with pytest.raises(ValueError, match=r"`status` must be 4 .* not 2"):
        RoomOutcome(1, 1, 2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00\xc1", "malformed frame: MessagePack data is malformed: invalid opcode"),
        (b"\x00\x82\xa1t", "malformed frame: Input data was truncated"),
        (body({"t": "Heartbeat", "seq": 1}) + b"\x00", "malformed frame: MessagePack data is"),
        (b"\x00", "malformed frame: Input data was truncated"),
        (b"\x00" + b"\x91" * 100_000, "invalid frame: Expected `object`, got `array`"),
        (b"\x00\x81\xa1t" + b"\x91" * 100_000 + b"\x00", "Expected `str`, got `array` - at `$.t`"),
        (b"\x00\x82\xa1x" + b"\x91" * 100_000 + b"\x00\xa1t\xa9Heartbeat", "nested too deeply"),
        (b"\x00\xdf\xff\xff\xff\xff", "truncated"),  # 4 G entries claimed in 5 bytes
    ],
)
def test_malformed_payload_is_not_fatal(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=re.escape(message)) as info:
        FrameCodec().decode(raw)
    assert not info.value.fatal
    assert info.value.room is None


def test_hostile_strings_are_clipped_in_reasons() -> None:
    with pytest.raises(FrameError) as info:
        FrameCodec().decode(body({"t": "x" * 100_000, "room": 3}))
    assert len(info.value.reason) < 200
    assert info.value.room == 3
    with pytest.raises(FrameError) as info:
        FrameCodec().decode(body(_with(META, **{"y" * 100_000: 1})))
    assert len(info.value.reason) < 400


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "empty frame body"),
        (b"\x02" + msgspec.msgpack.encode({"t": "Heartbeat", "seq": 1}), "unknown auth byte 2"),
        (b"\x01" + bytes(32) + body({})[1:], "the peer signs its frames but no secret"),
    ],
)
def test_envelope_errors_are_fatal(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=re.escape(message)) as info:
        FrameCodec().decode(raw)
    assert info.value.fatal


def test_oversized_body_is_fatal_on_decode() -> None:
    codec = FrameCodec(max_frame_bytes=64)
    with pytest.raises(FrameError, match="frame of 65 bytes exceeds the limit of 64") as info:
        codec.decode(bytes(65))
    assert info.value.fatal


def test_oversized_frame_is_refused_on_encode_naming_its_room() -> None:
    codec = FrameCodec(max_frame_bytes=1024)
    with pytest.raises(
        FrameError, match=r"RoomMetadata of .* exceeds the frame limit of 1024"
    ) as e:
        codec.encode(RoomMetadata(5, 2, bytes(4096), 0))
    assert (e.value.room, e.value.generation, e.value.fatal) == (5, 2, False)


def test_a_million_pages_fit_the_default_limit() -> None:
    frame = RoomMetadata(1, 1, bytes(4 * 2**20), 0)
    codec = FrameCodec(SECRET)
    wire = codec.encode(frame)
    assert len(wire) < MAX_FRAME_BYTES
    assert codec.decode(wire[4:]) == frame


def test_codec_arguments() -> None:
    with pytest.raises(ValueError, match="max_frame_bytes must be in"):
        FrameCodec(max_frame_bytes=2**32)
    with pytest.raises(ValueError, match="max_frame_bytes must be in"):
        FrameCodec(max_frame_bytes=8)
    with pytest.raises(ValueError, match="at least 16 are required"):
        FrameCodec(b"short")


def test_frame_error_pickles() -> None:
    error = FrameError("bad", 7, True, generation=3, tag="RoomAbort")
    again = pickle.loads(pickle.dumps(error))
    assert (again.reason, again.room, again.fatal, again.generation, again.tag) == (
        "bad",
        7,
        True,
        3,
        "RoomAbort",
    )


# -- authentication ------------------------------------------------------------------------------


def test_signed_round_trip_and_wire_differs() -> None:
    plain, signed = FrameCodec(), FrameCodec(SECRET)
    frame = RoomAbort(7, 1, "x")
    assert signed.decode(signed.encode(frame)[4:]) == frame
    assert signed.encode(frame) != plain.encode(frame)


@pytest.mark.parametrize("offset", [0, 5, 20, 36, 37, 40, -1], ids=lambda o: f"byte{o}")
def test_tampered_signed_frame_is_fatal(offset: int) -> None:
    codec = FrameCodec(SECRET)
    raw = bytearray(codec.encode(RoomMetadata(7, 1, bytes(64), 0))[4:])
    raw[offset] ^= 0x01
    with pytest.raises(FrameError) as info:
        codec.decode(bytes(raw))
    assert info.value.fatal
    assert info.value.room is None  # an unauthenticated payload names nothing


def test_wrong_secret_is_fatal() -> None:
    wire = FrameCodec(OTHER_SECRET).encode(RoomOutcome(7, 1, 4))
    with pytest.raises(FrameError, match="bad MAC") as info:
        FrameCodec(SECRET).decode(wire[4:])
    assert info.value.fatal


def test_unsigned_frame_to_a_codec_with_a_secret_is_fatal() -> None:
    wire = FrameCodec().encode(RoomOutcome(7, 1, 4))
    with pytest.raises(FrameError, match="unsigned frame: a secret is configured here") as info:
        FrameCodec(SECRET).decode(wire[4:])
    assert info.value.fatal


def test_signed_frame_to_a_codec_without_a_secret_is_fatal() -> None:
    wire = FrameCodec(SECRET).encode(HELLO)
    with pytest.raises(FrameError, match="signs its frames but no secret") as info:
        FrameCodec().decode(wire[4:])
    assert info.value.fatal


def test_truncated_mac_is_fatal() -> None:
    with pytest.raises(FrameError, match="too short for its MAC") as info:
        FrameCodec(SECRET).decode(b"\x01" + bytes(10))
    assert info.value.fatal


def test_authentic_but_invalid_frame_names_its_room() -> None:
    payload = msgspec.msgpack.encode(_with(META, aux_index=-5))
    with pytest.raises(FrameError, match=re.escape("at `$.aux_index`")) as info:
        FrameCodec(SECRET).decode(signed_body(payload))
    assert (info.value.room, info.value.generation, info.value.fatal) == (7, 1, False)


# -- the reader ----------------------------------------------------------------------------------

STREAM_FRAMES: list[Frame] = [f for f in FRAMES if not isinstance(f, RoomMetadata)] + [
    RoomMetadata(7, 1, bytes(range(16)), 5)
]


def _stream(codec: FrameCodec, frames: list[Frame]) -> bytes:
    return b"".join(codec.encode(frame) for frame in frames)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
def test_reader_split_at_every_byte_boundary(secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    stream = _stream(codec, STREAM_FRAMES)
    for cut in range(len(stream) + 1):
        reader = FrameReader(codec)
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == STREAM_FRAMES, cut
        assert reader.buffered == 0


def test_reader_byte_by_byte() -> None:
    codec = FrameCodec(SECRET)
    stream = _stream(codec, STREAM_FRAMES)
    reader = FrameReader(codec)
    got: list[Frame | FrameError] = []
    for i in range(len(stream)):
        got += reader.feed(stream[i : i + 1])
    assert got == STREAM_FRAMES


@given(cuts=st.lists(st.integers(0, 10_000), max_size=12), secret=st.sampled_from([None, SECRET]))
def test_reader_any_split(cuts: list[int], secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    stream = _stream(codec, STREAM_FRAMES)
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    reader = FrameReader(codec)
    got: list[Frame | FrameError] = []
    for lo, hi in itertools.pairwise(bounds):
        got += reader.feed(stream[lo:hi])
    assert got == STREAM_FRAMES


def test_reader_takes_any_buffer_and_copies_it() -> None:
    codec = FrameCodec()
    data = bytearray(codec.encode(RoomAbort(7, 1, "x")))
    reader = FrameReader(codec)
    assert reader.feed(data[:5]) == []
    tail = bytearray(data[5:])
    out = reader.feed(memoryview(tail))
    tail[:] = bytes(len(tail))  # the caller reuses its buffer
    assert out == [RoomAbort(7, 1, "x")]
    assert reader.feed(b"") == []


def test_reader_big_frame_in_many_reads() -> None:
    codec = FrameCodec(SECRET)
    frame = RoomMetadata(3, 4, bytes(range(256)) * 16_384, 1)  # 4 MiB of pages
    wire = codec.encode(frame) + codec.encode(Heartbeat(1))
    reader = FrameReader(codec)
    got: list[Frame | FrameError] = []
    for i in range(0, len(wire), 65_536):
        got += reader.feed(wire[i : i + 65_536])
        assert reader.buffered < len(wire)
    assert got == [frame, Heartbeat(1)]
    assert reader.buffered == 0


def test_reader_memory_stays_compact_when_a_frame_trickles_in() -> None:
    codec = FrameCodec()
    frame = RoomMetadata(3, 4, bytes(256 * 1024), 1)
    wire = codec.encode(frame)
    reader = FrameReader(codec)
    pieces = [wire[i : i + 1] for i in range(len(wire))]  # one byte per read
    tracemalloc.start()
    try:
        got: list[Frame | FrameError] = []
        for piece in pieces:
            got += reader.feed(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [frame]
    assert peak < 4 * len(wire)  # not one object per read


def test_reader_skips_a_bad_frame_and_goes_on() -> None:
    codec = FrameCodec()
    bad = body(_with(META, pages=b"12345"))
    stream = (
        codec.encode(Heartbeat(1))
        + len(bad).to_bytes(4, "big")
        + bad
        + codec.encode(RoomSettled(7, 1))
    )
    got = FrameReader(codec).feed(stream)
    assert got[0] == Heartbeat(1)
    assert isinstance(got[1], FrameError)
    assert (got[1].room, got[1].fatal) == (7, False)
    assert got[2] == RoomSettled(7, 1)


def test_reader_stops_at_a_fatal_frame_and_stays_dead() -> None:
    codec = FrameCodec(SECRET)
    forged = FrameCodec(OTHER_SECRET).encode(RoomAbort(7, 1, "forged"))
    stream = codec.encode(Heartbeat(1)) + forged + codec.encode(Heartbeat(2))
    reader = FrameReader(codec)
    got = reader.feed(stream)
    assert got[0] == Heartbeat(1)
    assert len(got) == 2
    error = got[1]
    assert isinstance(error, FrameError)
    assert error.fatal
    assert reader.failed is error
    assert reader.buffered == 0
    assert reader.feed(codec.encode(Heartbeat(3))) == [error]


def test_zero_length_frame_is_fatal() -> None:
    got = FrameReader().feed(b"\x00\x00\x00\x00")
    assert len(got) == 1
    assert isinstance(got[0], FrameError)
    assert got[0].fatal


def test_oversized_prefix_is_fatal_without_allocating() -> None:
    reader = FrameReader(FrameCodec())
    header = (2**32 - 1).to_bytes(4, "big")
    tracemalloc.start()
    try:
        got = reader.feed(header)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16_384
    assert len(got) == 1
    error = got[0]
    assert isinstance(error, FrameError)
    assert error.fatal
    assert error.reason == "frame length 4294967295 exceeds the limit of 16777216 bytes"
    assert reader.buffered == 0
    # Whatever follows is not buffered either.
    assert reader.feed(bytes(1 << 20)) == [error]
    assert reader.buffered == 0


def test_prefix_one_above_the_limit_is_fatal_after_good_frames() -> None:
    codec = FrameCodec(max_frame_bytes=1024)
    stream = codec.encode(Heartbeat(1)) + (1025).to_bytes(4, "big") + bytes(100)
    reader = FrameReader(codec)
    got = reader.feed(stream)
    assert got[0] == Heartbeat(1)
    assert isinstance(got[1], FrameError)
    assert got[1].fatal
    assert "1025 exceeds the limit of 1024" in got[1].reason
    assert reader.buffered == 0


def test_reader_default_codec() -> None:
    assert FrameReader().feed(FrameCodec().encode(Heartbeat(5))) == [Heartbeat(5)]


# -- fuzz ----------------------------------------------------------------------------------------

rooms = st.integers(0, MAX63)
reasons = st.text(max_size=40)
packed = st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4])

frames_st: st.SearchStrategy[Frame] = st.one_of(
    st.builds(
        Hello,
        version=st.integers(0, 3),
        role=st.sampled_from(["prefill", "decode"]),
        rank=st.integers(0, 2**31 - 1),
        agent=st.text(min_size=1, max_size=20),
        agent_metadata=st.binary(max_size=64),
        layout=st.binary(max_size=64),
        incarnation=rooms,
    ),
    st.builds(Heartbeat, seq=rooms, echo=st.none() | rooms, held_us=rooms),
    st.builds(LeaseRequest, seq=rooms, echo=st.none() | rooms, held_us=rooms),
    st.builds(
        RoomMetadata,
        room=rooms,
        generation=rooms,
        pages=packed,
        aux_index=st.integers(0, 2**31 - 1),
        state=packed,
    ),
    st.builds(
        RoomOutcome, room=rooms, generation=rooms, status=st.sampled_from([0, 4]), reason=reasons
    ),
    st.builds(RoomAbort, room=rooms, generation=rooms, reason=reasons),
    st.builds(RoomSettled, room=rooms, generation=rooms),
    st.builds(Error, room=st.none() | rooms, reason=reasons, generation=st.none() | rooms),
)
secrets_st = st.sampled_from([None, SECRET])
FUZZ = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])


def _only_frame_errors(codec: FrameCodec, raw: bytes) -> Frame | FrameError:
    try:
        return codec.decode(raw)
    except FrameError as exc:
        error = exc
    assert len(error.reason) <= 1024
    return error


@FUZZ
@given(frame=frames_st, secret=secrets_st)
def test_fuzz_valid_frames_decode_equal(frame: Frame, secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    wire = codec.encode(frame)
    assert codec.decode(wire[4:]) == frame
    assert FrameReader(codec).feed(wire) == [frame]


@FUZZ
@given(raw=st.binary(max_size=512), secret=secrets_st)
def test_fuzz_random_bytes(raw: bytes, secret: bytes | None) -> None:
    codec = FrameCodec(secret, max_frame_bytes=4096)
    _only_frame_errors(codec, raw)
    _only_frame_errors(codec, b"\x00" + raw)
    out = FrameReader(codec).feed(raw)
    assert all(isinstance(item, (Frame, FrameError)) for item in out)
    assert all(not item.fatal for item in out[:-1] if isinstance(item, FrameError))


def _mutate(data: st.DataObject, raw: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip" and raw:
        out = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(out) - 1))
            out[i] ^= 1 << data.draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw)))]
    if kind == "extend":
        return raw + data.draw(st.binary(min_size=1, max_size=32))
    i = data.draw(st.integers(0, len(raw)))
    return raw[:i] + data.draw(st.binary(max_size=16)) + raw[i:]


@FUZZ
@given(frame=frames_st, secret=secrets_st, data=st.data())
def test_fuzz_mutated_frames_to_codec(
    frame: Frame, secret: bytes | None, data: st.DataObject
) -> None:
    codec = FrameCodec(secret)
    raw = codec.encode(frame)[4:]
    mutated = _mutate(data, raw)
    result = _only_frame_errors(codec, mutated)
    if mutated == raw:
        assert result == frame
    elif secret is not None:
        # Any change to a signed body (auth byte, MAC or payload) is caught by the MAC.
        assert isinstance(result, FrameError)
        assert result.fatal


@FUZZ
@given(
    frames=st.lists(frames_st, min_size=1, max_size=5),
    secret=secrets_st,
    data=st.data(),
    chunk=st.integers(1, 64),
)
def test_fuzz_mutated_streams_to_reader(
    frames: list[Frame], secret: bytes | None, data: st.DataObject, chunk: int
) -> None:
    codec = FrameCodec(secret, max_frame_bytes=4096)
    stream = b"".join(codec.encode(f) for f in frames)
    mutated = _mutate(data, stream)
    reader = FrameReader(codec)
    out: list[Frame | FrameError] = []
    for i in range(0, len(mutated), chunk):
        out += reader.feed(mutated[i : i + chunk])
    assert all(isinstance(item, (Frame, FrameError)) for item in out)
    fatal = [i for i, item in enumerate(out) if isinstance(item, FrameError) and item.fatal]
    if reader.failed is None:
        assert not fatal
    else:  # nothing but the sticky error once it happened
        assert all(item is reader.failed for item in out[fatal[0] :])
    if mutated == stream:
        assert out == frames


def test_reconcile_refs_round_trip_and_ragged_ones_are_refused() -> None:
    refs = [(0, 0), (7, 1), (MAX63, MAX63)]
    assert unpack_refs(Reconcile(pack_refs(refs)).rooms) == refs
    with pytest.raises(ValueError, match="multiple of 16"):
        Reconcile(b"\x00" * 15)
    bad = FrameCodec().encode(Reconcile(b"")).replace(b"\xa5rooms\xc4\x00", b"\xa5rooms\xc4\x01x")
    with pytest.raises(FrameError, match="multiple of 16"):
        FrameCodec().decode(bad[4:])


def test_a_lease_grant_must_name_a_positive_bounded_lease() -> None:
    codec = FrameCodec()
    for lease_ms in (0, 3_600_001):
        wire = body({"t": "LeaseGrant", "seq": 1, "lease_ms": lease_ms})
        with pytest.raises(FrameError, match="lease_ms"):
            codec.decode(wire)


def test_a_long_reason_is_clipped_to_fit_a_frame_not_refused() -> None:
    reason = clip_reason("x" * 5000)
    assert len(reason) == 1024
    assert FrameCodec().decode(FrameCodec().encode(RoomAbort(1, 1, reason))[4:]) == RoomAbort(
        1, 1, reason
    )
