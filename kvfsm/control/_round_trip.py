"""A control link's round trip, measured on its heartbeats without a frame of its own.

NTP-style: each ``Heartbeat`` a side sends carries, besides its own ``seq``, the ``seq`` of the
last heartbeat it received from the peer (``echo``) and how long it held it before this one went
out (``held_us``). The side that sent the echoed heartbeat knows when it did, so

    rtt = now - sent_at(echo) - held

with both times on its own clock and ``held`` an interval on the peer's: the two clocks need not
agree. What the round trip includes is what a frame on the link meets: both sockets, both loops'
queues and the sealing of frames.

A heartbeat goes out only when a side had nothing else to send for ``heartbeat_s``, so a link
busy both ways measures nothing new and keeps its last figures. Sans-IO: every call takes ``now``
(``time.monotonic()`` in the control plane: the loop's clock may tick in milliseconds).
"""

from __future__ import annotations

from typing import Final

from kvfsm.control._frames import Heartbeat

__all__ = ["KEPT", "SMOOTHING", "RoundTrip"]

#: Send times of our own heartbeats kept for an echo. The peer echoes the last one it received,
#: normally our latest; a few more cover one that crossed ours on the wire.
KEPT: Final = 8
#: The weight of a new sample in the smoothed round trip (RFC 6298's alpha).
SMOOTHING: Final = 0.125


class RoundTrip:
    """One link's heartbeats both ways and the round trip they measured (loop thread)."""

    __slots__ = ("_heard_at", "_heard_seq", "_next", "_sent", "last_s", "samples", "smoothed_s")

    def __init__(self) -> None:
        self._next = 0
        #: Our heartbeats' send times by seq, oldest first (at most KEPT).
        self._sent: dict[int, float] = {}
        #: The peer's last heartbeat: its seq and when we received it.
        self._heard_seq: int | None = None
        self._heard_at = 0.0
        #: The latest round trip in seconds, and its smoothed mean; None until measured.
        self.last_s: float | None = None
        self.smoothed_s: float | None = None
        self.samples = 0

    def beat(self, now: float) -> Heartbeat:
        """The heartbeat to send at ``now``; its send time is kept for the peer's echo."""
        seq = self._next
        self._next += 1
        sent = self._sent
        sent[seq] = now
        if len(sent) > KEPT:
            del sent[next(iter(sent))]
        echo = self._heard_seq
        if echo is None:
            return Heartbeat(seq)
        held_us = max(0, round((now - self._heard_at) * 1e6))
        return Heartbeat(seq, echo, held_us)

    def heard(self, frame: Heartbeat, now: float) -> float | None:
        """The peer's heartbeat, received at ``now``: the round trip it completes, if any."""
        self._heard_seq, self._heard_at = frame.seq, now
        echo = frame.echo
        if echo is None:
            return None
        sent = self._sent.get(echo)
        if sent is None:  # never ours, or older than what is kept
            return None
        # The peer echoes the latest it received: ours before this one will not be echoed again.
        for seq in [s for s in self._sent if s < echo]:
            del self._sent[seq]
        rtt = now - sent - frame.held_us / 1e6
        if rtt < 0:  # a peer claiming it held ours longer than the round trip took
            return None
        self.last_s = rtt
        smoothed = self.smoothed_s
        self.smoothed_s = rtt if smoothed is None else smoothed + SMOOTHING * (rtt - smoothed)
        self.samples += 1
        return rtt
