"""A control link's round trip from its heartbeats and leases (``kvfsm.control._round_trip``): the
arithmetic, with ``now`` passed in, on both ends of one link played by two ``RoundTrip``s. The
measure against a real link is in tests/test_status.py and tests/test_metrics.py."""

from __future__ import annotations

import pytest

from kvfsm.control._frames import Heartbeat, LeaseRequest
from kvfsm.control._round_trip import KEPT, SMOOTHING, RoundTrip


def test_the_echo_says_which_beat_and_how_long_it_was_held() -> None:
    a, b = RoundTrip(), RoundTrip()
    assert a.beat(10.0) == Heartbeat(0)  # nothing heard yet: nothing to echo
    assert b.heard(Heartbeat(0), 50.000_2) is None  # b's clock need not be a's
    assert b.beat(50.300_2) == Heartbeat(0, 0, 300_000)  # held 0.3 s
    # a sent beat 0 at 10.0 and hears the echo at 10.3005: 0.3 s of it was b's holding.
    rtt = a.heard(Heartbeat(0, 0, 300_000), 10.300_5)
    assert rtt == pytest.approx(0.000_5)
    assert a.last_s == a.smoothed_s == rtt
    assert a.samples == 1
    assert b.last_s is None  # b has measured nothing: a has not echoed one of b's yet


def test_the_smoothed_round_trip_moves_an_eighth_of_the_way() -> None:
    a = RoundTrip()
    a.beat(0.0)
    a.heard(Heartbeat(0, 0, 0), 0.001)
    a.beat(1.0)
    a.heard(Heartbeat(1, 1, 0), 1.009)
    assert a.last_s == pytest.approx(0.009)
    assert a.smoothed_s == pytest.approx(0.001 + SMOOTHING * 0.008)


def test_echoes_that_measure_nothing_are_ignored() -> None:
    a = RoundTrip()
    a.beat(0.0)  # seq 0
    assert a.heard(Heartbeat(7, 5, 0), 1.0) is None  # an echo of a beat never sent
    assert a.heard(Heartbeat(8, 0, 2_000_000), 1.0) is None  # held longer than the trip took
    assert a.samples == 0
    assert a.smoothed_s is None
    # Each of the peer's beats is still what the next one of ours echoes.
    assert a.beat(1.5) == Heartbeat(1, 8, 500_000)


def test_only_the_latest_beats_wait_for_an_echo() -> None:
    a = RoundTrip()
    for i in range(KEPT + 2):
        a.beat(float(i))
    assert a.heard(Heartbeat(0, 0, 0), 20.0) is None  # too old: no longer kept
    assert a.heard(Heartbeat(1, 2, 0), 20.0) == pytest.approx(18.0)  # the oldest kept
    # Ours before an echoed one are never echoed after it: they are dropped.
    assert a.heard(Heartbeat(2, 1, 0), 20.0) is None
    assert a.heard(Heartbeat(3, KEPT + 1, 0), 20.0) == pytest.approx(20.0 - (KEPT + 1))


def test_the_lease_exchange_measures_both_ends() -> None:
    """Prefill's round trip is a grant's arrival less its request's send time (decode answers
    at once); decode's is a grant's echo in prefill's next request, less prefill's holding."""
    prefill, decode = RoundTrip(), RoundTrip()
    first = prefill.ask(1, 10.0)
    assert first == LeaseRequest(1)  # no grant heard yet: nothing to echo
    assert decode.asked(first, 70.000_4) is None
    decode.grant(1, 70.000_4)
    assert prefill.answered(1, 10.000_9) == pytest.approx(0.000_9)
    second = prefill.ask(2, 10.500_9)
    assert second == LeaseRequest(2, 1, 500_000)
    # Decode granted at 70.0004 and hears the echo at 70.5012: 0.5 s of it was prefill's.
    assert decode.asked(second, 70.501_2) == pytest.approx(0.000_8)
    assert decode.smoothed_s == pytest.approx(0.000_8)
    assert prefill.answered(7, 11.0) is None  # a grant of a request never sent measures nothing
    assert prefill.samples == decode.samples == 1
