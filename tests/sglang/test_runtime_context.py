"""The adapter reads SGLang's configuration where SGLang's own backends read it: the runtime
context (``get_disagg()``, ``get_parallel()``, ``get_serving()``, ``get_device()``), not only the
``server_args`` object it is handed. Under SGLang's own test fixture ``override_server_args``
(a published configuration the ``server_args`` argument knows nothing of), the adapter used to
connect to the default bootstrap port (8998) instead of the configured one; and on SGLang's CPU
device it registered the pool as VRAM, as SGLang labels it, which NIXL refuses on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer
from kvfsm.sglang._args import ServerConfig
from kvfsm.transport import MemKind

if os.environ.get("KVFSM_NO_SGLANG") == "1":
    pytest.skip("KVFSM_NO_SGLANG=1", allow_module_level=True)


def _child(*argv: str) -> dict[str, Any]:
    """Run ``runtime_context_child.py`` (see there why in a child) and read its report."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.sglang.runtime_context_child", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_under_override_server_args_the_manager_uses_the_published_configuration(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    got = _child("manager", str(bootstrap.port))
    assert got["port"] == bootstrap.port
    assert got["device"] == "cpu"
    assert got["url"] == f"http://127.0.0.1:{bootstrap.port}"
    assert got["kind"] == MemKind.DRAM.value
    # It registered (NIXL took the pool as DRAM) in the configured bootstrap server.
    assert got["registered_port"] > 0


def test_without_a_published_configuration_server_args_attributes_are_read() -> None:
    seen = ServerConfig.read(
        SimpleNamespace(host="10.0.0.9", disaggregation_bootstrap_port=9100, tp_size=4)
    )
    assert (seen.host, seen.disaggregation_bootstrap_port, seen.tp_size) == ("10.0.0.9", 9100, 4)
    assert ServerConfig.read(SimpleNamespace()) == ServerConfig()


def test_the_published_configuration_wins_over_server_args_attributes() -> None:
    seen = _child("published")
    assert seen["port"] == 4567
    assert seen["device"] == "cpu"
    assert seen["host"] == "127.0.0.1"  # SGLang's resolved default, not the stale attribute
