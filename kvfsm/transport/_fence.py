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
  unreachable, whenever it is reachable again. If the writer itself is frozen they move only
  when it progresses again: the stale-progress gate below refuses that progress.

The owner cannot refuse a write on these transports: ``remove_remote_agent`` on decode is a
no-op (decode never added the writer), and deregistering its memory does not stop a WRITE
(measured: DONE and landed, CMA and TCP). Only RDMA checks the registration at the target.

**Progress after a freeze (the stale-progress gate).** The check before ``transfer()`` stops
new posts, but over TCP a posted WRITE moves *nothing* until the writer progresses its agent:
``fence_probe --tls tcp --probes queued`` posts 128 KiB to 32 MiB, waits 2 s without
progress and finds 0 pages landed; the next progress (or a release followed by progress: a
release does not cancel) lands them all. So a writer frozen while a WRITE is in progress
lands that whole WRITE whenever it next progresses, after any freeze, into pages the owner
settled at ``its last grant + lease + margin``. The gate closes that: every call that can
progress the agent (``transfer()``, ``check_xfer_state``, ``get_new_notifs``,
``remove_remote_agent``, ...) first asks :meth:`Leases.progress_allowed`. Records are
*open* from just before their first ``transfer()`` until their final event (a held record
stays open through its quarantine: its bytes may still be queued). Rule:

* progressing at ``now`` is refused when some open record's fence has a lease that ended at
  ``until`` with ``now >= until + margin/2`` while the agent was last progressed before
  ``until + margin/4`` (``margin``: that fence's owner's, told with its grants, see
  :meth:`Leases.grant`): bytes queued then may still be queued, and pushed now they could land
  after the owner's bound (``until + margin`` at the earliest). A pump that kept progressing
  past the lease's end drained them within milliseconds (the module docstring of
  ``_pump``); only a gap of a quarter margin or more straddling the lease's end trips it.
