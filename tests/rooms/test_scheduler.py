"""The room scheduler (kvfsm.rooms._scheduler): the run queue that resumes rooms' tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from kvfsm.rooms._scheduler import SUSPEND, RoomScheduler

pytestmark = pytest.mark.asyncio


class Toy:
    """A room-shaped task: takes what is in its box each time it runs, suspends between."""

    def __init__(self, scheduler: RoomScheduler, name: str, log: list[str]) -> None:
        self.coro: Coroutine[Any, Any, None] | None = None
        self.suspended = False
        self.scheduler = scheduler
        self.name = name
        self.log = log
        self.box: list[str] = []
        self.stop_after: int | None = None
        self.raise_on: str | None = None
        self.cleaned = False

    async def run(self) -> None:
        steps = 0
        try:
            while True:
                self.log.append(
                    f"{self.name}:{','.join(self.box)}:{self.scheduler.current() is self}"
                )
                if self.raise_on is not None and self.raise_on in self.box:
                    raise ValueError(self.raise_on)
                self.box.clear()
                steps += 1
                if self.stop_after is not None and steps >= self.stop_after:
                    return
                await SUSPEND
        finally:
            self.cleaned = True

    def deliver(self, item: str) -> None:
        self.box.append(item)
        self.scheduler.wake(self)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def two_started(log: list[str]) -> tuple[RoomScheduler, Toy, Toy]:
    """A scheduler on the running loop with rooms ``a`` and ``b`` started (not yet run)."""
    scheduler = RoomScheduler(asyncio.get_running_loop())
    a, b = Toy(scheduler, "a", log), Toy(scheduler, "b", log)
    scheduler.start(a)
    scheduler.start(b)
    return scheduler, a, b


async def test_rooms_run_once_per_wake_in_wake_order_never_inline() -> None:
    log: list[str] = []
    scheduler, a, b = two_started(log)
    a.deliver("x")  # queued, not suspended yet: the first step takes it
    assert log == []  # start and wake never run a task inline
    await settle()
    assert log == ["a:x:True", "b::True"]
    b.deliver("1")
    a.deliver("2")
    a.deliver("3")  # a second wake of a queued room queues nothing more
    assert scheduler.ready == 2
    await settle()
    assert log[2:] == ["b:1:True", "a:2,3:True"]
    assert scheduler.current() is None
    assert scheduler.resumes == 4


async def test_a_flood_of_ready_rooms_yields_to_the_loop_between_batches() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop(), batch=10)
    log: list[str] = []
    toys = [Toy(scheduler, str(i), log) for i in range(35)]
    for toy in toys:
        scheduler.start(toy)
    await asyncio.sleep(0)  # one loop callback: one batch
    assert len(log) == 10
    await settle()
    assert len(log) == 35


async def test_a_finished_task_is_never_resumed_and_cleans_up() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    log: list[str] = []
    toy = Toy(scheduler, "t", log)
    toy.stop_after = 1
    scheduler.start(toy)
    await settle()
    assert toy.coro is None
    assert toy.cleaned
    toy.deliver("late")
    await settle()
    assert log == ["t::True"]


async def test_cancel_throws_cancelled_error_at_the_suspension_point() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    log: list[str] = []
    suspended, queued = Toy(scheduler, "s", log), Toy(scheduler, "q", log)
    scheduler.start(suspended)
    await settle()
    scheduler.start(queued)  # queued, never run
    scheduler.cancel(suspended)
    scheduler.cancel(queued)
    assert suspended.coro is None
    assert suspended.cleaned
    assert queued.coro is None
    await settle()
    assert log == ["s::True"]  # the queued one was never resumed after its cancel
    assert scheduler.escaped == []


async def test_an_exception_that_escapes_a_task_is_recorded_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    toy = Toy(scheduler, "e", [])
    toy.raise_on = "boom"
    scheduler.start(toy)
    await settle()
    toy.deliver("boom")
    await settle()
    assert toy.coro is None
    assert [type(exc) for exc in scheduler.escaped] == [ValueError]
    assert "ended with an exception" in caplog.text


async def test_a_task_that_awaits_anything_but_suspend_gets_the_error_at_that_await(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its own handler sees the error (as Room.run's fails the room), nothing reaches whoever
    # ran it (a drain, the pump), and it is recorded and logged.
    loop = asyncio.get_running_loop()
    scheduler = RoomScheduler(loop)
    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: loop_errors.append(context))
    handled: list[str] = []

    class Bad(Toy):
        async def run(self) -> None:
            try:
                await asyncio.sleep(0)  # a Future-based await: not allowed in a room task
            except RuntimeError as exc:
                handled.append(str(exc))

    bad = Bad(scheduler, "bad", [])
    scheduler.start(bad)
    scheduler.run_woken()  # as from a drain: must not raise
    await settle()
    loop.set_exception_handler(None)
    assert bad.coro is None
    assert len(handled) == 1
    assert "not SUSPEND" in handled[0]
    assert [str(exc) for exc in scheduler.escaped] == handled
    assert "not SUSPEND" in caplog.text
    assert loop_errors == []


async def test_a_room_task_run_as_an_asyncio_task_fails_instead_of_spinning() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    toy = Toy(scheduler, "t", [])
    with pytest.raises(RuntimeError, match="bad yield"):
        await asyncio.wait_for(asyncio.ensure_future(toy.run()), 1.0)


async def test_starting_a_task_twice_is_refused() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    toy = Toy(scheduler, "t", [])
    scheduler.start(toy)
    with pytest.raises(RuntimeError, match="already started"):
        scheduler.start(toy)
    scheduler.cancel(toy)


async def test_run_woken_runs_the_woken_rooms_now_but_never_inside_a_step() -> None:
    log: list[str] = []
    scheduler, a, b = two_started(log)
    await settle()
    a.deliver("x")
    scheduler.run_woken()  # a drain's end: no loop round trip
    assert log[-1] == "a:x:True"

    class Nested(Toy):
        async def run(self) -> None:
            while True:
                b.deliver("from a step")
                scheduler.run_woken()  # inside a step: must not run b here
                self.log.append(f"nested saw {b.box}")
                await SUSPEND

    n = Nested(scheduler, "n", log)
    scheduler.start(n)
    await asyncio.sleep(0)
    assert "nested saw ['from a step']" in log
    await settle()
    assert log[-1] == "b:from a step:True"  # b ran after, from the queue


async def test_run_woken_takes_one_batch_and_leaves_the_rest_queued() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop(), batch=4)
    log: list[str] = []
    toys = [Toy(scheduler, str(i), log) for i in range(10)]
    for toy in toys:
        scheduler.start(toy)
    scheduler.run_woken()
    assert len(log) == 4
    await settle()
    assert len(log) == 10


async def test_after_batch_runs_once_after_each_batch_of_steps_and_a_raising_one_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``after_batch`` (``CommandSink.rooms_ran``): after every batch, whether the loop or a
    ``run_woken`` ran it, once the batch's steps are all over; a hook that raises is logged and
    the next batch still runs."""
    scheduler = RoomScheduler(asyncio.get_running_loop(), batch=3)
    log: list[str] = []
    scheduler.after_batch = lambda: log.append(f"after (in a step: {scheduler.current()})")
    toys = [Toy(scheduler, str(i), log) for i in range(5)]
    for toy in toys:
        scheduler.start(toy)
    scheduler.run_woken()
    assert log == ["0::True", "1::True", "2::True", "after (in a step: None)"]
    await settle()
    assert log[4:] == ["3::True", "4::True", "after (in a step: None)"]

    def broken() -> None:
        raise RuntimeError("hook broke")

    scheduler.after_batch = broken
    toys[0].deliver("x")
    toys[1].deliver("y")
    await settle()
    assert log[-2:] == ["0:x:True", "1:y:True"]
    assert "after-batch hook" in caplog.text
    toys[2].deliver("z")  # the scheduler still runs rooms
    await settle()
    assert log[-1] == "2:z:True"


