"""Write leases: the writer's half of fencing (design law 4).

A prefill process frozen (SIGSTOP, a GC pause, a VM stall) longer than decode's grace used to
resume and post chunks it had queued before the freeze into pages decode had declared settled
and reused. The cure is a lease: the page owner (the decode control link) grants the writer the
right to write until some time, and the writer posts a WRITE only while it holds a valid lease,
checked on the poster thread right before each ``nixl.transfer()``, not when the chunk was
queued. However long the writer was frozen, the first thing it does with a queued chunk after
resuming is that check, and an expired lease stops it.

Rules:

* A **fence** is an int naming one grantor's lease; the control plane uses its link generation,
  so a reconnect is a new fence. 0 means "unfenced" and is never granted.
* ``grant(fence, until)`` (loop thread) extends the lease to ``max(current, until)``; it never
  shortens one. ``until`` is on the ``time.monotonic()`` clock of *this* process and must be no
  later than the moment the owner itself considers the lease over: anchor it at the time the
  request that the grant answers was *sent*, never at the grant's receipt (a writer frozen
  between receipt and bookkeeping would otherwise stretch its own lease by the freeze).
* ``revoke(fence)`` (loop thread) ends the lease for ever: a grant for a revoked fence is
  ignored, whenever it arrives (a grant may sit in a socket buffer across a freeze).
* ``valid(fence, now)`` (any thread) is one dict read, atomic under the GIL: no lock, so the
  poster can ask right before every ``transfer()`` at the cost of about 0.1 us.
* Bounded: fences granted and not yet revoked are stored (every granted fence must be revoked
  eventually; the control plane does it when the link ends, and an expired fence stays stored
  until then, since a late but correctly anchored grant may still extend it). The last
  ``REVOKED_KEPT`` revoked ids are kept exactly; older ones fold into a watermark, the highest
  id evicted, at or below which a fence that is not live is refused. Fence ids grow (link
  generations), so the watermark only ever refuses a fence whose first grant is still
  pending after ``REVOKED_KEPT`` newer fences were revoked: a link's first grant takes one
  round trip, so a newer link lost meanwhile is fine, thousands are not plausible.

What the fence does not cover (``python -m tests.transport.fence_probe``; 2 vCPUs, NIXL 1.5.1,
details in ``docs/reliability.md (Write fencing)``), so the owner's grace must:

* a freeze between the check and ``transfer()``: from the check's return to ``transfer()``'s
  entry took 0.23 us median, 1 us p99, 46 us at most idle and 100 us with a GIL-hungry thread
  (1500 chunks each); a GIL hand-off there can cost a switch interval (5 ms), and a freeze
  is as long as it is;
* a freeze inside ``transfer()``: on the shared-memory (CMA) path the copy runs inside the
  call, 62 us per 1 MiB chunk, 1.4 ms per 16 MiB, 9.9 ms per 64 MiB (medians); over TCP the
  call returns PROC but has already pushed bytes for 0.15 ms (1 MiB) to 3.7 ms (16 MiB);
* bytes of a WRITE posted before the lease ended and still queued (progress-driven
  transports): released at once, they drain while the pump progresses, or, if the owner is
  unreachable, whenever it is reachable again.

The owner cannot refuse a write on these transports: ``remove_remote_agent`` on decode is a
no-op (decode never added the writer), and deregistering its memory does not stop a WRITE
(measured: DONE and landed, CMA and TCP). Only RDMA checks the registration at the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["REVOKED_KEPT", "FenceError", "LeaseStats", "Leases"]

#: Revoked fence ids remembered one by one; older ones are folded into the watermark.
REVOKED_KEPT = 4096


class FenceError(Exception):
    """Raised on the poster thread when a chunk's lease is not valid before a part's
    ``transfer()``: that part and every later one were not posted."""


@dataclass(slots=True)
class LeaseStats:
    """Counters; loop thread."""

    grants: int = 0
    grants_refused: int = 0  # for a revoked fence (or 0): ignored
    revokes: int = 0


class Leases:
    """Write leases granted by page owners, one per fence id (the control plane uses its link
    generation)."""

    __slots__ = ("_revoked", "_until", "_watermark", "stats")

    def __init__(self) -> None:
        self._until: dict[int, float] = {}  # live: granted, not revoked
        self._revoked: dict[int, None] = {}  # the last REVOKED_KEPT revoked, oldest first
        self._watermark = 0  # every fence id <= this one that is not live counts as revoked
        self.stats = LeaseStats()

    def grant(self, fence: int, until: float) -> None:
        """Loop thread. Extend ``fence`` to ``until`` (``time.monotonic()``); never shortens."""
        current = self._until.get(fence)
        if current is None:
            if self._revoked_or_zero(fence):
                self.stats.grants_refused += 1
                return
            current = -math.inf
        self.stats.grants += 1
        if until > current:
            self._until[fence] = until

    def revoke(self, fence: int) -> None:
        """Loop thread. ``fence`` is invalid from now on, for ever."""
        self._until.pop(fence, None)
        self.stats.revokes += 1
        if fence <= self._watermark:
            return
        revoked = self._revoked
        revoked[fence] = None
        if len(revoked) > REVOKED_KEPT:
            oldest = next(iter(revoked))
            del revoked[oldest]
            self._watermark = max(self._watermark, oldest)

    def valid(self, fence: int, now: float) -> bool:
        """Any thread, lock-free: may a WRITE under ``fence`` be posted at ``now``?"""
        return self._until.get(fence, -math.inf) > now

    def until(self, fence: int) -> float:
        """When ``fence``'s lease ends; ``-inf`` if it was never granted or is revoked."""
        return self._until.get(fence, -math.inf)

    def describe(self, fence: int, now: float) -> str:
        """Why ``fence`` is not valid at ``now``, for a failure reason."""
        until = self._until.get(fence)
        if until is not None:
            if until > now:
                return "valid"
            return f"expired {now - until:.3g}s ago"
        if fence != 0 and self._revoked_or_zero(fence):
            return "revoked"
        return "never granted"

    def _revoked_or_zero(self, fence: int) -> bool:
        return fence == 0 or fence <= self._watermark or fence in self._revoked

    @property
    def live(self) -> int:
        """Fences granted and not revoked (expired ones included)."""
        return len(self._until)
