"""The report of ``kvfsm chaos servers`` from a campaign's record, without servers: the table,
the calibration and the verdict as text, the same as JSON (with each episode's phases), and the
PNG timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfsm.chaos._server_campaign import Calibration, CampaignResult
from kvfsm.chaos._server_plan import CALIBRATION, Action, Fault, PlannedRequest, ServerEpisode
from kvfsm.chaos._server_report import as_json, print_table, write_png
from kvfsm.chaos._server_scoring import DrainReading, EpisodeRecord, RequestOutcome, score
from kvfsm.chaos._server_soak import Sample

BOUNDS = {"liveness_s": 10.0, "lease_s": 10.0, "unclaimed_s": 6.0}
STOP = Fault(Action.STOP, "decode", 1.0, "1s")


def _result(*, late: bool = False) -> CampaignResult:
    req = PlannedRequest(0, (5, 6), 4, False, 0.0)
    calibration = ServerEpisode(0, CALIBRATION, 0.0, (req,))
    stop = ServerEpisode(1, STOP, 0.5, (PlannedRequest(1, (7,), 4, True, 0.0),))
    drained = [DrainReading("prefill", 0, 0, 4, 4), DrainReading("decode", 0, 0, 0, 0)]
    records = [
        EpisodeRecord(calibration, 1.0, drained, load_s=0.3, queue_s=1.5),
        EpisodeRecord(stop, 10.0, drained, load_s=0.4, queue_s=2.0),
    ]
    records[1].phases_s = {"reference": 0.4, "load": 3.0, "restart": 0.0}
    # The stop's bound: 1 + 10 + 10 + 30 + 2 = 53 s after it landed (at 10 s).
    outcomes = [
        RequestOutcome(0, 0, "completed", 1.0, 2.3, [9, 9]),
        RequestOutcome(1, 1, "completed", 9.5, 70.0 if late else 12.0, [8]),
    ]
    reference = {0: [9, 9], 1: [8]}
    return CampaignResult(
        seed=7,
        records=records,
        outcomes=outcomes,
        score=score(records, outcomes, reference, **BOUNDS),
        samples=[Sample(60.0, "prefill", 1, 0, 100 << 20, 50)],
        skipped={},
        elapsed_s=80.0,
        log_dir=Path("/nonexistent"),
        liveness_s=10.0,
        lease_s=10.0,
        unclaimed_s=6.0,
        reference=reference,
        calibration=Calibration(0.3, 1.5, 1),
    )


def test_the_text_names_the_calibration_and_counts_only_fault_kinds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_table(_result())
    out = capsys.readouterr().out
    assert (
        "calibration (no fault, 1 requests): reference 0.3s, pipeline 1.5s; each bound allows "
        "its episode's reference time x 5.0 for queueing"
    ) in out
    rows = [line.split()[0] for line in out.splitlines()[1:3]]
    assert rows == ["no-fault", "sigstop"]
    assert out.rstrip().endswith("seed 7: 2 requests, 1 fault kinds in 80s: ok")


def test_a_late_request_is_a_violation_in_the_text_and_the_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _result(late=True)
    print_table(result)
    out = capsys.readouterr().out
    assert "VIOLATION: sigstop decode 1s: request 1 ended 60.0s after the fault (bound 53s)" in out
    report = json.loads(json.dumps(as_json(result)))
    assert report["ok"] is False
    assert report["violations"] == result.score.violations


def test_the_json_carries_the_calibration_and_each_episodes_phases() -> None:
    report = json.loads(json.dumps(as_json(_result())))
    assert report["calibration"] == {
        "requests": 1,
        "reference_s": 0.3,
        "pipeline_s": 1.5,
        "factor": 5.0,
    }
    assert report["phases_s"] == [
        {"episode": 0, "fault": "no-fault"},
        {"episode": 1, "fault": "sigstop decode 1s", "reference": 0.4, "load": 3.0, "restart": 0.0},
    ]
    assert [f["kind"] for f in report["faults"]] == ["no-fault", "sigstop decode 1s"]
    assert report["faults"][1]["bound_s"] == 53.0


def test_the_factor_is_never_below_one() -> None:
    # A pipeline faster than the reference server allows no less than the reference's time.
    assert Calibration(2.0, 1.0, 8).factor == 1.0
    assert Calibration(0.0, 1.0, 8).factor > 1.0  # a reference time read as 0 still divides


def test_the_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    write_png(_result(late=True), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
