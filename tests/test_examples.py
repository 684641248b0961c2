"""Every example runs as-is, as a user would run it, and says it succeeded."""

from __future__ import annotations

import os
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
        (
            "top_pair.py",
            [
                "kvfsm top: 2 of 2 status servers answering",
                "deadline expired",
                "aborted (peer)",
                "top_pair: OK",
            ],
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


@pytest.mark.timeout(600)
def test_sglang_cpu_pd_example_runs() -> None:
    """Real SGLang prefill, decode and router on the CPU, one request through them."""
    done = subprocess.run(
        ["bash", str(EXAMPLES / "sglang_cpu_pd.sh")],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=EXAMPLES.parent,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "[prefill] ready" in done.stdout
    assert "[router] 8 prompt tokens -> output ids [" in done.stdout
    assert done.stdout.rstrip().endswith("sglang_cpu_pd: OK")
