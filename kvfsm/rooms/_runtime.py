"""The engine's event loop, running in a background thread.

Callers' threads (SGLang's scheduler) never run coroutines and never wait on the loop in the hot
path. They post with ``call_soon_threadsafe`` (fire and forget, ~0.3 us on uvloop) and read
published values. Blocking round trips (:meth:`LoopThread.call`) are for setup, teardown and tests,
and always carry a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # pragma: no cover - a dependency on Linux; optional for embedders
    uvloop = None  # type: ignore[assignment]

__all__ = ["LoopThread", "new_event_loop"]

_log = logging.getLogger("kvfsm.runtime")
T = TypeVar("T")


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when asked for and installed, else asyncio's."""
    if use_uvloop and uvloop is not None:
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """Owns an event loop that runs ``main`` in a daemon thread until :meth:`stop`.

    ``main(stop)`` is an async function given an ``asyncio.Event``; it sets up whatever lives
    on the loop, waits for ``stop``, and tears down. ``start`` returns once ``main`` has
    signalled readiness through :meth:`ready` (or raises what ``main`` raised).
    """

    def __init__(
        self,
        main: Callable[[asyncio.Event], Awaitable[None]],
        *,
        use_uvloop: bool = True,
        name: str = "kvfsm-loop",
    ) -> None:
        self._main = main
        self._use_uvloop = use_uvloop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("loop thread is not running")
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self._loop is not None and not self._loop.is_closed()

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"event loop thread did not start within {timeout}s")
        if self._error is not None:
            raise RuntimeError("event loop thread failed to start") from self._error

    def ready(self) -> None:
        """Called by ``main`` (on the loop) once it is ready to take posts."""
        self._ready.set()

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop soon. Never blocks. Raises ``RuntimeError`` after stop."""
        self.loop.call_soon_threadsafe(fn, *args)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result. Not for the hot path."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.call from the loop thread would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask ``main`` to finish, and join the thread. Idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"event loop thread did not stop within {timeout}s")

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=lambda: new_event_loop(self._use_uvloop)) as runner:
                runner.run(self._amain())
        except BaseException as exc:  # surfaced by start() or logged
            self._error = exc
            if self._ready.is_set():
                _log.exception("event loop thread crashed")
        finally:
            self._ready.set()

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self._main(self._stop)
