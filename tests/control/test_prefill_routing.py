"""Prefill's routing core and its own stalls: a process frozen past the unclaimed bound has not
read what decode sent meanwhile, so the bound is not judged until it has, and a room it fails
then says this rank stood still when its stall took over half the window. Driven directly,
``now`` and the stall passed in."""

from __future__ import annotations

import pytest

from kvfsm.control._frames import RoomClaim
from kvfsm.control._routing import Action, Deliver, PrefillRouting, RoutingConfig
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import PeerLost

CONFIG = RoutingConfig(pending_max=8, pending_ttl_s=100.0, unclaimed_s=60.0)
LINK = 1
SENDER = RoomKey(7, 101)
TICK = 0.1  # the watchdog's period


def delivered(actions: list[Action]) -> list[tuple[RoomKey, object]]:
    return [(a.key, a.event) for a in actions if isinstance(a, Deliver)]


@pytest.fixture
def prefill() -> PrefillRouting:
    core = PrefillRouting(CONFIG)
    core.link_opened(LINK, "decode-0-1", now=0.0, hello_sent=0.0, lease_ms=2000)
    core.sender_spawned(SENDER, 1.0)
    assert delivered(core.tick(1.0 + TICK)) == []
    return core


def test_a_claim_read_after_a_stall_wins_over_the_unclaimed_bound(
    prefill: PrefillRouting,
) -> None:
    # Frozen from 1.1 to 80.0: decode's claim came at 2.0 and waited in the socket. The first
    # tick after the stall comes before the reader has run, so it fails nothing.
    assert delivered(prefill.tick(80.0, stalled_s=80.0 - 1.1 - TICK)) == []
    assert prefill.on_claim(LINK, RoomClaim(7, 1), 80.01) == []
    assert delivered(prefill.tick(80.0 + TICK)) == []
    assert prefill.stats["unclaimed_failed"] == 0
    assert prefill.entries()["unclaimed"] == 0


def test_a_room_a_stall_took_past_the_bound_says_this_rank_stood_still(
    prefill: PrefillRouting,
) -> None:
    stalled = 80.0 - 1.1 - TICK
    assert delivered(prefill.tick(80.0, stalled_s=stalled)) == []
    # No claim in what was read after the stall: it fails now, blaming the stall, not decode.
    [(key, event)] = delivered(prefill.tick(80.0 + TICK))
    assert key == SENDER
    assert isinstance(event, PeerLost)
    assert event.reason.startswith(f"this prefill rank stood still for {stalled:.1f}s")
    assert "never arrived" not in event.reason
    assert prefill.stats["unclaimed_failed"] == 1
    assert delivered(prefill.tick(90.0)) == []  # once


def test_a_room_past_the_bound_by_its_running_time_alone_blames_its_decode_half(
    prefill: PrefillRouting,
) -> None:
    # A 1 s stall ending at 71.0: the room had waited 69 s of this rank's running time before
    # it, past the bound without the stall, so the stall only delays it by one tick.
    stalled = 1.0
    assert delivered(prefill.tick(71.0, stalled_s=stalled)) == []
    [(key, event)] = delivered(prefill.tick(71.0 + TICK))
    assert key == SENDER
    assert isinstance(event, PeerLost)
    assert event.reason.startswith("no decode room claimed it within 60s")


def test_without_a_stall_the_bound_is_judged_at_once(prefill: PrefillRouting) -> None:
    assert delivered(prefill.tick(61.0)) == []
    [(key, event)] = delivered(prefill.tick(61.0 + TICK))
    assert key == SENDER
    assert isinstance(event, PeerLost)
    assert event.reason.startswith("no decode room claimed it within 60s")


def test_a_loop_hiccup_just_before_the_bound_still_blames_its_decode_half(
    prefill: PrefillRouting,
) -> None:
    # A busy machine blocks the loop for 0.15 s just before the bound: the bound is judged a
    # tick later, and the room had almost all of it to be claimed, so the reason stays decode's
    # (blaming a hiccup would send an operator after the wrong process).
    stalled = 0.15
    assert delivered(prefill.tick(60.9, stalled_s=stalled)) == []
    assert delivered(prefill.tick(61.0)) == []
    [(key, event)] = delivered(prefill.tick(61.0 + TICK))
    assert key == SENDER
    assert isinstance(event, PeerLost)
    assert event.reason.startswith("no decode room claimed it within 60s")
    assert "stood still" not in event.reason
