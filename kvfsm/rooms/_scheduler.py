"""``RoomScheduler``: runs the rooms' tasks on the engine's loop from one run queue.

A room's task is a coroutine (``Room.run``) that owns the room's state machine and suspends
between events; it is the only writer of its room (law 2). This module is what resumes it.
It is not an ``asyncio.Task`` per room because rooms live for milliseconds and wake four or
five times each, and asyncio's per-task machinery is most of what a room costs: creating a
Task (and registering it in asyncio's set of all tasks, a ``WeakSet`` in Python) and, for
every wake-up, a Future to wait on, its ``set_result``, a ``call_soon`` of the task's wake-up
and the task's step around the coroutine's ``send``. Measured on uvloop: about 24 us per room
for a spawn and four wake-ups, against 3 us for the same through a run queue; in the engine,
15 to 23% of a room pair's CPU (``benchmarks/room_lifecycle.py``, its runtime ablation, and
``benchmarks/README.md``).

The rules, kept as small as trio's or curio's scheduler:

* A room's coroutine suspends only by awaiting :data:`SUSPEND`; it awaits nothing else. One
  that awaits anything else gets a ``RuntimeError`` raised at that await (the room's own
  handler fails it); one run by an ``asyncio.Task`` by mistake fails at once ("bad yield").
  Neither spins.
* :meth:`~RoomScheduler.wake` puts a suspended room on the ready queue (a room already queued
  or running is left alone: it drains its whole mailbox before it suspends again). One loop
  callback resumes the ready rooms in wake order, at most ``batch`` of them, and schedules
  itself again when more are left, so a flood of rooms never starves the loop's other work.
* :meth:`~RoomScheduler.run_woken` runs the ready rooms at once, from the end of a callback
  that delivered a batch of events (never from inside a room's step, nor between two steps
  of a batch), so those events are handled in the loop iteration that brought them.
* ``after_batch`` (the sink's ``rooms_ran``) is called after each batch, and also between
  two steps of a batch once :meth:`~RoomScheduler.rooms_ran_soon` asked for it: a sink that
  holds commands back to execute them together (the transport merging chunks) need not hold
  a full request while the rest of a 256-room batch runs.
* :meth:`~RoomScheduler.cancel` throws ``CancelledError`` into a room's coroutine at its
  suspension point, as ``Task.cancel`` would (engine shutdown): the room fails and is reaped.
* :meth:`~RoomScheduler.current` names the room being resumed, as ``asyncio.current_task``
  names a task: law 2's test reads it to check who writes each status.
* :attr:`~RoomScheduler.now` is ``time.monotonic()`` read when a batch began, and again every
  :data:`CLOCK_STEPS` steps of it: the time a room's flight recorder gives its step. One clock
  read per few steps instead of one per event (a ``time.monotonic()`` call costs 60 to 150 ns
  here, and a room records four or five steps), and a step's time is still its batch's within
  a few steps' work.
* A room coroutine that returns or raises is finished; nothing resumes it again. An exception
  that escapes ``Room.run`` (which catches everything it can: law 3) is logged, never
  swallowed silently; ``KeyboardInterrupt`` and ``SystemExit`` propagate, as from a Task.

Loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from contextvars import ContextVar
from typing import Any, Final, Protocol

_library: ContextVar[str | None] | None
try:  # anyio finds its backend through sniffio when sniffio is installed
    from sniffio import current_async_library_cvar as _library
except ImportError:  # pragma: no cover - then anyio assumes asyncio whenever a loop runs
    _library = None
# Bound once: CPython 3.11 compiles ``_library.set(...)`` on the imported name as an attribute
# load and a call, a bound method built and freed per batch.
_set_library = None if _library is None else _library.set

__all__ = ["SUSPEND", "RoomScheduler", "Schedulable"]

_log = logging.getLogger("kvfsm.rooms")

#: Ready rooms resumed per loop callback before yielding to the loop's other work.
DEFAULT_BATCH: Final = 256
#: Steps of a batch between two reads of :attr:`RoomScheduler.now` (a power of two).
CLOCK_STEPS: Final = 16
_CLOCK_MASK: Final = CLOCK_STEPS - 1
_monotonic: Final = time.monotonic


class _Suspended:
    """What a suspended room's coroutine yields to its scheduler (an ``asyncio.Task`` refuses
    it: a room must never be run as one)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<room suspended>"


