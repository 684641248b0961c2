"""Real SGLang 0.5.23 servers for the e2e suite. The servers themselves (``Server``,
``sglang_server``, ``pd_router`` and the flags every rig shares) are
:mod:`kvfsm.chaos._servers`'s, which ``kvfsm chaos servers`` starts too; this module adds what
only the tests use: pytest's log keeping, the shared prefill, and the readers of a server's log.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfsm.chaos._servers import (
    COMMON_FLAGS,
    DECODE_FLAGS,
    HEARTBEAT_S,
    KVFSM_ENV,
    LIVENESS_FACTOR,
    LIVENESS_S,
    MODEL_CONFIG,
    SHIM,
    START_TIMEOUT_S,
    Server,
    ServerStartError,
    body,
    free_port,
    get_json,
    get_text,
    healthy,
    kvfsm_stats,
    pd_router,
    post_json,
    prefill_flags,
    router_serves,
    router_workers,
    sglang_server,
    stop_all,
    write_model,
)

__all__ = [
    "ARM_ENV",
    "COMMON_FLAGS",
    "DECODE_FLAGS",
    "FAILED",
    "HEARTBEAT_S",
    "KVFSM_ENV",
    "LIVENESS_FACTOR",
    "LIVENESS_S",
    "MODEL_CONFIG",
    "SHIM",
    "START_TIMEOUT_S",
    "Server",
    "ServerStartError",
    "SharedPrefill",
    "assert_raised_in_sglang",
    "body",
    "free_port",
    "get_json",
    "get_text",
    "healthy",
    "keep_logs_if_failed",
    "kvfsm_stats",
    "metric_sum",
    "package_dir",
    "pd_router",
    "post_json",
    "prefill_flags",
    "router",
    "router_serves",
    "router_workers",
    "sglang_server",
    "stop_all",
    "tracebacks",
    "write_model",
]

#: Set on a module's node when one of its tests failed: its servers' logs are then kept.
FAILED = pytest.StashKey[bool]()


def router(log_dir: Path, prefill: Server, bootstrap_port: int, decode: Server) -> Server:
    # The suite aborts and kills requests on purpose: a router that retried them would send
    # new rooms behind the test's back, and one that opened its circuit to a worker after
    # those failures would refuse the checks that follow. Neither is kvfsm's.
    return pd_router(log_dir, [(prefill, bootstrap_port)], [decode], retries=False)


def metric_sum(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (all label sets) in a Prometheus exposition."""
    total = 0.0
    found = False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if match:
            found = True
            total += float(match.group(2))
    assert found, f"{name} is not on /metrics"
    return total


#: The variable that tells a prefill server where the negative control's arming file is (the
#: corrupting proxy's ``ARM_ENV``, ``shim/kvfsm_e2e_corrupt.py``).
ARM_ENV = "KVFSM_E2E_CORRUPT_ARM"


@dataclass
class SharedPrefill:
    """The servers the e2e modules share (``conftest.py``'s ``llama``):
    the test model, a non-disaggregated reference server and a kvfsm prefill server with
    metrics on, whose next transfer is corrupted while ``corrupt_next`` exists. Each module
    brings its own decode server and router (they differ: radix cache, kills), launches its
    decode server, then calls :meth:`ready`."""

    log_dir: Path
    model: Path
    reference: Server
    prefill: Server
    bootstrap_port: int
    corrupt_next: Path
    _ready: bool = False

    def ready(self) -> None:
        """Wait until both answer (launched by the fixture, which does not wait, so that the
        first module's own servers start at the same time); at once after the first call."""
        if not self._ready:
            for server in (self.reference, self.prefill):
                server.wait_ready()
            self._ready = True


def keep_logs_if_failed(request: pytest.FixtureRequest, log_dir: Path, failed: bool) -> None:
    """A fixture's teardown: keep ``log_dir`` (and say where) when one of its tests failed,
    else remove it."""
    if failed:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"sglang e2e logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in ')
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")


def tracebacks(log: str) -> list[tuple[list[Path], str]]:
    """Each Python traceback in a server's log, as (its frames' files, outermost first; the
    exception line that ends it)."""
    found: list[tuple[list[Path], str]] = []
    frames: list[Path] | None = None
    for line in log.splitlines():
        if "Traceback (most recent call last):" in line:
            frames = []
            continue
        if frames is None:
            continue
        match = _FRAME.match(line)
        if match:
            frames.append(Path(match.group(1)).resolve())
        elif _RAISED.match(line):
            found.append((frames, line.strip()))
            frames = None
    return found


def package_dir(name: str) -> Path:
    """Where an installed package's files are, found without importing it (SGLang's import
    takes seconds)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None, name
    assert spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def assert_raised_in_sglang(log: str, error: str, origin: str) -> None:
    """``log`` has a traceback ending with ``error`` (its exception line starts so), and in
    each such traceback the deepest frame inside the ``sglang`` package is SGLang's file
    ``origin`` (relative to the package), every frame below it is torch's (SGLang calls torch,
    which may raise for it), and no frame at all is kvfsm's."""
    sglang, torch, kvfsm = (package_dir(name) for name in ("sglang", "torch", "kvfsm"))
    tail = "\n".join(log.splitlines()[-30:])
    failing = [frames for frames, raised in tracebacks(log) if raised.startswith(error)]
    assert failing, f"no traceback ends with {error!r}; the log ends:\n{tail}"
    for frames in failing:
        shown = [str(p) for p in frames]
        assert not [p for p in frames if p.is_relative_to(kvfsm)], ("a kvfsm frame", shown)
        inside = [i for i, p in enumerate(frames) if p.is_relative_to(sglang)]
        assert inside, ("no SGLang frame", shown)
        assert frames[inside[-1]] == sglang / origin, ("raised elsewhere", shown)
        below = frames[inside[-1] + 1 :]
        assert all(p.is_relative_to(torch) for p in below), ("a frame below SGLang's", shown)
