"""``LoopThread``: posts run in order and are coalesced into few wake-ups, a failing post does
not stop the others, a flood yields to other work, and the guards (a ``call`` from the loop
thread, a post after close, a ``main`` that fails) say what went wrong. Plus the thread names an
operator sees."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvfsm.rooms._runtime import LoopThread, name_this_thread, thread_table


def started(use_uvloop: bool = True, name: str = "kvfsm-test-loop") -> LoopThread:
    async def main(stop: asyncio.Event) -> None:
        thread.ready()
        await stop.wait()

    thread = LoopThread(main, use_uvloop=use_uvloop, name=name)
    thread.start()
    return thread


def drained(thread: LoopThread) -> None:
    """Wait until everything posted so far has run (a post is FIFO behind them)."""
    done = threading.Event()
    thread.post(done.set)
    assert done.wait(10)


@pytest.mark.parametrize("use_uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_posts_from_several_threads_run_in_each_threads_order(use_uvloop: bool) -> None:
    thread = started(use_uvloop)
    try:
        seen: list[tuple[int, int]] = []

        def producer(k: int) -> None:
            for i in range(2000):
                thread.post(seen.append, (k, i))

        producers = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
        for p in producers:
            p.start()
        for p in producers:
            p.join()
        drained(thread)
        assert len(seen) == 6000
        for k in range(3):
            assert [i for kk, i in seen if kk == k] == list(range(2000))
    finally:
        thread.stop()


def test_a_burst_of_posts_costs_few_wake_ups() -> None:
    """Only the first post after a drain wakes the loop (asyncio's loop, whose
    ``call_soon_threadsafe`` can be counted)."""
    thread = started(use_uvloop=False)
    try:
        loop: Any = thread.loop
        wakes = 0
        real: Callable[..., Any] = loop.call_soon_threadsafe

        def counting(*args: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(*args)

        gate = threading.Event()
        thread.post(gate.wait, 10)  # hold the loop busy while the burst is posted
        drained_once = threading.Event()
        loop.call_soon_threadsafe = counting
        try:
            for _ in range(5000):
                thread.post(len, ())
            thread.post(drained_once.set)
            gate.set()
            assert drained_once.wait(10)
        finally:
            loop.call_soon_threadsafe = real
        assert wakes <= 2, wakes  # one for the burst (the held drain may add one)
    finally:
        thread.stop()


def test_a_failing_post_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    thread = started()
    try:
        ran: list[int] = []

        def boom() -> None:
            raise ValueError("a bug in one callback")

        with caplog.at_level("ERROR", logger="kvfsm.runtime"):
            thread.post(ran.append, 1)
            thread.post(boom)
            thread.post(ran.append, 2)
            drained(thread)
        assert ran == [1, 2]
        assert "posted callback" in caplog.text
        assert "a bug in one callback" in caplog.text
    finally:
        thread.stop()


def test_a_flood_yields_to_other_work_between_batches() -> None:
    """More posts than one drain takes: other ready callbacks get a turn before the rest."""
    thread = started()
    try:
        order: list[str] = []
        gate = threading.Event()
        thread.post(gate.wait, 10)
        for _ in range(10_000):
            thread.post(order.append, "post")

        def other() -> None:
            order.append("other")

        thread.loop.call_soon_threadsafe(other)
        gate.set()
        drained(thread)
        first_other = order.index("other")
        assert 0 < first_other < len(order) - 1, "the other callback waited for the whole flood"
        assert order.count("post") == 10_000
    finally:
        thread.stop()


def test_call_from_the_loop_thread_is_refused_instead_of_deadlocking() -> None:
    thread = started()
    try:
        answers: list[BaseException] = []

        async def nested() -> int:
            return 1

        def on_loop() -> None:
            try:
                thread.call(nested(), timeout=1)
            except RuntimeError as exc:
                answers.append(exc)

        thread.post(on_loop)
        drained(thread)
        assert len(answers) == 1
        assert "would deadlock" in str(answers[0])
        assert thread.call(nested(), timeout=5) == 1  # from another thread it works
    finally:
        thread.stop()


def test_after_stop_posts_are_refused_and_stop_is_idempotent() -> None:
    thread = started()
    thread.stop()
    thread.stop()
    assert not thread.running
    with pytest.raises(RuntimeError, match="closed"):
        thread.post(len, ())


def test_a_main_that_fails_before_ready_fails_start() -> None:
    async def main(stop: asyncio.Event) -> None:
        raise OSError("the port is taken")

    thread = LoopThread(main, name="kvfsm-test-failing")
    with pytest.raises(RuntimeError, match="failed to start") as info:
        thread.start()
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc names are Linux's")
def test_threads_carry_their_names_into_the_os_and_the_thread_table() -> None:
    thread = started(name="kvfsm-test-named")
    try:
        native = thread._thread.native_id
        with open(f"/proc/self/task/{native}/comm") as f:
            assert f.read().strip() == "kvfsm-test-name"  # the kernel keeps 15 bytes
        rows = {row["name"]: row for row in thread_table()}
        assert rows["kvfsm-test-named"]["native_id"] == native
        assert isinstance(rows["kvfsm-test-named"]["cpu_s"], float)
    finally:
        thread.stop()
    seen: list[str] = []

    def rename() -> None:
        name_this_thread("kvfsm-renamed-thread-with-a-long-name")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    other = threading.Thread(target=rename)
    other.start()
    other.join()
    assert seen == ["kvfsm-renamed-t"]


def test_the_after_drain_hook_runs_after_each_drain_and_a_raising_one_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What the engine hangs its woken rooms on: they run in the drain's own loop iteration.
    thread = started()
    try:
        seen: list[list[int]] = []
        ran: list[int] = []
        thread.after_drain = lambda: seen.append(list(ran))
        thread.post(ran.append, 1)
        thread.post(ran.append, 2)
        drained(thread)
        assert seen
        assert seen[0][:2] == [1, 2]  # after the posts of its drain, never before them

        def boom() -> None:
            raise ValueError("a bug in the hook")

        thread.after_drain = boom
        with caplog.at_level("ERROR", logger="kvfsm.runtime"):
            thread.post(ran.append, 3)
            drained(thread)
            thread.post(ran.append, 4)
            drained(thread)
        assert ran == [1, 2, 3, 4]
        assert "after-drain hook" in caplog.text
    finally:
        thread.stop()
