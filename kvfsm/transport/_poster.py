"""``Poster``: the thread that makes and posts NIXL transfers, in order, off the event loop.

``transfer()`` copies synchronously on shared-memory paths (bytes / ~8 GB/s inside the call), so
it must not run on the loop thread. A per-chunk ``run_in_executor`` would cost two futures and a
loop wake-up per chunk; instead chunks go into a queue and the thread posts them in order.

When results go back (``done`` on the loop, one ``call_soon_threadsafe`` each time). Each
hand-back is a loop wake-up, and the loop then holds the GIL the poster needs to make its next
request, so handing each result back as soon as it is posted would make every small request
pay a wake-up and a GIL round trip. Results are held while the requests after them are small,
and go back:

* before the poster starts an item that would take the ``weight`` posted since the first held
  result past ``hand_back_weight`` (the loop can end those rooms while a large request, maybe
  several milliseconds of copy, is copied);
* when the items taken from the queue are all posted.

``hand_back_weight = 0`` (or no ``weight``) hands every result back as soon as it is posted.
Results that pile up before the loop drains them share one wake-up all the same. With 32
decode peers, whose small rooms cannot share requests, this is 0.09 hand-backs a room instead
of 0.95, and a third less of the loop thread's CPU per room (``benchmarks/README.md``, the
peers curve).
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
    calls ``done(batch)`` on the loop with ``(item, exception or None)`` pairs (when: see the
    module docstring; ``weight(item)`` is what posting ``item`` costs, in the unit of
    ``hand_back_weight``)."""

    def __init__(
        self,
        post: Callable[[T], None],
        done: Callable[[list[tuple[T, BaseException | None]]], None],
        *,
        name: str = "kvfsm-poster",
        weight: Callable[[T], int] | None = None,
        hand_back_weight: int = 0,
    ) -> None:
        if hand_back_weight < 0:
            raise ValueError("hand_back_weight must be >= 0")
        self._post = post
        self._done = done
        self._weight = weight
        self._hand_back_weight = hand_back_weight if weight is not None else 0
        #: Hand-backs so far (each one loop wake-up at most). Poster thread only.
        self.hand_backs = 0
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
            weight, bound = self._weight, self._hand_back_weight
            held: list[tuple[T, BaseException | None]] = []
            since = 0  # the weight posted since the first held result, the next item's too
            for item in batch:
                if item is _STOP:
                    stop = True
                    continue
                if held:
                    try:
                        since += weight(item) if bound else 1  # type: ignore[arg-type,misc]
                    except Exception:  # a weight that raises must not stop the thread
                        _log.exception("poster: could not weigh an item; handing back first")
                        since = bound + 1
                    if since > bound:
                        self._hand_back(held)
                        held, since = [], 0
                try:
                    self._post(item)  # type: ignore[arg-type]
                except Exception as exc:
                    held.append((item, exc))  # type: ignore[arg-type]
                else:
                    held.append((item, None))  # type: ignore[arg-type]
            if held:
                self._hand_back(held)
            if stop:
                return

    def _hand_back(self, results: list[tuple[T, BaseException | None]]) -> None:
        # One wake-up per burst: the flag is cleared on the loop *before* it drains (see
        # kvfsm.rooms._runtime.LoopThread.post for the same pattern and why it cannot lose one).
        self.hand_backs += 1
        self._results.extend(results)
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
