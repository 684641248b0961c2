"""benchmarks/gil.py at toy sizes: its busy phases move real rooms, every one of them ending in
Success (a benchmark whose rooms all failed, as once when its runner became fenced and it did
not, stops with an error instead of reporting a ratio), and its raw NIXL baseline moves rooms
as well."""

from __future__ import annotations

import json

import pytest

from tests.helpers.bench import run_benchmark


@pytest.mark.slow
def test_busy_rounds_move_rooms_and_report_a_ratio() -> None:
    small = ("--seconds", "0.3", "--rounds", "1", "--pages", "256", "--window", "4")
    proc = run_benchmark("gil.py", "--json", *small)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    (round_,) = report["rounds"]
    assert round_["busy"]["rooms_per_s"] > 0
    assert round_["idle"]["rooms_per_s"] == 0
    assert 0 < report["ratio_best"] == round_["ratio"]
    # kvfsm's threads took the GIL from the loop (which never sleeps) while they moved rooms.
    assert round_["busy"]["scheduler_gil_handovers_per_s"] > 0
    # Every phase timed its work on this thread's CPU clock, and the machine was never idle
    # (the loop itself keeps a core busy).
    for name in ("idle", "busy", "raw"):
        assert round_[name]["scheduler_work_cpu_us"] > 0
        assert round_[name]["machine_busy_cores"] > 0.5
    # The raw NIXL baseline moved rooms too (at the busy phase's rate: not checked, a loaded
    # machine may keep it from it), and the two ratios come from the same phases.
    raw = round_["raw"]
    assert raw["rooms_per_s"] > 0
    idle = round_["idle"]["iterations_per_s"]
    assert round_["ratio_raw"] == raw["iterations_per_s"] / idle
    assert round_["kvfsm_vs_raw"] == round_["busy"]["iterations_per_s"] / raw["iterations_per_s"]
