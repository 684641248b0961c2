"""Every example runs as-is, as a user would run it, and says it succeeded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("script", "key_lines"),
    [
        (
            "pd_pair.py",
            ["[decode]  room 1005: Success, pages [43, 42, 41, 40] match", "pd_pair: OK"],
        ),
        ("tp2_pair.py", ["r0=Success r1=Success -> Success, both shards match", "tp2_pair: OK"]),
        (
            "abort_storm.py",
            ["deadline expired: Bootstrapping", "all decode rooms settled", "abort_storm: OK"],
        ),
    ],
)
def test_example_runs(script: str, key_lines: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES.parent,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for line in key_lines:
        assert line in done.stdout, done.stdout[-4000:]
    assert "MISMATCH" not in done.stdout
    assert "PROBLEM" not in done.stdout
