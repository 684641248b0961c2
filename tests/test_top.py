"""``kvfsm top``: one frame of a real pair's status servers (``--once``), the rates of a pair that
moves rooms between two samples, the frame drawn from recorded samples, and servers that do not
answer."""

from __future__ import annotations

import io
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvfsm import KVPoll
from kvfsm.top import DASH as D
from kvfsm.top import Poller, Sample, Window, parse_metrics, rates, render
from tests.helpers.cli import REPO, _sigint_not_ignored
from tests.helpers.observed_pair import WAITING, ObservedPair, get, move_room, observed_pair
from tests.helpers.waiting import wait_until_sync


@pytest.fixture(scope="module")
def pair() -> Iterator[ObservedPair]:
    with observed_pair() as observed:
        yield observed


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm", "top", "--width", "120", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def panel(frame: str, url: str) -> str:
    """One server's panel of a frame: from its title to the panel's bottom edge."""
    start = frame.index(f"─ {url} ")
    return frame[start : frame.index("╰", start)]


def drawn(frame: Any, width: int = 160) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(frame)
    return console.export_text()


def dead_url() -> str:
    """A URL nothing listens on: a port bound and let go."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- against a real pair ------------------------------------------------------------------------


def test_once_shows_the_rooms_states_links_and_failures_the_pair_has(pair: ObservedPair) -> None:
    shown = top("--once", "--interval", "0.3", pair.prefill_url, "--url", pair.decode_url)
    assert shown.returncode == 0, shown.stderr
    frame = shown.stdout
    assert "kvfsm top: 2 of 2 status servers answering" in frame
    prefill, decode = panel(frame, pair.prefill_url), panel(frame, pair.decode_url)

    # Prefill: rooms 1 (done), 3 and 4 (failed) all reaped; bytes are counted here, the writer.
    assert "since start: 3 spawned, 1 succeeded, 2 failed" in prefill
    # Over the two samples: --interval apart, and a little more on a busy machine.
    rated = re.search(r"rates over the last (\d+\.\d) s: 0\.000 GB/s +0\.0 rooms/s", prefill)
    assert rated is not None, prefill
    assert float(rated[1]) >= 0.3
    assert re.search(r"WaitingForInput +0\b", prefill)
    assert re.search(r"all +0\b", prefill)
    # Its decode peer, up, with the write lease; the round trip is a number or a dash.
    assert re.search(rf"decode r0 t +1 +up +({D}|\d+\.\d\d) +live +\d+\.\d\d", prefill), prefill
    assert re.search(r"aborted \(local\) +0 +0\.0 +1\b", prefill)
    assert re.search(r"aborted \(peer\) +0 +0\.0 +1\b", prefill)

    # Decode: room 2 waits for prefill; room 4 was aborted by its own caller.
    assert "since start: 3 spawned, 1 succeeded, 1 failed" in decode
    assert f"{D} GB/s (this rank writes no KV)" in decode
    assert re.search(r"WaitingForInput +1\b", decode)
    (room,) = get(f"{pair.decode_url}/rooms")
    assert room["room"] == WAITING
    # Its age, its time in WaitingForInput and what is left of that state's 300 s deadline.
    assert re.search(
        rf"\b{WAITING} +{room['generation']} +receiver +WaitingForInput +\d+\.\d +\d+\.\d "
        r"+29\d\.\d +0%",
        decode,
    ), decode
    assert re.search(rf"prefill r0 t +1 +up +({D}|\d+\.\d\d) +{D} +\d+\.\d\d", decode), decode
    assert re.search(r"aborted \(local\) +0 +0\.0 +1\b", decode)
    assert "aborted (peer)" not in decode


def test_rates_of_rooms_moved_between_two_samples() -> None:
    with observed_pair() as pair:
        poller = Poller([pair.prefill_url, pair.decode_url])
        try:
            before = poller.sample_all()
            _move_a_room_and_abort_another(pair)
            after = poller.sample_all()
        finally:
            poller.close()
        layout = pair.prefill.agent.layout
    sent = rates([before[0], after[0]])
    assert sent is not None
    assert sent.bytes == 4 * layout.page_bytes() + layout.aux_row_bytes()
    assert sent.bytes / 1e9 / sent.span_s == sent.gb_per_s
    assert (sent.succeeded, sent.failed) == (1, 1)
    assert sent.by_kind == {"aborted (local)": 1}
    received = rates([before[1], after[1]])
    assert received is not None
    assert received.bytes is None  # decode is written into; it counts no bytes
    assert (received.succeeded, received.failed) == (1, 0)
    assert received.by_kind == {}
    frame = drawn(render({s.url: [b, s] for b, s in zip(before, after, strict=True)}))
    assert re.search(r"\d+\.\d{3} GB/s +\d+\.\d rooms/s \(1 succeeded, 1 failed\)", frame)
    assert re.search(r"aborted \(local\) +1 +\d+\.\d +2\b", frame)


def _move_a_room_and_abort_another(pair: ObservedPair) -> None:
    """Room 10 moves 4 pages and an aux row and succeeds; room 11 is aborted by prefill."""
    moved = move_room(pair, 10, [[9, 10], [11, 12]], [30, 31, 32, 33], src_aux=6, dst_aux=5)
    assert moved == (KVPoll.Success, KVPoll.Success)
    pair.prefill.sender(11).abort("operator test")
    wait_until_sync(lambda: pair.prefill.stats()["rooms"]["failed"] == 3, timeout=10)
    wait_until_sync(lambda: pair.prefill.stats()["rooms"]["live"] == 0, timeout=10)


def test_live_view_redraws_until_ctrl_c(pair: ObservedPair) -> None:
    """Without --once it samples every --interval until Ctrl-C, then leaves its last frame
    (on a pipe, rich draws only that one) and exits 0."""
    with _sigint_not_ignored():
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfsm", "top", "--interval", "0.1", pair.decode_url],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        # Its poller's first thread, its only one beside the main thread, starts with the first
        # sample.
        wait_until_sync(lambda: _threads(proc.pid) >= 2, timeout=30, interval=0.05)
        # Real time on purpose: nothing on a pipe marks each redraw; 2 s is 20 intervals.
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "kvfsm top: 1 of 1 status servers answering, every 0.1 s" in out
    span = re.search(r"rates over the last (\d+\.\d) s", out)
    assert span is not None, out
    assert float(span[1]) >= 1.5
    assert re.search(r"WaitingForInput +1\b", out)


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


# -- servers that do not answer ------------------------------------------------------------------


def test_an_unreachable_server_is_shown_with_its_error_and_fails_the_command() -> None:
    url = dead_url()
    shown = top("--once", "--interval", "0.05", url)
    assert shown.returncode == 1, shown.stderr
    assert "kvfsm top: 0 of 1 status servers answering" in shown.stdout
    assert "unreachable: [Errno 111] Connection refused" in panel(shown.stdout, url)
    assert "Traceback" not in shown.stderr


def test_one_answering_server_is_enough(pair: ObservedPair) -> None:
    url = dead_url()
    shown = top("--once", "--interval", "0.05", url, pair.decode_url)
    assert shown.returncode == 0, shown.stderr
    assert "kvfsm top: 1 of 2 status servers answering" in shown.stdout
    assert "unreachable: " in panel(shown.stdout, url)
    assert re.search(r"WaitingForInput +1\b", panel(shown.stdout, pair.decode_url))


def test_no_url_is_a_usage_error() -> None:
    shown = top("--once")
    assert shown.returncode == 2
    assert "give at least one status server URL" in shown.stderr


def test_the_svg_is_the_frame(pair: ObservedPair, tmp_path: Any) -> None:
    svg = tmp_path / "top.svg"
    shown = top("--once", "--interval", "0.05", "--svg", str(svg), pair.decode_url)
    assert shown.returncode == 0, shown.stderr
    text = svg.read_text()
    assert text.startswith("<svg")
    # rich writes each run of text as its own element, spaces as &#160;.
    assert "WaitingForInput" in text
    assert "kvfsm&#160;top" in text


# -- recorded samples ----------------------------------------------------------------------------

URL = "http://rank:1"


def sample(
    t: float,
    *,
    bytes_done: int | None = 0,
    succeeded: int = 0,
    failed: int = 0,
    kinds: Mapping[str, float] | None = None,
    failures: Sequence[Mapping[str, Any]] | None = None,
    rooms: Sequence[Mapping[str, Any]] = (),
    links: Sequence[Mapping[str, Any]] = (),
    deadlines: Mapping[tuple[str, str], float] | None = None,
) -> Sample:
    stats: dict[str, Any] = {"rooms": {"spawned": succeeded + failed, "succeeded": succeeded}}
    stats["rooms"]["failed"] = failed
    if bytes_done is not None:
        stats["transport"] = {"bytes_done": bytes_done}
    return Sample(
        URL,
        t,
        rooms=rooms,
        links=links,
        stats=stats,
        failures_by_kind=kinds,
        failures=failures,
        deadlines=deadlines or {},
    )


def test_rates_are_deltas_over_the_window_and_a_reset_counts_anew() -> None:
    samples = [
        sample(100.0, bytes_done=5_000_000_000, succeeded=10, failed=2, kinds={"peer lost": 2}),
        sample(100.5, bytes_done=6_000_000_000, succeeded=20, failed=3, kinds={"peer lost": 3}),
        # The rank restarted: every counter starts again from zero.
        sample(101.0, bytes_done=1_000_000_000, succeeded=5, failed=1, kinds={"deadline # s": 1}),
        sample(102.0, bytes_done=3_000_000_000, succeeded=25, failed=3, kinds={"deadline # s": 3}),
    ]
    got = rates(samples)
    assert got is not None
    assert got.span_s == pytest.approx(2.0)
    assert got.bytes == 1_000_000_000 + 1_000_000_000 + 2_000_000_000
    assert got.gb_per_s == pytest.approx(2.0)
    assert (got.succeeded, got.failed) == (10 + 5 + 20, 1 + 1 + 2)
    assert got.rooms_per_s == pytest.approx(39 / 2.0)
    assert got.by_kind == {"peer lost": 1, "deadline # s": 3}
    frame = drawn(render({URL: samples}))
    assert "rates over the last 2.0 s: 2.000 GB/s   19.5 rooms/s (35 succeeded, 4 failed)" in frame
    # Per kind: in the window, per minute, since the rank (re)started.
    assert re.search(r"deadline # s +3 +90\.0 +3\b", frame)
    assert re.search(rf"peer lost +1 +30\.0 +{D}", frame)
    assert rates(samples[:1]) is None
    assert "waiting for a second sample" in drawn(render({URL: samples[:1]}))


def test_an_unanswered_sample_is_skipped_and_the_window_slides() -> None:
    window = Window(60.0)
    for t, moved in [(0.0, 0), (30.0, 30e9), (61.0, 61e9), (90.0, 90e9)]:
        window.add(sample(t, bytes_done=int(moved)))
    window.add(Sample(URL, 95.0, error="timed out"))
    # The sample at 0 s fell out; the one at 30 s stays: the rates cover a whole minute.
    assert [s.t for s in window.samples] == [30.0, 61.0, 90.0, 95.0]
    got = rates(window.samples)
    assert got is not None
    assert (got.span_s, got.gb_per_s) == (60.0, 1.0)
    frame = drawn(render({URL: list(window.samples)}))
    assert "unreachable: timed out" in frame
    assert "last answered 5.0 s ago" in frame


def failure(room: int, kind: str) -> dict[str, Any]:
    return {"room": room, "generation": room, "role": "sender", "created": 1.0, "reason_kind": kind}


def test_without_metrics_failures_are_told_from_new_rows_of_failures() -> None:
    old = [failure(1, "peer lost")]
    new = [failure(3, "aborted (peer)"), failure(2, "aborted (peer)"), *old]
    samples = [
        sample(0.0, failed=1, failures=old),
        # Four failed, but only two new rows: the rest were not kept (past the rows asked for,
        # or a rank without the flight recorder).
        sample(1.0, failed=5, failures=new),
    ]
    got = rates(samples)
    assert got is not None
    assert got.by_kind == {"aborted (peer)": 2, "(kind not kept)": 2}
    frame = drawn(render({URL: samples}))
    assert re.search(r"aborted \(peer\) +2 +120\.0 +2\b", frame)
    assert re.search(rf"\(kind not kept\) +2 +120\.0 +{D}", frame)
    assert re.search(r"peer lost +0 +0\.0 +1\b", frame)
    assert "last 3 kept" in frame


def test_links_show_the_round_trip_when_served_and_down_links_last() -> None:
    links = [
        {"role": "decode", "rank": 0, "engine": "e", "link": 1, "up": False, "leased": False},
        {"role": "decode", "rank": 1, "engine": "e", "link": 2, "up": True, "leased": True},
        {"role": "decode", "rank": 2, "engine": "e", "link": 3, "up": True, "rtt_ms": None},
        {"role": "decode", "rank": 3, "engine": "e", "link": 4, "up": True, "rtt_ms": 1.234},
    ]
    links[1]["last_heard_s"] = 0.25
    frame = drawn(render({URL: [sample(0.0, links=links)]}))
    assert "peer links (3 up, 1 down)" in frame
    rows = [line for line in frame.splitlines() if "decode r" in line]
    assert re.search(rf"decode r1 e +2 +up +{D} +live +0\.25", rows[0])
    assert re.search(rf"decode r2 e +3 +up +{D} +{D} +{D}", rows[1])
    assert re.search(rf"decode r3 e +4 +up +1\.23 +{D} +{D}", rows[2])
    assert re.search(rf"decode r0 e +1 +down +{D} +{D} +{D}", rows[3])


def test_the_oldest_rooms_with_the_deadline_they_used() -> None:
    rooms = [
        {"room": 7, "generation": 1, "role": "sender", "state": "Transferring", "age_s": 95.0},
        {"room": 8, "generation": 2, "role": "receiver", "state": "Bootstrapping", "age_s": 9.0},
        {"room": 9, "generation": 3, "role": "sender", "state": "Success", "age_s": 500.0},
        {"room": 5, "generation": 4, "role": "sender", "state": "WaitingForInput", "age_s": 1.0},
    ]
    rooms[0]["deadline_in_s"] = 30.0  # 90 s of Transferring's 120 s used
    rooms[1]["deadline_in_s"] = 51.0
    rooms[2]["deadline_in_s"] = None
    rooms[3]["deadline_in_s"] = 4.0
    deadlines = {("sender", "Transferring"): 120.0, ("receiver", "Bootstrapping"): 60.0}
    frame = drawn(render({URL: [sample(0.0, rooms=rooms, deadlines=deadlines)]}, oldest=2))
    assert "oldest rooms not terminal (2 of 3)" in frame
    assert re.search(r"7 +1 +sender +Transferring +95\.0 +90\.0 +30\.0 +75%", frame)
    assert re.search(r"8 +2 +receiver +Bootstrapping +9\.0 +9\.0 +51\.0 +15%", frame)
    assert not re.search(r"\b5 +4 +sender", frame)  # the third oldest: past --oldest 2
    # Live rooms by state, terminal ones too (until they are reaped).
    assert re.search(r"state +receiver +sender", frame)
    assert re.search(r"Transferring +0 +1\b", frame)
    assert re.search(r"Success +0 +1\b", frame)
    assert re.search(r"all +1 +3\b", frame)


def test_metrics_text_gives_failures_by_kind_and_deadlines() -> None:
    kinds, deadlines = parse_metrics(
        "# HELP kvfsm_failures_total Failed rooms by reason\n"
        'kvfsm_failures_total{kind="chunk # stalled",role="sender"} 2.0\n'
        'kvfsm_failures_total{kind="chunk # stalled",role="receiver"} 1.0\n'
        'kvfsm_failures_total{kind="say \\"no\\"",role="sender"} 1.0\n'
        # Escaped: a backslash then n (not a newline), and a newline.
        'kvfsm_failures_total{kind="a\\\\n b\\nc",role="sender"} 1.0\n'
        'kvfsm_failures_created{kind="chunk # stalled",role="sender"} 1.7e9\n'
        'kvfsm_state_deadline_seconds{role="sender",state="Transferring"} 120.0\n'
    )
    assert kinds == {"chunk # stalled": 3.0, 'say "no"': 1.0, "a\\n b\nc": 1.0}
    assert deadlines == {("sender", "Transferring"): 120.0}


def test_urls_are_taken_as_host_port_too_and_each_sampled_once() -> None:
    poller = Poller(["127.0.0.1:9400", "http://127.0.0.1:9400/", "http://127.0.0.1:9401"])
    try:
        assert poller.urls == ["http://127.0.0.1:9400", "http://127.0.0.1:9401"]
    finally:
        poller.close()
