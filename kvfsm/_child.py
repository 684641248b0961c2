"""``ChildProcess``: a helper process started with ``spawn`` and driven over a pipe.

The decode peer of the data-path tests and of ``kvfsm run``, and the prefill rank of the
control-plane tests, are such processes: the child sends one greeting when it is ready, then
answers ``(op, *args)`` requests until ``("quit",)``. Killing it (SIGKILL) is part of the tests.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

__all__ = ["ChildProcess"]


class ChildProcess:
    """Start ``target(conn, *args)`` in a new process and wait for its greeting."""

    def __init__(
        self, target: Callable[..., None], *args: object, what: str, start_timeout_s: float = 60
    ) -> None:
        ctx = mp.get_context("spawn")
        self.what = what
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"{what} process did not start")
        self.greeting: Any = self._conn.recv()

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