* A refusal is final: the agent is **fenced out**. Every lease is void, the transport fails
  its chunks without another NIXL call, and the agent is never progressed, disconnected or
  closed again (its queued bytes die with the process). Restart the process (or its rank).
  Nothing less is safe: no NIXL call discards a queued WRITE, and the next progress for any
  reason (another peer's transfer, a flush-mode endpoint close) would push it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

__all__ = ["REVOKED_KEPT", "FenceError", "LeaseStats", "Leases"]

#: Revoked fence ids remembered one by one; older ones are folded into the watermark.
REVOKED_KEPT = 4096


class FenceError(Exception):
    """Raised on the poster thread when a chunk's lease is not valid before a part's
    ``transfer()``: that part and every later one were not posted."""


@dataclass(slots=True)
class LeaseStats:
    """Counters; loop thread, except ``progress_refused`` (any thread, under the gate's lock)."""

    grants: int = 0
    grants_refused: int = 0  # for a revoked fence (or 0), or after the agent was fenced out
    revokes: int = 0
    #: Progress of the agent refused by the stale-progress gate (the first one fenced it out).
    progress_refused: int = 0


class Leases:
    """Write leases granted by page owners, one per fence id (the control plane uses its link
    generation), and the stale-progress gate (module docstring).

    ``margin_s``: the page owners' ``fence_margin_s`` (one settles a lost link's pages at its
    last grant + lease + margin) for fences whose grants do not say theirs; ``inf`` (the
    default) turns the gate off for those.
    """

    __slots__ = (
        "_lock",
        "_margin",
        "_margins",
        "_open",
        "_revoked",
        "_trip_at",
        "_until",
        "_watermark",
        "fenced_out",
        "last_progress",
        "stats",
    )

    def __init__(self, margin_s: float = math.inf) -> None:
        if not margin_s >= 0:
            raise ValueError("margin_s must be >= 0")
        self._until: dict[int, float] = {}  # live: granted, not revoked
        self._revoked: dict[int, None] = {}  # the last REVOKED_KEPT revoked, oldest first
        self._watermark = 0  # every fence id <= this one that is not live counts as revoked
        self.stats = LeaseStats()
        self._margin = margin_s
        self._margins: dict[int, float] = {}  # live fences whose owner said its margin
        # The gate. Written under _lock (poster, loop and worker threads); read lock-free.
        self._lock = threading.Lock()
        #: fence -> [open records, lease end, margin]
        self._open: dict[int, list[float]] = {}
        #: The earliest ``lease end + margin/2`` among open fences: before it, nothing to judge.
        self._trip_at = math.inf
        #: When the agent was last allowed to progress (any thread).
        self.last_progress = -math.inf
        #: Why the agent was fenced out; None while it is not.
        self.fenced_out: str | None = None

    def grant(self, fence: int, until: float, margin_s: float | None = None) -> None:
        """Loop thread. Extend ``fence`` to ``until`` (``time.monotonic()``); never shortens.
        ``margin_s``: the owner's fence margin for this fence (None: the default)."""
        current = self._until.get(fence)
        if current is None:
            if self._revoked_or_zero(fence) or self.fenced_out is not None:
                self.stats.grants_refused += 1
                return
            current = -math.inf
        self.stats.grants += 1
        if margin_s is not None and self._margins.get(fence) != margin_s:
            self._margins[fence] = margin_s
            self._update_open(fence)
        if until > current:
            self._until[fence] = until
            self._update_open(fence)

    def revoke(self, fence: int) -> None:
        """Loop thread. ``fence`` is invalid from now on, for ever (an open record of it keeps
        its last lease end and margin for the gate)."""
        self._until.pop(fence, None)
        self._margins.pop(fence, None)
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

    def margin(self, fence: int) -> float:
        """The owner's fence margin the gate uses for ``fence``."""
        return self._margins.get(fence, self._margin)

    def describe(self, fence: int, now: float) -> str:
        """Why ``fence`` is not valid at ``now``, for a failure reason."""
        if self.fenced_out is not None:
            return f"void: {self.fenced_out}"
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

    # -- the stale-progress gate ---------------------------------------------------------------

    def opened(self, fence: int) -> None:
        """Poster thread, right before a record's first ``transfer()`` (its lease was just
        checked valid): the record may have bytes queued in the agent until :meth:`closed`."""
        with self._lock:
            entry = self._open.get(fence)
            if entry is not None:
                entry[0] += 1
                return
            entry = [1, self._until.get(fence, -math.inf), self.margin(fence)]
            self._open[fence] = entry
            self._recompute()

    def closed(self, fence: int) -> None:
        """Loop thread: a record :meth:`opened` under ``fence`` had its final event."""
        with self._lock:
            entry = self._open.get(fence)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] <= 0:
                del self._open[fence]
                self._recompute()

    def progress_allowed(self, now: float) -> bool:
        """Any thread, right before a NIXL call that can progress the agent: may it progress at
        ``now``? False once the agent is fenced out (for ever). One comparison unless an open
        record's lease ended at least half its margin ago."""
        if now < self._trip_at:
            self.last_progress = now
            return True
        return self._judge(now)

    def _judge(self, now: float) -> bool:
        with self._lock:
            if self.fenced_out is not None:
                self.stats.progress_refused += 1
                return False
            last = self.last_progress
            for fence, (count, until, margin) in self._open.items():
                if now >= until + margin / 2 and last < until + margin / 4:
                    self.stats.progress_refused += 1
                    self.fenced_out = (
                        f"NIXL agent fenced out: {int(count)} record(s) of fence {fence} may "
                        f"still have bytes queued, its lease ended {now - until:.3g}s ago "
                        f"(page owner's margin {margin:g}s), and the agent was last "
                        f"progressed {now - last:.3g}s ago (this process was stopped or "
                        "starved); progressed now, they could land after the page owner "
                        "reused its pages, so the agent is never progressed again: restart "
                        "this process"
                    )
                    self._trip_at = -math.inf  # every later call takes this path: refused
                    self._until.clear()  # and no lease is valid any more
                    return False
            self.last_progress = now
            return True

    def _update_open(self, fence: int) -> None:
        # Loop thread: a grant moved an open fence's lease end or margin.
        if fence not in self._open:
            return
        with self._lock:
            entry = self._open.get(fence)
            if entry is not None:
                entry[1] = max(entry[1], self._until.get(fence, -math.inf))
                entry[2] = self.margin(fence)
                self._recompute()

    def _recompute(self) -> None:
        # Under _lock.
        if self.fenced_out is None:
            self._trip_at = min((e[1] + e[2] / 2 for e in self._open.values()), default=math.inf)