async def test_rooms_ran_soon_calls_after_batch_between_two_steps_and_again_at_the_end() -> None:
    """A sink that staged a full request from inside a step (``rooms_ran_soon``) hears
    ``after_batch`` right after that step, before the batch's next room runs, outside any
    step; the batch's end still calls it. A ``run_woken`` from that hook does not start a
    batch inside the batch: the rooms it would run are the batch's own, or the next one's."""
    scheduler = RoomScheduler(asyncio.get_running_loop())
    log: list[str] = []

    def after() -> None:
        log.append(f"after (in a step: {scheduler.current()})")
        scheduler.run_woken()

    scheduler.after_batch = after

    class Staging(Toy):
        async def run(self) -> None:
            while True:
                self.log.append(f"{self.name} stages a full request")
                scheduler.rooms_ran_soon()
                await SUSPEND

    toys: list[Toy] = [Toy(scheduler, "0", log), Staging(scheduler, "s", log)]
    toys += [Toy(scheduler, str(i), log) for i in (2, 3)]
    for toy in toys:
        scheduler.start(toy)
    scheduler.run_woken()
    assert log == [
        "0::True",
        "s stages a full request",
        "after (in a step: None)",  # between the steps: before room 2 ran
        "2::True",
        "3::True",
        "after (in a step: None)",  # the batch's end, as always
    ]
    log.clear()
    toys[2].deliver("x")  # no request pending any more: one call, at the end
    await settle()
    assert log == ["2:x:True", "after (in a step: None)"]


