"""``VirtualClock``: time for kvfsm's sans-IO cores, which never read a clock themselves.

The rules of the control channel (``kvfsm.control._routing``: leases, fences, claim and
tombstone lifetimes) and of a room (``kvfsm.rooms.RoomCore``) take ``now`` as an argument, so a
test can walk them through minutes of deadlines in microseconds, and exactly: hand them
``clock.now`` (or the clock itself, where a ``Callable[[], float]`` is wanted) and
:meth:`VirtualClock.advance` between calls. Nothing sleeps, and an assertion about "after the
lease ran out" is about the lease, not about how busy the machine was.
"""

from __future__ import annotations

__all__ = ["VirtualClock"]


class VirtualClock:
    """Monotonic seconds that move only when told to."""

    __slots__ = ("now",)

    def __init__(self, start: float = 1000.0) -> None:
        # Not 0: code that treats 0 as "never" must not be fooled by the first instant.
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward ``seconds`` (>= 0); returns the new ``now``."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds} s)")
        self.now += seconds
        return self.now

    def after(self, seconds: float) -> float:
        """The time ``seconds`` from now, without moving (a deadline to compare with)."""
        return self.now + seconds
