"""CallTimer: a call that blocks is charged in full; time the thread only waited for a CPU
that other processes held is not."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfsm.workload.call_timer import CallTimer, Timed
from tests.helpers.waiting import wait_until_sync

SCHEDSTAT = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


#: A CPU burner: a separate interpreter (not a fork of this one: forking a process with
#: threads and native libraries loaded runs their at-fork hooks and is unsafe; a clean-clone
#: run once aborted in a garbage collection that an at-fork hook set off).
_BURN = (
    "import time\nuntil = time.monotonic() + {seconds}\nwhile time.monotonic() < until:\n    pass"
)


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_own_time_is_wall_less_queued_and_never_negative() -> None:
    assert Timed(30.0, 12.5).own_ms == 17.5
    assert Timed(1.0, 1.5).own_ms == 0.0


def test_a_blocked_call_counts_in_full() -> None:
    # Asleep on a lock (here: a sleep) is not waiting for a CPU: nothing is subtracted.
    timer = CallTimer()
    result, timed = timer.time(lambda: time.sleep(0.05) or "done")
    timer.close()
    assert result == "done"
    assert timed.wall_ms >= 50.0
    assert timed.own_ms >= 45.0  # at most a scheduling hiccup of the wake-up itself


def test_an_exception_propagates() -> None:
    timer = CallTimer()

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        timer.time(boom)
    timer.close()


# Its burners hold every CPU for seconds: alone, so that they slow no other test.
@pytest.mark.alone
@pytest.mark.skipif(not SCHEDSTAT.exists(), reason="this kernel does not report schedstat")
def test_waiting_for_a_cpu_held_by_other_processes_is_subtracted() -> None:
    # More CPU-bound processes than CPUs: a CPU-bound call on this thread waits its turn on a
    # run queue for much of its wall time, and the timer takes exactly that out.
    cpus = len(os.sched_getaffinity(0))
    code = _BURN.format(seconds=3.5)
    burners = [subprocess.Popen([sys.executable, "-S", "-c", code]) for _ in range(2 * cpus)]
    try:
        # Every burner has begun burning (its CPU time is counted), not just been forked.
        wait_until_sync(lambda: all(_cpu_s(proc.pid) > 0.1 for proc in burners), timeout=20)
        timer = CallTimer()
        cpu0 = time.thread_time()
        _, timed = timer.time(_spin, 0.5)
        cpu_ms = (time.thread_time() - cpu0) * 1e3
        timer.close()
    finally:
        for proc in burners:
            proc.wait(timeout=30)
    assert timed.wall_ms >= 500.0
    # With 2 burners per CPU this thread got at most about a third of a CPU: much of the wall
    # time was spent queued, and what is left is the spin's own running time.
    assert timed.queued_ms > 0.25 * timed.wall_ms, timed
    assert abs(timed.own_ms - cpu_ms) < 0.1 * timed.wall_ms, (timed, cpu_ms)


def test_the_timer_follows_the_calling_thread() -> None:
    # One timer used from two threads reads each thread's own counter, not the first one's.
    timer = CallTimer()
    first = timer.run_queue_ns()
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(timer.run_queue_ns()))
    worker.start()
    worker.join()
    assert timer._tid == worker.native_id
    assert seen
    # Back on this thread: its own counter again, which only grows.
    assert timer.run_queue_ns() >= first
    assert timer._tid == threading.get_native_id()
    timer.close()
