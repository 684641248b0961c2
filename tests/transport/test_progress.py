"""``AgentProgress``: a decode agent is progressed fast while writes are expected and slowly
otherwise (virtual time, looptime), and stops when closed."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfsm.transport import AgentProgress, ProgressWatch
from tests.helpers.waiting import wait_until


class _Nixl:
    def __init__(self) -> None:
        self.progressed = 0

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.progressed += 1
        return {}


class _Agent:
    """The one member of an ``Agent`` the loop uses."""

    def __init__(self) -> None:
        self.nixl = _Nixl()


@pytest.mark.asyncio
@pytest.mark.looptime
async def test_busy_while_writes_are_expected_idle_otherwise_stopped_when_closed() -> None:
    agent, expecting = _Agent(), [False]
    progress = AgentProgress(agent, lambda: expecting[0], 0.001)  # type: ignore[arg-type]
    progress.start()
    with pytest.raises(RuntimeError, match="already started"):
        progress.start()
    await asyncio.sleep(1.0)
    idle = agent.nixl.progressed
    assert 19 <= idle <= 21  # every 50 ms
    expecting[0] = True
    await asyncio.sleep(1.0)
    busy = agent.nixl.progressed - idle
    assert 990 <= busy <= 1010  # every interval_s
    assert progress.running
    await progress.aclose()
    assert not progress.running
    stopped = agent.nixl.progressed
    await asyncio.sleep(1.0)
    assert agent.nixl.progressed == stopped


@pytest.mark.asyncio
@pytest.mark.looptime
@pytest.mark.parametrize(
    ("interval_s", "expecting", "low", "high"),
    [
        # over the idle pace: used for both
        (0.2, False, 5, 6),
        # under the loop's timer resolution: raised to it (1 ms), not 0.5 ms
        (0.0005, True, 990, 1010),
    ],
)
async def test_the_interval_is_bounded_by_the_idle_pace_and_the_loops_timer(
    interval_s: float, expecting: bool, low: int, high: int
) -> None:
    agent = _Agent()
    progress = AgentProgress(agent, lambda: expecting, interval_s)  # type: ignore[arg-type]
    progress.start()
    await asyncio.sleep(1.0)
    assert low <= agent.nixl.progressed <= high
    await progress.aclose()


@pytest.mark.asyncio
async def test_a_progress_watch_counts_the_steady_stretch_and_restarts_it_after_a_gap() -> None:
    watch = ProgressWatch(max_gap_s=0.25)
    assert watch.steady_for(0.0) == 0.0  # never progressed
    for now in (1.0, 1.2, 1.4, 1.6):
        watch.progressed(now)
    assert watch.steady_for(1.6) == pytest.approx(0.6)
    assert watch.steady_for(1.8) == pytest.approx(0.8)  # within the gap since the last one
    assert watch.steady_for(1.9) == 0.0  # the last progress is too old: standing still
    watch.progressed(61.6)  # woke from a freeze
    assert watch.steady_for(61.6) == 0.0
    watch.progressed(61.8)
    assert watch.steady_for(61.8) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="max_gap_s"):
        ProgressWatch(0.0)


@pytest.mark.asyncio
async def test_the_progress_loop_tells_its_watch() -> None:
    agent = _Agent()
    watch = ProgressWatch(max_gap_s=0.5)
    progress = AgentProgress(agent, lambda: True, 0.001, watch)  # type: ignore[arg-type]
    progress.start()
    await wait_until(lambda: agent.nixl.progressed > 2, message="three progress calls")
    await progress.aclose()
    assert agent.nixl.progressed > 1
    assert watch.steady_for(time.monotonic()) > 0.0


def test_on_uvloop_a_busy_agent_is_progressed_once_a_millisecond_not_on_every_iteration() -> None:
    """uvloop times in whole milliseconds and runs a shorter sleep on the next iteration: the
    loop must not turn into a spin while writes are expected (it would hold a core)."""
    uvloop = pytest.importorskip("uvloop")
    agent = _Agent()

    async def main() -> float:
        progress = AgentProgress(agent, lambda: True, 0.0005)  # type: ignore[arg-type]
        t0 = time.monotonic()
        progress.start()
        await asyncio.sleep(0.2)
        await progress.aclose()
        return time.monotonic() - t0

    elapsed = uvloop.run(main())
    # A spin makes thousands of calls in 0.2 s; once a millisecond is at most one per 1 ms.
    assert 1 <= agent.nixl.progressed <= elapsed / 0.001 + 2
