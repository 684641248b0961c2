"""``ChildProcess``: a helper process started with ``spawn`` and driven over a pipe.

The decode peer of the data-path tests and of ``kvfsm run``, and the prefill rank of the
control-plane tests, are such processes: the child sends one greeting when it is ready, then
answers ``(op, *args)`` requests until ``("quit",)``. Killing it (SIGKILL) is part of the tests.

A child can be started under a command prefix (``prefix=["ip", "netns", "exec", NAME]``): it then
runs in another network namespace (kvfsm.chaos's two-host tests), still driven over the same pipe.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker, spawn
from multiprocessing.connection import Connection
from typing import Any, Final, TypeVar

__all__ = ["NIXL_LEVELS", "ChildProcess", "dump_stacks_on_sigusr1", "environ", "spawn_quietly"]

#: ``NIXL_LOG_LEVEL`` for a child, by the level name of our ``nixl`` logger.
NIXL_LEVELS: Final = {"DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARN", "ERROR": "ERROR"}

# ``spawn`` starts every child with one process-wide executable; a prefixed child swaps it for
# the duration of its start, so every start takes this lock (spawn_quietly starts in threads).
_START_LOCK = threading.Lock()


def _launcher(prefix: Sequence[str], directory: str) -> str:
    """A script that execs ``prefix`` + this Python with its arguments, as ``spawn``'s
    executable: ``multiprocessing`` runs one path, not a command line. Every step execs in place,
    so the child keeps its pid, its parent and the pipe's file descriptors."""
    path = os.path.join(directory, "python")
    command = shlex.join([*prefix, os.fsdecode(spawn.get_executable())])
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'#!/bin/sh\nexec {command} "$@"\n')
    os.chmod(path, 0o700)
    return path


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's Python stack to stderr and the process goes
    on: how an operator (or a test that gave up waiting) sees where a wedged ``kvfsm`` command
    or one of its children is stuck, without a debugger. After the stacks come the live rooms
    of each room engine in the process, one JSON line per engine (``kvfsm explain`` reads both).

    The stacks are written by faulthandler from the C signal handler, at once, whatever the
    threads are doing. The rooms need Python, so they come from a Python handler that
    faulthandler chains to: it runs on the main thread as soon as that thread next runs Python
    (a blocked ``recv`` or ``sleep`` is woken for it), which may be never if the main thread is
    stuck inside C; the stacks say so then. Only the main thread may install it; elsewhere the
    stacks alone are registered."""
    # Unregistered first: faulthandler keeps the handler it found at its first registration,
    # so installing ours over it would silently unhook faulthandler on a second call. Chained,
    # faulthandler's handler no longer restarts an interrupted system call: like SIGINT's, the
    # signal interrupts one, which Python retries (PEP 475); Linux gives a signal sent to the
    # process to its main thread unless that thread blocks it.
    faulthandler.unregister(signal.SIGUSR1)
    chain = threading.current_thread() is threading.main_thread()
    if chain:
        signal.signal(signal.SIGUSR1, _dump_rooms)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=chain)


def _dump_rooms(signum: int, frame: object) -> None:
    """The live rooms after faulthandler's stacks (see :func:`dump_stacks_on_sigusr1`). Never
    raises: it runs between two bytecodes of whatever the main thread was doing."""
    try:
        engine = sys.modules.get("kvfsm.rooms._engine")  # no engine was ever made otherwise
        if engine is None:
            lines = [json.dumps({"event": "live_rooms", "pid": os.getpid(), "engine": None})]
        else:
            lines = engine.live_rooms_lines()
        text = "".join(f"kvfsm live rooms: {line}\n" for line in lines)
        # os.write, not print: the main thread may be inside a write to sys.stderr itself.
        os.write(2, text.encode())
    except Exception as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"kvfsm live rooms: not dumped: {exc!r}\n".encode())


def _entry(target: Callable[..., None], conn: Connection, *args: object) -> None:
    """Every child's first frame: stacks on SIGUSR1 like its parent's, then ``target``."""
    dump_stacks_on_sigusr1()
    target(conn, *args)


class ChildProcess:
    """Start ``target(conn, *args)`` in a new process and wait for its greeting. With
    ``prefix``, the process is started as ``prefix + [python, ...]`` (see the module doc)."""

    def __init__(
        self,
        target: Callable[..., None],
        *args: object,
        what: str,
        start_timeout_s: float = 60,
        prefix: Sequence[str] = (),
    ) -> None:
        ctx = mp.get_context("spawn")
        self.what = what
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_entry, args=(target, child, *args), daemon=True)
        scratch = tempfile.mkdtemp(prefix="kvfsm-child-") if prefix else None
        try:
            with _START_LOCK:
                if scratch is None:
                    self.process.start()
                else:
                    # The tracker is started with the executable too: start it with ours first.
                    resource_tracker.ensure_running()
                    python = os.fsdecode(spawn.get_executable())
                    ctx.set_executable(_launcher(prefix, scratch))
                    try:
                        self.process.start()
                    finally:
                        ctx.set_executable(python)
            child.close()
            if not self._conn.poll(start_timeout_s):
                self.kill()
                raise TimeoutError(f"{what} process did not start")
            self.greeting: Any = self._conn.recv()
        finally:
            if scratch is not None:  # the script has been exec'd (or never will be)
                shutil.rmtree(scratch, ignore_errors=True)

    def ask(self, *request: object, timeout: float = 30.0) -> Any:
        self._conn.send(request)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.what} process did not answer {request[0]!r}")
        return self._conn.recv()

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self, timeout: float = 15.0) -> None:
        """Ask it to quit, then kill it if it does not. Idempotent."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("quit",))
                self.process.join(timeout)
        self.kill()
        self._conn.close()


