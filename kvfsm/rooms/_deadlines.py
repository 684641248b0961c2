"""``DeadlineQueue``: every room's deadline timer of one engine, behind one loop timer.

Rooms live for milliseconds while their deadlines are seconds to minutes away, so nearly every
deadline is cancelled unfired. A loop timer per room costs a ``call_at`` and a ``cancel`` (two
of each per room once its settle timeout is counted): about 2 us a pair of calls on uvloop,
over 10 us per sender+receiver pair. Here an armed deadline is a list ``[when, seq, callback]``
on a heap, and cancelling it clears its callback:

* ``arm`` pushes the entry (a C ``heappush``) and moves the one loop timer only when the new
  entry falls due before everything armed so far.
* ``cancel`` is lazy: the entry stays on the heap with no callback, and is dropped when it
  reaches the top. So that cancelled entries cannot pile up (a room cancels its deadline
  minutes before it would fall due), the heap is rebuilt from the live entries once cancelled
  ones outnumber them, and emptied, with its loop timer cancelled, when none is live: an idle
  engine has no timer at all.
* The loop timer fires the entries due by then (plus a millisecond, as loops may fire a little
  early; a room's own ``_on_timer`` re-arms for any remainder), in the order they were due
  (ties in the order they were armed), then moves to the next one.

A callback that raises is logged and does not stop the others. Loop thread only; the loop's
clock is the only clock (``loop.time()``), so virtual-time tests drive it like any timer.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any, Final, TypeAlias

__all__ = ["FIRE_SLACK_S", "DeadlineQueue", "Entry"]

_log = logging.getLogger("kvfsm.rooms")

#: ``[when, seq, callback]``; the callback is None once cancelled or fired. A list: heapq
#: compares lists in C (a class with ``__lt__`` would be a Python call per comparison), and
#: cancelling mutates it in place.
Entry: TypeAlias = list[Any]
#: Loops may fire a timer a little before its time: entries due within this are fired too.
FIRE_SLACK_S: Final = 0.001
#: Cancelled entries tolerated before a rebuild is considered (small heaps never rebuild).
_REBUILD_MIN: Final = 1024


class DeadlineQueue:
    """Deadlines of many rooms behind one ``loop.call_at``."""

    __slots__ = ("_cancelled", "_handle", "_head", "_heap", "_loop", "_seq", "fired", "rebuilds")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[Entry] = []
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        #: When the loop timer is armed for (inf: not armed).
        self._head = math.inf
        self._cancelled = 0
        #: Callbacks run so far, and heap rebuilds (operators and tests).
        self.fired = 0
        self.rebuilds = 0

    @property
    def live(self) -> int:
        """Armed entries that have not fired or been cancelled."""
        return len(self._heap) - self._cancelled

    def arm(self, when: float, callback: Callable[[], None]) -> Entry:
        """Call ``callback()`` on the loop at ``when`` (loop time), unless cancelled first."""
        entry: Entry = [when, next(self._seq), callback]
        heapq.heappush(self._heap, entry)
        if when < self._head:
            self._move_timer(when)
        return entry

    def cancel(self, entry: Entry) -> None:
        """Make sure ``entry`` never fires. Idempotent; a no-op once it fired."""
        if entry[2] is None:
            return
        entry[2] = None
        self._cancelled += 1
        heap = self._heap
        if self._cancelled == len(heap):  # nothing live: no heap, no timer
            heap.clear()
            self._cancelled = 0
            self._stop_timer()
        elif self._cancelled > _REBUILD_MIN and 2 * self._cancelled > len(heap):
            live = [e for e in heap if e[2] is not None]
            heapq.heapify(live)
            self._heap = live
            self._cancelled = 0
            self.rebuilds += 1

    def close(self) -> None:
        """Cancel everything (engine shutdown)."""
        for entry in self._heap:
            entry[2] = None
        self._heap.clear()
        self._cancelled = 0
        self._stop_timer()

    def _move_timer(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._head = when
        self._handle = self._loop.call_at(when, self._fire)

    def _stop_timer(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._head = math.inf

    def _fire(self) -> None:
        self._handle = None
        self._head = math.inf
        limit = self._loop.time() + FIRE_SLACK_S
        # ``self._heap`` is read afresh each time: a callback's cancel may rebuild it.
        while self._heap and self._heap[0][0] <= limit:
            entry = heapq.heappop(self._heap)
            callback = entry[2]
            if callback is None:
                self._cancelled -= 1
                continue
            entry[2] = None
            self.fired += 1
            try:
                callback()
            except Exception:
                _log.exception("deadline callback %r failed", callback)
        heap = self._heap
        while heap and heap[0][2] is None:  # do not wake up for a cancelled one
            heapq.heappop(heap)
            self._cancelled -= 1
        if heap and heap[0][0] < self._head:
            self._move_timer(heap[0][0])
