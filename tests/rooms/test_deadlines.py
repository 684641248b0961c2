"""The deadline queue (kvfsm.rooms._deadlines): every room's deadline behind one loop timer."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvfsm.rooms._deadlines import DeadlineQueue

pytestmark = pytest.mark.asyncio


@pytest.mark.looptime
async def test_entries_fire_at_their_time_in_due_order_ties_in_arming_order() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    start = loop.time()
    fired: list[tuple[str, float]] = []

    def at(name: str) -> None:
        fired.append((name, loop.time() - start))

    for name, delay in [("c", 30.0), ("a", 10.0), ("b", 20.0), ("a2", 10.0)]:
        queue.arm(start + delay, lambda name=name: at(name))  # type: ignore[misc]
    await asyncio.sleep(35.0)
    assert [name for name, _ in fired] == ["a", "a2", "b", "c"]
    assert [when for _, when in fired] == pytest.approx([10.0, 10.0, 20.0, 30.0])
    assert queue.fired == 4
    assert queue.live == 0


@pytest.mark.looptime
async def test_a_cancelled_entry_never_fires_and_an_idle_queue_holds_no_timer() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    fired: list[int] = []
    entries = [queue.arm(loop.time() + 5.0 + i, lambda i=i: fired.append(i)) for i in range(3)]  # type: ignore[misc]
    queue.cancel(entries[0])
    queue.cancel(entries[0])  # idempotent
    await asyncio.sleep(10.0)
    assert fired == [1, 2]
    late = queue.arm(loop.time() + 5.0, lambda: fired.append(9))
    queue.cancel(late)
    assert queue.live == 0
    assert queue._handle is None  # nothing armed, nothing to wake the loop for
    await asyncio.sleep(10.0)
    assert fired == [1, 2]


@pytest.mark.looptime
async def test_an_earlier_entry_moves_the_timer_forward() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    start = loop.time()
    fired: list[float] = []
    queue.arm(start + 300.0, lambda: fired.append(loop.time() - start))
    queue.arm(start + 2.0, lambda: fired.append(loop.time() - start))
    await asyncio.sleep(3.0)
    assert fired == pytest.approx([2.0])
    await asyncio.sleep(300.0)
    assert fired == pytest.approx([2.0, 300.0])


@pytest.mark.looptime
async def test_cancelled_entries_cannot_pile_up() -> None:
    # Rooms cancel deadlines minutes before they fall due: the heap is rebuilt from the live
    # entries once cancelled ones outnumber them, and what is live still fires on time.
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    rng = random.Random(3)
    start = loop.time()
    fired: list[int] = []
    keep: set[int] = set()
    for i in range(20_000):
        entry = queue.arm(start + 100.0 + rng.random(), lambda i=i: fired.append(i))  # type: ignore[misc]
        if i % 10:
            queue.cancel(entry)
        else:
            keep.add(i)
        assert len(queue._heap) <= 2 * queue.live + 1100
    assert queue.rebuilds > 0
    assert queue.live == len(keep)
    await asyncio.sleep(102.0)
    assert set(fired) == keep
    assert queue.live == 0


@pytest.mark.looptime
async def test_a_raising_callback_is_logged_and_the_rest_still_fire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    fired: list[str] = []

    def boom() -> None:
        raise KeyError("a bug")

    queue.arm(loop.time() + 1.0, boom)
    queue.arm(loop.time() + 1.0, lambda: fired.append("after"))
    await asyncio.sleep(2.0)
    assert fired == ["after"]
    assert "deadline callback" in caplog.text


@pytest.mark.looptime
async def test_a_callback_may_arm_again_and_close_cancels_everything() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    start = loop.time()
    fired: list[float] = []

    def again() -> None:
        fired.append(loop.time() - start)
        if len(fired) < 3:
            queue.arm(loop.time() + 1.5, again)

    queue.arm(start + 1.0, again)
    await asyncio.sleep(10.0)
    assert fired == pytest.approx([1.0, 2.5, 4.0])
    queue.arm(loop.time() + 1.0, lambda: fired.append(-1.0))
    queue.close()
    await asyncio.sleep(5.0)
    assert len(fired) == 3
    assert queue.live == 0


@pytest.mark.looptime
async def test_callbacks_that_cancel_many_entries_while_firing_keep_the_count_right() -> None:
    # A callback's cancels may rebuild the heap under the firing loop: what is still live fires
    # once, what was cancelled never does, and the live count ends at zero.
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop)
    start = loop.time()
    fired: list[int] = []
    later = [queue.arm(start + 50.0, lambda i=i: fired.append(i)) for i in range(3000)]  # type: ignore[misc]

    def sweep() -> None:
        fired.append(-1)
        for entry in later[:2500]:
            queue.cancel(entry)

    queue.arm(start + 10.0, sweep)
    queue.arm(start + 10.0, lambda: fired.append(-2))
    await asyncio.sleep(20.0)
    assert fired == [-1, -2]
    assert queue.rebuilds > 0
    assert queue.live == 500
    await asyncio.sleep(40.0)
    assert sorted(fired[2:]) == list(range(2500, 3000))
    assert queue.live == 0
    assert queue._handle is None
