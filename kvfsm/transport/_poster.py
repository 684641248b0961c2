"""``Poster``: the thread that makes and posts NIXL transfers, in order, off the event loop.

``transfer()`` copies synchronously on shared-memory paths (bytes / ~8 GB/s inside the call), so
it must not run on the loop thread. A per-chunk ``run_in_executor`` would cost two futures and a
loop wake-up per chunk; instead chunks go into a queue and the thread posts them in order,
handing each result back as soon as its chunk is posted (the loop can end its rooms while the
next, maybe a merged request of several milliseconds, is copied). Results that pile up before
the loop drains them share one ``call_soon_threadsafe``: under load, one loop wake-up serves
many chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from kvfsm.rooms import name_this_thread

__all__ = ["Poster"]

_log = logging.getLogger("kvfsm.transport")
T = TypeVar("T")
_STOP = object()


class Poster(Generic[T]):
    """Runs ``post(item)`` on its own thread for each submitted item, in submission order, and
    calls ``done(batch)`` on the loop with ``(item, exception or None)`` pairs."""

    def __init__(
        self,
        post: Callable[[T], None],
        done: Callable[[list[tuple[T, BaseException | None]]], None],
        *,
        name: str = "kvfsm-poster",
    ) -> None:
        self._post = post
        self._done = done
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._results: deque[tuple[T, BaseException | None]] = deque()
        self._flush_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def submit(self, item: T) -> None:
        """Queue ``item`` (any thread; never blocks)."""
        self._queue.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the items already queued. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        name_this_thread(self._thread.name)
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            stop = False
            for item in batch:
                if item is _STOP:
                    stop = True
                    continue
                try:
                    self._post(item)  # type: ignore[arg-type]
                except Exception as exc:
                    self._hand_back((item, exc))  # type: ignore[arg-type]
                else:
                    self._hand_back((item, None))  # type: ignore[arg-type]
            if stop:
                return

    def _hand_back(self, result: tuple[T, BaseException | None]) -> None:
        # Each item as soon as it is posted, so the loop can end its rooms while the next is
        # copied (a merged request is milliseconds of copy); one wake-up per burst all the
        # same: the flag is cleared on the loop *before* it drains (see
        # kvfsm.rooms._runtime.LoopThread.post for the same pattern and why it cannot lose one).
        self._results.append(result)
        if not self._flush_pending:
            self._flush_pending = True
            loop = self._loop
            assert loop is not None
            try:
                loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop closed under us: nobody is left to tell
                _log.warning("poster: loop closed with %d results undelivered", len(self._results))

    def _flush(self) -> None:
        self._flush_pending = False
        results = self._results
        batch = [results.popleft() for _ in range(len(results))]
        self._done(batch)
