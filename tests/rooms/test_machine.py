"""The transitions machines are built from the tables and nothing else (law 1)."""

from __future__ import annotations

import pytest
from transitions import MachineError

from kvfsm.rooms import MACHINES, RoomCore, build_machine, machine_edges
from kvfsm.states import EVENT_TYPES, TABLES, TERMINAL, KVPoll, Role


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
