"""A control link's round trip, measured on the frames both ends send anyway, without a frame of
its own.

NTP-style: a frame that answers nothing carries the number of the last such frame it received
from the peer (``echo``) and how long it held it before this one went out (``held_us``). The end
that sent the echoed frame knows when it did, so

    rtt = now - sent_at(echo) - held

with both times on its own clock and ``held`` an interval on the peer's: the two clocks need not
agree. Two exchanges carry it:

* ``Heartbeat``\\ s, both ways: each echoes the peer's last heartbeat. A heartbeat goes out only
  when a side had nothing else to send for ``heartbeat_s``, so they flow on an idle link whose
  heartbeat is shorter than the lease renewal, not otherwise.
* The lease exchange, which runs on every live link every ``lease_s / 4`` whatever else it
  carries: decode answers prefill's ``LeaseRequest(seq)`` at once with ``LeaseGrant(seq)``, so
  prefill's round trip is the grant's arrival less the request's send time; and each request
  echoes the last grant prefill received, so decode takes its own from the next request.

What a round trip includes is what any frame on the link meets: both sockets, both loops' queues
and the sealing of frames. Sans-IO: every call takes ``now`` (``time.monotonic()`` in the
control plane: the loop's clock may tick in milliseconds).
"""

from __future__ import annotations

from typing import Final

from kvfsm.control._frames import Heartbeat, LeaseRequest

__all__ = ["KEPT", "SMOOTHING", "RoundTrip"]

#: Send times kept for an echo, per exchange. The peer echoes the last one it received, normally
#: our latest; a few more cover one that crossed ours on the wire.
KEPT: Final = 8
#: The weight of a new sample in the smoothed round trip (RFC 6298's alpha).
SMOOTHING: Final = 0.125


def _keep(sent: dict[int, float], seq: int, now: float) -> None:
    sent[seq] = now
    if len(sent) > KEPT:
        del sent[next(iter(sent))]


def _since(sent: dict[int, float], echo: int) -> float | None:
    """When ``echo`` was sent, forgetting every earlier one (the peer echoes the latest it
    received: ours before an echoed one will not be echoed after it)."""
    at = sent.get(echo)
    if at is not None:
        for seq in [s for s in sent if s < echo]:
            del sent[seq]
    return at


def _held_us(heard: tuple[int, float] | None, now: float) -> tuple[int | None, int]:
    if heard is None:
        return None, 0
    seq, at = heard
    return seq, max(0, round((now - at) * 1e6))


class RoundTrip:
    """One link's echoes both ways and the round trip they measured (loop thread)."""

    __slots__ = (
        "_beats",
        "_heard_beat",
        "_heard_grant",
        "_leases",
        "_next",
        "last_s",
        "samples",
        "smoothed_s",
    )

    def __init__(self) -> None:
        self._next = 0
        #: Our heartbeats' send times by seq, oldest first (at most KEPT).
        self._beats: dict[int, float] = {}
        #: Prefill: its lease requests' send times by seq; decode: its grants'.
        self._leases: dict[int, float] = {}
        #: The peer's last heartbeat, and (prefill) decode's last grant: seq and when received.
        self._heard_beat: tuple[int, float] | None = None
        self._heard_grant: tuple[int, float] | None = None
        #: The latest round trip in seconds, and its smoothed mean; None until measured.
        self.last_s: float | None = None
        self.smoothed_s: float | None = None
        self.samples = 0

    # -- heartbeats, both ends ---------------------------------------------------------------

    def beat(self, now: float) -> Heartbeat:
        """The heartbeat to send at ``now``; its send time is kept for the peer's echo."""
        seq = self._next
        self._next += 1
        _keep(self._beats, seq, now)
        echo, held_us = _held_us(self._heard_beat, now)
        return Heartbeat(seq) if echo is None else Heartbeat(seq, echo, held_us)

    def heard(self, frame: Heartbeat, now: float) -> float | None:
        """The peer's heartbeat, received at ``now``: the round trip it completes, if any."""
        self._heard_beat = (frame.seq, now)
        return self._echoed(self._beats, frame.echo, frame.held_us, now)

    # -- the lease exchange --------------------------------------------------------------------

    def ask(self, seq: int, now: float) -> LeaseRequest:
        """Prefill: lease request ``seq`` goes out at ``now``, echoing decode's last grant."""
        _keep(self._leases, seq, now)
        echo, held_us = _held_us(self._heard_grant, now)
        return LeaseRequest(seq) if echo is None else LeaseRequest(seq, echo, held_us)

    def answered(self, seq: int, now: float) -> float | None:
        """Prefill: decode's grant of request ``seq``, received at ``now`` (decode answers at
        once: the time it held the request is its handling, part of any frame's trip)."""
        self._heard_grant = (seq, now)
        return self._echoed(self._leases, seq, 0, now)

    def asked(self, frame: LeaseRequest, now: float) -> float | None:
        """Decode: prefill's lease request, received at ``now``: the round trip of the grant it
        echoes, if any."""
        return self._echoed(self._leases, frame.echo, frame.held_us, now)

    def grant(self, seq: int, now: float) -> None:
        """Decode: the grant of request ``seq`` goes out at ``now``."""
        _keep(self._leases, seq, now)

    # -- the measure ---------------------------------------------------------------------------

    def _echoed(
        self, sent: dict[int, float], echo: int | None, held_us: int, now: float
    ) -> float | None:
        if echo is None:
            return None
        at = _since(sent, echo)
        if at is None:  # never ours, or older than what is kept
            return None
        rtt = now - at - held_us / 1e6
        if rtt < 0:  # a peer claiming it held ours longer than the round trip took
            return None
        self.last_s = rtt
        smoothed = self.smoothed_s
        self.smoothed_s = rtt if smoothed is None else smoothed + SMOOTHING * (rtt - smoothed)
        self.samples += 1
        return rtt
