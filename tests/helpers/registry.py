"""A real bootstrap registry in its own process, for tests that need ranks to find each other."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

from tests.helpers.waiting import wait_until_sync


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def running_registry(ttl_s: float, expected_ranks: int = 1) -> Iterator[str]:
    """``kvfsm bootstrap`` on a free loopback port; yields its URL; SIGINT on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "kvfsm.registry._cli", "--port", str(port)]
    command += ["--expected-ranks", str(expected_ranks), "--ttl", str(ttl_s)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_sync(lambda: _listening(port), timeout=20)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
