"""How long a call kept its caller, less the time the machine's load kept it waiting for a CPU.

The chaos ranks check law 6 (never block the caller) by timing every scheduler-facing call. A
wall-clock time mixes two things: time the call spent running or asleep (on a lock, the GIL, a
round trip: what kvfsm decides) and time the thread was runnable but every CPU was busy with
other processes (what the machine decides). On a shared 2-vCPU machine the second one alone
pushed a 17 MB ``send_metadata`` copy past its limit in a loaded test run. The kernel counts it
per thread: the second field of ``/proc/<pid>/task/<tid>/schedstat`` is the nanoseconds the
thread spent on a run queue. :class:`CallTimer` subtracts it, so a call that *blocked* still
counts in full, and one that only waited its turn for a CPU does not.

Where the kernel does not report schedstat (no ``CONFIG_SCHED_INFO``), nothing is subtracted:
the check is then the plain wall-clock one, never a weaker one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["CallTimer", "Timed"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Timed:
    """One call's times, in milliseconds."""

    #: Wall-clock time from the call to its return.
    wall_ms: float
    #: Of that, the time the thread waited on a run queue (0 where the kernel does not say).
    queued_ms: float

    @property
    def own_ms(self) -> float:
        """The wall time the machine's load does not explain: running or asleep."""
        return max(0.0, self.wall_ms - self.queued_ms)


class CallTimer:
    """Times calls made on one thread (the one that makes the first call)."""

    def __init__(self) -> None:
        self._tid = 0
        self._fd = -1

    def run_queue_ns(self) -> int:
        """Nanoseconds the calling thread has waited on a run queue so far (0: not reported)."""
        tid = threading.get_native_id()
        if tid != self._tid:
            self.close()
            self._tid = tid
            with contextlib.suppress(OSError):
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        if self._fd < 0:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def time(self, fn: Callable[..., T], *args: object) -> tuple[T, Timed]:
        """``fn(*args)`` and how long it took; an exception from it propagates untimed."""
        q0 = self.run_queue_ns()
        t0 = time.perf_counter()
        result = fn(*args)
        wall = time.perf_counter() - t0
        queued = self.run_queue_ns() - q0
        return result, Timed(wall * 1e3, queued / 1e6)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