C = TypeVar("C", bound=ChildProcess)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (children forked meanwhile inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn_quietly(factories: Sequence[Callable[[], C]]) -> list[C]:
    """Start child processes so that they neither hear the terminal's Ctrl-C (this process
    stops them, in order) nor write to our stdout (kept for the summary): each is forked, on a
    helper thread, while SIGINT is ignored here and fd 1 points at stderr (both survive exec),
    with NIXL logging at our ``nixl`` logger's level. As soon as the processes exist, SIGINT
    and stdout are restored and this thread waits for their greetings interruptibly (the same
    recipe for ``kvfsm run``'s decode process and ``kvfsm demo``'s ranks). The children come back
    in the order of ``factories``; if one fails to start, the others are closed."""
    level = logging.getLevelName(logging.getLogger("nixl").getEffectiveLevel())
    env = (
        {} if "NIXL_LOG_LEVEL" in os.environ else {"NIXL_LOG_LEVEL": NIXL_LEVELS.get(level, "WARN")}
    )
    in_main = threading.current_thread() is threading.main_thread()
    lock = threading.Lock()
    ready: dict[int, C | BaseException] = {}
    abandoned = False

    def build(index: int, factory: Callable[[], C]) -> None:
        try:
            child: C | BaseException = factory()
        except BaseException as exc:
            child = exc
        with lock:
            if not abandoned:
                ready[index] = child
                return
        if isinstance(child, ChildProcess):
            child.close()  # the caller gave up meanwhile

    before = {child.pid for child in mp.active_children()}
    helpers = [
        threading.Thread(target=build, args=(i, f), name="kvfsm-child-start", daemon=True)
        for i, f in enumerate(factories)
    ]
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        os.dup2(2, 1)
        with environ(env):
            for helper in helpers:
                helper.start()
            while any(h.is_alive() for h in helpers) and (
                sum(c.pid not in before for c in mp.active_children()) < len(helpers)
            ):
                time.sleep(0.001)
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        if in_main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    try:
        for helper in helpers:
            helper.join()
    except BaseException:
        with lock:
            abandoned = True
            started = list(ready.values())
        for child in started:
            if isinstance(child, ChildProcess):
                child.close()
        raise
    results = [ready[i] for i in range(len(factories))]
    children = [c for c in results if not isinstance(c, BaseException)]
    errors = [c for c in results if isinstance(c, BaseException)]
    if errors:
        for child in children:
            child.close()
        raise errors[0]
    return children
