"""benchmarks/gil_backends.py at toy sizes: both backends (kvfsm's adapter, SGLang's own NIXL
backend) move rooms whose bytes decode checks, and bytes other than prefill's fail that check."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.bench import run_benchmark

SMALL = ["--seconds", "0.3", "--rounds", "1", "--window", "4", "--ahead", "4", "--json"]


def _run(*args: str) -> dict[str, Any]:
    proc = run_benchmark("gil_backends.py", *SMALL, *args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_backends_move_checked_rooms_and_report_the_ratio() -> None:
    report = _run()
    assert set(report["backends"]) == {"kvfsm", "sglang"}
    for name, r in report["backends"].items():
        busy = r["best"]["busy"]
        assert r["failed_prefill_count"] == 0, (name, r["failed_prefill"])
        decode = r["decode"]
        assert decode["failed"] == 0, name
        assert decode["wrong_bytes"] == 0, name
        # Decode saw every room prefill finished (the warm-up's and the drained ones too).
        assert decode["succeeded"] >= busy["rooms"] > 0, name
        assert 0 < r["ratio_best"] == r["best"]["ratio"]
        assert {"scheduler_running", "scheduler_waiting_for_cpu"} <= set(busy)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rooms_that_deliver_other_bytes_than_prefills_are_counted_wrong() -> None:
    report = _run("--backends", "kvfsm", "--prefill-fill", "9")
    decode = report["backends"]["kvfsm"]["decode"]
    assert decode["succeeded"] > 0
    assert decode["wrong_bytes"] == decode["succeeded"]