_SUSPENDED: Final = _Suspended()


_ONCE: Final = (_SUSPENDED,)


class _Suspend:
    """``await SUSPEND``: give control back to the scheduler until the room is woken.

    The awaited iterator is a tuple's (one C object, where a generator would be a frame per
    wait): the coroutine yields its one item, and ends the ``await`` when resumed."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        # A tuple iterator is all ``await`` needs here: the scheduler only ever sends None
        # (yield-from then calls __next__) or throws (raised at the await, as from a Task).
        return iter(_ONCE)  # type: ignore[return-value]


SUSPEND: Final = _Suspend()


class Schedulable(Protocol):
    """What the scheduler keeps on a room: its coroutine and where it stands."""

    #: The running coroutine; None before ``start`` and once finished.
    coro: Coroutine[Any, Any, None] | None
    #: True while the coroutine waits at ``await SUSPEND`` and is not queued.
    suspended: bool

    def run(self) -> Coroutine[Any, Any, None]: ...


class RoomScheduler:
    """The run queue of one engine's room tasks (loop thread only)."""

    __slots__ = (
        "_batch",
        "_current",
        "_in_batch",
        "_loop",
        "_ran_due",
        "_ready",
        "_scheduled",
        "after_batch",
        "escaped",
        "now",
        "resumes",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, batch: int = DEFAULT_BATCH) -> None:
        self._loop = loop
        self._batch = batch
        self._ready: deque[Schedulable] = deque()
        self._scheduled = False
        self._current: Schedulable | None = None
        self._in_batch = False  # between the steps of a batch (run_woken waits for its end)
        self._ran_due = False  # rooms_ran_soon() asked: call after_batch after this step
        #: Coroutine resumptions so far (a room's wake-ups, for benchmarks and tests).
        self.resumes = 0
        #: Exceptions that escaped a room's coroutine (none should: ``Room.run`` catches them).
        self.escaped: list[BaseException] = []
        #: Called after each batch of steps (``CommandSink.rooms_ran``): the registry sets it.
        self.after_batch: Callable[[], None] | None = None
        #: ``time.monotonic()`` at the latest batch's start or its latest :data:`CLOCK_STEPS`
        #: steps: a room step's time, to within a few steps (read inside a step only).
        self.now = _monotonic()

    def start(self, room: Schedulable) -> None:
        """Create ``room``'s coroutine and queue its first step (it runs on a later loop
        callback, as a new Task's would: events delivered meanwhile are in its mailbox)."""
        if room.coro is not None:
            raise RuntimeError("room task already started")
        room.coro = room.run()
        room.suspended = False
        self._queue(room)

    def wake(self, room: Schedulable) -> None:
        """Resume ``room`` soon if it is suspended. Never runs it inline."""
        if room.suspended:
            room.suspended = False
            self._queue(room)

    def cancel(self, room: Schedulable) -> None:
        """Throw ``CancelledError`` into ``room``'s task now (engine shutdown). A room that
        is running (the caller is inside its step) or finished is left alone."""
        if room.coro is None or room is self._current:
            return
        if not room.suspended:  # queued: drop it from the queue, it resumes here instead
            with contextlib.suppress(ValueError):
                self._ready.remove(room)
        room.suspended = False
        self.now = _monotonic()  # a step outside any batch
        self._resume(room, asyncio.CancelledError())

    def current(self) -> Schedulable | None:
        """The room whose task is running, None outside any room's step."""
        return self._current

    @property
    def ready(self) -> int:
        return len(self._ready)

    def _queue(self, room: Schedulable) -> None:
        self._ready.append(room)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run_ready)

    def run_woken(self) -> None:
        """Resume the rooms woken so far now, not on the loop's next iteration: a callback that
        delivered a batch of events (the loop thread's drain of callers' posts, the transport's
        completions) calls this at its end. It saves a loop round trip per hop, and under a
        scheduler thread that never releases the GIL each round trip is a forced switch (up to
        ``sys.getswitchinterval()``, 5 ms). A no-op inside a room's step: rooms never run
        inside one another."""
        if self._current is None and not self._in_batch and self._ready:
            self._run_batch()

    def rooms_ran_soon(self) -> None:
        """Call ``after_batch`` after the step that is running now, before the batch's next
        step, and not only at the batch's end (a sink staged a full request from inside a
        step: a 256-room batch would otherwise hold it back for milliseconds). Outside a
        batch it applies to the next step that runs; the caller keeps its own backstop."""
        self._ran_due = True

    def _run_ready(self) -> None:
        self._scheduled = False
        self._run_batch()

    def _run_batch(self) -> None:
        # Room commands may start anyio tasks (the control channel's task group), and anyio
        # finds its backend through sniffio, which looks for a running asyncio.Task: name it
        # here, for this callback's context only (call_soon runs each in a copy).
        if _set_library is not None:
            _set_library("asyncio")
        ready = self._ready
        self._in_batch = True
        try:
            for step in range(min(len(ready), self._batch)):
                if not ready:  # (a hook between two steps cancelled the rest)
                    break
                if not step & _CLOCK_MASK:
                    self.now = _monotonic()
                room = ready.popleft()
                if room.coro is not None:
                    self._resume(room, None)
                    if self._ran_due:
                        self._ran_due = False
                        self._after_batch()
        finally:
            self._in_batch = False
        if ready and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run_ready)
        self._ran_due = False  # the call below serves any request still pending
        self._after_batch()

    def _after_batch(self) -> None:
        after = self.after_batch
        if after is not None:
            try:
                after()
            except Exception:  # a sink's hook must not stop the next batch
                _log.exception("after-batch hook %r failed", after)

    def _resume(self, room: Schedulable, exc: BaseException | None) -> None:
        coro = room.coro
        assert coro is not None
        outer, self._current = self._current, room
        self.resumes += 1
        try:
            yielded = coro.send(None) if exc is None else coro.throw(exc)
        except (StopIteration, asyncio.CancelledError):
            room.coro = None
        except (KeyboardInterrupt, SystemExit):
            room.coro = None
            raise
        except BaseException as escaped:  # Room.run catches what it can: the last resort
            room.coro = None
            self.escaped.append(escaped)
            _log.exception("room task %r ended with an exception", room)
        else:
            if yielded is _SUSPENDED:
                room.suspended = True
            else:
                self._awaited_wrongly(room, coro, yielded)
        finally:
            self._current = outer

    def _awaited_wrongly(
        self, room: Schedulable, coro: Coroutine[Any, Any, None], yielded: object
    ) -> None:
        """A room task awaited something other than SUSPEND (a bug): raise that in the task, at
        that await, so the room's own handler fails and reaps it (law 3) rather than leaving it
        stranded, and never into whoever ran it (a drain, the pump, a control frame)."""
        error = RuntimeError(f"room task {room!r} awaited {yielded!r}, not SUSPEND")
        self.escaped.append(error)
        _log.error("%s", error)
        try:
            again = coro.throw(error)
        except (KeyboardInterrupt, SystemExit):
            room.coro = None
            raise
        except BaseException as escaped:  # ended: handled inside, or out of it (recorded)
            room.coro = None
            if escaped is not error and not isinstance(escaped, StopIteration):
                self.escaped.append(escaped)
        else:
            if again is _SUSPENDED:  # it handled the error and waits for events again
                room.suspended = True
            else:
                room.coro = None
                coro.close()
