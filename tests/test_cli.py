"""The ``kvfsm`` command line as a user runs it, in a subprocess: ``kvfsm run`` (the data path
alone) moving real KV over NIXL (UCX, DRAM) from this machine's prefill process into a passive
decode process, every byte checked; and the command line itself: every subcommand listed by
``kvfsm --help`` without loading any of them, each one's own ``--help``, ``python -m kvfsm``.
The main job, ``kvfsm demo``, has its own tests (tests/test_demo.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvfsm.cli import SUBCOMMANDS
from tests.helpers.cli import REPO, interrupt_and_check

CLI = [sys.executable, "-m", "kvfsm.cli"]


def kvfsm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_json(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = kvfsm("run", "--json", *args)
    # stdout is the summary alone: NIXL's log lines (both processes) go to stderr.
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return proc.returncode, json.loads(lines[0]), proc.stderr


def test_every_room_lands_every_byte() -> None:
    status, s, stderr = run_json("--rooms", "40")
    assert status == 0, (s, stderr)
    assert s["rooms"] == s["succeeded"] == 40, s
    assert s["failed"] == s["mismatched"] == s["wedged"] == s["unsettled"] == 0, s
    assert s["failed_by_reason"] == {}
    assert s["handles_created"] == s["handles_released"] > 0
    assert s["in_flight"] == 0
    assert s["bytes"] > 0
    assert s["gbps"] > 0
    assert 0 < s["p50_ms"] <= s["p99_ms"]
    assert s["engine"]["spawned"] == s["engine"]["reaped"] == 40
    assert s["engine"]["live"] == 0
    assert s["peer_pid"] != os.getpid()


def test_aborted_rooms_fail_with_the_abort_or_succeed_and_never_wedge() -> None:
    status, s, stderr = run_json("--rooms", "60", "--abort-rate", "0.3", "--seed", "7")
    assert s["wedged"] == s["mismatched"] == s["unsettled"] == 0, s
    assert s["succeeded"] + s["failed"] == 60, s
    assert s["failed"] > 0, s  # seed 7 aborts some rooms before their last chunk
    assert sum(s["failed_by_reason"].values()) == s["failed"]
    for reason in s["failed_by_reason"]:
        assert reason.startswith("aborted (local)"), s["failed_by_reason"]
    assert s["failed_unexpectedly"] == 0
    assert s["failed"] + s["aborts_too_late"] == s["aborts_requested"], s
    assert s["handles_created"] == s["handles_released"]
    assert s["in_flight"] == 0
    # The run's own aborts are not errors.
    assert status == 0, (s, stderr)


def test_bad_flags_exit_non_zero_with_a_message() -> None:
    proc = kvfsm("run", "--rooms", "many")
    assert proc.returncode == 2
    assert "--rooms: invalid int value: 'many'" in proc.stderr
    proc = kvfsm("run", "--abort-rate", "1.5")
    assert proc.returncode == 2
    assert "--abort-rate must be in [0, 1]" in proc.stderr
    proc = kvfsm("run", "--no-such-flag")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in proc.stderr
    assert proc.stdout == ""


def test_ctrl_c_stops_the_run_cleanly_with_130() -> None:
    # A terminal's Ctrl-C goes to the whole foreground process group, decode process included.
    interrupt_and_check(
        [*CLI, "run", "--rooms", "1000000"], "run", children=1, moving_s=1.0, timeout=30
    )


NAMES = [command.name for command in SUBCOMMANDS]


def loaded_by(*args: str) -> tuple[int, dict[str, Any]]:
    """Run ``kvfsm.cli.main(args)`` in a new interpreter: its exit status, and which of kvfsm's
    modules (and of the heavy libraries) it had loaded by then."""
    code = (
        "import json, sys\n"
        "from kvfsm.cli import main\n"
        "try:\n"
        f"    status = main({list(args)!r})\n"
        "except SystemExit as exc:\n"
        "    status = exc.code\n"
        "heavy = ('nixl', 'aiohttp', 'numpy', 'torch')\n"
        "print(json.dumps({'status': status,"
        " 'kvfsm': sorted(m for m in sys.modules if m.startswith('kvfsm')),"
        " 'heavy': sorted(m for m in heavy if m in sys.modules)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result.pop("status"), result


def test_help_lists_every_subcommand_and_loads_none_of_them() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfsm", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "{" + ",".join(NAMES) + "}" in proc.stdout
    for name in NAMES:
        assert f"\n    {name} " in proc.stdout, proc.stdout
    assert "the main job: a prefill process and a decode process" in proc.stdout
    status, loaded = loaded_by("--help")
    assert status == 0
    assert loaded == {"kvfsm": ["kvfsm", "kvfsm.cli"], "heavy": []}


@pytest.mark.parametrize("name", NAMES)
def test_each_subcommand_has_its_own_help_and_loads_only_itself(name: str) -> None:
    proc = kvfsm(name, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: kvfsm {name} [-h]"), proc.stdout
    status, loaded = loaded_by(name, "--help")
    assert status == 0
    # Only the campaign loads chaos (demo loads it for --two-hosts only, when it runs).
    assert ("kvfsm.chaos" in loaded["kvfsm"]) is (name == "chaos"), loaded
    if name == "rooms":
        assert loaded == {"kvfsm": ["kvfsm", "kvfsm.cli"], "heavy": []}
    if name == "diagram":
        assert loaded["heavy"] == [], loaded


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=NAMES)
def test_the_listed_help_is_the_subcommands_own(command: Any) -> None:
    """``kvfsm --help`` shows the table's line without loading the subcommand; the
    subcommand's own parser must say the same."""
    add, _ = command.load()
    sub = argparse.ArgumentParser(prog="kvfsm").add_subparsers()
    parser = add(sub)
    assert parser.prog == f"kvfsm {command.name}"
    [listed] = sub._choices_actions
    assert (listed.dest, listed.help) == (command.name, command.help)


def test_an_unknown_or_missing_subcommand_exits_2_with_the_choices() -> None:
    proc = kvfsm("nope")
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr
    assert all(f"'{name}'" in proc.stderr for name in NAMES)
    proc = kvfsm()
    assert proc.returncode == 2
    assert "the following arguments are required: command" in proc.stderr
    status, loaded = loaded_by("-v", "nope")
    assert status == 2
    assert loaded == {"kvfsm": ["kvfsm", "kvfsm.cli"], "heavy": []}


def test_global_flags_before_the_subcommand_still_choose_it() -> None:
    proc = kvfsm("-v", "-v", "diagram", "--role", "sender")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("stateDiagram-v2\n"), proc.stdout
