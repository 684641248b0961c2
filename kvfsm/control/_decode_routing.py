"""Decode's routing core: which receiver room a prefill frame belongs to, what prefill must be
told, and when a lost link's pages settle. Sans-IO; the rules are in
:mod:`kvfsm.control._routing`, and the lifecycle of each binding (a receiver room and the link
its claim went out on) is the table ``DECODE_BINDINGS`` of :mod:`kvfsm.control._binding`.

A binding's state says which index holds it, and only ``DecodeRouting._move`` changes either:
CLAIMED and EXPOSED ones are in ``_rooms`` (EXPOSED ones counted in ``_exposed``), LOST and
RECONCILING ones in ``_lost``; CLAIMED, EXPOSED and RECONCILING ones are in their link's
``rooms``. The aborts a lost link leaves owed (``_untold``) are TTL'd marks, not states: their
rooms' bindings are gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from kvfsm.control._binding import BindingEvent, DecodeBinding, decode_step
from kvfsm.control._frames import (
    Error,
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
)
from kvfsm.control._routing_common import (
    SUCCESS,
    Action,
    Deliver,
    RoutingConfig,
    Send,
    expire,
    join_stats,
    new_stats,
)
from kvfsm.rooms import RoomKey
from kvfsm.states import (
    AbortRequested,
    EventRejected,
    PeerFailed,
    PeerLost,
    PeerResolved,
    PeerSettled,
    TransferConfirmed,
)

__all__ = ["UNTOLD_REASON", "DecodeRouting"]

_E: Final = BindingEvent
_D: Final = DecodeBinding

#: The states whose bindings are in ``_rooms``: claimed on a live link.
_LIVE: Final = frozenset({_D.CLAIMED, _D.EXPOSED})
#: The states whose bindings are in ``_lost``: exposed, their link lost, not settled.
_LOST: Final = frozenset({_D.LOST, _D.RECONCILING})
#: The states whose bindings are in their link's ``rooms``.
_ON_LINK: Final = frozenset({_D.CLAIMED, _D.EXPOSED, _D.RECONCILING})


class _Receiver:
    __slots__ = ("key", "link", "peer", "rank", "settle_at", "state")

    def __init__(self, key: RoomKey, link: int, peer: str, rank: int) -> None:
        self.key = key
        self.link = link
        self.peer = peer  # the prefill incarnation its link talks to
        self.rank = rank
        self.state = DecodeBinding.NEW  # changed only by DecodeRouting._move
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
    """Decode's routing rules (:mod:`kvfsm.control._routing`). Loop thread only."""

    def __init__(
        self, config: RoutingConfig | None = None, stats: dict[str, int] | None = None
    ) -> None:
        self.config = config if config is not None else RoutingConfig()
        #: Counters, added to ``stats`` when given (the control plane shares its dict).
        self.stats = new_stats() if stats is None else join_stats(stats)
        self._links: dict[int, _DecodeLink] = {}
        # The bindings by state (kept by ``_move`` alone; see the module docstring).
        self._rooms: dict[RoomKey, _Receiver] = {}  # CLAIMED, EXPOSED
        self._lost: dict[RoomKey, _Receiver] = {}  # LOST, RECONCILING: exposed, not settled
        # Claimed rooms a lost link failed before they were exposed, by prefill incarnation:
        # (room, gen) -> when. Told on the next link to it (a RoomAbort each); TTL'd and
        # bounded like prefill's marks.
        self._untold: dict[str, dict[tuple[int, int], float]] = {}
        self._exposed = 0  # EXPOSED

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
        waiting = [r for r in self._lost.values() if r.peer == peer]
        if waiting:
            for receiver in waiting:  # the same prefill incarnation: it knows what it still writes
                self._move(receiver, _E.RECONCILED, link)
            refs = [(r.key.room, r.key.generation) for r in waiting]
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
        if now < state.granted + self.config.lease_s:
            # Lost under a live lease: only the fence keeps its writes out of pages it exposed.
            self.stats["leases_fenced"] += 1
        out: list[Action] = []
        for key in list(state.rooms):
            receiver = self._rooms.get(key)
            if receiver is None:
                receiver = self._lost.get(key)
                if receiver is not None:  # lost again while reconciling: keep the earlier bound
                    receiver.settle_at = min(receiver.settle_at, settle_at)
                    if receiver.link == link:
                        self._move(receiver, _E.LINK_LOST)
                continue
            out.append(Deliver(key, PeerLost(reason)))
            if receiver.state is _D.EXPOSED:
                receiver.settle_at = settle_at
            else:
                self._owe_abort(receiver.peer, key, now)
            self._move(receiver, _E.LINK_LOST)
        return out

    # -- the rooms' side ------------------------------------------------------------------------

    def bind(self, key: RoomKey, link: int, peer_rank: int) -> list[Action]:
        """A receiver's prefill rank is connected: claim the room there at once."""
        state = self._links.get(link)
        if state is None or key in self._rooms:
            return []
        self._move(_Receiver(key, link, state.peer, state.rank), _E.BIND)
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
        self._move(receiver, _E.PAGES)
        return [Send(receiver.link, frame)]

    def receiver_failed(self, key: RoomKey, reason: str) -> list[Action]:
        receiver = self._rooms.get(key)
        if receiver is None:
            return []
        frame = RoomAbort(key.room, key.generation, clip_reason(reason or "aborted"))
        # Not exposed: nothing to acknowledge, the link forgets it now. Exposed: it waits for
        # prefill's RoomSettled.
        self._move(receiver, _E.FAILED)
        return [Send(receiver.link, frame)]

    def receiver_reaped(self, key: RoomKey) -> list[Action]:
        self._move_all(key, _E.REAPED)
        return []

    # -- frames from prefill --------------------------------------------------------------------

    def on_outcome(self, link: int, frame: RoomOutcome) -> list[Action]:
        key = RoomKey(frame.room, frame.generation)
        receiver = self._on_link(link, key)
        if receiver is None:
            return []
        if frame.status == SUCCESS:
            # A lost room stays lost: its pages settle by RoomSettled or at their bound.
            self._move(receiver, _E.SUCCEEDED)
            return [Deliver(key, TransferConfirmed(receiver.rank))]
        return [Deliver(key, PeerFailed(frame.reason))]

    def on_settled(self, link: int, frame: RoomSettled) -> list[Action]:
        key = RoomKey(frame.room, frame.generation)
        receiver = self._on_link(link, key)
        if receiver is None:
            return []
        self._move_all(key, _E.SETTLED)  # (a lost one too: reconciled after a reconnect)
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
            expire(untold, now - ttl, lambda v: v)
            if not untold:
                del self._untold[peer]
        if steady_s < self.config.fence_margin_s:
            if any(r.settle_at <= now for r in self._lost.values()):
                self.stats["settles_held_unsteady"] += 1
            return []
        due = [k for k, r in self._lost.items() if r.settle_at <= now]
        out: list[Action] = []
        for key in due:
            receiver = self._lost[key]
            self._move(receiver, _E.EXPIRED)
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

    def _move_all(self, key: RoomKey, event: BindingEvent) -> None:
        """``event`` for every binding of room ``key``: live, and lost (one of each at most)."""
        for receiver in (self._rooms.get(key), self._lost.get(key)):
            if receiver is not None:
                self._move(receiver, event)

    def _move(self, receiver: _Receiver, event: BindingEvent, link: int | None = None) -> None:
        """The one place a binding changes state (rule 1 of :mod:`kvfsm.control._binding`):
        along the table's edge for ``event``, leaving only the indexes its new state is not
        in and entering only those its old state was not in (so an index keeps its order).
        ``link``: the link it is attached to from now on (RECONCILED)."""
        old = receiver.state
        new = decode_step(old, event)
        receiver.state = new
        key = receiver.key
        if old is _D.EXPOSED and new is not _D.EXPOSED:
            self._exposed -= 1
        elif new is _D.EXPOSED and old is not _D.EXPOSED:
            self._exposed += 1
        if old in _LIVE and new not in _LIVE and self._rooms.get(key) is receiver:
            del self._rooms[key]
        elif new in _LIVE and old not in _LIVE:
            self._rooms[key] = receiver
        if old in _LOST and new not in _LOST and self._lost.get(key) is receiver:
            del self._lost[key]
        elif new in _LOST and old not in _LOST:
            self._lost[key] = receiver
        moved = link is not None and link != receiver.link
        if old in _ON_LINK and (moved or new not in _ON_LINK):
            self._off_link(receiver)
        if link is not None:
            receiver.link = link
        if new in _ON_LINK and (moved or old not in _ON_LINK):
            self._links[receiver.link].rooms.add(key)

    def _off_link(self, receiver: _Receiver) -> None:
        state = self._links.get(receiver.link)
        if state is not None:  # (a lost link's rooms went with it)
            state.rooms.discard(receiver.key)
