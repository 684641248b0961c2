"""The engine's event loop, running in a background thread.

Callers' threads (SGLang's scheduler) never run coroutines and never wait on the loop in the hot
path. They post work and read published values. Blocking round trips (:meth:`LoopThread.call`)
are for setup, teardown and tests, and always carry a timeout.

Posts are coalesced. Each ``call_soon_threadsafe`` wakes a sleeping loop through its self-pipe:
a system call on both threads and, on a VM, a cross-CPU wake-up that costs tens of microseconds
of CPU. A scheduler iteration posts many events (``init``, ``send``, ``abort`` for many rooms), so
posts go into a deque (``append`` is atomic under the GIL) and only the first post after the loop
last drained it schedules a wake-up. FIFO order is kept across all posts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # pragma: no cover - a dependency on Linux; optional for embedders
    uvloop = None  # type: ignore[assignment]

__all__ = ["LoopThread", "name_this_thread", "new_event_loop", "thread_table"]

_log = logging.getLogger("kvfsm.runtime")
#: Posted callbacks run per loop callback before yielding to other ready work.
_DRAIN_BATCH = 4096
T = TypeVar("T")


_PR_SET_NAME = 15
_NATIVE_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last one NUL
_libc: ctypes.CDLL | None = None


def _prctl() -> ctypes.CDLL | None:
    global _libc  # noqa: PLW0603 - loaded once, on first use
    if _libc is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (``top -H``, ``py-spy``, ``/proc``), not
    only in ``threading``: Python 3.11 leaves every thread named after the process. The kernel
    keeps 15 bytes; longer names are cut. Best effort: a platform without ``prctl`` keeps its
    name."""
    libc = _prctl()
    if libc is None:
        return
    with contextlib.suppress(Exception):
        libc.prctl(_PR_SET_NAME, name.encode()[:_NATIVE_NAME_BYTES], 0, 0, 0)


def thread_table() -> list[dict[str, object]]:
    """kvfsm's threads in this process (name, OS thread id, CPU seconds so far): what an
    operator matches against ``top -H`` (``/stats`` serves it). Linux reads ``/proc``; CPU is
    None elsewhere."""
    rows: list[dict[str, object]] = []
    tick = 100.0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        tick = float(os.sysconf("SC_CLK_TCK"))
    for thread in threading.enumerate():
        if not thread.name.startswith("kvfsm"):
            continue
        cpu: float | None = None
        tid = thread.native_id
        with contextlib.suppress(OSError, ValueError, IndexError, TypeError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = round((int(fields[11]) + int(fields[12])) / tick, 3)
        rows.append({"name": thread.name, "native_id": tid, "cpu_s": cpu})
    return rows


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
        self._posted: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self._wake_pending = False
        #: Called (on the loop) after each drain of posted callbacks: the engine runs the rooms
        #: those posts woke, in the same loop iteration (``RoomScheduler.run_woken``).
        self.after_drain: Callable[[], None] | None = None

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
        """Run ``fn(*args)`` on the loop soon, after everything posted before. Never blocks.
        Raises ``RuntimeError`` once the loop is closed."""
        loop = self._loop  # not the property: this is every caller's hot path
        if loop is None:
            raise RuntimeError("loop thread is not running")
        if loop.is_closed():
            raise RuntimeError("event loop is closed")
        self._posted.append((fn, args))
        if not self._wake_pending:
            self._wake_pending = True
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # Clear the flag *before* draining: a post that still sees it set is appended before
        # this drain reads the deque, and a post that sees it clear schedules another drain.
        self._wake_pending = False
        posted = self._posted
        for _ in range(min(len(posted), _DRAIN_BATCH)):
            fn, args = posted.popleft()
            try:
                fn(*args)
            except Exception:
                _log.exception("posted callback %r failed", fn)
        if posted and not self._wake_pending:
            # A flood: yield to the loop's other work, then go on.
            self._wake_pending = True
            self.loop.call_soon(self._drain)
        after = self.after_drain
        if after is not None:
            try:
                after()
            except Exception:
                _log.exception("after-drain hook %r failed", after)

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
        name_this_thread(self._thread.name)
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