async def test_a_hook_between_steps_that_cancels_the_rest_of_the_batch_ends_it_cleanly() -> None:
    scheduler = RoomScheduler(asyncio.get_running_loop())
    log: list[str] = []
    toys: list[Toy] = []

    def cancel_the_rest() -> None:
        log.append("after")
        for toy in toys[1:]:
            scheduler.cancel(toy)  # (engine shutdown between two steps)

    scheduler.after_batch = cancel_the_rest

    class Asking(Toy):
        async def run(self) -> None:
            scheduler.rooms_ran_soon()
            await Toy.run(self)

    toys += [Asking(scheduler, "a", log), Toy(scheduler, "1", log), Toy(scheduler, "2", log)]
    for toy in toys:
        scheduler.start(toy)
    scheduler.run_woken()
    assert log == ["a::True", "after", "after"]  # between the steps, and the batch's end
    assert all(toy.coro is None for toy in toys[1:])  # cancelled before their first step
    assert scheduler.ready == 0


async def test_now_is_read_at_each_batch_and_every_clock_steps_steps_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's time is the scheduler's clock: read when a batch begins and every CLOCK_STEPS
    steps of it (a flight recorder's times are then a few steps' work old at most), and before
    a step outside any batch (a cancel)."""
    import kvfsm.rooms._scheduler as scheduler_module

    reads: list[float] = []

    def clock() -> float:
        reads.append(float(len(reads)))
        return reads[-1]

    monkeypatch.setattr(scheduler_module, "_monotonic", clock)
    steps = scheduler_module.CLOCK_STEPS
    scheduler = RoomScheduler(asyncio.get_running_loop(), batch=10 * steps)
    seen: list[float] = []

    class Clocked(Toy):
        async def run(self) -> None:
            try:
                while True:
                    seen.append(self.scheduler.now)
                    await SUSPEND
            except asyncio.CancelledError:
                seen.append(self.scheduler.now)
                raise

    toys = [Clocked(scheduler, str(i), []) for i in range(2 * steps + 1)]
    for toy in toys:
        scheduler.start(toy)
    before = len(reads)
    await asyncio.sleep(0)  # one batch of 2 * CLOCK_STEPS + 1 steps
    assert len(seen) == 2 * steps + 1
    assert len(reads) - before == 3  # steps 0, CLOCK_STEPS and 2 * CLOCK_STEPS
    assert seen == sorted(seen)
    assert seen[0] == seen[steps - 1] != seen[steps]
    assert seen[-1] == reads[-1]
    scheduler.cancel(toys[0])
    assert seen[-1] == reads[-1]  # a cancel reads the clock for its own step
    assert len(reads) - before == 4
