"""The metrics read at scrape time (oldest room per state, peer links and their round trips,
the control plane's counters) and the time rooms spent in each state, from ``/metrics`` of a real
prefill-decode pair; the room hooks' arithmetic on a ``RoomMetrics`` of its own."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from kvfsm.metrics import RoomMetrics
from kvfsm.states import KVPoll, Role
from tests.helpers.observed_pair import ObservedPair, get_text, observed_pair
from tests.helpers.waiting import wait_until_sync


@pytest.fixture(scope="module")
def pair() -> Iterator[ObservedPair]:
    with observed_pair() as observed:
        yield observed


def value(text: str, name: str, labels: str = "") -> float:
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "")
    match = re.search(pattern + r" (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def test_a_waiting_room_shows_as_an_age_and_its_deadline(pair: ObservedPair) -> None:
    text = get_text(pair.decode_url + "/metrics")
    age = value(text, "kvfsm_oldest_room_age_seconds", 'role="receiver",state="WaitingForInput"')
    assert age > 0  # the receiver left waiting
    assert value(text, "kvfsm_oldest_room_age_seconds", 'role="sender",state="Transferring"') == 0
    assert (
        value(text, "kvfsm_state_deadline_seconds", 'role="receiver",state="WaitingForInput"')
        == 300
    )


def test_peers_and_control_counters(pair: ObservedPair) -> None:
    text = get_text(pair.prefill_url + "/metrics")
    incarnation = pair.decode.control.incarnation  # type: ignore[union-attr]
    labels = f'incarnation="{incarnation}",peer_rank="0",peer_role="decode"'
    assert value(text, "kvfsm_peer_up", labels) == 1
    assert value(text, "kvfsm_peer_last_heard_seconds", labels) >= 0
    assert value(text, "kvfsm_control_leases_granted_total") >= 1
    for name in ("frames_rejected", "handshakes_refused", "unexpected_errors", "leases_fenced"):
        assert value(text, f"kvfsm_control_{name}_total") == 0
    # SGLang-independent room metrics stay filled.
    assert value(text, "kvfsm_failures_total", 'kind="aborted (local)",role="sender"') == 1


def test_each_link_shows_its_round_trip(pair: ObservedPair) -> None:
    incarnation = pair.prefill.control.incarnation  # type: ignore[union-attr]
    labels = f'incarnation="{incarnation}",peer_rank="0",peer_role="prefill"'
    name = "kvfsm_peer_heartbeat_rtt_seconds"
    # Measured once a heartbeat (every 0.25 s here) or a lease grant was echoed.
    wait_until_sync(lambda: f"{name}{{" in get_text(pair.decode_url + "/metrics"), timeout=10)
    rtt = value(get_text(pair.decode_url + "/metrics"), name, labels)
    assert 0 < rtt < 0.1  # loopback; the echo's holding left in would be up to 0.5 s


def test_time_in_each_state_is_a_histogram_per_role(pair: ObservedPair) -> None:
    """Every room that left a state was observed in it once: on prefill, the finished room
    and the one decode aborted each left Bootstrapping and WaitingForInput, the finished one
    Transferring, and the one its caller aborted only Bootstrapping."""
    text = get_text(pair.prefill_url + "/metrics")
    name = "kvfsm_room_state_seconds"
    counts = {
        state: value(text, f"{name}_count", f'role="sender",state="{state}"')
        for state in ("Bootstrapping", "WaitingForInput", "Transferring")
    }
    assert counts == {"Bootstrapping": 3, "WaitingForInput": 2, "Transferring": 1}
    for state, count in counts.items():
        labels = f'role="sender",state="{state}"'
        assert value(text, f"{name}_bucket", labels.replace("role", 'le="+Inf",role')) == count
        assert value(text, f"{name}_sum", labels) > 0
    # The receiver left waiting on decode has left nothing but Bootstrapping yet.
    decode = get_text(pair.decode_url + "/metrics")
    assert value(decode, f"{name}_count", 'role="receiver",state="Transferring"') == 2
    assert value(decode, f"{name}_count", 'role="receiver",state="Bootstrapping"') == 3


def test_state_times_fall_in_the_bucket_of_their_upper_bound() -> None:
    """The hooks' arithmetic: a time equal to a bound is in that bucket (Prometheus' ``le``),
    buckets are cumulative, only the state left is observed, and roles are apart."""
    metrics = RoomMetrics()
    metrics.spawned(Role.SENDER)
    metrics.transition(Role.SENDER, KVPoll.Bootstrapping, KVPoll.WaitingForInput, "", 0.0001)
    metrics.transition(Role.SENDER, KVPoll.WaitingForInput, KVPoll.Transferring, "", 0.0003)
    metrics.transition(Role.SENDER, KVPoll.Transferring, KVPoll.Failed, "peer lost: 3", 400.0)
    text = metrics.exposition().decode()
    name = "kvfsm_room_state_seconds"
    boot, waiting = 'role="sender",state="Bootstrapping"', 'role="sender",state="WaitingForInput"'
    assert value(text, f"{name}_bucket", f'le="0.0001",{boot}') == 1
    assert value(text, f"{name}_bucket", f'le="0.00025",{waiting}') == 0
    assert value(text, f"{name}_bucket", f'le="0.0005",{waiting}') == 1
    assert value(text, f"{name}_bucket", f'le="+Inf",{waiting}') == 1
    transferring = 'role="sender",state="Transferring"'
    assert value(text, f"{name}_bucket", f'le="300.0",{transferring}') == 0
    assert value(text, f"{name}_bucket", f'le="+Inf",{transferring}') == 1
    assert value(text, f"{name}_sum", transferring) == 400.0
    assert value(text, f"{name}_count", 'role="receiver",state="Bootstrapping"') == 0
    assert value(text, "kvfsm_rooms", 'role="sender",state="Failed"') == 1
    assert value(text, "kvfsm_failures_total", 'kind="peer lost",role="sender"') == 1
    assert (
        value(
            text,
            "kvfsm_transitions_total",
            'from_state="Transferring",role="sender",to_state="Failed"',
        )
        == 1
    )
    metrics.reaped(Role.SENDER, KVPoll.Failed)
    assert value(metrics.exposition().decode(), "kvfsm_rooms", 'role="sender",state="Failed"') == 0


def test_a_peer_with_a_lost_link_and_a_new_one_is_one_series() -> None:
    """The same incarnation reconnecting leaves its lost link in the peer book beside the new
    one: the exposition has one sample per label set, the up one, and a peer whose links are
    all down reads down (the newest)."""
    rows = [
        {"role": "decode", "rank": 0, "incarnation": 7, "up": False, "last_heard_s": 9.0},
        {"role": "decode", "rank": 0, "incarnation": 7, "up": True, "last_heard_s": 0.1},
        {"role": "decode", "rank": 0, "incarnation": 7, "up": False, "last_heard_s": 30.0},
        {"role": "decode", "rank": 1, "incarnation": 8, "up": False, "last_heard_s": 5.0},
        {"role": "decode", "rank": 1, "incarnation": 8, "up": False, "last_heard_s": 2.0},
    ]
    metrics = RoomMetrics()
    metrics.watch(list, links=lambda: rows)

    async def scrape() -> str:  # scrapes run on the engine's loop
        return metrics.exposition().decode()

    text = asyncio.run(scrape())
    for name in ("kvfsm_peer_up", "kvfsm_peer_last_heard_seconds"):
        assert len(re.findall(f"^{name}{{", text, re.MULTILINE)) == 2, text
    live = 'incarnation="7",peer_rank="0",peer_role="decode"'
    assert value(text, "kvfsm_peer_up", live) == 1
    assert value(text, "kvfsm_peer_last_heard_seconds", live) == 0.1
    gone = 'incarnation="8",peer_rank="1",peer_role="decode"'
    assert value(text, "kvfsm_peer_up", gone) == 0
    assert value(text, "kvfsm_peer_last_heard_seconds", gone) == 2.0
