"""The control plane's per-room routing, sans-IO: frames and room commands in, actions out.

:class:`PrefillRouting` and :class:`DecodeRouting` hold every rule about which room a control frame
belongs to and what the other side must be told. They read no clock (every call that needs time
is passed ``now``), touch no socket and deliver nothing: they return :class:`Send` and
:class:`Deliver` actions, and :class:`GrantLease` / :class:`RevokeLease` for the write fence. The
``ControlPlane`` executes them. Links are named by an int the plane assigns (its link
generation), which is also the **fence** id of the writes made under that link's lease.

Rules
-----

Identity (law 5).
    A room on the wire is ``(room, generation)``, the generation being the decode room's. Decode
    routes a frame straight to ``RoomKey(room, generation)``; prefill routes it through the
    binding ``(link, room, generation)``. A reused room id is a new pair: it never touches its
    predecessor, and its predecessor's acknowledgements still reach it.

Claims (law 3).
    Decode sends ``RoomClaim`` as soon as a receiver is bound to its link, before pages are
    reserved. Prefill binds the claim to its live, unbound sender room of that id, or *holds* it
    until such a room appears (bounded per link, and by a TTL after which decode is answered
    Failed + Settled). A sender bound to a link fails with ``PeerLost`` the moment that link is
    lost, whatever its state: only a room no decode ever claimed waits out its Bootstrapping
    deadline. ``RoomMetadata`` without a claim is a claim plus metadata.

Destinations.
    A claim alone does not move a sender: only decode's ``RoomMetadata`` (its page list, sent
    at ``send_metadata``) becomes the sender's ``DestinationReceived``, the event that makes it
    WaitingForInput. It carries the frame's ``prefix`` (prompt tokens decode holds already),
    so prefill's scheduler, which reads the prefix at its first WaitingForInput to size
    ``init``, always finds it there. A page list held with its claim keeps its prefix.

Duplicates.
    A claim for a room whose live sender is already bound to another decode room, or for which
    another link's claim is held, is refused (Failed + Settled: nothing was written), and the
    first is untouched; except a newer generation on the same link after decode aborted the
    bound one (an id reused at once), which is held for the next sender of that id.

Ends (law 4).
    A sender's outcome goes to its bound decode room. Success unbinds (every write landed). A
    failure of a sender that never got decode's pages is also settled (nothing was posted). A
    failed sender that had the pages stays bound until the room reports ``ReportSettled``, which
    becomes ``RoomSettled``. A sender that fails before any decode claimed it leaves a
    *tombstone* that answers the claim when it comes (TTL-bounded), unless it was failed by an
    early abort (below), whose decode room already knows.

Legs.
    When decode's attention TP is larger than prefill's, a prefill rank writes each room into
    several decode ranks, each over its own link: its request is one sender room per decode rank,
    its *legs*, spawned as the first leg learns how many there are. The handshake says which leg
    a link's decode rank is (``link_opened(leg=, legs=)``, from both fingerprints), so a sender
    is named by ``(room, leg)`` wherever a room id alone would name it (claims, holds,
    tombstones, early aborts), and ``DestinationReceived.legs`` tells the first leg the count.
    With equal TP, or several prefill ranks per decode rank, every link is leg 0 of 1.

Early aborts.
    A ``RoomAbort`` for a room prefill has not bound is acknowledged at once (``RoomSettled``:
    nothing was written). A live sender of that id that no decode room is bound to fails at
    once (its decode room is over: the abort is all that will come); with no such sender the
    abort is remembered, and the next sender of that id fails at once, unless a newer claim for
    the id arrived since, which supersedes it.

Errors.
    An ``Error`` frame that names a room fails exactly that room (its generation, when given).

Links.
    When a link is lost, its bound rooms get ``PeerLost``. Decode's exposed rooms settle once no
    write can still land: the last lease decode granted on that link, plus ``lease_s``, plus
    ``fence_margin_s`` (a write checked against its lease just before it was posted), *and*
    only after decode's own agent has been progressed without a gap for ``fence_margin_s``
    (``tick(now, steady_s)``). A decode frozen past that bound has not taken the bytes its
    socket and prefill's agent hold for it: they land once it is progressed again, so its
    clock alone proves nothing; the steady stretch after it resumes is when they land.
    Prefill revokes the link's fence at once and keeps bindings whose sender may still write as
    *orphans*. After decode reconnects to the same prefill incarnation it sends ``Reconcile``
    with the rooms still waiting; prefill re-attaches the orphans to the new link (their
    ``RoomSettled`` goes out when they settle) and answers the unknown ones ``RoomSettled`` at
    once, so nothing waits on a message that died with a link. Decode's claimed rooms that the
    loss failed before they were exposed may never have reached prefill (a claim sent into a
    link prefill had already closed): decode sends a ``RoomAbort`` for each right after the
    ``Reconcile``, so a sender waiting for that claim fails then, not at its Bootstrapping
    deadline. Until that reconnect, decode *owes* the incarnation (``owes``): the control
    plane reconnects for it, not only when a new room needs the link.

Leases (law 4).
    Prefill sends ``LeaseRequest(seq)`` every ``lease_s / 4``, remembering when it sent each;
    decode answers ``LeaseGrant(seq, lease_ms)`` and remembers when it granted. Prefill's fence
    for the link is valid until its *send* time of the granted request plus the lease: a grant
    delayed by a freeze grants nothing. The decode side of a lost link knows no write it
    allowed starts after its last grant plus the lease.

Cleanup.
    Every per-room entry (binding, held claim, orphan) is dropped when its room is reaped, and
    every mark (tombstone, early abort, held claim) has a TTL: nothing grows with the number of
    rooms ever served.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from kvfsm.control._frames import (
    Error,
    Frame,
    LeaseGrant,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    clip_reason,
    pack_refs,
    unpack_refs,
)
from kvfsm.rooms import RoomKey
from kvfsm.states import (
    AbortRequested,
    DestinationReceived,
    Event,
    EventRejected,
    KVPoll,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    TransferConfirmed,
)

__all__ = [
    "Action",
    "DecodeRouting",
    "Deliver",
    "GrantLease",
    "PrefillRouting",
    "RevokeLease",
    "RoutingConfig",
    "Send",
]

#: A sender's identity for claims: (room id, leg). The leg is the link's: which of the decode
#: ranks a prefill rank writes each room into that link's peer is (0 but for unequal TP).
Slot: TypeAlias = tuple[int, int]

_SUCCESS: Final = int(KVPoll.Success)
_FAILED: Final = int(KVPoll.Failed)


@dataclass(frozen=True, slots=True)
class Send:
    """Queue ``frame`` on link ``link`` (dropped if the link is closed)."""

    link: int
    frame: Frame


@dataclass(frozen=True, slots=True)
class Deliver:
    """Post ``event`` to room ``key``."""

    key: RoomKey
    event: Event


@dataclass(frozen=True, slots=True)
class GrantLease:
    """Prefill: writes under fence ``fence`` may be posted until ``until`` (monotonic); the
    page owner settles a lost link's pages ``margin_s`` after that (None: unknown)."""

    fence: int
    until: float
    margin_s: float | None = None


