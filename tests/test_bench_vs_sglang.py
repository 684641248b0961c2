"""benchmarks/vs_sglang.py at toy sizes: both backends (kvfsm's adapter, SGLang's own NIXL
backend) move every request of every window with the bytes decode checks, the report carries
each measure per backend and window and the ratios against the targets, and bytes other than
prefill's fail decode's check."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.bench import run_benchmark

SMALL = ["--rounds", "1", "--requests", "12", "--warmup", "4", "--windows", "1,4", "--json"]
MEASURES = {
    "rooms_per_s",
    "gb_per_s",
    "p50_ms",
    "p99_ms",
    "bootstrap_p50_ms",
    "send_p50_ms",
    "process_cpu_us",
    "scheduler_cpu_us",
    "decode_cpu_us",
}


def _run(*args: str) -> dict[str, Any]:
    proc = run_benchmark("vs_sglang.py", *SMALL, *args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_both_backends_move_every_request_with_checked_bytes_and_report_ratios() -> None:
    report = _run("--stories", "2")
    assert set(report["backends"]) == {"kvfsm", "sglang"}
    for name, b in report["backends"].items():
        assert b["failed_prefill_count"] == 0, (name, b["failed_prefill"])
        # Decode saw every request prefill made (warm-up included), each with prefill's bytes.
        assert b["decode"] == {"succeeded": 4 + 2 * 12, "failed": 0, "wrong_bytes": 0}, name
        assert set(b["windows"]) == {"1", "4"}
        for row in b["windows"].values():
            assert set(row) == MEASURES | {"failed", "rounds", "threads_cpu_us"}
            assert row["failed"] == 0
            assert all(row[m] > 0 for m in MEASURES if m != "decode_cpu_us"), (name, row)
            assert row["p50_ms"] <= row["p99_ms"]
            # Each request's phases add up to its latency, so neither phase's median exceeds
            # the latency's.
            assert row["bootstrap_p50_ms"] <= row["p50_ms"], (name, row)
            assert row["send_p50_ms"] <= row["p50_ms"], (name, row)
    # --stories: the flight recorder's timeline of each window's last two kvfsm rooms (the
    # windows ran in order, so window 4's rooms are the round's last), SGLang has none.
    assert report["backends"]["sglang"]["stories"] == {}
    stories = report["backends"]["kvfsm"]["stories"]
    assert set(stories) == {"1", "4"}
    last = 4 + 2 * 12  # the warm-up's rooms, then each window's
    assert [s["room"] for s in stories["4"]] == [last - 1, last]
    assert [s["room"] for s in stories["1"]] == [last - 13, last - 12]
    for story in stories["1"] + stories["4"]:
        assert story["state"] == "Success", story
        times = [t for t, _ in story["timeline"]]
        assert times == sorted(times), story
        whats = [what for _, what in story["timeline"]]
        assert "entered WaitingForInput" in whats, story
        assert whats.index("entered Success") > whats.index("chunk done"), story
    kvfsm, sglang = (report["backends"][n]["windows"]["4"] for n in ("kvfsm", "sglang"))
    ratios = report["ratios"]["4"]
    assert ratios["rooms_per_s"] == kvfsm["rooms_per_s"] / sglang["rooms_per_s"]
    # The targets that name a measured window are judged, each from its ratio.
    targets = {(t["measure"], t["window"]): t for t in report["targets"]}
    assert set(targets) == {("process_cpu_us", 1), ("p50_ms", 1)}
    p50 = targets[("p50_ms", 1)]
    assert p50["ratio"] == report["ratios"]["1"]["p50_ms"]
    assert p50["met"] == (p50["ratio"] <= 0.5)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_requests_that_deliver_other_bytes_than_prefills_are_counted_wrong() -> None:
    report = _run("--backends", "kvfsm", "--prefill-fill", "9")
    decode = report["backends"]["kvfsm"]["decode"]
    assert decode["succeeded"] > 0
    assert decode["wrong_bytes"] == decode["succeeded"]
    assert "ratios" not in report
