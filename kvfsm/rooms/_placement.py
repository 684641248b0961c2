"""Where kvfsm's threads run: ``KVFSM_THREAD_CPUS``, or :func:`set_thread_cpus`.

Why. kvfsm's loop and poster threads share a process, and its GIL, with SGLang's scheduler
thread. Each time one of them takes the GIL the scheduler blocks, and Linux tends to run the
woken kvfsm thread on the core the scheduler just left (it is free, and warm). The scheduler
then comes back to caches full of kvfsm's objects. ``benchmarks/gil.py`` measured it on a
2-vCPU machine: the scheduler loop's own, unchanged work took 5 to 12% more CPU per iteration
while kvfsm moved rooms, and that, more than the GIL waits, was what kvfsm cost it. With
kvfsm's threads on a CPU of their own and the scheduler off it, kvfsm cost the loop what raw
NIXL moving the same bytes did (``benchmarks/README.md``).

What. Given a CPU list (``"3"``, ``"2-3"``, ``"0,6-7"``: the syntax of ``taskset -c``):

* every kvfsm thread (loop, poster, peer worker, registry) confines itself to those CPUs as it
  starts, and threads NIXL starts from them inherit that;
* the thread that starts an engine (:meth:`LoopThread.start`: in SGLang the scheduler thread,
  which builds the backend) is moved off them, keeping the rest of the CPUs it may use, for
  the life of the process; it is left alone if that would leave it none. Threads it starts
  afterwards inherit that.

Unset (the default), no thread's placement is touched. A list that does not parse is refused
when an engine starts, naming the variable. CPUs the process may not use are the kernel's to
drop; when none is left, a warning is logged and nothing changes. Linux only (the calls are
``os.sched_setaffinity``); elsewhere a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

__all__ = [
    "ENV",
    "keep_this_thread_off",
    "parse_cpu_list",
    "place_this_thread",
    "set_thread_cpus",
    "thread_cpus",
]

_log = logging.getLogger("kvfsm.runtime")

#: The environment variable read when no value was set in code.
ENV = "KVFSM_THREAD_CPUS"
_MAX_CPU = 1 << 16  # beyond any machine: a typo, not a CPU

_lock = threading.Lock()
_override: frozenset[int] | None = None
_overridden = False


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0,2-3"`` as ``{0, 2, 3}``. Raises ``ValueError`` saying what is wrong: an empty
    list or item, a value that is not a non-negative integer, a range that runs backwards."""
    cpus: set[int] = set()
    items = text.replace(" ", "").split(",")
    if items == [""]:
        raise ValueError("an empty CPU list")
    for item in items:
        low, sep, high = item.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(f"{item!r} is not a CPU number or a range of them") from None
        if first < 0 or last >= _MAX_CPU:
            raise ValueError(f"{item!r} is out of range")
        if last < first:
            raise ValueError(f"the range {item!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def set_thread_cpus(cpus: Iterable[int] | None) -> None:
    """Use ``cpus`` for kvfsm's threads started after this call (None: the environment
    variable again). For embedding and tests; deployments set ``KVFSM_THREAD_CPUS``."""
    global _override, _overridden
    value = None if cpus is None else frozenset(cpus)
    if value is not None and (not value or min(value) < 0):
        raise ValueError(f"thread CPUs must be a non-empty set of CPU numbers, got {cpus!r}")
    with _lock:
        _override, _overridden = value, cpus is not None


def thread_cpus() -> frozenset[int] | None:
    """The CPUs kvfsm's threads run on, or None (unset: wherever the OS puts them). Raises
    ``ValueError`` naming the variable when it does not parse."""
    with _lock:
        if _overridden:
            return _override
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_cpu_list(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV}={raw!r}: {exc}") from None


def place_this_thread() -> None:
    """Confine the calling kvfsm thread to :func:`thread_cpus`, if set. Never raises: a thread
    that cannot be placed runs where it is, and says so."""
    try:
        cpus = thread_cpus()
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:
        _log.warning(
            "thread %s not placed on the CPUs of %s: %s", threading.current_thread().name, ENV, exc
        )


def keep_this_thread_off() -> frozenset[int] | None:
    """Move the calling thread off :func:`thread_cpus`, if set, keeping the rest of the CPUs it
    may use; returns its CPUs after that (None: nothing changed). Leaves it where it is when
    that would leave it none. Raises ``ValueError`` when the setting does not parse (at an
    engine's start: refused, naming the variable)."""
    cpus = thread_cpus()
    if cpus is None or not hasattr(os, "sched_getaffinity"):
        return None
    current = os.sched_getaffinity(0)
    left = frozenset(current - cpus)
    if not left:
        _log.warning(
            "%s=%s covers every CPU thread %s may use: it is left where it is, sharing them "
            "with kvfsm's threads",
            ENV,
            sorted(cpus),
            threading.current_thread().name,
        )
        return None
    if left != current:
        try:
            os.sched_setaffinity(0, left)
        except OSError as exc:
            _log.warning(
                "could not move thread %s off %s: %s", threading.current_thread().name, ENV, exc
            )
            return None
    return left
