"""``PollPacer``: how long the pump waits between poll rounds while chunks are in flight.

NIXL completion is polling only (``check_xfer_state``; no callback, no fd), so a pump that polls
in a tight loop finds each chunk done the moment it is, and burns a core doing it: CPU the
scheduler thread pays for through the GIL. One that sleeps a fixed interval adds up to that
interval to every chunk. The pacer spends its polling where completions are due:

* It keeps an estimate of the data path's throughput (an exponentially weighted mean of
  ``nbytes / seconds`` over finished chunks, seconds from acceptance to the round that found
  the chunk done), so every in-flight chunk has an *expected* completion,
  ``accepted + nbytes / throughput``.
* Within ``spin_s`` of the earliest expected completion, on either side, the pump polls
  without sleeping (it yields to the loop only). Outside that window it sleeps ``max_wait_s``
  (``LOOP_TIMER_S`` at least) between rounds: a chunk that finishes well before its estimate
  is found at most ``max_wait_s`` late (the latency cost), one that is stalled costs one round
  per ``max_wait_s``.
* Spinning is bounded: after ``spin_s`` of consecutive rounds without a sleep, the next round
  sleeps ``max_wait_s`` whatever the estimate says, so the pump never holds more than about
  ``spin_s / (spin_s + max_wait_s)`` of a core, even with a stream of completions due.

The estimate cannot run away: a pump that polls late inflates the next estimate by at most the
lateness, which is at most ``max_wait_s``, and an estimate within ``spin_s`` of the truth is
polled on time. ``max_wait_s = 0`` turns pacing off (poll every loop iteration). Sans-IO: no
clock (``now`` is passed in), no asyncio, loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Protocol

__all__ = ["LOOP_TIMER_S", "PollPacer"]

#: The shortest wait the event loop keeps: loops time in whole milliseconds, and uvloop runs a
#: shorter sleep on its next iteration, no wait at all. A loop-thread poll with a shorter
#: interval is a spin that holds a core (decode's agent progress every 0.5 ms: 60% of one on a
#: busy rank), so the pump's waits and that progress are never shorter; a wait of 0 is the
#: explicit spin (``TransferConfig.poll_max_wait_s = 0``).
LOOP_TIMER_S: Final = 0.001

#: Weight of the newest sample in the throughput estimate.
_ALPHA: Final = 0.25
#: Until the first chunk finishes: about what a DRAM path moves here (the first estimate only
#: decides when the first round spins).
_INITIAL_BPS: Final = 4e9


class _InFlight(Protocol):
    t0: float
    nbytes: int


class PollPacer:
    __slots__ = ("bps", "max_wait_s", "spin_s", "_spin_since", "spins", "sleeps")

    def __init__(self, spin_s: float, max_wait_s: float, initial_bps: float = _INITIAL_BPS):
        if spin_s < 0 or max_wait_s < 0 or not initial_bps > 0:
            raise ValueError("spin_s and max_wait_s must be >= 0, initial_bps > 0")
        self.spin_s = spin_s
        self.max_wait_s = max_wait_s
        #: Estimated throughput of one chunk, bytes per second.
        self.bps = initial_bps
        self._spin_since: float | None = None
        #: Rounds that yielded without sleeping, and rounds that slept (counters).
        self.spins = 0
        self.sleeps = 0

    def finished(self, nbytes: int, seconds: float) -> None:
        """A chunk of ``nbytes`` was found done ``seconds`` after it was accepted."""
        if nbytes > 0 and seconds > 0:
            self.bps += _ALPHA * (nbytes / seconds - self.bps)

    def wait(self, now: float, in_flight: Iterable[_InFlight]) -> float:
        """Seconds to wait before the next round (0: yield only)."""
        if self.max_wait_s <= 0:
            return 0.0
        bps = self.bps
        due = min((r.t0 + r.nbytes / bps for r in in_flight), default=None)
        if due is not None and abs(now - due) <= self.spin_s:
            since = self._spin_since
            if since is None:
                self._spin_since = now
                self.spins += 1
                return 0.0
            if now - since < self.spin_s:
                self.spins += 1
                return 0.0
        # Always the whole interval, and never under the loop's timer resolution: a shorter
        # wait would be a spin outside the budget.
        self._spin_since = None
        self.sleeps += 1
        return max(self.max_wait_s, LOOP_TIMER_S)
