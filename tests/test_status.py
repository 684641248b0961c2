"""The status server's story routes (``/rooms/<id>``, ``/failures``, ``/links``) and ``kvfsm rooms
--room/--failed``, against a real prefill-decode pair."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
from collections.abc import Iterator

import pytest

from kvfsm.control import ChannelConfig
from kvfsm.manager import ManagerConfig
from tests.helpers.observed_pair import (
    DECODE_ABORTED,
    DONE,
    PREFILL_ABORTED,
    WAITING,
    ObservedPair,
    get,
    observed_pair,
)
from tests.helpers.waiting import wait_until_sync


@pytest.fixture(scope="module")
def pair() -> Iterator[ObservedPair]:
    with observed_pair() as observed:
        yield observed


def kvfsm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_finished_room_tells_its_story_on_both_ranks(pair: ObservedPair) -> None:
    (sender,) = get(f"{pair.prefill_url}/rooms/{DONE}")
    (receiver,) = get(f"{pair.decode_url}/rooms/{DONE}")
    assert sender["state"] == receiver["state"] == "Success"
    assert sender["live"] is False
    kinds = [e["kind"] for e in sender["timeline"]]
    assert "lease" in kinds  # its destination came under the decode link's lease
    posted = [e for e in sender["timeline"] if e["kind"] == "chunk_posted"]
    assert [(e["chunk"], e["pages"]) for e in posted] == [(0, 2), (1, 2)]
    assert all(e["bytes"] == 2 * pair.prefill.agent.layout.page_bytes() for e in posted)
    assert [e["chunk"] for e in sender["timeline"] if e["kind"] == "chunk_done"] == [0, 1]
    # The peer by its identity: the decode rank's engine, rank, incarnation and agent.
    peer = sender["peer"]
    assert peer["engine"] == "t"
    assert peer["rank"] == 0
    assert peer["agent"] == pair.decode.agent.name
    assert peer["incarnation"] == pair.decode.control.incarnation  # type: ignore[union-attr]
    assert receiver["peer"]["agent"] == pair.prefill.agent.name
    assert [e["what"] for e in receiver["timeline"] if e["kind"] == "frame_out"] == [
        "RoomMetadata out: destination pages"
    ]
    assert any(e["what"] == "RoomOutcome in: Success" for e in receiver["timeline"])


def test_a_live_room_and_an_unknown_one(pair: ObservedPair) -> None:
    (row,) = get(f"{pair.decode_url}/rooms/{WAITING}")
    assert row["live"] is True
    assert row["state"] == "WaitingForInput"
    assert row["timeline"][-1]["what"] == "entered WaitingForInput"
    with pytest.raises(urllib.error.HTTPError) as raised:
        get(f"{pair.decode_url}/rooms/999")
    assert raised.value.code == 404
    raised.value.close()
    with pytest.raises(urllib.error.HTTPError) as bad:
        get(f"{pair.decode_url}/rooms/seven")
    assert bad.value.code == 400
    bad.value.close()


def test_failures_are_listed_with_their_kinds(pair: ObservedPair) -> None:
    failures = get(f"{pair.prefill_url}/failures")
    kinds = {f["room"]: f["reason_kind"] for f in failures}
    assert kinds[PREFILL_ABORTED] == "aborted (local)"
    assert kinds[DECODE_ABORTED] == "aborted (peer)"
    (story,) = get(f"{pair.prefill_url}/rooms/{DECODE_ABORTED}")
    assert any(e["what"] == "RoomAbort in: the peer aborted" for e in story["timeline"])


def test_links_show_each_peer(pair: ObservedPair) -> None:
    (link,) = get(f"{pair.prefill_url}/links")
    assert link["up"] is True
    assert link["role"] == "decode"
    assert link["leased"] is True  # prefill holds a live write lease from decode
    assert link["agent"] == pair.decode.agent.name
    assert link["last_heard_s"] >= 0
    (back,) = get(f"{pair.decode_url}/links")
    assert back["role"] == "prefill"
    assert back["leased"] is False  # decode grants leases, it holds none


def test_links_show_their_round_trip(pair: ObservedPair) -> None:
    """Both ends measure the round trip of their link on its echoes: more than nothing, and on
    loopback far less than the 0.25 s a heartbeat or 0.5 s a lease grant is held at most here
    (which a round trip that forgot to take the holding out would be near)."""

    for url in (pair.prefill_url, pair.decode_url):
        links = f"{url}/links"
        wait_until_sync(lambda: get(links)[0]["rtt_ms"] is not None, timeout=10)  # noqa: B023
        (link,) = get(links)
        assert 0 < link["rtt_ms"] < 100


def test_a_link_busy_with_its_leases_measures_its_round_trip_on_them() -> None:
    """A heartbeat goes out only after ``heartbeat_s`` with nothing else to send, and every
    link renews its lease every ``lease_s / 4``: with the default settings (1 s against 0.5 s)
    no heartbeat is ever sent, and the round trip comes from the lease exchange. Heartbeats
    every 5 s here: within the wait, only the leases can have measured it."""
    config = ManagerConfig(
        channel=ChannelConfig(heartbeat_s=5.0), register_interval_s=0.5, status_port=0, metrics=True
    )
    with observed_pair(config) as slow:
        for url in (slow.prefill_url, slow.decode_url):
            links = f"{url}/links"
            wait_until_sync(lambda: get(links)[0]["rtt_ms"] is not None, timeout=4)  # noqa: B023
            (link,) = get(links)
            assert 0 < link["rtt_ms"] < 100


def test_the_rooms_command_tells_a_story_and_groups_failures(pair: ObservedPair) -> None:
    shown = kvfsm("rooms", "--url", pair.prefill_url, "--room", str(DONE))
    assert shown.returncode == 0, shown.stderr
    assert f"room {DONE} generation" in shown.stdout
    assert "sender, Success (finished" in shown.stdout
    assert "chunk_posted" in shown.stdout
    assert "entered Success" in shown.stdout
    assert f"agent={pair.decode.agent.name}" in shown.stdout

    missing = kvfsm("rooms", "--url", pair.prefill_url, "--room", "999")
    assert missing.returncode == 1
    assert "knows no live or recently finished room 999" in missing.stdout

    failed = kvfsm("rooms", "--url", pair.prefill_url, "--failed")
    assert failed.returncode == 0, failed.stderr
    assert "aborted (local): 1" in failed.stdout
    assert "aborted (peer): 1" in failed.stdout
    grouped = json.loads(kvfsm("rooms", "--url", pair.prefill_url, "--failed", "--json").stdout)
    assert [r["room"] for r in grouped["aborted (peer)"]] == [DECODE_ABORTED]


def test_the_rooms_command_takes_a_bare_host_and_port(pair: ObservedPair) -> None:
    """A Prometheus target's ``instance`` (host:port) names the same status server."""
    bare = pair.prefill_url.removeprefix("http://")
    shown = kvfsm("rooms", "--url", bare, "--room", str(DONE), "--json")
    assert shown.returncode == 0, shown.stderr
    assert [r["room"] for r in json.loads(shown.stdout)] == [DONE]


def test_the_rooms_command_says_when_a_status_server_cannot_be_read() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"
    for extra in ((), ("--room", "1"), ("--failed",)):
        shown = kvfsm("rooms", "--url", url, *extra)
        assert shown.returncode == 1
        assert f"kvfsm rooms: cannot read {url}/" in shown.stderr