@dataclass(frozen=True, slots=True)
class RevokeLease:
    """Prefill: no write under fence ``fence`` may be posted any more."""

    fence: int


Action: TypeAlias = Send | Deliver | GrantLease | RevokeLease


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    #: Claims and page lists held for rooms that do not exist yet: at most this many per link,
    #: this long; tombstones and early-abort marks are kept as long and at most this many.
    pending_max: int = 4096
    pending_ttl_s: float = 60.0
    #: Decode grants prefill write leases of this length.
    lease_s: float = 2.0
    #: Decode: added to the lease before a lost link's pages settle (a write posted just inside
    #: its lease; see docs/reliability.md for what is left unfenced).
    fence_margin_s: float = 1.0

    @property
    def renew_s(self) -> float:
        """How often prefill asks for a lease (four requests per lease)."""
        return self.lease_s / 4


def _stats() -> dict[str, int]:
    return {
        "stale_frames": 0,
        "duplicates_refused": 0,
        "pending_dropped": 0,
        "claims": 0,
        "reconciled": 0,
        "leases_granted": 0,
        "errors_for_rooms": 0,
        "early_aborts_over_quota": 0,
        "aborts_told_late": 0,
        "settles_held_unsteady": 0,
    }


def _expire(marks: dict[Any, Any], before: float, when: Callable[[Any], float]) -> None:
    """Drop the marks set before ``before``, oldest first, until the first one that is not."""
    while marks:
        oldest = next(iter(marks))
        if when(marks[oldest]) >= before:
            return
        del marks[oldest]


def _into(stats: dict[str, int]) -> dict[str, int]:
    for name, value in _stats().items():
        stats.setdefault(name, value)
    return stats


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------


