"""``AgentProgress``: keeps a NIXL agent that is written into (decode) progressing.

Agents run with their progress thread off (it spins a core: docs/design.md, the data path). A
UCX worker then advances only when it is polled, and a writer's completion flushes wait for the
target's worker too. Prefill's pump progresses its own agent (:mod:`kvfsm.transport._pump`); a
decode rank posts nothing and has no pump, so this loop does it there. It is fast
(``interval_s``, 1 ms at least) only while some room's pages are exposed to a live link, which
the control plane knows and says through ``expecting()``, and slow (every 50 ms at least)
otherwise, so an idle decode rank, or one whose rooms all ended, costs about nothing. It lives
here because every NIXL call does (docs/design.md, Architecture).

``ProgressWatch`` records each progress, so the control plane knows for how long the agent has
been progressed without a gap (``steady_for``). A decode rank frozen (SIGSTOP, a VM stall) has
not taken the bytes queued for it, in its socket and in the writer's agent: they land once its
agent is progressed again. So a lost link's pages settle by the clock only after a steady
stretch (``DecodeRouting.tick``), whatever the clock says about the lease.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from kvfsm._tasks import cancel_and_wait
from kvfsm.transport._agent import Agent
from kvfsm.transport._pacer import LOOP_TIMER_S

__all__ = ["AgentProgress", "ProgressWatch"]

_log = logging.getLogger("kvfsm.transport")
#: The slowest an idle agent is progressed (a watch's gap limit must be longer).
IDLE_S = 0.05


class ProgressWatch:
    """When an agent was progressed, sans-IO (``now`` is passed in). A gap longer than
    ``max_gap_s`` between two progresses (or since the last one) starts the steady stretch
    again: the process, or its loop, stood still meanwhile."""

    __slots__ = ("_last", "_since", "max_gap_s")

    def __init__(self, max_gap_s: float) -> None:
        if not max_gap_s > 0:
            raise ValueError("max_gap_s must be > 0")
        self.max_gap_s = max_gap_s
        self._last = -math.inf
        self._since = math.inf

    def progressed(self, now: float) -> None:
        if now - self._last > self.max_gap_s:
            self._since = now
        self._last = now

    def steady_for(self, now: float) -> float:
        """Seconds the agent has been progressed without a gap, up to ``now`` (0 if the last
        progress is already more than ``max_gap_s`` ago, or never happened)."""
        if now - self._last > self.max_gap_s:
            return 0.0
        return max(0.0, now - self._since)


class AgentProgress:
    """Progresses ``agent`` every ``interval_s`` (at least ``LOOP_TIMER_S``) while
    ``expecting()`` is true, else every ``max(interval_s, 50 ms)``, telling ``watch`` each
    time. :meth:`start` and :meth:`aclose` on the loop thread."""

    def __init__(
        self,
        agent: Agent,
        expecting: Callable[[], bool],
        interval_s: float,
        watch: ProgressWatch | None = None,
    ) -> None:
        self.agent = agent
        self.watch = watch
        self._expecting = expecting
        self._busy_s = max(interval_s, LOOP_TIMER_S)
        self._idle_s = max(interval_s, IDLE_S)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("AgentProgress is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvfsm-nixl-progress")
        self._task.add_done_callback(_progress_ended)

    @property
    def running(self) -> bool:
        """The loop's task is alive (started and neither closed nor crashed)."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        progress, expecting = self.agent.nixl.get_new_notifs, self._expecting
        busy, idle = self._busy_s, self._idle_s
        watch, clock = self.watch, time.monotonic
        while True:
            progress()
            if watch is not None:
                watch.progressed(clock())
            await asyncio.sleep(busy if expecting() else idle)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)


def _progress_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("NIXL progress loop crashed", exc_info=task.exception())
