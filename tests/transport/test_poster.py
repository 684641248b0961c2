"""``Poster``: items are posted in submission order on the poster's own thread; without a
weight each result goes back to the loop as soon as its item is posted, with one the results of
light items are held and go back together, but never behind a heavy item (those that pile up
before the loop drains come back in one batch either way); a failing post is one failed result
and not a dead thread, and close() posts what was queued first."""

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


async def queue_behind_item_0(rec: Recorder, poster: Poster[int], items: tuple[int, ...]) -> None:
    """Hold the poster inside its post of item 0 (a batch of its own), queue ``items`` behind
    it, so that they form the next batch; the caller releases ``rec.gate``."""
    rec.gate.clear()
    poster.submit(0)
    await wait_until(rec.entered.is_set, message="the poster inside its first post")
    for item in items:
        poster.submit(item)


def hand_backs(poster: Poster[int]) -> list[list[int]]:
    """The items of each hand-back, in order, as the poster thread made them (the loop may
    drain several in one batch, so ``done``'s batches cannot tell them apart)."""
    groups: list[list[int]] = []
    original = poster._hand_back

    def recording(results: list[tuple[int, BaseException | None]]) -> None:
        groups.append([item for item, _ in results])
        original(results)

    poster._hand_back = recording  # type: ignore[method-assign]
    return groups


@pytest.mark.asyncio
async def test_small_items_posted_back_to_back_go_back_together() -> None:
    # Each hand-back is a loop wake-up: items of weight 1 under a bound of 10 are held and go
    # back in runs of at most 10 posted after the first, and the rest when the queue is empty.
    rec = Recorder(asyncio.get_running_loop())
    poster: Poster[int] = Poster(rec.post, rec.done, weight=lambda _: 1, hand_back_weight=10)
    groups = hand_backs(poster)
    poster.start(rec.loop)
    try:
        rec.expected = 26
        await queue_behind_item_0(rec, poster, tuple(range(1, 26)))
        rec.gate.set()
        await asyncio.wait_for(rec.all_in.wait(), 10)
        # item 0 went back alone (its batch was itself); then 1..11 (11 held: the 12th would
        # make 11 posted after the first held one), 12..22, 23..25
        assert [item for batch in rec.batches for item, _ in batch] == list(range(26))
        assert groups == [[0], list(range(1, 12)), list(range(12, 23)), [23, 24, 25]]
        assert poster.hand_backs == 4
    finally:
        poster.close()


@pytest.mark.asyncio
async def test_held_results_go_back_before_a_heavy_item_is_posted() -> None:
    # A heavy item (a merged request: milliseconds of copy) must not hold the results of the
    # small ones before it: they go back before it starts, and it alone after.
    rec = Recorder(asyncio.get_running_loop())
    heavy_started = threading.Event()
    release_heavy = threading.Event()
    post = rec.post

    def post_slow_heavy(item: int) -> None:
        if item == 100:
            heavy_started.set()
            release_heavy.wait(10)
        post(item)

    poster: Poster[int] = Poster(
        post_slow_heavy,
        rec.done,
        weight=lambda item: 1000 if item == 100 else 1,
        hand_back_weight=64,
    )
    groups = hand_backs(poster)
    poster.start(rec.loop)
    try:
        await queue_behind_item_0(rec, poster, (1, 2, 3, 100, 4))
        rec.expected = 4  # 0, then 1..3 while 100 is still being posted
        rec.gate.set()
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert heavy_started.is_set()
        assert not release_heavy.is_set()
        assert groups == [[0], [1, 2, 3]]
        rec.all_in.clear()
        rec.expected = 6
        release_heavy.set()
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert groups == [[0], [1, 2, 3], [100, 4]]
    finally:
        poster.close()


@pytest.mark.asyncio
async def test_a_held_failure_goes_back_with_its_run_and_a_negative_bound_is_refused() -> None:
    rec = Recorder(asyncio.get_running_loop())
    poster: Poster[int] = Poster(rec.post, rec.done, weight=lambda _: 1, hand_back_weight=100)
    groups = hand_backs(poster)
    poster.start(rec.loop)
    try:
        await queue_behind_item_0(rec, poster, (1, -2, 3))
        rec.expected = 4
        rec.gate.set()
        await asyncio.wait_for(rec.all_in.wait(), 10)
        assert groups == [[0], [1, -2, 3]]
        errors = {item: error for batch in rec.batches for item, error in batch}
        assert isinstance(errors[-2], ValueError)
        assert errors[1] is None
        assert errors[3] is None
        assert rec.posted == [0, 1, 3]
    finally:
        poster.close()
    with pytest.raises(ValueError, match="hand_back_weight"):
        Poster(rec.post, rec.done, weight=lambda _: 1, hand_back_weight=-1)


@pytest.mark.asyncio
async def test_a_weight_that_raises_hands_back_first_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder(asyncio.get_running_loop())

    def weight(item: int) -> int:
        if item == 2:
            raise RuntimeError("cannot weigh 2")
        return 1

    poster: Poster[int] = Poster(rec.post, rec.done, weight=weight, hand_back_weight=100)
    groups = hand_backs(poster)
    poster.start(rec.loop)
    try:
        await queue_behind_item_0(rec, poster, (1, 2, 3))
        rec.expected = 4
        with caplog.at_level("ERROR", logger="kvfsm.transport"):
            rec.gate.set()
            await asyncio.wait_for(rec.all_in.wait(), 10)
        assert groups == [[0], [1], [2, 3]]
        assert rec.posted == [0, 1, 2, 3]
        assert "could not weigh an item" in caplog.text
    finally:
        poster.close()
