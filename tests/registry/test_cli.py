"""``kvfsm bootstrap`` (``kvfsm/registry/_cli.py``) in a subprocess: it serves, signed or
not, until SIGINT, and reports bad arguments."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys
from pathlib import Path

import pytest

from kvfsm.registry import BootstrapClient
from tests.helpers.rank_info import ENGINE, SECRET, info


async def _listening(proc: asyncio.subprocess.Process) -> tuple[int, bytes]:
    """Read the server's log up to its "listening on" line (logged once it serves): its port,
    and what it logged so far."""
    assert proc.stderr is not None
    head = b""
    async with asyncio.timeout(30.0):
        while True:
            line = await proc.stderr.readline()
            head += line
            if not line:
                raise AssertionError(f"the registry exited before it listened:\n{head.decode()}")
            found = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1)), head


@pytest.mark.asyncio
@pytest.mark.parametrize("signed", [False, True], ids=["open", "secret-file"])
async def test_cli_serves_until_sigint(tmp_path: Path, signed: bool) -> None:
    # Port 0: the server binds a free port and logs it (no port picked here to race for).
    args = ["-m", "kvfsm.registry._cli", "--port", "0", "--expected-ranks", "1"]
    args += ["--max-connections", "64", "--idle-timeout", "3", "--request-timeout", "4"]
    secret: bytes | None = None
    if signed:
        secret = SECRET
        (tmp_path / "secret").write_bytes(SECRET + b"\n")
        args += ["--secret-file", str(tmp_path / "secret")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        port, head = await _listening(proc)
        async with BootstrapClient(f"http://127.0.0.1:{port}", secret=secret) as client:
            await client.register(info(0, tp_size=1))
            assert await client.ranks(ENGINE) == [info(0, tp_size=1)]
            assert (await client.health()).ready
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = (head + err).decode()
    assert proc.returncode == 0, log
    assert f"listening on http://127.0.0.1:{port}" in log
    assert "at most 64 connections, idle timeout 3 s, request timeout 4 s" in log
    assert f"registered: engine {ENGINE} rank 0" in log
    assert ("signed writes" if signed else "unsigned writes") in log
    assert "Traceback" not in log


@pytest.mark.asyncio
async def test_cli_reports_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"short\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            (["--expected-ranks", "0"], 2, "expected_ranks"),
            (
                ["--expected-ranks", "1", "--secret-file", str(tmp_path / "secret")],
                2,
                "at least 16",
            ),
            (["--expected-ranks", "1", "--secret-file", str(tmp_path / "none")], 2, "No such file"),
            (["--expected-ranks", "1", "--port", str(busy.getsockname()[1])], 1, "cannot serve"),
            (["--expected-ranks", "1", "--max-connections", "0"], 2, "max_connections"),
            (["--expected-ranks", "1", "--idle-timeout", "0"], 2, "idle_timeout_s"),
        ]
        for extra, rc, words in cases:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvfsm.registry._cli",
                "--port",
                "0",
                *extra,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
            assert proc.returncode == rc, err
            assert words in err.decode()
