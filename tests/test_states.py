"""The tables in kvfsm.states are the single source of truth; check their shape and promises."""

from __future__ import annotations

import msgspec
import pytest

from kvfsm.states import (
    DEFAULT_DEADLINES,
    EVENT_TYPES,
    FAILURE_EVENTS,
    NON_TERMINAL,
    TABLES,
    TERMINAL,
    AbortRequested,
    ChunkFailed,
    DeadlineExpired,
    Event,
    EventRejected,
    KVPoll,
    PeerFailed,
    PeerLost,
    Role,
    deadline_of,
    failure_reason,
)


def test_kvpoll_integers_are_sglangs() -> None:
    # SGLang all-reduces polls with MIN: these integers are the wire protocol.
    assert [(s.name, int(s)) for s in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


@pytest.mark.parametrize("role", list(Role))
def test_every_state_has_a_row_and_terminals_are_empty(role: Role) -> None:
    table = TABLES[role]
    assert set(table) == set(KVPoll)
    for state in TERMINAL:
        assert dict(table[state]) == {}


@pytest.mark.parametrize("role", list(Role))
def test_edges_only_move_forward_or_into_failed(role: Role) -> None:
    for state, row in TABLES[role].items():
        for event_type, dest in row.items():
            assert dest is KVPoll.Failed or dest >= state, (state, event_type, dest)


@pytest.mark.parametrize("role", list(Role))
def test_every_non_terminal_state_can_fail_every_way(role: Role) -> None:
    for state in NON_TERMINAL:
        row = TABLES[role][state]
        for event_type in (AbortRequested, DeadlineExpired, PeerLost, PeerFailed, EventRejected):
            assert row[event_type] is KVPoll.Failed
        assert all(dest is KVPoll.Failed for et, dest in row.items() if et in FAILURE_EVENTS)


@pytest.mark.parametrize("role", list(Role))
def test_success_is_reachable_only_through_transfer_completed(role: Role) -> None:
    into_success = [
        (state, et)
        for state, row in TABLES[role].items()
        for et, d in row.items()
        if d is KVPoll.Success
    ]
    assert [et.__name__ for _, et in into_success] == ["TransferCompleted"]


@pytest.mark.parametrize("role", list(Role))
def test_every_non_terminal_state_has_a_positive_finite_deadline(role: Role) -> None:
    for state in NON_TERMINAL:
        assert 0 < deadline_of(role, state) < float("inf")
    for state in TERMINAL:
        assert deadline_of(role, state) == float("inf")
    assert set(DEFAULT_DEADLINES[role]) == set(NON_TERMINAL)
    assert deadline_of(role, KVPoll.Transferring, {KVPoll.Transferring: 0.5}) == 0.5


def test_events_are_frozen_tagged_and_round_trip_through_msgpack() -> None:
    samples = [
        AbortRequested("stop", origin="peer"),
        DeadlineExpired(KVPoll.WaitingForInput, 2.5),
        ChunkFailed(3, "remote disconnect"),
    ]
    decoder = msgspec.msgpack.Decoder(AbortRequested | DeadlineExpired | ChunkFailed)
    for event in samples:
        with pytest.raises(AttributeError):
            event.reason = "changed"  # type: ignore[misc]
        assert decoder.decode(msgspec.msgpack.encode(event)) == event
    names = [t.__name__ for t in EVENT_TYPES]
    assert len(set(names)) == len(names)
    assert all(issubclass(t, Event) for t in EVENT_TYPES)


def test_failure_reasons_name_their_cause() -> None:
    assert "peer" in failure_reason(AbortRequested("x", origin="peer"))
    assert "WaitingForInput" in failure_reason(DeadlineExpired(KVPoll.WaitingForInput, 3))
    assert "chunk 7" in failure_reason(ChunkFailed(7, "boom"))
    with pytest.raises(TypeError):
        failure_reason(PeerLost.__mro__[1]())  # the Event base is not a failure
