"""``Poster``: items are posted in submission order on the poster's own thread, each result
goes back to the loop as soon as its item is posted (those that pile up before the loop drains
come back in one batch), a failing post is one failed result and not a dead thread, and
close() posts what was queued first."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvfsm.transport._poster import Poster
from tests.helpers.waiting import wait_until, wait_until_sync


class Recorder:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.posted: list[int] = []
        self.posting_threads: set[str] = set()
        self.batches: list[list[tuple[int, BaseException | None]]] = []
        self.done_on_loop = True
        self.gate = threading.Event()
        self.gate.set()
        #: Set once the poster thread is inside a post (held there while ``gate`` is cleared).
        self.entered = threading.Event()
        self.all_in = asyncio.Event()
        self.expected = 0

    def post(self, item: int) -> None:
        self.entered.set()
        self.gate.wait(10)
        self.posting_threads.add(threading.current_thread().name)
        if item < 0:
            raise ValueError(f"cannot post {item}")
        self.posted.append(item)

    def done(self, batch: list[tuple[int, BaseException | None]]) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        self.done_on_loop = self.done_on_loop and running is self.loop
        self.batches.append(batch)
        if sum(len(b) for b in self.batches) >= self.expected:
            self.all_in.set()


@pytest.mark.asyncio
async def test_items_are_posted_in_order_off_the_loop_and_answered_on_it() -> None:
    rec = Recorder(asyncio.get_running_loop())
    poster: Poster[int] = Poster(rec.post, rec.done, name="kvfsm-poster-test")
    poster.start(rec.loop)
    try:
        rec.expected = 500
        for i in range(500):
            poster.submit(i)
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert rec.posted == list(range(500))
        assert rec.posting_threads == {"kvfsm-poster-test"}
        assert rec.done_on_loop
        assert [item for batch in rec.batches for item, _ in batch] == list(range(500))
        assert all(error is None for batch in rec.batches for _, error in batch)
    finally:
        poster.close()


@pytest.mark.asyncio
async def test_results_that_pile_up_before_the_loop_drains_come_back_in_one_batch() -> None:
    rec = Recorder(asyncio.get_running_loop())
    poster: Poster[int] = Poster(rec.post, rec.done)
    poster.start(rec.loop)
    try:
        rec.gate.clear()  # the poster blocks in its first post
        rec.expected = 200
        for i in range(200):
            poster.submit(i)
        await wait_until(rec.entered.is_set, message="the poster inside its first post")
        rec.gate.set()
        # The loop is busy (blocked here, on purpose) while all 200 are posted: one wake-up
        # was scheduled, for the first result, and every later one joins its batch.
        wait_until_sync(lambda: len(rec.posted) == 200, message="all 200 items posted")
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert [len(b) for b in rec.batches] == [200]
        assert rec.posted == list(range(200))
    finally:
        poster.close()


@pytest.mark.asyncio
async def test_a_result_comes_back_while_the_next_item_is_still_being_posted() -> None:
    # A merged request is milliseconds of copy inside post(): the rooms of the one before it
    # must not wait for it to end.
    rec = Recorder(asyncio.get_running_loop())
    second = threading.Event()
    post = rec.post

    def slow_second(item: int) -> None:
        if item == 1:
            second.wait(10)
        post(item)

    poster: Poster[int] = Poster(slow_second, rec.done)
    poster.start(rec.loop)
    try:
        rec.expected = 1
        poster.submit(0)
        poster.submit(1)
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert rec.batches == [[(0, None)]]
        assert not second.is_set()  # item 1 is still in its post
        rec.all_in.clear()
        rec.expected = 2
        second.set()
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert rec.batches == [[(0, None)], [(1, None)]]
    finally:
        poster.close()


@pytest.mark.asyncio
async def test_a_failing_post_is_a_failed_result_and_the_next_items_still_go() -> None:
    rec = Recorder(asyncio.get_running_loop())
    poster: Poster[int] = Poster(rec.post, rec.done)
    poster.start(rec.loop)
    try:
        rec.expected = 3
        for item in (1, -2, 3):
            poster.submit(item)
        await asyncio.wait_for(rec.all_in.wait(), 10)
        results = [pair for batch in rec.batches for pair in batch]
        assert [item for item, _ in results] == [1, -2, 3]
        errors = {item: error for item, error in results}
        assert errors[1] is None
        assert errors[3] is None
        assert isinstance(errors[-2], ValueError)
        assert rec.posted == [1, 3]
    finally:
        poster.close()


def test_close_posts_what_was_queued_then_stops_and_is_idempotent() -> None:
    loop = asyncio.new_event_loop()
    try:
        rec = Recorder(loop)
        poster: Poster[int] = Poster(rec.post, rec.done)
        poster.close()  # never started: nothing to stop
        rec.gate.clear()
        poster.start(loop)
        for i in range(50):
            poster.submit(i)
        rec.gate.set()
        poster.close()
        poster.close()
        assert rec.posted == list(range(50))
        # the results wait on the loop until it runs
        rec.expected = 50
        loop.run_until_complete(asyncio.wait_for(rec.all_in.wait(), 10))
        assert sum(len(b) for b in rec.batches) == 50
    finally:
        loop.close()


def test_results_for_a_closed_loop_are_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    rec = Recorder(loop)
    poster: Poster[int] = Poster(rec.post, rec.done)
    poster.start(loop)
    loop.close()
    with caplog.at_level("WARNING", logger="kvfsm.transport"):
        poster.submit(7)
        poster.close()
    assert rec.posted == [7]  # posted; nobody is left to hear about it
    assert "loop closed with 1 results undelivered" in caplog.text
