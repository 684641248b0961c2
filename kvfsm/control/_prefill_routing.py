"""Prefill's routing core: which sender room a decode room's frames belong to, and what decode
must be told. Sans-IO; the rules are in :mod:`kvfsm.control._routing`, and the lifecycle of each
binding (a decode room ``(link, room, generation)`` and the sender serving it) is the table
``PREFILL_BINDINGS`` of :mod:`kvfsm.control._binding`.

A binding's state says which index holds it, and only ``PrefillRouting._move`` changes either:
HELD ones are in ``_held`` (by slot, oldest first, and counted in their link's quota), CLAIMED,
EXPOSED and ABORTED ones in ``_bound`` (by link, room, generation), orphans in ``_orphans`` (by
peer incarnation, room, generation). A sender points at its binding until the binding is gone.
The marks that outlive bindings (tombstones, early aborts, finished decode rooms) are TTL'd
entries, not states: no binding is left to carry them.

Quotas. Everything a decode's frames can make this core keep is counted against that decode's
link, never against a pool shared with other links: held claims (``pending_max``) and the bytes
of their page lists (``held_bytes_max``), early-abort marks (``pending_max``; over it an abort
is acknowledged and not remembered) and marks of answered decode rooms (``pending_max``; over
it the link's own oldest go). A link over a quota is counted in ``stats`` and logged once. The
early-abort marks of a lost link stay (its decode's rooms are still over), counted against its
peer host's share of lost links' marks. Marks are kept in the order they were set, so expiry
is a prefix: a tick costs what expired, plus one look per live link.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final, TypeAlias

from kvfsm.control._binding import BindingEvent, PrefillBinding, prefill_step
from kvfsm.control._frames import (
    Error,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    clip_reason,
    iter_refs,
)
from kvfsm.control._routing_common import (
    FAILED,
    Action,
    Deliver,
    GrantLease,
    RevokeLease,
    RoutingConfig,
    Send,
    Slot,
    expire,
    join_stats,
    new_stats,
)
from kvfsm.control._stage_rows import StageRows
from kvfsm.rooms import RoomKey
from kvfsm.states import (
    AbortRequested,
    DestinationReceived,
    EventRejected,
    KVPoll,
    PeerLost,
)

__all__ = ["PrefillRouting"]

_log = logging.getLogger("kvfsm.control")

_E: Final = BindingEvent
_P: Final = PrefillBinding

#: The states whose bindings are in ``_bound``: bound to a sender, on a live link.
_BOUND: Final = frozenset({_P.CLAIMED, _P.EXPOSED, _P.ABORTED})
#: The states whose bindings are in ``_orphans``: exposed, their link lost.
_ORPHANS: Final = frozenset({_P.ORPHANED, _P.ORPHANED_ABORTED})
#: Decode aborted the room (then a newer generation of the id on its link may be held).
_ABORTED: Final = frozenset({_P.ABORTED, _P.ORPHANED_ABORTED})


class _Binding:
    """Decode room ``(room, gen)`` on link ``link``; its sender once bound (see the module)."""

    __slots__ = ("gen", "link", "metadata", "peer", "room", "sender", "since", "slot", "state")

    def __init__(self, link: int, peer: str, slot: Slot, gen: int, since: float) -> None:
        self.link = link
        self.peer = peer  # the decode incarnation of its link: what Reconcile names it by
        self.slot = slot  # (room id, leg of its link): what a sender takes it by
        self.room = slot[0]
        self.gen = gen
        self.since = since
        self.state = PrefillBinding.NEW  # changed only by PrefillRouting._move
        self.sender: _Sender | None = None
        self.metadata: RoomMetadata | None = None  # held until a sender takes it

    @property
    def key(self) -> RoomKey:
        """The sender room it is bound to (a bound or orphaned binding)."""
        assert self.sender is not None
        return self.sender.key


class _EarlyOwner:
    """Whose quota early-abort marks count against: a live link, or (once links are lost) the
    share of one peer host for the marks its lost links left. ``slots``: its marks, in the
    order they were given to it."""

    __slots__ = ("host", "slots")

    def __init__(self, host: str) -> None:
        self.host = host
        self.slots: dict[Slot, None] = {}


#: An early abort: (when, decode incarnation, generation, reason, whose quota it counts against).
_Early: TypeAlias = tuple[float, str, int, str, _EarlyOwner]

#: Longest reason an early-abort mark keeps (a decode's reason is up to 1,024 characters: with
#: 4,096 marks a link, the reasons alone would cost 4 MiB of it).
_KEPT_REASON: Final = 256
_TRUNCATED: Final = " [truncated]"


class _Sender:
    __slots__ = ("binding", "ended", "key", "known", "slot")

    def __init__(self, key: RoomKey, leg: int = 0) -> None:
        self.key = key
        #: (room id, leg): what claims name it by (see "Legs" in the routing rules).
        self.slot: Slot = (key.room, leg)
        self.binding: _Binding | None = None
        self.ended = False
        #: A decode room claimed it or aborted it early: no tombstone is needed for it.
        self.known = False


class _PrefillLink:
    __slots__ = (
        "asked",
        "finished",
        "held",
        "held_bytes",
        "leg",
        "legs",
        "margin_s",
        "marks",
        "noted",
        "peer",
        "requests",
        "rows",
        "seq",
        "until",
    )

    def __init__(self, peer: str, leg: int = 0, legs: int = 1, host: str = "") -> None:
        self.peer = peer
        #: A pipeline stage holding none of some state type: decode's state rows as this
        #: link's summary numbers them (``_stage_rows``); None: they need no translation.
        self.rows: StageRows | None = None
        #: Decode's fence margin for this link (``Hello.fence_margin_ms``); None: not told.
        self.margin_s: float | None = None
        #: Which of the decode ranks this prefill rank writes each room into the link's peer
        #: is (``leg``), of how many (``legs``): 0 of 1 unless decode's attention TP is larger
        #: or this rank also sends a state-only leg (KV heads replicated on both sides).
        self.leg = leg
        self.legs = legs
        self.held = 0  # claims held for rooms that do not exist yet (quota: pending_max)
        self.held_bytes = 0  # the bytes of their page lists (quota: held_bytes_max)
        #: Its early-abort marks still kept (quota: pending_max); the host's once it is lost.
        self.marks = _EarlyOwner(host)
        #: Decode rooms of this link already answered, (room, gen) -> when, oldest first
        #: (quota: pending_max, its own oldest go): a late frame of one is stale.
        self.finished: dict[tuple[int, int], float] = {}
        self.noted: set[str] = set()  # the quotas it went over (each logged once)
        self.seq = 0
        self.asked = -math.inf  # when the last lease request went out
        self.requests: dict[int, float] = {}  # lease request seq -> when it was sent
        self.until = -math.inf  # when the latest lease granted on the link runs out


class PrefillRouting:
    """Prefill's routing rules (:mod:`kvfsm.control._routing`). Loop thread only."""

    def __init__(
        self, config: RoutingConfig | None = None, stats: dict[str, int] | None = None
    ) -> None:
        self.config = config if config is not None else RoutingConfig()
        #: Counters, added to ``stats`` when given (the control plane shares its dict).
        self.stats = new_stats() if stats is None else join_stats(stats)
        self._links: dict[int, _PrefillLink] = {}
        self._senders: dict[RoomKey, _Sender] = {}
        #: Senders no decode room has claimed yet, with when they were spawned and
        #: ``_stalled_s`` then, oldest first (so a tick expires a prefix).
        self._unclaimed: dict[RoomKey, tuple[float, float]] = {}
        #: Seconds this process has stood still in all, as the ticks were told (``tick``).
        self._stalled_s = 0.0
        self._current: dict[Slot, _Sender] = {}  # (room id, leg) -> newest sender
        # The bindings by state (kept by ``_move`` alone): CLAIMED, EXPOSED and ABORTED ones
        # by (link, room, gen); HELD ones by slot, oldest first (and counted on their link);
        # orphans by (peer, room, gen).
        self._bound: dict[tuple[int, int, int], _Binding] = {}
        self._held: dict[Slot, list[_Binding]] = {}
        self._orphans: dict[tuple[str, int, int], _Binding] = {}
        self._tombstones: dict[Slot, tuple[float, str]] = {}
        # Every early-abort mark, oldest first (all share one TTL, so expiry is a prefix); each
        # also counts in its owner's ``slots``: its live link's, or its lost link's host's.
        self._early: dict[Slot, _Early] = {}
        self._retained: dict[str, _EarlyOwner] = {}  # host -> marks its lost links left
        self._retained_count = 0  # their sum

    # -- reads (tests, operators) ---------------------------------------------------------------

    def entries(self) -> dict[str, int]:
        """How many entries of each kind are kept: all zero once every room is gone."""
        return {
            "senders": len(self._senders),
            "unclaimed": len(self._unclaimed),
            "current": len(self._current),
            "bound": len(self._bound),
            "held": sum(len(v) for v in self._held.values()),
            "orphans": len(self._orphans),
            "tombstones": len(self._tombstones),
            "early_aborts": len(self._early),
            "finished": sum(len(state.finished) for state in self._links.values()),
            "held_bytes": sum(state.held_bytes for state in self._links.values()),
        }

    def bound_to(self, link: int) -> list[RoomKey]:
        return [b.key for b in self._bound.values() if b.link == link]

    # -- links ----------------------------------------------------------------------------------

    def link_opened(
        self,
        link: int,
        peer: str,
        now: float,
        hello_sent: float,
        lease_ms: int | None = None,
        *,
        leg: int = 0,
        legs: int = 1,
        margin_ms: int = 0,
        host: str = "",
        rows: StageRows | None = None,
    ) -> list[Action]:
        """A link after the Hello exchange. Decode's Hello answers ours, sent at ``hello_sent``,
        and grants ``lease_ms`` (``Hello.lease_ms``; None: this side's ``lease_s``, for a peer
        known to share the configuration): the first lease. 0: none until a ``LeaseGrant``.
        ``margin_ms``: decode's fence margin (``Hello.fence_margin_ms``; 0: not told), passed
        on with every lease of this link. ``leg`` of ``legs``: see "Legs" in the routing
        rules. ``host``: the peer's address as the link bounds count it (``peer_host``): the
        early-abort marks the link leaves when it is lost count against that host's share.
        ``rows``: how decode's state rows translate for this link (a pipeline stage that holds
        none of some state type), or None."""
        if lease_ms is None:
            lease_ms = round(self.config.lease_s * 1000)
        state = _PrefillLink(peer, leg, legs, host)
        state.rows = rows
        if margin_ms > 0:
            state.margin_s = margin_ms / 1000.0
        self._links[link] = state
        state.requests[0] = state.asked = hello_sent
        if lease_ms <= 0:
            del state.requests[0]
            return []
        return self.lease_granted(link, 0, lease_ms, now)

    def lease_due(self, link: int, now: float) -> list[Action]:
        """Ask for the next lease if the last request is ``renew_s`` old."""
        state = self._links.get(link)
        if state is None:
            return []
        if now - state.asked < self.config.renew_s:
            return []
        state.seq += 1
        state.requests[state.seq] = state.asked = now
        # Keep a few: a grant for an older request still extends nothing newer.
        for old in [s for s in state.requests if s < state.seq - 8]:
            del state.requests[old]
        return [Send(link, LeaseRequest(state.seq))]

    def lease_granted(self, link: int, seq: int, lease_ms: float, now: float) -> list[Action]:
        state = self._links.get(link)
        if state is None:
            return []
        sent = state.requests.pop(seq, None)
        if sent is None:
            self.stats["stale_frames"] += 1
            return []
        self.stats["leases_granted"] += 1
        until = sent + lease_ms / 1000.0
        state.until = max(state.until, until)
        return [GrantLease(link, until, state.margin_s)]

    def link_lost(self, link: int, reason: str, now: float) -> list[Action]:
        state = self._links.pop(link, None)
        out: list[Action] = [RevokeLease(link)]
        if state is None:
            return out
        if now < state.until:  # the revocation is what stops writes the lease still allowed
            self.stats["leases_fenced"] += 1
        for binding in [b for b in self._bound.values() if b.link == link]:
            out.append(Deliver(binding.key, PeerLost(reason)))
            # One that had the pages may still have writes to drain: it is an orphan, which
            # decode may ask after (Reconcile). One that never had them is gone.
            self._move(binding, _E.LINK_LOST)
        for binding in [b for held in self._held.values() for b in held if b.link == link]:
            self._move(binding, _E.LINK_LOST)
        # Its finished marks go with it (no frame comes on a lost link again); its early-abort
        # marks stay: the decode rooms they stand for are over whatever happens to the link.
        self._retire_marks(state)
        return out

    # -- the rooms' side ------------------------------------------------------------------------

    def sender_spawned(self, key: RoomKey, now: float, leg: int = 0) -> list[Action]:
        sender = _Sender(key, leg)
        slot = sender.slot
        self._senders[key] = sender
        self._current[slot] = sender
        self._unclaimed[key] = (now, self._stalled_s)
        self._tombstones.pop(slot, None)  # a new room reuses the id
        waiting = self._held.get(slot)
        if waiting:
            return self._bind(sender, waiting[0])  # the oldest claim held for the id
        early = self._drop_early(slot)
        if early is not None:
            sender.known = True
            self._unclaimed.pop(key, None)
            return [Deliver(key, AbortRequested(early[3], origin="peer"))]
        return []

    def sender_outcome(self, key: RoomKey, status: KVPoll, reason: str, now: float) -> list[Action]:
        sender = self._senders.get(key)
        if sender is None or sender.ended:
            return []
        sender.ended = True
        self._unclaimed.pop(key, None)
        binding = sender.binding
        if binding is None:
            if status is KVPoll.Failed and not sender.known:
                # Failed before any decode claimed it: answer the claim when it comes.
                self._mark(self._tombstones, sender.slot, (now, reason))
            return []
        event = _E.SUCCEEDED if status is KVPoll.Success else _E.FAILED
        if binding.link not in self._links:  # an orphan: its link is gone, nobody to tell
            self._end(binding, event, now)
            return []
        out: list[Action] = [
            Send(
                binding.link,
                RoomOutcome(binding.room, binding.gen, int(status), clip_reason(reason)),
            )
        ]
        if status is KVPoll.Failed and binding.state is _P.CLAIMED:
            # It never had the pages: nothing was written.
            out.append(Send(binding.link, RoomSettled(binding.room, binding.gen)))
        self._end(binding, event, now)
        return out

    def sender_settled(self, key: RoomKey, now: float) -> list[Action]:
        sender = self._senders.get(key)
        if sender is None or sender.binding is None:
            return []
        binding = sender.binding
        self._end(binding, _E.SETTLED, now)
        if binding.link not in self._links:  # an orphan: its link is gone, nobody to tell
            return []
        return [Send(binding.link, RoomSettled(binding.room, binding.gen))]

    def sender_reaped(self, key: RoomKey) -> list[Action]:
        sender = self._senders.pop(key, None)
        self._unclaimed.pop(key, None)
        if sender is None:
            return []
        if self._current.get(sender.slot) is sender:
            del self._current[sender.slot]
        if sender.binding is not None:
            # Reaped unsettled (its settle timeout gave up): the decode room is not told its
            # pages are free; it gives up on its own settle timeout.
            self._end(sender.binding, _E.REAPED, None)
        return []

    # -- frames from decode ---------------------------------------------------------------------

    def on_claim(self, link: int, frame: RoomClaim, now: float) -> list[Action]:
        return self._claim(link, frame.room, frame.generation, None, now)

    def on_metadata(self, link: int, frame: RoomMetadata, now: float) -> list[Action]:
        return self._claim(link, frame.room, frame.generation, frame, now)

    def _claim(
        self, link: int, room: int, gen: int, metadata: RoomMetadata | None, now: float
    ) -> list[Action]:
        state = self._links.get(link)
        if state is None:
            return []
        self.stats["claims"] += metadata is None
        if (room, gen) in state.finished:
            # This decode room was answered already (Failed + Settled, or Success): its page
            # list coming right behind its claim is stale. Holding it as a new claim would hand
            # pages decode has settled and reused to the id's next sender (laws 4 and 5).
            self.stats["stale_frames"] += 1
            return []
        binding = self._bound.get((link, room, gen))
        if binding is not None:  # already bound: the page list after the claim, or a repeat
            if metadata is None or binding.state is not _P.CLAIMED:
                self.stats["stale_frames"] += 1
                return []
            return self._destination(binding, metadata)
        slot = (room, state.leg)
        size = _held_size(metadata)
        for held in self._held.get(slot, ()):
            if held.link == link and held.gen == gen:  # held: keep the page list with it
                if metadata is None or held.metadata is not None:
                    self.stats["stale_frames"] += 1
                    return []
                if state.held_bytes + size > self.config.held_bytes_max:
                    # Dropped: its page list does not fit in this link's share.
                    self._move(held, _E.EXPIRED)
                    return self._over_held(state, link, room, gen, now)
                held.metadata = metadata
                state.held_bytes += size
                return []
        early = self._early.get(slot)
        if early is not None and early[1] == state.peer and early[2] != gen:
            # A newer claim of the id by the same decode supersedes its early abort (an id
            # reused at once). Another decode's claim does not: its mark is not theirs to undo.
            self._drop_early(slot)
        sender = self._current.get(slot)
        if sender is not None and not sender.ended:
            current = sender.binding
            if current is None:
                return self._bind(sender, self._new_binding(link, room, gen, metadata, now))
            if not (current.link == link and current.state in _ABORTED and gen > current.gen):
                return self._refuse(link, room, gen, "prefill already serves another receiver", now)
        else:
            tombstone = self._tombstones.pop(slot, None)
            if tombstone is not None:
                # The sender already failed; nothing was ever posted to these pages.
                return self._answer_failed(link, room, gen, tombstone[1], now)
        if any(held.link != link for held in self._held.get(slot, ())):
            # Another decode already waits for this id: ids come from clients and can collide.
            # The first keeps its claim (a newer generation on one link is a reuse: it waits).
            return self._refuse(link, room, gen, "another receiver already waits for it", now)
        if state.held >= self.config.pending_max or (
            state.held_bytes + size > self.config.held_bytes_max
        ):
            return self._over_held(state, link, room, gen, now)
        self._move(self._new_binding(link, room, gen, metadata, now), _E.HOLD)
        return []

    def on_abort(self, link: int, frame: RoomAbort, now: float) -> list[Action]:
        room, gen = frame.room, frame.generation
        binding = self._bound.get((link, room, gen))
        if binding is not None:
            abort = Deliver(binding.key, AbortRequested(frame.reason, origin="peer"))
            claimed = binding.state is _P.CLAIMED
            # Exposed: RoomSettled once its writes are over (sender_settled). Claimed, never
            # given the pages: nothing was or will be written, so it is gone and acknowledged
            # now (the sender, failed on the peer's word, reports nothing back).
            self._end(binding, _E.ABORT, now)
            return [abort, Send(link, RoomSettled(room, gen))] if claimed else [abort]
        state = self._links.get(link)
        if state is None:
            return []
        if (room, gen) in state.finished:  # too late: that room is over and settled
            self.stats["stale_frames"] += 1
            return [Send(link, RoomSettled(room, gen))]
        slot = (room, state.leg)
        for held in [b for b in self._held.get(slot, ()) if b.link == link and b.gen == gen]:
            self._move(held, _E.ABORT)
        self._finish(link, room, gen, now)
        settled = Send(link, RoomSettled(room, gen))  # no sender wrote for it
        sender = self._current.get(slot)
        if sender is not None and not sender.ended and sender.binding is None:
            # A live sender no decode room is bound to: it waits for this room's claim (lost
            # with a link, or never sent), which will not come now.
            sender.known = True
            return [Deliver(sender.key, AbortRequested(frame.reason, origin="peer")), settled]
        # No sender has it: the room, if it comes, fails at once, unless a newer claim of the
        # id comes first.
        self._set_early(state, link, slot, frame, now)
        return [settled]

    def rooms_named(self, link: int, room: int, gen: int | None) -> list[RoomKey]:
        """The sender rooms bound on ``link`` to decode room ``room`` (of ``gen``, if given)."""
        if gen is not None:
            binding = self._bound.get((link, room, gen))
            return [] if binding is None else [binding.key]
        return [
            b.key for (blink, broom, _), b in self._bound.items() if blink == link and broom == room
        ]

    def on_error(self, link: int, frame: Error) -> list[Action]:
        """Decode rejected a frame: fail exactly the room it names."""
        if frame.room is None:
            return []
        reason = f"decode rejected a frame of this room: {frame.reason}"
        keys = self.rooms_named(link, frame.room, frame.generation)
        self.stats["errors_for_rooms"] += len(keys)
        return [Deliver(key, EventRejected(reason)) for key in keys]

    def on_reconcile(self, link: int, frame: Reconcile, now: float) -> list[Action]:
        state = self._links.get(link)
        if state is None:
            return []
        out: list[Action] = []
        answered = 0
        for room, gen in iter_refs(frame.rooms):
            self.stats["reconciled"] += 1
            orphan = self._orphans.get((state.peer, room, gen))
            if orphan is not None:
                orphan.link = link  # its RoomSettled goes out here when it settles
                self._move(orphan, _E.RECONCILED)
            elif answered < self.config.pending_max:
                answered += 1
                self._finish(link, room, gen, now)
                out.append(Send(link, RoomSettled(room, gen)))
            else:
                # More unknown rooms than the link's quota of answered ones: the rest are not
                # answered. Decode settles them at its lost link's bound all the same (the
                # answer only saves that wait); answering would queue a frame per reference
                # and push out this link's own marks.
                self._over(
                    state,
                    link,
                    "reconcile_refs_over_quota",
                    f"a Reconcile names over {self.config.pending_max} rooms it does not know",
                    "the rest are not answered (decode settles them at its lost-link bound)",
                )
        return out

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float, stalled_s: float = 0.0) -> list[Action]:
        """Expire what is due. ``stalled_s``: for how long this process stood still (stopped,
        or its loop blocked) just before this tick, 0 if it did not. What decode sent meanwhile
        is still unread in the sockets, so the unclaimed bound waits for the next tick: a claim
        that came is read first, and wins."""
        ttl = self.config.pending_ttl_s
        # Marks are kept in the order they were set (``_mark`` re-inserts), so the expired ones
        # are a prefix: a tick costs what expired, not what is kept.
        expire(self._tombstones, now - ttl, lambda v: v[0])
        while self._early and now - next(iter(self._early.values()))[0] > ttl:
            self._drop_early(next(iter(self._early)))
        for state in self._links.values():
            expire(state.finished, now - ttl, lambda v: v)
        # A dict keeps its table's size once emptied: a flood's tables are given back when they
        # are empty again, not kept at their peak for the process's life.
        if not self._early:
            self._early = {}
        if not self._held:
            self._held = {}
        out: list[Action] = []
        limit = self.config.unclaimed_s
        self._stalled_s += stalled_s
        while not stalled_s and self._unclaimed:
            since, stalled_before = next(iter(self._unclaimed.values()))
            if now - since <= limit:
                break
            key = next(iter(self._unclaimed))
            del self._unclaimed[key]
            self.stats["unclaimed_failed"] += 1
            stood_still = self._stalled_s - stalled_before
            if now - since - stood_still < limit / 2:
                # Its own stall took more than half the window: decode's claim had too little of
                # this rank's running time to be read, so the stall is why. A shorter stall (a
                # loop hiccup of a tick or two) only shifts when the bound is judged: a claim
                # takes milliseconds, and one that had most of the window and never came is
                # its decode half's to explain.
                why = (
                    f"this prefill rank stood still for {stood_still:.1f}s (its process stopped "
                    f"or its loop blocked) while the room waited {limit:g}s for a decode room's "
                    "claim, and none was read once it ran again"
                )
            else:
                why = (
                    f"no decode room claimed it within {limit:g}s (its decode half never "
                    "arrived: was the request sent to decode?)"
                )
            out.append(Deliver(key, PeerLost(why)))
        expired = [b for held in self._held.values() for b in held if now - b.since > ttl]
        for binding in expired:
            self.stats["pending_dropped"] += 1
            self._move(binding, _E.EXPIRED)
            # Nothing was written into its pages: without the settle the receiver, failed by
            # its peer, would wait for an acknowledgement that never comes.
            room = binding.room
            out += self._answer_failed(
                binding.link, room, binding.gen, f"no prefill room {room} within {ttl:g}s", now
            )
        return out

    # -- helpers --------------------------------------------------------------------------------

    def _new_binding(
        self, link: int, room: int, gen: int, metadata: RoomMetadata | None, now: float
    ) -> _Binding:
        state = self._links[link]
        binding = _Binding(link, state.peer, (room, state.leg), gen, now)
        binding.metadata = metadata
        return binding

    def _bind(self, sender: _Sender, binding: _Binding) -> list[Action]:
        sender.known = True
        unclaimed = self._unclaimed.pop(sender.key, None)
        if unclaimed is not None:
            # How long decode took to claim it: what ``unclaimed_s`` must stay well above.
            waited = round((binding.since - unclaimed[0]) * 1000)
            self.stats["claim_wait_max_ms"] = max(self.stats["claim_wait_max_ms"], waited)
        binding.sender = sender
        sender.binding = binding
        self._move(binding, _E.BIND)
        metadata, binding.metadata = binding.metadata, None
        return [] if metadata is None else self._destination(binding, metadata)

    def _destination(self, binding: _Binding, frame: RoomMetadata) -> list[Action]:
        self._move(binding, _E.PAGES)
        link = self._links[binding.link]
        state, rings = frame.state, frame.rings
        if link.rows is not None:
            state, rings = link.rows.translate(state), link.rows.translate_rings(state, rings)
        event = DestinationReceived(
            frame.pages,
            frame.aux_index,
            link.peer,
            state,
            binding.link,
            frame.part,
            link.legs,
            prefix=frame.prefix,
            rings=rings,
        )
        return [Deliver(binding.key, event)]

    def _move(self, binding: _Binding, event: BindingEvent) -> None:
        """The one place a binding changes state (rule 1 of :mod:`kvfsm.control._binding`):
        along the table's edge for ``event``, and into the indexes of its new state only."""
        old = binding.state
        new = prefill_step(old, event)
        if new is old:
            return
        binding.state = new
        if old is _P.HELD:
            waiting = self._held[binding.slot]
            waiting.remove(binding)
            if not waiting:
                del self._held[binding.slot]
            link = self._links.get(binding.link)
            if link is not None:  # (a lost link's quota went with it)
                link.held -= 1
                link.held_bytes -= _held_size(binding.metadata)
        elif old in _BOUND:
            if new not in _BOUND:
                ident = (binding.link, binding.room, binding.gen)
                if self._bound.get(ident) is binding:
                    del self._bound[ident]
        elif old in _ORPHANS:
            orphan = (binding.peer, binding.room, binding.gen)
            if self._orphans.get(orphan) is binding:
                del self._orphans[orphan]
        if new is _P.HELD:
            self._held.setdefault(binding.slot, []).append(binding)
            link = self._links[binding.link]
            link.held += 1
            link.held_bytes += _held_size(binding.metadata)
        elif new in _BOUND:
            if old not in _BOUND:
                self._bound[(binding.link, binding.room, binding.gen)] = binding
        elif new in _ORPHANS:
            self._orphans[(binding.peer, binding.room, binding.gen)] = binding
        elif new is _P.GONE:
            sender = binding.sender
            if sender is not None and sender.binding is binding:
                sender.binding = None

    def _end(self, binding: _Binding, event: BindingEvent, now: float | None) -> None:
        """``event`` for a bound binding; if it is gone by it, and ``now`` is given, its
        decode room is finished with (None: given up on, as at reaping)."""
        self._move(binding, event)
        if binding.state is _P.GONE and now is not None:
            self._finish(binding.link, binding.room, binding.gen, now)

    def _refuse(self, link: int, room: int, gen: int, why: str, now: float) -> list[Action]:
        self.stats["duplicates_refused"] += 1
        return self._answer_failed(link, room, gen, f"duplicate room id {room}: {why}", now)

    def _answer_failed(
        self, link: int, room: int, gen: int, reason: str, now: float
    ) -> list[Action]:
        """Fail decode room ``(room, gen)`` that no sender wrote to, and remember it: whatever
        of it still arrives (its page list behind its claim) is stale."""
        self._finish(link, room, gen, now)
        return [
            Send(link, RoomOutcome(room, gen, FAILED, reason)),
            Send(link, RoomSettled(room, gen)),  # nothing was written
        ]

    def _over_held(
        self, state: _PrefillLink, link: int, room: int, gen: int, now: float
    ) -> list[Action]:
        """Refuse a claim or page list over its link's share of held ones: that room fails,
        nobody else's."""
        config = self.config
        if state.held >= config.pending_max:
            what = f"claims held by prefill are over their quota of {config.pending_max}"
        else:
            what = (
                f"page lists held by prefill are over their quota of {config.held_bytes_max} bytes"
            )
        self._over(state, link, "held_over_quota", what, "its rooms over it fail")
        return self._answer_failed(link, room, gen, f"this decode's {what}", now)

    def _over(
        self,
        state: _PrefillLink,
        link: int,
        counter: str,
        what: str,
        then: str,
        *,
        level: int = logging.WARNING,
    ) -> None:
        """A link went over one of its quotas: counted every time, logged once per link."""
        self.stats[counter] += 1
        if counter in state.noted:
            return
        state.noted.add(counter)
        _log.log(
            level,
            "decode link %d (%s): %s; %s (counted in %s; logged once per link)",
            link,
            state.peer,
            what,
            then,
            counter,
        )

    def _finish(self, link: int, room: int, gen: int, now: float) -> None:
        """Mark decode room ``(room, gen)`` of ``link`` answered: a late frame of it is stale.
        Within the link's quota: over it, its own oldest mark goes (another link's never)."""
        state = self._links.get(link)
        if state is None:  # a lost link: no frame comes on it again
            return
        finished = state.finished
        finished.pop((room, gen), None)
        if len(finished) >= self.config.pending_max:
            del finished[next(iter(finished))]
            self._over(
                state,
                link,
                "finished_over_quota",
                f"over {self.config.pending_max} answered rooms kept",
                "its oldest marks go first",
                # A busy link goes over it in normal service (marks only have to outlive a
                # late frame, which comes within a round trip): not a warning.
                level=logging.INFO,
            )
        finished[(room, gen)] = now

    def _set_early(
        self, state: _PrefillLink, link: int, slot: Slot, frame: RoomAbort, now: float
    ) -> None:
        """Remember an early abort, within its link's quota: one peer's flood of aborts cannot
        push out the marks of another (over quota it is acknowledged, not remembered)."""
        owner = state.marks
        old = self._early.get(slot)
        if old is not None:
            if old[4] is not owner:
                return  # another decode's abort of the id, or a lost link's: the first stands
            self._drop_early(slot)
        elif len(owner.slots) >= self.config.pending_max:
            self._over(
                state,
                link,
                "early_aborts_over_quota",
                f"over {self.config.pending_max} early-abort marks kept",
                "further early aborts are acknowledged, not remembered",
            )
            return
        why = frame.reason
        if len(why) > _KEPT_REASON:
            why = why[: _KEPT_REASON - len(_TRUNCATED)] + _TRUNCATED
        self._early[slot] = (now, state.peer, frame.generation, why, owner)
        owner.slots[slot] = None

    def _drop_early(self, slot: Slot) -> _Early | None:
        early = self._early.pop(slot, None)
        if early is not None:
            owner = early[4]
            del owner.slots[slot]
            if self._retained.get(owner.host) is owner:
                self._retained_count -= 1
                if not owner.slots:
                    del self._retained[owner.host]
        return early

    def _retire_marks(self, state: _PrefillLink) -> None:
        """A lost link's early-abort marks move to its host's share of lost links' marks
        (``pending_max * max_links_per_host``; over it, the host's oldest go) within the total
        for every host (``pending_max * max_links``; what does not fit is not kept): a host
        that opens and drops links in a loop pushes out only its own."""
        marks = list(state.marks.slots)  # oldest first
        if not marks:
            return
        config = self.config
        room = config.pending_max * config.max_links - self._retained_count
        excess = len(marks) - max(room, 0)
        if excess > 0:
            for slot in marks[:excess]:
                self._drop_early(slot)
            self.stats["early_aborts_dropped"] += excess
            marks = marks[excess:]
        host = state.marks.host
        pool = self._retained.setdefault(host, _EarlyOwner(host))
        for slot in marks:
            # Assigning an existing key keeps its place: the global order (expiry) stands.
            self._early[slot] = (*self._early[slot][:4], pool)
            pool.slots[slot] = None
        state.marks.slots.clear()
        self._retained_count += len(marks)
        share = config.pending_max * config.max_links_per_host
        while len(pool.slots) > share:
            self._drop_early(next(iter(pool.slots)))
            self.stats["early_aborts_dropped"] += 1
        if not pool.slots:
            self._retained.pop(host, None)

    def _mark(self, marks: dict[Any, Any], ident: object, value: object) -> None:
        """Set a bounded, TTL'd mark: the oldest goes first when ``pending_max`` are kept (the
        tombstones: this rank's own rooms set them, not a peer's frames)."""
        marks.pop(ident, None)
        if len(marks) >= self.config.pending_max:
            del marks[next(iter(marks))]
        marks[ident] = value


def _held_size(metadata: RoomMetadata | None) -> int:
    """What a held page list counts against its link's ``held_bytes_max``."""
    return 0 if metadata is None else len(metadata.pages) + len(metadata.state)
