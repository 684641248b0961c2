"""benchmarks/scaling.py at toy sizes: every curve runs kvfsm and raw NIXL on the same verified
work (a room that fails, or a destination whose checksum differs, stops the run instead of
reporting a figure), says whether its target was met, and writes its JSON and its plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench import run_benchmark

CURVES = ("rooms", "peers", "descriptors", "page_size", "live_rooms")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_every_curve_reports_its_points_target_and_figures(tmp_path: Path) -> None:
    proc = run_benchmark("scaling.py", "--tiny", "--json", "--figures", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["mode"] == "tiny"
    assert set(report["curves"]) == set(CURVES)
    for name, curve in report["curves"].items():
        assert isinstance(curve["met"], bool), name
        assert curve["target"], name
        assert curve["points"], name
        assert curve["command"].startswith("python benchmarks/scaling.py"), name
        # The file is the curve the run printed, and its plot is a PNG.
        assert json.loads((tmp_path / f"scaling_{name}.json").read_text()) == curve
        assert (tmp_path / f"scaling_{name}.png").read_bytes().startswith(PNG_MAGIC), name

    curves = report["curves"]
    # Rooms in flight: each point moved every one of its rooms through both runners.
    rooms = curves["rooms"]["points"]
    assert [p["x"] for p in rooms] == [1, 16]
    assert [p["rooms"] for p in rooms] == [32, 32]
    for point in rooms:
        for runner in ("raw_nixl", "kvfsm"):
            assert point[runner]["wall_us_per_room"] > 0
            assert point[runner]["process_cpu_us_per_room"] > 0
        assert point["kvfsm"]["thread_cpu_us_per_room"] > 0  # the loop thread's, measured
    assert curves["rooms"]["value"] is not None  # 16 is a point: the ratio is computed

    peers = curves["peers"]["points"]
    assert [(p["x"], p["rooms"]) for p in peers] == [(1, 16), (2, 16)]
    assert all(p["kvfsm"]["thread_cpu_us_per_room"] > 0 for p in peers)

    desc = curves["descriptors"]
    # 4 buffers x 8 and 32 pages, both layouts, the per-descriptor difference derived.
    for rows in (desc["points"], desc["contiguous"]):
        assert [p["x"] for p in rows] == [32, 128]
        for p in rows:
            assert p["raw_nixl_s"] > 0
            assert p["kvfsm_s"] > 0
            expected = (p["kvfsm_s"] - p["raw_nixl_s"]) / p["x"] * 1e6
            assert p["extra_us_per_desc"] == pytest.approx(expected)
    assert set(desc["linear"]) == {"raw_nixl", "kvfsm"}

    pages = curves["page_size"]["points"]
    assert [p["x"] for p in pages] == [4096, 65536]
    assert all(p["ratio"] == pytest.approx(p["kvfsm_gbps"] / p["raw_nixl_gbps"]) for p in pages)

    live = curves["live_rooms"]["points"]
    assert [p["x"] for p in live] == [200]
    assert live[0]["bytes_per_live_room"] > 0  # the parked rooms were traced


@pytest.mark.slow
def test_an_unknown_curve_is_refused(tmp_path: Path) -> None:
    proc = run_benchmark("scaling.py", "--curves", "rooms,nope", "--figures", str(tmp_path))
    assert proc.returncode == 2
    assert "unknown curve: nope" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written
