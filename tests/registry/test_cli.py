"""``kvfsm bootstrap`` (``kvfsm/registry/_cli.py``) in a subprocess: it serves, signed or
not, until SIGINT, and reports bad arguments."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from kvfsm.registry import BootstrapClient, UnreachableError
from tests.helpers.rank_info import ENGINE, SECRET, info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _wait_healthy(client: BootstrapClient, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        try:
            await client.health()
            return
        except UnreachableError:
            if proc.returncode is not None or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.parametrize("signed", [False, True], ids=["open", "secret-file"])
async def test_cli_serves_until_sigint(tmp_path: Path, signed: bool) -> None:
    port = _free_port()
    args = ["-m", "kvfsm.registry._cli", "--port", str(port), "--expected-ranks", "1"]
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
        async with BootstrapClient(f"http://127.0.0.1:{port}", secret=secret) as client:
            await _wait_healthy(client, proc)
            await client.register(info(0, tp_size=1))
            assert await client.ranks(ENGINE) == [info(0, tp_size=1)]
            assert (await client.health()).ready
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = err.decode()
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
