"""cancel_and_wait: the stopped task's cancellation ends there, the caller's does not."""

from __future__ import annotations

import asyncio

import pytest

from kvfsm._tasks import cancel_and_wait

# Virtual time (looptime): cancel_and_wait and these tasks run on the loop only, so their
# sleeps and timeouts move its clock and cost no real time.
pytestmark = pytest.mark.looptime


async def _slow_to_stop(stopping: asyncio.Event, cleanup_s: float) -> None:
    """Runs until cancelled, then takes ``cleanup_s`` (of the loop's clock) to clean up, as
    the pump's release does."""
    try:
        await asyncio.Event().wait()
    finally:
        stopping.set()
        await asyncio.shield(asyncio.sleep(cleanup_s))


@pytest.mark.asyncio
async def test_tasks_are_cancelled_and_waited_for() -> None:
    stopping = asyncio.Event()
    a = asyncio.create_task(_slow_to_stop(stopping, 0.01))
    b = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    await cancel_and_wait(a, None, b)
    assert a.cancelled()
    assert b.cancelled()
    assert stopping.is_set()


@pytest.mark.asyncio
async def test_finished_and_missing_tasks_are_skipped() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancel_and_wait(None, done)
    await cancel_and_wait()
    assert done.done()
    assert not done.cancelled()


@pytest.mark.asyncio
async def test_a_timeout_around_it_still_fires() -> None:
    # The spelling it replaces swallowed the timeout's cancellation: the caller went on as if
    # the 0.05 s had not passed, and no TimeoutError was raised.
    stopping = asyncio.Event()
    task = asyncio.create_task(_slow_to_stop(stopping, 5.0))
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await cancel_and_wait(task)
    assert stopping.is_set()
    await cancel_and_wait(task)  # the cleanup itself is shielded; let it end


@pytest.mark.asyncio
async def test_a_cancelled_caller_stays_cancelled() -> None:
    stopping = asyncio.Event()
    task = asyncio.create_task(_slow_to_stop(stopping, 5.0))
    await asyncio.sleep(0)
    caller = asyncio.create_task(cancel_and_wait(task))
    await stopping.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert caller.cancelled()
    await cancel_and_wait(task)


@pytest.mark.asyncio
async def test_a_caller_already_cancelling_may_still_clean_up() -> None:
    # Cleanup after the caller itself was cancelled: only a *new* cancellation propagates, so
    # stopping a task there does not cut the rest of the cleanup short.
    stopped: list[str] = []

    async def owner() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            task = asyncio.create_task(asyncio.Event().wait())
            await asyncio.sleep(0)
            await cancel_and_wait(task)
            stopped.append("task")
            raise

    runner = asyncio.create_task(owner())
    await asyncio.sleep(0)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert stopped == ["task"]


@pytest.mark.asyncio
async def test_an_error_raised_while_stopping_propagates() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(task)
