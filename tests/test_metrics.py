"""The metrics read at scrape time (oldest room per state, peer links, the control plane's
counters), from ``/metrics`` of a real prefill-decode pair."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.helpers.observed_pair import ObservedPair, get_text, observed_pair


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
    for name in ("frames_rejected", "handshakes_refused", "unexpected_errors"):
        assert value(text, f"kvfsm_control_{name}_total") == 0
    # SGLang-independent room metrics stay filled.
    assert value(text, "kvfsm_failures_total", 'kind="aborted (local)",role="sender"') == 1
