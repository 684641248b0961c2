"""Driving ``kvfsm`` commands as a terminal does: a command in its own process group, Ctrl-C
to the whole group, and what must be true afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.waiting import wait_until_sync

__all__ = ["REPO", "group_members", "interrupt_and_check"]

REPO = Path(__file__).resolve().parent.parent.parent


def group_members(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes of a process group, from /proc: pid -> command line."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members[int(entry.name)] = cmdline
    return members


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Children started in the block get SIGINT's default action, as a terminal's foreground
    job does. An ignored signal stays ignored across ``exec`` (a handler does not), and a test
    run started in the background of a non-interactive shell (``.ci/run &``) has SIGINT and
    SIGQUIT ignored from the start: the command under test then never heard the Ctrl-C (two
    clean-clone runs here timed out on it, with ``SigIgn`` in /proc showing SIGINT ignored in
    pytest itself). So while the child is started, a handler stands in for the ignore."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupt_and_check(
    command: list[str], name: str, *, children: int, moving_s: float, timeout: float
) -> None:
    """Start ``command`` in its own process group, wait for its ``children`` spawned processes
    and ``moving_s`` more, send SIGINT to the whole group (what a terminal's Ctrl-C does), and
    check: exit 130, "kvfsm <name>: interrupted", no traceback, nothing on stdout, no process
    of the group left behind."""
    with _sigint_not_ignored():
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    try:

        def started() -> bool:
            assert proc.poll() is None, proc.communicate()
            return sum("spawn_main" in cmd for cmd in group_members(proc.pid).values()) >= children

        wait_until_sync(
            started, timeout=timeout, interval=0.05, message=f"{children} child processes"
        )
        # Real time on purpose: the command prints nothing while it runs, so nothing marks the
        # moment its rooms move; the Ctrl-C must come after that.
        time.sleep(moving_s)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Still running: every process of the group prints its threads' stacks (kvfsm's
            # commands and children dump them on SIGUSR1), one process at a time so that they
            # do not interleave, and the failure says where it hangs.
            members = sorted(group_members(proc.pid).items())
            for pid, _ in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                # Real time on purpose (a failure's diagnosis only): one dump at a time.
                time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            raise AssertionError(
                f"kvfsm {name} still running {timeout:.0f} s after Ctrl-C; its group "
                f"{[f'{pid}: {cmd[:100]}' for pid, cmd in members]}; its stderr, with the "
                f"stacks of every process of the group, in that order:\n{stderr[-20000:]}"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert f"kvfsm {name}: interrupted" in stderr
    assert "Traceback" not in stderr, stderr
    assert stdout == ""
    wait_until_sync(
        lambda: not group_members(proc.pid),
        timeout=timeout / 3,
        interval=0.05,
        message="every process of the group to exit",
    )
