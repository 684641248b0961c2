"""A chaos rank judges each scheduler-facing call on its own time (law 6): a call that blocks
is slow, and a call that the campaign's SIGSTOP of the rank's own process fell inside is not
(its wall time is the stop's), counted apart instead."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvfsm.chaos._options import CampaignOptions
from kvfsm.chaos._rank_service import RankService


@pytest.fixture
def service() -> Iterator[RankService]:
    mine, theirs = multiprocessing.Pipe()
    rank: RankService = RankService(mine, "decode", CampaignOptions())
    before = signal.signal(signal.SIGCONT, rank.continued_by_sigcont)
    signal.siginterrupt(signal.SIGCONT, False)
    try:
        yield rank
    finally:
        signal.signal(signal.SIGCONT, before)
        rank.timer.close()
        mine.close()
        theirs.close()


def test_a_call_that_blocks_is_slow(service: RankService) -> None:
    assert service.call("clear", time.sleep, 0.05) is None
    assert service.slow["clear"] == 1
    assert service.calls_stopped == 0


def test_a_call_the_process_was_stopped_inside_is_not_slow(
    service: RankService,
) -> None:
    def stopped_inside() -> str:
        # Something else resumes this process after 0.3 s, as the campaign does after a freeze.
        waker = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        waker.wait(10)
        return "cleared"

    t0 = time.monotonic()
    assert service.call("clear", stopped_inside) == "cleared"
    assert time.monotonic() - t0 >= 0.25  # the stop happened
    assert service.slow["clear"] == 0
    assert service.calls_stopped == 1
    assert service.calls == 1
