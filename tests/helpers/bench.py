"""Running a script of ``benchmarks/`` in a child process, as an operator would (or Python code
with ``benchmarks/`` importable): what the benchmarks' smoke tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["BENCH", "run_benchmark"]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def run_benchmark(
    script: str, *args: str, code: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>`` (``code``: ``python -c <code> <args>`` instead),
    with ``benchmarks/`` and the repository on ``PYTHONPATH``; output captured, never raises
    on a non-zero exit (the caller asserts on it, with stderr)."""
    env = {**os.environ, "PYTHONPATH": f"{BENCH}{os.pathsep}{ROOT}"}
    head = ["-c", code] if code is not None else [str(BENCH / script)]
    return subprocess.run(
        [sys.executable, *head, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
