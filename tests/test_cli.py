"""``kvfsm run``, the main job, as a user runs it: a subprocess moving real KV over NIXL (UCX,
DRAM) from this machine's prefill process into a decode process, every byte checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.helpers.cli import REPO, interrupt_and_check

CLI = [sys.executable, "-m", "kvfsm.cli"]


def kvfsm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_json(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = kvfsm("run", "--json", *args)
    # stdout is the summary alone: NIXL's log lines (both processes) go to stderr.
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return proc.returncode, json.loads(lines[0]), proc.stderr


def test_every_room_lands_every_byte() -> None:
    status, s, stderr = run_json("--rooms", "40")
    assert status == 0, (s, stderr)
    assert s["rooms"] == s["succeeded"] == 40, s
    assert s["failed"] == s["mismatched"] == s["wedged"] == s["unsettled"] == 0, s
    assert s["failed_by_reason"] == {}
    assert s["handles_created"] == s["handles_released"] > 0
    assert s["in_flight"] == 0
    assert s["bytes"] > 0
    assert s["gbps"] > 0
    assert 0 < s["p50_ms"] <= s["p99_ms"]
    assert s["engine"]["spawned"] == s["engine"]["reaped"] == 40
    assert s["engine"]["live"] == 0
    assert s["peer_pid"] != os.getpid()


def test_aborted_rooms_fail_with_the_abort_or_succeed_and_never_wedge() -> None:
    status, s, stderr = run_json("--rooms", "60", "--abort-rate", "0.3", "--seed", "7")
    assert s["wedged"] == s["mismatched"] == s["unsettled"] == 0, s
    assert s["succeeded"] + s["failed"] == 60, s
    assert s["failed"] > 0, s  # seed 7 aborts some rooms before their last chunk
    assert sum(s["failed_by_reason"].values()) == s["failed"]
    for reason in s["failed_by_reason"]:
        assert reason.startswith("aborted (local)"), s["failed_by_reason"]
    assert s["failed_unexpectedly"] == 0
    assert s["failed"] + s["aborts_too_late"] == s["aborts_requested"], s
    assert s["handles_created"] == s["handles_released"]
    assert s["in_flight"] == 0
    # The run's own aborts are not errors.
    assert status == 0, (s, stderr)


def test_bad_flags_exit_non_zero_with_a_message() -> None:
    proc = kvfsm("run", "--rooms", "many")
    assert proc.returncode == 2
    assert "--rooms: invalid int value: 'many'" in proc.stderr
    proc = kvfsm("run", "--abort-rate", "1.5")
    assert proc.returncode == 2
    assert "--abort-rate must be in [0, 1]" in proc.stderr
    proc = kvfsm("run", "--no-such-flag")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in proc.stderr
    assert proc.stdout == ""


def test_ctrl_c_stops_the_run_cleanly_with_130() -> None:
    # A terminal's Ctrl-C goes to the whole foreground process group, decode process included.
    interrupt_and_check(
        [*CLI, "run", "--rooms", "1000000"], "run", children=1, moving_s=1.0, timeout=30
    )
