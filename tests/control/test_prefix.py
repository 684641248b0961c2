"""Decode prefix caching on the control plane: ``RoomMetadata.prefix`` on the wire (protocol v5),
and the routing rule that hands it to the sender with the page list, in the one event that makes
the sender WaitingForInput (so prefill's scheduler finds it at its first WaitingForInput)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvfsm.control._codec import FrameCodec
from kvfsm.control._frames import PROTOCOL_VERSION, FrameError, RoomClaim, RoomMetadata
from kvfsm.control._routing import Deliver, PrefillRouting, RoutingConfig, Send
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import DestinationReceived

PAGES = np.arange(3, dtype="<i4").tobytes()
A = 1
S1 = RoomKey(7, 101)


def test_the_protocol_version_says_the_wire_changed() -> None:
    assert PROTOCOL_VERSION >= 5  # 5: RoomMetadata.prefix (6 added pipeline stages)


@pytest.mark.parametrize("prefix", [0, 16, 2**40])
def test_room_metadata_round_trips_its_prefix(prefix: int) -> None:
    codec = FrameCodec()
    frame = RoomMetadata(7, 1, PAGES, 3, b"", prefix=prefix)
    assert codec.decode(codec.encode(frame)[4:]) == frame
    assert RoomMetadata(7, 1, PAGES, 3).prefix == 0  # the default: no prefix


def test_a_negative_prefix_is_refused_naming_the_room() -> None:
    fields = {"t": "RoomMetadata", "room": 7, "generation": 1, "pages": PAGES, "aux_index": 3}
    payload = msgspec.msgpack.encode({**fields, "prefix": -16})
    with pytest.raises(FrameError) as info:
        FrameCodec().decode(b"\x00" + payload)
    error = info.value
    assert (error.room, error.generation, error.fatal) == (7, 1, False)
    assert "prefix" in error.reason


def _prefill() -> PrefillRouting:
    core = PrefillRouting(RoutingConfig(pending_max=8, pending_ttl_s=10.0))
    core.link_opened(A, "decode-0-1", now=0.0, hello_sent=0.0, lease_ms=2000)
    return core


def _destinations(actions: list[object]) -> list[tuple[RoomKey, DestinationReceived]]:
    return [
        (a.key, a.event)
        for a in actions
        if isinstance(a, Deliver) and isinstance(a.event, DestinationReceived)
    ]


def test_a_claim_alone_gives_the_sender_nothing_the_page_list_brings_the_prefix() -> None:
    prefill = _prefill()
    prefill.sender_spawned(S1, 0.0)
    assert prefill.on_claim(A, RoomClaim(7, 1), 0.1) == []  # no event: it stays Bootstrapping
    frame = RoomMetadata(7, 1, PAGES, 3, b"", prefix=48)
    ((key, event),) = _destinations(prefill.on_metadata(A, frame, 0.2))
    assert key == S1
    assert event == DestinationReceived(PAGES, 3, "decode-0-1", b"", A, prefix=48)


def test_a_page_list_held_for_a_sender_not_yet_spawned_keeps_its_prefix() -> None:
    prefill = _prefill()
    assert prefill.on_claim(A, RoomClaim(7, 1), 0.0) == []
    assert prefill.on_metadata(A, RoomMetadata(7, 1, PAGES, 3, b"", prefix=32), 0.1) == []
    ((key, event),) = _destinations(prefill.sender_spawned(S1, 0.2))
    assert (key, event.prefix, event.pages) == (S1, 32, PAGES)


def test_a_full_hit_page_list_is_a_destination_too() -> None:
    """Decode holds the whole prompt: no page, the aux row and the prefix still go to the
    sender, which then sends one zero-page last chunk."""
    prefill = _prefill()
    prefill.sender_spawned(S1, 0.0)
    actions = prefill.on_metadata(A, RoomMetadata(7, 1, b"", 3, b"", prefix=64), 0.1)
    ((_, event),) = _destinations(actions)
    assert (event.pages, event.aux_index, event.prefix) == (b"", 3, 64)
    assert not [a for a in actions if isinstance(a, Send)]
