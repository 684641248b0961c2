"""The transitions machines are built from the tables and nothing else (law 1)."""

from __future__ import annotations

import pytest
from transitions import MachineError

from kvfsm.rooms import IllegalEventError, RoomCore
from kvfsm.rooms._machine import DISPATCH, MACHINES, build_machine, compile_dispatch, machine_edges
from kvfsm.states import EVENT_TYPES, TABLES, TERMINAL, AbortRequested, KVPoll, Role


def table_edges(role: Role) -> set[tuple[str, str, str]]:
    return {
        (et.__name__, state.name, dest.name)
        for state, row in TABLES[role].items()
        for et, dest in row.items()
    }


@pytest.mark.parametrize("role", list(Role))
def test_built_machine_has_exactly_the_table_edges(role: Role) -> None:
    assert machine_edges(MACHINES[role]) == table_edges(role)


@pytest.mark.parametrize("role", list(Role))
def test_no_edge_of_the_built_machine_leaves_a_terminal(role: Role) -> None:
    machine = MACHINES[role]
    terminal_names = {s.name for s in TERMINAL}
    leaving = [e for e in machine_edges(machine) if e[1] in terminal_names]
    assert leaving == []
    for state in TERMINAL:
        assert machine.get_triggers(state) == []
    # No auto "to_<state>" edges, no wildcard expansion.
    assert not [name for name in machine.events if name.startswith("to_")]


@pytest.mark.parametrize("role", list(Role))
def test_firing_any_event_on_a_terminal_model_raises(role: Role) -> None:
    machine = MACHINES[role]
    for state in TERMINAL:
        model = RoomCore(role)
        model.state = state
        for name, event in machine.events.items():
            with pytest.raises(MachineError):
                event.trigger(model)
            assert model.state is state, name


@pytest.mark.parametrize("role", list(Role))
def test_machine_sets_enum_members_on_the_model(role: Role) -> None:
    model = RoomCore(role)
    first = next(
        et
        for et, d in TABLES[role][KVPoll.Bootstrapping].items()
        if d is not KVPoll.Failed and d is not KVPoll.Bootstrapping
    )
    MACHINES[role].events[first.__name__].trigger(model)
    assert model.state is KVPoll.WaitingForInput
    assert type(model.state) is KVPoll


def test_building_from_a_table_with_an_edge_out_of_a_terminal_is_visible() -> None:
    # The check above is not vacuous: a corrupted table yields a machine the walk catches.
    bad = {state: dict(row) for state, row in TABLES[Role.SENDER].items()}
    bad[KVPoll.Failed] = {EVENT_TYPES[0]: KVPoll.Transferring}
    machine = build_machine(bad)
    assert any(src == "Failed" for _, src, _ in machine_edges(machine))


# -- the compiled dispatch RoomCore changes state by ----------------------------------------


def dispatch_edges(role: Role) -> set[tuple[str, str, str]]:
    return {
        (et.__name__, state.name, dest.name)
        for state, row in DISPATCH[role].items()
        for et, dest in row.items()
    }


@pytest.mark.parametrize("role", list(Role))
def test_compiled_dispatch_has_exactly_the_built_machine_edges(role: Role) -> None:
    assert dispatch_edges(role) == machine_edges(MACHINES[role])
    assert set(DISPATCH[role]) == set(KVPoll)


class _Model:
    def __init__(self, state: KVPoll) -> None:
        self.state = state


@pytest.mark.parametrize("role", list(Role))
def test_compiled_dispatch_answers_what_firing_the_built_machine_does(role: Role) -> None:
    # Every event in every state, fired on the real machine: the dispatch names the state the
    # machine moves the model to, and has no entry exactly where trigger raises.
    machine = MACHINES[role]
    for state in KVPoll:
        for event_type in EVENT_TYPES:
            model = _Model(state)
            expected = DISPATCH[role][state].get(event_type)
            event = machine.events.get(event_type.__name__)
            if event is None:
                assert expected is None
                continue
            if expected is None:
                with pytest.raises(MachineError):
                    event.trigger(model)
                assert model.state is state
            else:
                assert event.trigger(model) is True
                assert model.state is expected, (state, event_type)


def test_compile_refuses_a_machine_whose_firing_does_more_than_the_lookup() -> None:
    with_callback = build_machine(TABLES[Role.SENDER])
    with_callback.before_state_change = ["log_it"]
    with pytest.raises(ValueError, match="before_state_change"):
        compile_dispatch(with_callback)
    conditional = build_machine(TABLES[Role.RECEIVER])
    next(iter(conditional.events["PeerResolved"].transitions.values()))[0].conditions = [object()]
    with pytest.raises(ValueError, match="conditions"):
        compile_dispatch(conditional)
    entering = build_machine(TABLES[Role.SENDER])
    entering.get_state(KVPoll.Success).on_enter = ["celebrate"]
    with pytest.raises(ValueError, match="on_enter"):
        compile_dispatch(entering)


@pytest.mark.parametrize("role", list(Role))
def test_a_room_changes_state_only_along_dispatch_edges(role: Role) -> None:
    # RoomCore reads the dispatch, not the tables: corrupting the dispatch it holds changes
    # what the room does (so the dispatch is what is in force, and the tests above cover it).
    core = RoomCore(role, strict=True)
    core._dispatch = {state: {} for state in KVPoll}
    with pytest.raises(IllegalEventError):
        core.handle(AbortRequested())
