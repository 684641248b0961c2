"""The binding tables of kvfsm.control._binding are the truth about the routing cores' bindings.

Each table's shape is checked, then every (state, event) pair is walked through the real
``PrefillRouting`` and ``DecodeRouting``: a binding is brought to the state through the cores'
own methods, the event is fired the way the control plane fires it, and the binding takes the
table's edge, or, where the table has none, does not move at all. Every edge of each table is
taken by the cores, and after every step the cores' indexes hold exactly the bindings their
states say they hold. A random walk then checks that nothing the cores can be told, in any
order, leads off the tables or out of step with the indexes.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfsm.control import _binding
from kvfsm.control._binding import (
    DECODE_BINDINGS,
    PREFILL_BINDINGS,
    BindingError,
    BindingEvent,
    DecodeBinding,
    PrefillBinding,
    decode_step,
    prefill_step,
)
from kvfsm.control._decode_routing import _LIVE, _LOST, _ON_LINK, _Receiver
from kvfsm.control._frames import (
    Error,
    LeaseRequest,
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    pack_refs,
)
from kvfsm.control._prefill_routing import _BOUND, _ORPHANS, _Binding
from kvfsm.control._routing import DecodeRouting, PrefillRouting, RoutingConfig
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import KVPoll

CONFIG = RoutingConfig(pending_max=8, pending_ttl_s=10.0, lease_s=2.0, fence_margin_s=1.0)
PAGES = np.arange(4, dtype="<i4").tobytes()
A, C, D = 1, 3, 4  # link ids
PREFILL_PEER, DECODE_PEER = "prefill-0-9", "decode-0-1"
S1, S2 = RoomKey(7, 101), RoomKey(7, 102)  # prefill senders of room id 7
R1 = RoomKey(7, 1)  # decode room 7, generation 1
LATE = 1e6  # past every TTL and settle bound

_E = BindingEvent
_P = PrefillBinding
_D = DecodeBinding


def metadata() -> RoomMetadata:
    return RoomMetadata(7, 1, PAGES, 3)


# -- the tables' shape ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "states"),
    [(PREFILL_BINDINGS, PrefillBinding), (DECODE_BINDINGS, DecodeBinding)],
    ids=["prefill", "decode"],
)
def test_every_state_has_a_row_gone_has_none_and_every_state_lives_and_ends(
    table: Any, states: Any
) -> None:
    assert set(table) == set(states)
    assert dict(table[states.GONE]) == {}
    edges = {(src, dst) for src, row in table.items() for dst in row.values()}
    reach = {states.NEW}
    for _ in states:
        reach |= {dst for src, dst in edges if src in reach}
    assert reach == set(states)
    for state in states:
        ends = {state}
        for _ in states:
            ends |= {dst for src, dst in edges if src in ends}
        assert states.GONE in ends, state
    assert all(dst is not states.NEW for _, dst in edges)  # NEW is where a binding is made


def test_every_event_is_used_and_only_prefill_holds_or_is_aborted() -> None:
    used_p = {e for row in PREFILL_BINDINGS.values() for e in row}
    used_d = {e for row in DECODE_BINDINGS.values() for e in row}
    assert used_p | used_d == set(BindingEvent)
    assert used_p - used_d == {_E.HOLD, _E.ABORT}
    assert used_d <= used_p


@pytest.mark.parametrize(("state", "event"), list(product(PrefillBinding, BindingEvent)))
def test_each_prefill_pair_is_the_tables_or_refused(
    state: PrefillBinding, event: BindingEvent
) -> None:
    expected = PREFILL_BINDINGS[state].get(event)
    core = PrefillRouting(CONFIG)
    core.link_opened(A, DECODE_PEER, now=0.0, hello_sent=0.0)
    binding = _Binding(A, DECODE_PEER, (7, 0), 1, 0.0)
    binding.state = state
    if expected is None:
        with pytest.raises(BindingError, match=f"{state.name} has no edge for {event.name}"):
            prefill_step(state, event)
        with pytest.raises(BindingError):
            core._move(binding, event)
        assert binding.state is state
    else:
        assert prefill_step(state, event) is expected


@pytest.mark.parametrize(("state", "event"), list(product(DecodeBinding, BindingEvent)))
def test_each_decode_pair_is_the_tables_or_refused(
    state: DecodeBinding, event: BindingEvent
) -> None:
    expected = DECODE_BINDINGS[state].get(event)
    core = DecodeRouting(CONFIG)
    core.link_opened(A, PREFILL_PEER, rank=0, now=0.0)
    receiver = _Receiver(R1, A, PREFILL_PEER, 0)
    receiver.state = state
    if expected is None:
        with pytest.raises(BindingError, match=f"{state.name} has no edge for {event.name}"):
            decode_step(state, event)
        with pytest.raises(BindingError):
            core._move(receiver, event)
        assert receiver.state is state
    else:
        assert decode_step(state, event) is expected


# -- the indexes follow the states ---------------------------------------------------------------


def audit_prefill(core: PrefillRouting) -> None:
    """Every index of ``core`` holds exactly the bindings whose state says it does."""
    held = [b for waiting in core._held.values() for b in waiting]
    for slot, waiting in core._held.items():
        assert waiting, slot
        assert all(b.state is _P.HELD and b.slot == slot for b in waiting)
    assert len({id(b) for b in held}) == len(held)
    for link_id, link in core._links.items():
        assert link.held == sum(1 for b in held if b.link == link_id)
    for ident, binding in core._bound.items():
        assert binding.state in _BOUND
        assert ident == (binding.link, binding.room, binding.gen)
        assert binding.link in core._links
        assert binding.sender is not None
        assert binding.sender.binding is binding
    for (peer, room, gen), binding in core._orphans.items():
        assert binding.state in _ORPHANS
        assert (peer, room, gen) == (binding.peer, binding.room, binding.gen)
        assert binding.sender is not None
        assert binding.sender.binding is binding
    for sender in core._senders.values():
        if sender.binding is not None:
            assert sender.binding.state in _BOUND | _ORPHANS
            assert sender.binding.sender is sender


def audit_decode(core: DecodeRouting) -> None:
    for key, receiver in core._rooms.items():
        assert receiver.state in _LIVE
        assert receiver.key == key
    for key, receiver in core._lost.items():
        assert receiver.state in _LOST
        assert receiver.key == key
    assert core._exposed == sum(1 for r in core._rooms.values() if r.state is _D.EXPOSED)
    receivers = [*core._rooms.values(), *core._lost.values()]
    for link_id, link in core._links.items():
        on_it = {r.key for r in receivers if r.state in _ON_LINK and r.link == link_id}
        assert link.rooms == on_it, link_id
    for receiver in core._lost.values():
        if receiver.state is _D.LOST:
            assert receiver.link not in core._links
        else:
            assert receiver.link in core._links


# -- walking every pair through the real cores ---------------------------------------------------

Move = tuple[Any, Any, BindingEvent, Any]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[Move]:
    """Every state change the cores make, as (binding, from, event, to), in order."""
    out: list[Move] = []
    prefill_move = PrefillRouting._move
    decode_move = DecodeRouting._move

    def on_prefill(self: PrefillRouting, binding: _Binding, event: BindingEvent) -> None:
        old = binding.state
        prefill_move(self, binding, event)
        out.append((binding, old, event, binding.state))

    def on_decode(
        self: DecodeRouting, receiver: _Receiver, event: BindingEvent, link: int | None = None
    ) -> None:
        old = receiver.state
        decode_move(self, receiver, event, link)
        out.append((receiver, old, event, receiver.state))

    monkeypatch.setattr(PrefillRouting, "_move", on_prefill)
    monkeypatch.setattr(DecodeRouting, "_move", on_decode)
    return out


def prefill_core() -> PrefillRouting:
    core = PrefillRouting(CONFIG)
    core.link_opened(A, DECODE_PEER, now=0.0, hello_sent=0.0)
    return core


def _held(core: PrefillRouting) -> _Binding:
    core.on_claim(A, RoomClaim(7, 1), 0.0)
    return core._held[(7, 0)][0]


def _claimed(core: PrefillRouting) -> _Binding:
    core.sender_spawned(S1, 0.0)
    core.on_claim(A, RoomClaim(7, 1), 0.0)
    return core._bound[(A, 7, 1)]


def _exposed(core: PrefillRouting) -> _Binding:
    core.sender_spawned(S1, 0.0)
    core.on_metadata(A, metadata(), 0.0)
    return core._bound[(A, 7, 1)]


def _aborted(core: PrefillRouting) -> _Binding:
    binding = _exposed(core)
    core.on_abort(A, RoomAbort(7, 1, "client gone"), 0.1)
    return binding


def _orphaned(core: PrefillRouting) -> _Binding:
    binding = _exposed(core)
    core.link_lost(A, "cut", 0.2)
    return binding


def _orphaned_aborted(core: PrefillRouting) -> _Binding:
    binding = _aborted(core)
    core.link_lost(A, "cut", 0.2)
    return binding


def _prefill_gone(core: PrefillRouting) -> _Binding:
    binding = _exposed(core)
    core.sender_outcome(S1, KVPoll.Success, "", 0.3)
    return binding


#: How a binding of decode room (7, 1) on link A, served by sender S1, is brought to each state.
PREFILL_TO: dict[PrefillBinding, Callable[[PrefillRouting], _Binding]] = {
    _P.HELD: _held,
    _P.CLAIMED: _claimed,
    _P.EXPOSED: _exposed,
    _P.ABORTED: _aborted,
    _P.ORPHANED: _orphaned,
    _P.ORPHANED_ABORTED: _orphaned_aborted,
    _P.GONE: _prefill_gone,
}


def _reconcile_on_c(core: PrefillRouting) -> None:
    core.link_opened(C, DECODE_PEER, now=1.0, hello_sent=1.0)  # the same decode incarnation
    core.on_reconcile(C, Reconcile(pack_refs([(7, 1)])), 1.0)


#: Each event, fired at prefill's core the way the control plane fires it.
PREFILL_FIRE: dict[BindingEvent, Callable[[PrefillRouting], object]] = {
    _E.HOLD: lambda core: core.on_claim(A, RoomClaim(7, 1), 1.0),
    _E.BIND: lambda core: core.sender_spawned(S2, 1.0),  # the id's next sender
    _E.PAGES: lambda core: core.on_metadata(A, metadata(), 1.0),
    _E.ABORT: lambda core: core.on_abort(A, RoomAbort(7, 1, "client gone"), 1.0),
    _E.FAILED: lambda core: core.sender_outcome(S1, KVPoll.Failed, "boom", 1.0),
    _E.SUCCEEDED: lambda core: core.sender_outcome(S1, KVPoll.Success, "", 1.0),
    _E.SETTLED: lambda core: core.sender_settled(S1, 1.0),
    _E.LINK_LOST: lambda core: core.link_lost(A, "cut", 1.0),
    _E.RECONCILED: _reconcile_on_c,
    _E.EXPIRED: lambda core: core.tick(LATE),
    _E.REAPED: lambda core: core.sender_reaped(S1),
}


def test_every_event_has_a_way_to_fire_it() -> None:
    assert set(PREFILL_FIRE) == set(BindingEvent)
    assert set(PREFILL_TO) == set(PrefillBinding) - {_P.NEW}
    assert set(DECODE_FIRE) == set(BindingEvent) - {_E.HOLD}
    assert set(DECODE_TO) == set(DecodeBinding) - {_D.NEW}


@pytest.mark.parametrize(
    ("state", "event"),
    list(product(PREFILL_TO, PREFILL_FIRE)),
    ids=lambda v: v.name,
)
def test_prefill_takes_the_tables_edge_or_none(
    state: PrefillBinding, event: BindingEvent, moves: list[Move]
) -> None:
    core = prefill_core()
    binding = PREFILL_TO[state](core)
    assert binding.state is state
    audit_prefill(core)
    del moves[:]
    PREFILL_FIRE[event](core)
    taken = [(old, ev, new) for b, old, ev, new in moves if b is binding]
    expected = PREFILL_BINDINGS[state].get(event)
    if expected is None:
        assert taken == []
        assert binding.state is state
    else:
        assert taken == [(state, event, expected)]
    audit_prefill(core)


def test_a_prefill_binding_is_made_for_a_claim_held_or_bound(moves: list[Move]) -> None:
    core = prefill_core()
    core.on_claim(A, RoomClaim(7, 1), 0.0)  # no sender of id 7: held
    core.sender_spawned(S1, 0.0)  # which takes it
    assert [(old, ev, new) for _, old, ev, new in moves] == [
        (_P.NEW, _E.HOLD, _P.HELD),
        (_P.HELD, _E.BIND, _P.CLAIMED),
    ]
    del moves[:]
    core.on_metadata(A, RoomMetadata(8, 4, PAGES, 3), 0.0)  # a page list is a claim too
    core.sender_spawned(RoomKey(8, 1), 0.1)  # which takes both
    assert [(old, ev, new) for _, old, ev, new in moves] == [
        (_P.NEW, _E.HOLD, _P.HELD),
        (_P.HELD, _E.BIND, _P.CLAIMED),
        (_P.CLAIMED, _E.PAGES, _P.EXPOSED),
    ]
    del moves[:]
    core.sender_spawned(RoomKey(9, 1), 0.2)
    core.on_claim(A, RoomClaim(9, 2), 0.2)  # a claim for a live, unbound sender: bound at once
    assert [(old, ev, new) for _, old, ev, new in moves] == [(_P.NEW, _E.BIND, _P.CLAIMED)]
    audit_prefill(core)


def decode_core() -> DecodeRouting:
    core = DecodeRouting(CONFIG)
    core.link_opened(A, PREFILL_PEER, rank=0, now=0.0)
    return core


def _d_claimed(core: DecodeRouting) -> _Receiver:
    core.bind(R1, A, 0)
    return core._rooms[R1]


def _d_exposed(core: DecodeRouting) -> _Receiver:
    receiver = _d_claimed(core)
    core.metadata(R1, metadata())
    return receiver


def _d_lost(core: DecodeRouting) -> _Receiver:
    receiver = _d_exposed(core)
    core.link_lost(A, "cut", 1.0)
    return receiver


def _d_reconciling(core: DecodeRouting) -> _Receiver:
    receiver = _d_lost(core)
    core.link_opened(C, PREFILL_PEER, rank=0, now=1.5)
    return receiver


def _d_gone(core: DecodeRouting) -> _Receiver:
    receiver = _d_exposed(core)
    core.on_outcome(A, RoomOutcome(7, 1, int(KVPoll.Success)))
    return receiver


#: How decode room (7, 1), claimed on link A to prefill incarnation PREFILL_PEER, is brought
#: to each state.
DECODE_TO: dict[DecodeBinding, Callable[[DecodeRouting], _Receiver]] = {
    _D.CLAIMED: _d_claimed,
    _D.EXPOSED: _d_exposed,
    _D.LOST: _d_lost,
    _D.RECONCILING: _d_reconciling,
    _D.GONE: _d_gone,
}

#: Each event, fired at decode's core the way the control plane fires it; frames from prefill
#: come on the link the room is attached to now.
DECODE_FIRE: dict[BindingEvent, Callable[[DecodeRouting, _Receiver], object]] = {
    _E.BIND: lambda core, r: core.bind(R1, A, 0),
    _E.PAGES: lambda core, r: core.metadata(R1, metadata()),
    _E.ABORT: lambda core, r: core.on_abort(r.link, RoomAbort(7, 1, "prefill aborted")),
    _E.FAILED: lambda core, r: core.receiver_failed(R1, "client gone"),
    _E.SUCCEEDED: lambda core, r: core.on_outcome(r.link, RoomOutcome(7, 1, int(KVPoll.Success))),
    _E.SETTLED: lambda core, r: core.on_settled(r.link, RoomSettled(7, 1)),
    _E.LINK_LOST: lambda core, r: core.link_lost(r.link, "cut", 2.0),
    _E.RECONCILED: lambda core, r: core.link_opened(D, PREFILL_PEER, rank=0, now=2.0),
    _E.EXPIRED: lambda core, r: core.tick(LATE),
    _E.REAPED: lambda core, r: core.receiver_reaped(R1),
}


@pytest.mark.parametrize(
    ("state", "event"),
    list(product(DECODE_TO, DECODE_FIRE)),
    ids=lambda v: v.name,
)
def test_decode_takes_the_tables_edge_or_none(
    state: DecodeBinding, event: BindingEvent, moves: list[Move]
) -> None:
    core = decode_core()
    receiver = DECODE_TO[state](core)
    assert receiver.state is state
    audit_decode(core)
    del moves[:]
    DECODE_FIRE[event](core, receiver)
    taken = [(old, ev, new) for r, old, ev, new in moves if r is receiver]
    expected = DECODE_BINDINGS[state].get(event)
    if expected is None:
        assert taken == []
        assert receiver.state is state
    else:
        assert taken == [(state, event, expected)]
    audit_decode(core)


def test_a_decode_binding_is_made_by_bind(moves: list[Move]) -> None:
    core = decode_core()
    core.bind(R1, A, 0)
    assert [(old, ev, new) for _, old, ev, new in moves] == [(_D.NEW, _E.BIND, _D.CLAIMED)]


def test_every_edge_is_taken_by_the_cores(moves: list[Move]) -> None:
    """The walks above, once more, collecting what the cores did: every edge of each table."""
    core = prefill_core()
    core.on_claim(A, RoomClaim(7, 1), 0.0)
    core.sender_spawned(RoomKey(9, 1), 0.0)
    core.on_claim(A, RoomClaim(9, 1), 0.0)
    for state, event in product(PREFILL_TO, PREFILL_FIRE):
        core = prefill_core()
        PREFILL_TO[state](core)
        PREFILL_FIRE[event](core)
    for dstate, devent in product(DECODE_TO, DECODE_FIRE):
        dcore = decode_core()
        DECODE_FIRE[devent](dcore, DECODE_TO[dstate](dcore))
    prefill_taken = {(o, e, n) for b, o, e, n in moves if isinstance(b, _Binding)}
    decode_taken = {(o, e, n) for r, o, e, n in moves if isinstance(r, _Receiver)}
    assert prefill_taken == {
        (s, e, n) for s, row in PREFILL_BINDINGS.items() for e, n in row.items()
    }
    assert decode_taken == {(s, e, n) for s, row in DECODE_BINDINGS.items() for e, n in row.items()}


# -- the tables are what is in force -------------------------------------------------------------


def test_the_cores_move_by_the_tables_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    prefill = {state: dict(row) for state, row in PREFILL_BINDINGS.items()}
    del prefill[_P.CLAIMED][_E.PAGES]
    decode = {state: dict(row) for state, row in DECODE_BINDINGS.items()}
    del decode[_D.EXPOSED][_E.LINK_LOST]
    monkeypatch.setattr(_binding, "PREFILL_BINDINGS", prefill)
    monkeypatch.setattr(_binding, "DECODE_BINDINGS", decode)
    core = prefill_core()
    binding = _claimed(core)
    with pytest.raises(BindingError, match="CLAIMED has no edge for PAGES"):
        core.on_metadata(A, metadata(), 0.1)
    assert binding.state is _P.CLAIMED
    dcore = decode_core()
    receiver = _d_exposed(dcore)
    with pytest.raises(BindingError, match="EXPOSED has no edge for LINK_LOST"):
        dcore.link_lost(A, "cut", 1.0)
    assert receiver.state is _D.EXPOSED


# -- any order: on the tables, in step with the indexes ------------------------------------------

ROOMS = st.integers(0, 2)
GENS = st.integers(1, 3)


class PrefillWalk(RuleBasedStateMachine):
    """Prefill's core told anything, in any order, by two decode incarnations over up to four
    links (each rule a method the control plane calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.core = PrefillRouting(RoutingConfig(pending_max=2, pending_ttl_s=5.0))
        self.now = 0.0
        self.links = 0
        self.senders = 0

    def link(self, pick: int) -> int:
        return 1 + pick % max(self.links, 1)

    @rule(peer=st.sampled_from(["d0", "d1"]), leg=st.integers(0, 1))
    def link_opened(self, peer: str, leg: int) -> None:
        if self.links < 4:
            self.links += 1
            self.core.link_opened(self.links, peer, self.now, self.now, leg=leg, legs=2)

    @rule(pick=st.integers(0, 3))
    def link_lost(self, pick: int) -> None:
        self.core.link_lost(self.link(pick), "cut", self.now)

    @rule(room=ROOMS, leg=st.integers(0, 1))
    def sender_spawned(self, room: int, leg: int) -> None:
        self.senders += 1
        self.core.sender_spawned(RoomKey(room, 100 + self.senders), self.now, leg)

    @rule(room=ROOMS, n=st.integers(0, 20), success=st.booleans(), what=st.integers(0, 2))
    def sender_ends(self, room: int, n: int, success: bool, what: int) -> None:
        key = RoomKey(room, 100 + n)
        if what == 0:
            status = KVPoll.Success if success else KVPoll.Failed
            self.core.sender_outcome(key, status, "r", self.now)
        elif what == 1:
            self.core.sender_settled(key, self.now)
        else:
            self.core.sender_reaped(key)

    @rule(pick=st.integers(0, 3), room=ROOMS, gen=GENS, what=st.integers(0, 4))
    def frame(self, pick: int, room: int, gen: int, what: int) -> None:
        link = self.link(pick)
        if what == 0:
            self.core.on_claim(link, RoomClaim(room, gen), self.now)
        elif what == 1:
            self.core.on_metadata(link, RoomMetadata(room, gen, PAGES, 3), self.now)
        elif what == 2:
            self.core.on_abort(link, RoomAbort(room, gen, "x"), self.now)
        elif what == 3:
            self.core.on_reconcile(link, Reconcile(pack_refs([(room, gen)])), self.now)
        else:
            self.core.on_error(link, Error(room, "bad", gen))

    @rule(dt=st.sampled_from([0.1, 1.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.core.tick(self.now)

    @invariant()
    def indexes_follow_states(self) -> None:
        audit_prefill(self.core)


class DecodeWalk(RuleBasedStateMachine):
    """Decode's core told anything, in any order, over links to two prefill incarnations.
    A receiver room binds once (its ``ResolvePeer``), as the room's task does."""

    def __init__(self) -> None:
        super().__init__()
        self.core = DecodeRouting(RoutingConfig(pending_max=2, pending_ttl_s=5.0))
        self.now = 0.0
        self.links = 0
        self.bound: set[RoomKey] = set()

    def link(self, pick: int) -> int:
        return 1 + pick % max(self.links, 1)

    @rule(peer=st.sampled_from(["p0", "p1"]))
    def link_opened(self, peer: str) -> None:
        if self.links < 5:
            self.links += 1
            self.core.link_opened(self.links, peer, 0, self.now)

    @rule(pick=st.integers(0, 4))
    def link_lost(self, pick: int) -> None:
        self.core.link_lost(self.link(pick), "cut", self.now)

    @rule(pick=st.integers(0, 4), room=ROOMS, gen=GENS, what=st.integers(0, 3))
    def room(self, pick: int, room: int, gen: int, what: int) -> None:
        key = RoomKey(room, gen)
        if what == 0 and key not in self.bound:
            self.bound.add(key)
            self.core.bind(key, self.link(pick), 0)
        elif what == 1:
            self.core.metadata(key, RoomMetadata(room, gen, PAGES, 3))
        elif what == 2:
            self.core.receiver_failed(key, "x")
        else:
            self.core.receiver_reaped(key)

    @rule(pick=st.integers(0, 4), room=ROOMS, gen=GENS, what=st.integers(0, 4))
    def frame(self, pick: int, room: int, gen: int, what: int) -> None:
        link = self.link(pick)
        if what == 0:
            self.core.on_outcome(link, RoomOutcome(room, gen, int(KVPoll.Success)))
        elif what == 1:
            self.core.on_outcome(link, RoomOutcome(room, gen, int(KVPoll.Failed), "r"))
        elif what == 2:
            self.core.on_settled(link, RoomSettled(room, gen))
        elif what == 3:
            self.core.on_abort(link, RoomAbort(room, gen, "x"))
        else:
            self.core.lease_requested(link, LeaseRequest(1), self.now)

    @rule(dt=st.sampled_from([0.1, 1.0, 6.0]), steady=st.sampled_from([0.0, 5.0]))
    def tick(self, dt: float, steady: float) -> None:
        self.now += dt
        self.core.tick(self.now, steady)

    @invariant()
    def indexes_follow_states(self) -> None:
        audit_decode(self.core)


_WALK = settings(max_examples=150, stateful_step_count=40, deadline=None)
PrefillWalk.TestCase.settings = _WALK
DecodeWalk.TestCase.settings = _WALK
test_prefill_walk = PrefillWalk.TestCase
test_decode_walk = DecodeWalk.TestCase
