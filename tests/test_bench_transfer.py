"""benchmarks/transfer.py's unequal-TP cases at toy sizes: every runner verifies, and a slice
written at the wrong offset fails the run instead of reporting a figure."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.bench import run_benchmark

SMALL = ["--tp-pages", "32", "--tp-regions", "2", "--repeat", "1"]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_benchmark("transfer.py", *args, code=code, timeout=100)


@pytest.mark.slow
def test_sliced_cases_verify_and_report_the_ratio() -> None:
    proc = _run("--cases", "tp2to1_rooms_16,tp2to1_large", "--json", *SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    results = report["results"]
    assert {(r["case"], r["runner"]) for r in results} == {
        (case, runner)
        for case in ("tp2to1_rooms_16", "tp2to1_large")
        for runner in ("copy", "raw_nixl", "kvfsm")
    }
    assert all(r["verified"] for r in results)
    # 2 buffers x 32 pages x 16 rows of 1 KiB: the source's whole rows.
    assert all(r["bytes"] == 2 * 32 * 16 * 1024 for r in results)
    case = report["cases"]["tp2to1_large"]
    assert (case["src_row_bytes"], case["dst_row_bytes"], case["dst_offset"]) == (1024, 2048, 1024)
    assert case["descriptors_per_side"] == 2 * 32 * 16
    ratios = {(r["case"], r["ratio"]) for r in report["ratios"]}
    assert ("tp2to1_rooms_16", "kvfsm/raw_nixl") in ratios


# The raw runner's destination list at offset 0 (the first half of each decode row, which
# prefill rank 0 owns) instead of the second half.
_WRONG_HALF = """
import sys
import transfer

right = transfer._row_descs

def wrong(base, geometry):
    regions, pages, rows, row_bytes, offset, length = geometry
    return right(base, (regions, pages, rows, row_bytes, 0, length))

transfer._row_descs = wrong
sys.exit(transfer.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_slice_at_the_wrong_offset_fails_the_run() -> None:
    proc = _run("--cases", "tp2to1_rooms_16", "--runners", "raw_nixl", *SMALL, code=_WRONG_HALF)
    assert proc.returncode != 0
    assert "written outside the head slice" in proc.stderr


@pytest.mark.slow
def test_the_hand_off_floor_moves_every_room_and_reports_its_ratios() -> None:
    """``actor_floor`` (the kvfsm runner's caller and round trips, no room logic) and
    ``kvfsm_ahead`` (bootstrap ahead of sending) move the same verified bytes, for equal and
    unequal TP, and their ratios sit beside kvfsm's."""
    cases = "rooms_1,rooms_16,tp2to1_rooms_16"
    runners = "raw_nixl,actor_floor,actor_floor_1trip,kvfsm,kvfsm_ahead"
    proc = _run("--cases", cases, "--runners", runners, "--pages", "256", "--json", *SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    results = report["results"]
    assert {(r["case"], r["runner"]) for r in results} == {
        (case, runner) for case in cases.split(",") for runner in runners.split(",")
    }
    assert all(r["verified"] for r in results)
    floor = [r for r in results if r["runner"].startswith("actor_floor")]
    # One latency per room, and the loop thread's CPU (not the spinning caller's) per chunk.
    assert all(r["extra"]["room_p50_us"] > 0 and r["cpu_us_per_chunk"] > 0 for r in floor)
    ratios = {(r["case"], r["ratio"]) for r in report["ratios"]}
    for case in cases.split(","):
        assert {
            (case, "kvfsm/actor_floor"),
            (case, "actor_floor/raw_nixl"),
            (case, "kvfsm_ahead/actor_floor_1trip"),
        } <= ratios
    # Every room of kvfsm_ahead was timed from its hand-over (one latency each, all Success).
    ahead = [r for r in results if r["runner"] == "kvfsm_ahead"]
    assert all(r["extra"]["room_p50_us"] > 0 for r in ahead)


# The floor's NIXL agent refuses the third request it is asked to post; every handle it made
# and every one it released are counted, and the counts printed however the run ends.
_REFUSING_FLOOR = """
import sys
import transfer

counts = {"made": 0, "released": 0}

def refusing(run):
    def wrapped(self, case):
        agent, calls = self.raw.agent, [0]
        real_transfer, real_make = agent.transfer, agent.make_prepped_xfer
        real_release = agent.release_xfer_handle

        def transfer_(handle):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected NIXL refusal")
            return real_transfer(handle)

        def make(*args):
            handle = real_make(*args)
            counts["made"] += 1
            return handle

        def release(handle):
            counts["released"] += 1
            return real_release(handle)

        agent.transfer, agent.make_prepped_xfer = transfer_, make
        agent.release_xfer_handle = release
        try:
            return run(self, case)
        finally:
            del agent.transfer, agent.make_prepped_xfer, agent.release_xfer_handle
    return wrapped

transfer.ActorFloor.run = refusing(transfer.ActorFloor.run)
try:
    sys.exit(transfer.main(sys.argv[1:]))
finally:
    print(f"handles made {counts['made']} released {counts['released']}", file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rooms_1", "rooms_16"])
def test_a_request_the_floor_cannot_post_fails_the_run_at_once(case: str) -> None:
    """The refusal is the run's error, and no handle is left behind: with 16 rooms in flight
    the others' handles are still posted when the run stops, and are released before their
    descriptor lists go."""
    proc = _run(
        "--cases", case, "--runners", "actor_floor", "--pages", "256", *SMALL,
        code=_REFUSING_FLOOR,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "actor_floor: NIXL: RuntimeError('injected NIXL refusal')" in proc.stderr
    made, released = (int(n) for n in proc.stderr.split("handles made ")[1].split()[::2][:2])
    assert made >= 3
    assert released == made
