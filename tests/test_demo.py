"""``kvfsm demo`` as a user runs it: a subprocess that starts the bootstrap registry, a prefill
process and a decode process (both with rooms, over the real control channel), moves real KV over
NIXL (UCX, DRAM) and checks every byte on the decode side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import interrupt_and_check

REPO = Path(__file__).resolve().parent.parent
DEMO = [sys.executable, "-m", "kvfsm.cli", "demo"]


def demo_json(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [*DEMO, "--json", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    # stdout is the summary alone: progress, NIXL's and the ranks' log lines go to stderr.
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.mark.timeout(200)
def test_every_request_lands_every_byte() -> None:
    status, s, stderr = demo_json("--requests", "40")
    assert status == 0, (s, stderr)
    assert s["requests"] == s["succeeded"] == 40, s
    assert s["failed"] == s["wedged"] == s["unsettled"] == 0, s
    assert s["mismatched"] == s["mismatched_bytes"] == 0, s
    assert s["failed_by_reason"] == {}
    assert s["checked_bytes"] == s["bytes"] > 0
    assert s["gbps"] > 0
    assert 0 < s["p50_ms"] <= s["p99_ms"]
    assert len({s["pids"]["prefill"], s["pids"]["decode"], os.getpid()}) == 3, s["pids"]
    for side in ("prefill", "decode"):
        rooms = s["engines"][side]["rooms"]
        assert rooms["spawned"] == rooms["reaped"] == rooms["succeeded"] == 40, rooms
        assert rooms["live"] == 0
        assert s["engines"][side]["control"]["links_opened"] == 1


@pytest.mark.timeout(200)
def test_aborts_from_either_side_fail_with_the_abort_and_never_wedge() -> None:
    status, s, stderr = demo_json("--requests", "60", "--abort-rate", "0.2")
    assert s["wedged"] == s["unsettled"] == 0, s
    assert s["mismatched"] == s["mismatched_bytes"] == 0, s
    assert s["succeeded"] + s["failed"] == 60, s
    assert sum(s["failed_by_reason"].values()) == s["failed"]
    for reason in s["failed_by_reason"]:
        assert "requested by --abort-rate" in reason, s["failed_by_reason"]
    assert s["failed_unexpectedly"] == 0
    assert s["failed"] + s["aborts_too_late"] == s["aborts_planned"], s
    assert status == 0, (s, stderr)


@pytest.mark.timeout(200)
def test_seeded_aborts_include_failures() -> None:
    # Seed 1 aborts rooms on both sides before their data lands.
    status, s, stderr = demo_json("--requests", "60", "--abort-rate", "0.3", "--seed", "1")
    assert status == 0, (s, stderr)
    assert s["failed"] > 0, s
    assert s["wedged"] == s["mismatched"] == 0, s


def test_bad_flags_exit_2_with_a_message() -> None:
    proc = subprocess.run(
        [*DEMO, "--abort-rate", "2"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "--abort-rate must be in [0, 1]" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.timeout(200)
def test_ctrl_c_stops_the_demo_cleanly_with_130() -> None:
    # A terminal's Ctrl-C goes to the whole foreground process group, both ranks included.
    interrupt_and_check(
        [*DEMO, "--requests", "1000000", "--json"], "demo", children=2, moving_s=4.0, timeout=60
    )