class _Binding:
    """A decode room ``(room, gen)`` on link ``link``, bound to sender ``sender`` (or held)."""

    __slots__ = ("aborted", "destination", "gen", "link", "metadata", "room", "sender", "since")

    def __init__(self, link: int, room: int, gen: int, since: float) -> None:
        self.link = link
        self.room = room
        self.gen = gen
        self.since = since
        self.sender: RoomKey | None = None
        self.metadata: RoomMetadata | None = None  # held until a sender takes it
        self.destination = False  # DestinationReceived delivered: writes may happen
        self.aborted = False  # decode aborted it: a newer claim of the id may wait


class _Sender:
    __slots__ = ("binding", "ended", "key", "known", "slot")

    def __init__(self, key: RoomKey, leg: int = 0) -> None:
        self.key = key
        #: (room id, leg): what claims name it by (see "Legs" in the module docstring).
        self.slot: Slot = (key.room, leg)
        self.binding: _Binding | None = None
        self.ended = False
        #: A decode room claimed it or aborted it early: no tombstone is needed for it.
        self.known = False


class _PrefillLink:
    __slots__ = ("asked", "early", "held", "leg", "legs", "margin_s", "peer", "requests", "seq")

    def __init__(self, peer: str, leg: int = 0, legs: int = 1) -> None:
        self.peer = peer
        #: Decode's fence margin for this link (``Hello.fence_margin_ms``); None: not told.
        self.margin_s: float | None = None
        #: Which of the decode ranks this prefill rank writes each room into the link's peer
        #: is (``leg``), of how many (``legs``): 0 of 1 unless decode's attention TP is larger.
        self.leg = leg
        self.legs = legs
        self.held = 0  # claims held for rooms that do not exist yet (quota: pending_max)
        self.early = 0  # early-abort marks it set that are still kept (quota: pending_max)
        self.seq = 0
        self.asked = -math.inf  # when the last lease request went out
        self.requests: dict[int, float] = {}  # lease request seq -> when it was sent


