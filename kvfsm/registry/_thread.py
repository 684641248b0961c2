"""The bootstrap registry embedded in a process: a ``BootstrapServer`` on an event loop in a daemon
thread of its own, so that a synchronous caller (SGLang's main process, the demo, the chaos
campaign and its helper processes in a network namespace, ``kvfsm.testing``'s pair) can run one
without an event loop of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvfsm.registry._server import BootstrapServer

__all__ = ["RegistryThread"]

_T = TypeVar("_T")


class RegistryThread:
    """A registry serving on ``host`` and ``port`` (0: a free one) from construction until
    :meth:`close`; :meth:`restart` brings it back on the same port. A server that cannot start
    (the port is taken) raises from the constructor, and leaves no thread behind.
    ``expected_ranks``: what the registry's health counts as complete. ``quiet``: :meth:`close`
    does not raise when stopping the server fails (a teardown that must go on regardless)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        expected_ranks: int = 1,
        secret: bytes | None = None,
        ttl_s: float | None = None,
        quiet: bool = False,
    ) -> None:
        self.host, self.secret, self.ttl_s, self.quiet = host, secret, ttl_s, quiet
        self.expected_ranks = expected_ranks
        self.port, self._url = port, ""
        self.server: BootstrapServer | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kvfsm-registry", daemon=True
        )
        self.thread.start()
        try:
            self.start()
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        """The server's URL; the same after a restart (same host and port)."""
        return self._url

    def start(self) -> None:
        """Serve (again) on ``port`` (0 the first time: any free port)."""
        extra: dict[str, Any] = {} if self.ttl_s is None else {"ttl_s": self.ttl_s}
        server = BootstrapServer(
            self.host, self.port, expected_ranks=self.expected_ranks, secret=self.secret, **extra
        )
        self._call(server.start(), 30)
        self.server, self.port, self._url = server, server.port, server.url

    def stop(self) -> None:
        """Stop serving; the loop thread stays up for a :meth:`start`."""
        if self.server is not None:
            server, self.server = self.server, None
            self._call(server.stop(), 30)

    def restart(self, down_s: float) -> None:
        """Stop, stay down ``down_s`` seconds, serve again on the same port."""
        self.stop()
        time.sleep(down_s)
        for _ in range(50):  # the port may linger for a moment
            try:
                self.start()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the registry could not be restarted on its port")

    def close(self) -> None:
        """Stop the server, then the loop and its thread."""
        try:
            if self.quiet:
                with contextlib.suppress(Exception):
                    self.stop()
            else:
                self.stop()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()
