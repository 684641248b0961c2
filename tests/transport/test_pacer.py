"""The pump's bounded adaptive polling (sans-IO: no clock, no NIXL)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvfsm.transport._pacer import LOOP_TIMER_S, PollPacer


@dataclass
class _Chunk:
    t0: float
    nbytes: int


def test_nothing_in_flight_sleeps_the_whole_interval() -> None:
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.001)
    assert pacer.wait(10.0, []) == 0.001


def test_an_interval_under_the_loops_timer_resolution_sleeps_the_resolution() -> None:
    # A shorter sleep is none at all on uvloop: the pump would spin outside its budget.
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.0002)
    assert pacer.wait(10.0, []) == LOOP_TIMER_S == 0.001


def test_pacing_off_polls_every_iteration() -> None:
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.0)
    assert pacer.wait(10.0, [_Chunk(0.0, 1 << 30)]) == 0.0


def test_far_from_the_expected_completion_it_sleeps_near_it_it_spins() -> None:
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.001, initial_bps=1e9)
    chunk = _Chunk(t0=0.0, nbytes=10_000_000)  # expected at 10 ms
    assert pacer.wait(0.002, [chunk]) == 0.001
    assert pacer.wait(0.0098, [chunk]) == 0.0
    # Well past the estimate (slow or stalled): polled once per interval, not spun on.
    assert pacer.wait(0.05, [chunk]) == 0.001


def test_spinning_is_bounded_even_when_completions_stay_due() -> None:
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.001, initial_bps=1e9)
    now, spun = 0.0, 0.0
    waits = []
    while now < 0.02:
        # A chunk always due right now: the worst case for a spinner.
        wait = pacer.wait(now, [_Chunk(t0=now - 0.001, nbytes=1_000_000)])
        waits.append(wait)
        step = wait if wait else 0.00001
        spun += 0 if wait else step
        now += step
    assert 0.001 in waits
    assert spun / now < 0.5  # at most spin_s / (spin_s + max_wait_s) of the time, about


def test_the_estimate_follows_finished_chunks() -> None:
    pacer = PollPacer(spin_s=0.0005, max_wait_s=0.001, initial_bps=1e9)
    for _ in range(50):
        pacer.finished(1_000_000, 0.01)  # 100 MB/s
    assert pacer.bps == pytest.approx(1e8, rel=0.01)
    pacer.finished(0, 0.01)
    pacer.finished(1, 0.0)
    assert pacer.bps == pytest.approx(1e8, rel=0.01)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="must be"):
        PollPacer(spin_s=-1, max_wait_s=0.001)
    with pytest.raises(ValueError, match="must be"):
        PollPacer(spin_s=0, max_wait_s=0.001, initial_bps=0)