class PrefillRouting:
    """Prefill's routing rules (see the module docstring). Loop thread only."""

    def __init__(
        self, config: RoutingConfig | None = None, stats: dict[str, int] | None = None
    ) -> None:
        self.config = config if config is not None else RoutingConfig()
        #: Counters, added to ``stats`` when given (the control plane shares its dict).
        self.stats = _stats() if stats is None else _into(stats)
        self._links: dict[int, _PrefillLink] = {}
        self._senders: dict[RoomKey, _Sender] = {}
        self._current: dict[Slot, _Sender] = {}  # (room id, leg) -> newest sender
        self._bound: dict[tuple[int, int, int], _Binding] = {}  # (link, room, gen)
        self._held: dict[Slot, list[_Binding]] = {}  # claims waiting for a sender
        self._orphans: dict[tuple[str, int, int], _Binding] = {}  # (peer, room, gen)
        self._tombstones: dict[Slot, tuple[float, str]] = {}
        self._early: dict[Slot, tuple[float, int, int, str]] = {}  # -> (when, link, gen, why)
        # Decode rooms this side finished with (Success, or settled): a late abort of one is
        # answered, and must not mark the id's next sender as aborted early.
        self._finished: dict[tuple[int, int, int], float] = {}

    # -- reads (tests, operators) ---------------------------------------------------------------

    def entries(self) -> dict[str, int]:
        """How many entries of each kind are kept: all zero once every room is gone."""
        return {
            "senders": len(self._senders),
            "current": len(self._current),
            "bound": len(self._bound),
            "held": sum(len(v) for v in self._held.values()),
            "orphans": len(self._orphans),
            "tombstones": len(self._tombstones),
            "early_aborts": len(self._early),
            "finished": len(self._finished),
        }

    def bound_to(self, link: int) -> list[RoomKey]:
        return [b.sender for b in self._bound.values() if b.link == link and b.sender is not None]

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
    ) -> list[Action]:
        """A link after the Hello exchange. Decode's Hello answers ours, sent at ``hello_sent``,
        and grants ``lease_ms`` (``Hello.lease_ms``; None: this side's ``lease_s``, for a peer
        known to share the configuration): the first lease. 0: none until a ``LeaseGrant``.
        ``margin_ms``: decode's fence margin (``Hello.fence_margin_ms``; 0: not told), passed
        on with every lease of this link. ``leg`` of ``legs``: see "Legs" in the module
        docstring."""
        if lease_ms is None:
            lease_ms = round(self.config.lease_s * 1000)
        state = _PrefillLink(peer, leg, legs)
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
        return [GrantLease(link, sent + lease_ms / 1000.0, state.margin_s)]

    def link_lost(self, link: int, reason: str, now: float) -> list[Action]:
        state = self._links.pop(link, None)
        out: list[Action] = [RevokeLease(link)]
        if state is None:
            return out
        for ident, binding in list(self._bound.items()):
            if binding.link != link:
                continue
            del self._bound[ident]
            key = binding.sender
            if key is None:
                continue
            out.append(Deliver(key, PeerLost(reason)))
            sender = self._senders.get(key)
            if binding.destination and sender is not None:
                # It may still have writes to drain: decode may ask after it (Reconcile).
                self._orphans[(state.peer, binding.room, binding.gen)] = binding
            elif sender is not None:
                sender.binding = None  # it never had pages: nothing to drain
        for slot, waiting in list(self._held.items()):
            kept = [b for b in waiting if b.link != link]
            self._set_held(slot, kept)
        return out

    # -- the rooms' side ------------------------------------------------------------------------

    def sender_spawned(self, key: RoomKey, now: float, leg: int = 0) -> list[Action]:
        sender = _Sender(key, leg)
        slot = sender.slot
        self._senders[key] = sender
        self._current[slot] = sender
        self._tombstones.pop(slot, None)  # a new room reuses the id
        waiting = self._held.get(slot)
        if waiting:
            binding = waiting.pop(0)
            self._set_held(slot, waiting)
            self._links[binding.link].held -= 1
            return self._bind(sender, binding)
        early = self._drop_early(slot)
        if early is not None:
            sender.known = True
            return [Deliver(key, AbortRequested(early[3], origin="peer"))]
        return []

    def sender_outcome(self, key: RoomKey, status: KVPoll, reason: str, now: float) -> list[Action]:
        sender = self._senders.get(key)
        if sender is None or sender.ended:
            return []
        sender.ended = True
        binding = sender.binding
        if binding is None:
            if status is KVPoll.Failed and not sender.known:
                # Failed before any decode claimed it: answer the claim when it comes.
                self._mark(self._tombstones, sender.slot, (now, reason))
            return []
        if binding.link not in self._links:  # an orphan: its link is gone
            if status is KVPoll.Success:
                self._drop_binding(sender, now)
            return []
        out: list[Action] = [
            Send(
                binding.link,
                RoomOutcome(binding.room, binding.gen, int(status), clip_reason(reason)),
            )
        ]
        if status is KVPoll.Success or not binding.destination:
            if status is KVPoll.Failed:  # it never had the pages: nothing was written
                out.append(Send(binding.link, RoomSettled(binding.room, binding.gen)))
            self._drop_binding(sender, now)
        return out

    def sender_settled(self, key: RoomKey, now: float) -> list[Action]:
        sender = self._senders.get(key)
        if sender is None or sender.binding is None:
            return []
        binding = sender.binding
        self._drop_binding(sender, now)
        if binding.link not in self._links:
            return []
        return [Send(binding.link, RoomSettled(binding.room, binding.gen))]

    def sender_reaped(self, key: RoomKey) -> list[Action]:
        sender = self._senders.pop(key, None)
        if sender is None:
            return []
        if self._current.get(sender.slot) is sender:
            del self._current[sender.slot]
        if sender.binding is not None:
            # Reaped unsettled (its settle timeout gave up): the decode room is not told its
            # pages are free; it gives up on its own settle timeout.
            self._drop_binding(sender, None)
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
        if (link, room, gen) in self._finished:
            # This decode room was answered already (Failed + Settled, or Success): its page
            # list coming right behind its claim is stale. Holding it as a new claim would hand
            # pages decode has settled and reused to the id's next sender (laws 4 and 5).
            self.stats["stale_frames"] += 1
            return []
        binding = self._bound.get((link, room, gen))
        if binding is not None:  # already bound: the page list after the claim, or a repeat
            if metadata is None or binding.destination:
                self.stats["stale_frames"] += 1
                return []
            return self._destination(binding, metadata)
        slot = (room, state.leg)
        for held in self._held.get(slot, ()):
            if held.link == link and held.gen == gen:  # held: keep the page list with it
                if metadata is not None and held.metadata is None:
                    held.metadata = metadata
                else:
                    self.stats["stale_frames"] += 1
                return []
        early = self._early.get(slot)
        if early is not None and (early[1], early[2]) != (link, gen):
            self._drop_early(slot)  # a newer claim of the id supersedes the early abort
        sender = self._current.get(slot)
        if sender is not None and not sender.ended:
            current = sender.binding
            if current is None:
                return self._bind(sender, self._new_binding(link, room, gen, metadata, now))
            if not (current.link == link and current.aborted and gen > current.gen):
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
        if state.held >= self.config.pending_max:
            self.stats["pending_dropped"] += 1
            reason = (
                "this decode's claims held by prefill are over their quota of "
                f"{self.config.pending_max}"
            )
            return self._answer_failed(link, room, gen, reason, now)
        state.held += 1
        self._held.setdefault(slot, []).append(self._new_binding(link, room, gen, metadata, now))
        return []

    def on_abort(self, link: int, frame: RoomAbort, now: float) -> list[Action]:
        room, gen = frame.room, frame.generation
        binding = self._bound.get((link, room, gen))
        if binding is not None and binding.sender is not None:
            binding.aborted = True
            abort = Deliver(binding.sender, AbortRequested(frame.reason, origin="peer"))
            if binding.destination:
                return [abort]  # RoomSettled once its writes are over (sender_settled)
            # Claimed, never given the pages: nothing was or will be written. Acknowledge now:
            # the sender, failed on the peer's word, reports nothing back.
            sender = self._senders.get(binding.sender)
            if sender is not None:
                self._drop_binding(sender, now)
            return [abort, Send(link, RoomSettled(room, gen))]
        if (link, room, gen) in self._finished:  # too late: that room is over and settled
            self.stats["stale_frames"] += 1
            return [Send(link, RoomSettled(room, gen))]
        state = self._links.get(link)
        if state is None:
            return []
        slot = (room, state.leg)
        waiting = self._held.get(slot, [])
        kept = [b for b in waiting if not (b.link == link and b.gen == gen)]
        if len(kept) != len(waiting):
            state.held -= len(waiting) - len(kept)
            self._set_held(slot, kept)
        self._mark(self._finished, (link, room, gen), now)
        settled = Send(link, RoomSettled(room, gen))  # no sender wrote for it
        sender = self._current.get(slot)
        if sender is not None and not sender.ended and sender.binding is None:
            # A live sender no decode room is bound to: it waits for this room's claim (lost
            # with a link, or never sent), which will not come now.
            sender.known = True
            return [Deliver(sender.key, AbortRequested(frame.reason, origin="peer")), settled]
        # No sender has it: the room, if it comes, fails at once, unless a newer claim of the
        # id comes first.
        self._set_early(slot, (now, link, gen, frame.reason))
        return [settled]

    def rooms_named(self, link: int, room: int, gen: int | None) -> list[RoomKey]:
        """The sender rooms bound on ``link`` to decode room ``room`` (of ``gen``, if given)."""
        if gen is not None:
            binding = self._bound.get((link, room, gen))
            return [] if binding is None or binding.sender is None else [binding.sender]
        return [
            b.sender
            for (blink, broom, _), b in self._bound.items()
            if blink == link and broom == room and b.sender is not None
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
        for room, gen in unpack_refs(frame.rooms):
            self.stats["reconciled"] += 1
            orphan = self._orphans.pop((state.peer, room, gen), None)
            if orphan is not None and orphan.sender in self._senders:
                orphan.link = link  # its RoomSettled goes out here when it settles
                self._bound[(link, room, gen)] = orphan
            else:
                self._mark(self._finished, (link, room, gen), now)
                out.append(Send(link, RoomSettled(room, gen)))
        return out

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        ttl = self.config.pending_ttl_s
        # Marks are kept in the order they were set (``_mark`` re-inserts), so the expired ones
        # are a prefix: a tick costs what expired, not what is kept.
        _expire(self._tombstones, now - ttl, lambda v: v[0])
        while self._early and now - next(iter(self._early.values()))[0] > ttl:
            self._drop_early(next(iter(self._early)))
        _expire(self._finished, now - ttl, lambda v: v)
        out: list[Action] = []
        for slot, waiting in list(self._held.items()):
            kept = []
            for binding in waiting:
                if now - binding.since <= ttl:
                    kept.append(binding)
                    continue
                self.stats["pending_dropped"] += 1
                self._links[binding.link].held -= 1
                # Nothing was written into its pages: without the settle the receiver, failed
                # by its peer, would wait for an acknowledgement that never comes.
                room = binding.room
                out += self._answer_failed(
                    binding.link, room, binding.gen, f"no prefill room {room} within {ttl:g}s", now
                )
            self._set_held(slot, kept)
        return out

    # -- helpers --------------------------------------------------------------------------------

    def _new_binding(
        self, link: int, room: int, gen: int, metadata: RoomMetadata | None, now: float
    ) -> _Binding:
        binding = _Binding(link, room, gen, now)
        binding.metadata = metadata
        return binding

    def _bind(self, sender: _Sender, binding: _Binding) -> list[Action]:
        sender.known = True
        binding.sender = sender.key
        sender.binding = binding
        self._bound[(binding.link, binding.room, binding.gen)] = binding
        metadata, binding.metadata = binding.metadata, None
        return [] if metadata is None else self._destination(binding, metadata)

    def _destination(self, binding: _Binding, frame: RoomMetadata) -> list[Action]:
        assert binding.sender is not None
        binding.destination = True
        peer = self._links[binding.link].peer
        legs = self._links[binding.link].legs
        event = DestinationReceived(
            frame.pages,
            frame.aux_index,
            peer,
            frame.state,
            binding.link,
            frame.part,
            legs,
            prefix=frame.prefix,
        )
        return [Deliver(binding.sender, event)]

    def _drop_binding(self, sender: _Sender, now: float | None) -> None:
        """Unbind ``sender``; ``now``: it finished with its decode room (None: gave up)."""
        binding = sender.binding
        sender.binding = None
        if binding is None:
            return
        ident = (binding.link, binding.room, binding.gen)
        if self._bound.get(ident) is binding:
            del self._bound[ident]
        if now is not None:
            self._mark(self._finished, ident, now)
        for key in [k for k, b in self._orphans.items() if b is binding]:
            del self._orphans[key]

    def _refuse(self, link: int, room: int, gen: int, why: str, now: float) -> list[Action]:
        self.stats["duplicates_refused"] += 1
        return self._answer_failed(link, room, gen, f"duplicate room id {room}: {why}", now)

    def _answer_failed(
        self, link: int, room: int, gen: int, reason: str, now: float
    ) -> list[Action]:
        """Fail decode room ``(room, gen)`` that no sender wrote to, and remember it: whatever
        of it still arrives (its page list behind its claim) is stale."""
        self._mark(self._finished, (link, room, gen), now)
        return [
            Send(link, RoomOutcome(room, gen, _FAILED, reason)),
            Send(link, RoomSettled(room, gen)),  # nothing was written
        ]

    def _set_held(self, slot: Slot, waiting: list[_Binding]) -> None:
        if waiting:
            self._held[slot] = waiting
        else:
            self._held.pop(slot, None)

    def _set_early(self, slot: Slot, value: tuple[float, int, int, str]) -> None:
        """Remember an early abort, within its link's quota: one peer's flood of aborts cannot
        push out the marks of another (over quota it is acknowledged, not remembered)."""
        state = self._links[value[1]]
        if state.early >= self.config.pending_max:
            self.stats["early_aborts_over_quota"] += 1
            return
        self._drop_early(slot)
        if len(self._early) >= 8 * self.config.pending_max:  # every link at its quota at once
            self._drop_early(next(iter(self._early)))
        self._early[slot] = value
        state.early += 1

    def _drop_early(self, slot: Slot) -> tuple[float, int, int, str] | None:
        early = self._early.pop(slot, None)
        if early is not None:
            state = self._links.get(early[1])
            if state is not None:
                state.early -= 1
        return early

    def _mark(self, marks: dict[Any, Any], ident: object, value: object) -> None:
        """Set a bounded, TTL'd mark: the oldest goes first when ``pending_max`` are kept."""
        marks.pop(ident, None)
        if len(marks) >= self.config.pending_max:
            del marks[next(iter(marks))]
        marks[ident] = value


# ------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------


class _Receiver:
    __slots__ = ("exposed", "link", "peer", "rank", "settle_at")

    def __init__(self, link: int, peer: str, rank: int) -> None:
        self.link = link
        self.peer = peer  # the prefill incarnation its link talks to
        self.rank = rank
        self.exposed = False  # its page list went out: writes may come
        self.settle_at = math.inf  # link lost: its pages settle then, unless acknowledged first


@dataclass(slots=True)
class _DecodeLink:
    peer: str
    rank: int
    granted: float  # the last time a lease was granted on this link
    rooms: set[RoomKey] = field(default_factory=set)


#: Why decode aborts a room on the next link when the last one was lost before it was exposed.
UNTOLD_REASON: Final = "decode room failed while its control link was down"


class DecodeRouting:
    """Decode's routing rules (see the module docstring). Loop thread only."""

    def __init__(
        self, config: RoutingConfig | None = None, stats: dict[str, int] | None = None
    ) -> None:
        self.config = config if config is not None else RoutingConfig()
        #: Counters, added to ``stats`` when given (the control plane shares its dict).
        self.stats = _stats() if stats is None else _into(stats)
        self._links: dict[int, _DecodeLink] = {}
        self._rooms: dict[RoomKey, _Receiver] = {}
        self._lost: dict[RoomKey, _Receiver] = {}  # exposed rooms of lost links, not settled
        # Claimed rooms a lost link failed before they were exposed, by prefill incarnation:
        # (room, gen) -> when. Told on the next link to it (a RoomAbort each); TTL'd and
        # bounded like prefill's marks.
        self._untold: dict[str, dict[tuple[int, int], float]] = {}
        self._exposed = 0

    def entries(self) -> dict[str, int]:
        return {
            "rooms": len(self._rooms),
            "lost": len(self._lost),
            "exposed": self._exposed,
            "untold": sum(len(v) for v in self._untold.values()),
        }

    @property
    def expecting_writes(self) -> bool:
        """Some room's pages are exposed to a live link, or to a lost one and not settled yet
        (bytes queued for them land as soon as the agent takes them): the agent must be
        progressed."""
        return self._exposed > 0 or bool(self._lost)

    def owes(self, peer: str) -> bool:
        """Something waits for the next link to prefill incarnation ``peer``: a lost room to
        reconcile, or an abort to tell."""
        return bool(self._untold.get(peer)) or any(r.peer == peer for r in self._lost.values())

    # -- links ----------------------------------------------------------------------------------

    def link_opened(self, link: int, peer: str, rank: int, now: float) -> list[Action]:
        """A link after the Hello exchange. Our Hello, which granted the first lease, answered
        prefill's, so ``now`` (after prefill's Hello arrived) is no earlier than that grant's
        start on prefill's side."""
        self._links[link] = _DecodeLink(peer, rank, now)
        out: list[Action] = []
        waiting = [k for k, r in self._lost.items() if r.peer == peer]
        if waiting:
            for key in waiting:  # the same prefill incarnation: it knows what it still writes
                self._lost[key].link = link
                self._links[link].rooms.add(key)
            refs = [(k.room, k.generation) for k in waiting]
            out.append(Send(link, Reconcile(pack_refs(refs))))
        untold = self._untold.pop(peer, None)
        if untold:
            self.stats["aborts_told_late"] += len(untold)
            out += [Send(link, RoomAbort(room, gen, UNTOLD_REASON)) for room, gen in untold]
        return out

    def lease_requested(self, link: int, frame: LeaseRequest, now: float) -> list[Action]:
        state = self._links.get(link)
        if state is None:
            return []
        state.granted = now
        self.stats["leases_granted"] += 1
        return [Send(link, LeaseGrant(frame.seq, max(1, round(self.config.lease_s * 1000))))]

    def link_lost(self, link: int, reason: str, now: float) -> list[Action]:
        state = self._links.pop(link, None)
        if state is None:
            return []
        # No write this link allowed can start after the last lease it granted ran out.
        settle_at = state.granted + self.config.lease_s + self.config.fence_margin_s
        out: list[Action] = []
        for key in state.rooms:
            receiver = self._rooms.pop(key, None)
            if receiver is None:
                receiver = self._lost.get(key)
                if receiver is not None:  # lost again while reconciling: keep the earlier bound
                    receiver.settle_at = min(receiver.settle_at, settle_at)
                continue
            out.append(Deliver(key, PeerLost(reason)))
            if receiver.exposed:
                self._exposed -= 1
                receiver.settle_at = settle_at
                self._lost[key] = receiver
            else:
                self._owe_abort(receiver.peer, key, now)
        return out

    # -- the rooms' side ------------------------------------------------------------------------

    def bind(self, key: RoomKey, link: int, peer_rank: int) -> list[Action]:
        """A receiver's prefill rank is connected: claim the room there at once."""
        state = self._links.get(link)
        if state is None or key in self._rooms:
            return []
        self._rooms[key] = _Receiver(link, state.peer, state.rank)
        state.rooms.add(key)
        return [
            Send(link, RoomClaim(key.room, key.generation)),
            Deliver(key, PeerResolved(peer_rank)),
        ]

    def metadata(self, key: RoomKey, frame: RoomMetadata) -> list[Action]:
        receiver = self._rooms.get(key)
        if receiver is None:
            # Its link was lost between send_metadata and now (the room has not processed its
            # PeerLost yet): the page list never left, so nothing can be written to it.
            return [
                Deliver(key, PeerLost("control link lost before the page list was sent")),
                Deliver(key, PeerSettled(0)),
            ]
        if not receiver.exposed:
            receiver.exposed = True
            self._exposed += 1
        return [Send(receiver.link, frame)]

    def receiver_failed(self, key: RoomKey, reason: str) -> list[Action]:
        receiver = self._rooms.get(key)
        if receiver is None:
            return []
        frame = RoomAbort(key.room, key.generation, clip_reason(reason or "aborted"))
        if not receiver.exposed:  # nothing to acknowledge: the link forgets it now
            self._forget(key)
        return [Send(receiver.link, frame)]

    def receiver_reaped(self, key: RoomKey) -> list[Action]:
        self._forget(key)
        self._lost.pop(key, None)
        return []

    # -- frames from prefill --------------------------------------------------------------------

    def on_outcome(self, link: int, frame: RoomOutcome) -> list[Action]:
        key = RoomKey(frame.room, frame.generation)
        receiver = self._on_link(link, key)
        if receiver is None:
            return []
        if frame.status == _SUCCESS:
            self._forget(key)
            return [Deliver(key, TransferConfirmed(receiver.rank))]
        return [Deliver(key, PeerFailed(frame.reason))]

    def on_settled(self, link: int, frame: RoomSettled) -> list[Action]:
        key = RoomKey(frame.room, frame.generation)
        receiver = self._on_link(link, key)
        if receiver is None:
            return []
        self._forget(key)
        if self._lost.pop(key, None) is not None:  # reconciled after a reconnect
            state = self._links.get(link)
            if state is not None:
                state.rooms.discard(key)
        return [Deliver(key, PeerSettled(receiver.rank))]

    def on_abort(self, link: int, frame: RoomAbort) -> list[Action]:
        key = RoomKey(frame.room, frame.generation)
        if self._on_link(link, key) is None:
            return []
        return [Deliver(key, AbortRequested(frame.reason, origin="peer"))]

    def rooms_named(self, link: int, room: int, gen: int | None) -> list[RoomKey]:
        """The live receiver rooms on ``link`` with id ``room`` (and ``gen``, if given)."""
        if gen is not None:
            receiver = self._rooms.get(RoomKey(room, gen))
            return [] if receiver is None or receiver.link != link else [RoomKey(room, gen)]
        state = self._links.get(link)
        if state is None:
            return []
        return [k for k in state.rooms if k.room == room and k in self._rooms]

    def on_error(self, link: int, frame: Error) -> list[Action]:
        """Prefill rejected a frame: fail exactly the room it names (the failure is reported
        back as an abort, so prefill's room ends too)."""
        if frame.room is None:
            return []
        reason = f"prefill rejected a frame of this room: {frame.reason}"
        keys = self.rooms_named(link, frame.room, frame.generation)
        self.stats["errors_for_rooms"] += len(keys)
        return [Deliver(key, EventRejected(reason)) for key in keys]

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float, steady_s: float = math.inf) -> list[Action]:
        """Settle the lost rooms that are due. ``steady_s``: for how long this rank's agent has
        been progressed without a gap (``kvfsm.transport.ProgressWatch``); a lost room settles
        only once that is at least ``fence_margin_s`` (the links rule). The default, for a
        caller that progresses the agent on every tick, vouches for it."""
        ttl = self.config.pending_ttl_s
        for peer, untold in list(self._untold.items()):
            _expire(untold, now - ttl, lambda v: v)
            if not untold:
                del self._untold[peer]
        if steady_s < self.config.fence_margin_s:
            if any(r.settle_at <= now for r in self._lost.values()):
                self.stats["settles_held_unsteady"] += 1
            return []
        due = [k for k, r in self._lost.items() if r.settle_at <= now]
        out: list[Action] = []
        for key in due:
            receiver = self._lost.pop(key)
            state = self._links.get(receiver.link)
            if state is not None:
                state.rooms.discard(key)
            out.append(Deliver(key, PeerSettled(receiver.rank)))
        return out

    # -- helpers --------------------------------------------------------------------------------

    def _owe_abort(self, peer: str, key: RoomKey, now: float) -> None:
        untold = self._untold.setdefault(peer, {})
        if len(untold) >= self.config.pending_max:
            del untold[next(iter(untold))]  # the oldest: its sender's own deadline bounds it
        untold[(key.room, key.generation)] = now

    def _on_link(self, link: int, key: RoomKey) -> _Receiver | None:
        receiver = self._rooms.get(key) or self._lost.get(key)
        if receiver is None or receiver.link != link:
            self.stats["stale_frames"] += 1
            return None
        return receiver

    def _forget(self, key: RoomKey) -> None:
        receiver = self._rooms.pop(key, None)
        if receiver is None:
            return
        if receiver.exposed:
            self._exposed -= 1
        state = self._links.get(receiver.link)
        if state is not None:
            state.rooms.discard(key)
