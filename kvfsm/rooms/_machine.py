"""Build one ``transitions.Machine`` per role from the tables in :mod:`kvfsm.states`.

The machines are built once, at import, and shared by every room of their role, with no model
of their own: an event can be fired on any ``RoomCore`` as the model
(``MACHINES[role].events[name].trigger(core)``, which ``tests/rooms/test_machine.py`` does), so
no room pays for ``add_model``, whose bookkeeping grows with the number of live rooms. A room's
state changes along the built machine's edges, read once into a dispatch (below): ``trigger``
and ``set_state`` are what that dispatch is proven equal to, not what the hot path calls.

The build is faithful to the table and nothing more:

* ``auto_transitions=False``: no ``to_<state>`` edges out of terminals;
* every edge has an explicit source; ``'*'`` is never used;
* ``ignore_invalid_triggers=False``: firing an event with no edge raises ``MachineError``;
* self-edges (``Transferring --ChunkDone--> Transferring``) are *internal* transitions
  (``dest=None``): the state does not change, so no exit/enter bookkeeping runs.

Two adaptations keep a trigger near 9 us instead of 13 us (measured in
``benchmarks/room_lifecycle.py``) without changing what the machine does: ``transitions`` reads
``State.name`` and looks states up by name several times per trigger, and ``Enum.name`` is a slow
descriptor on Python 3.11, so ``_KVState`` caches its name and ``_KVMachine.get_state`` caches the
lookup. Both are the library's own extension points (``state_cls``, an overridable method).

The hot path does not call ``trigger``: it reads a **dispatch compiled from the built machine**
(:func:`compile_dispatch`), ``state -> {event type -> next state}``, walked out of
``machine.events`` once at import. That is the same check ``trigger`` makes (is there an edge
for this trigger from the model's current state, and where does it go) without the per-call
``EventData``, ``partial``, callback walks and about ten ``logging`` calls that made a trigger
cost 9 us here, six times per room pair. It is exactly equivalent only because the machine has
nothing else to run: no conditions, no callbacks on transitions, states or the machine, one
transition per (trigger, source). ``compile_dispatch`` refuses to compile a machine that has
any of those, and ``tests/rooms/test_machine.py`` fires every event in every state on the built
machine and proves the dispatch answers the same (the same destination, or no edge where
``trigger`` raises ``MachineError``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from transitions import Machine, State

from kvfsm.states import EVENT_TYPES, TABLES, Event, KVPoll, Role, Table

__all__ = [
    "DISPATCH",
    "MACHINES",
    "Dispatch",
    "build_machine",
    "compile_dispatch",
    "machine_edges",
    "trigger_name",
]


def trigger_name(event_type: type) -> str:
    """The ``transitions`` trigger that carries events of ``event_type``: the class name."""
    return event_type.__name__


class _KVState(State):
    """A state whose ``name`` is computed once."""

    def __init__(self, name: str | enum.Enum, *args: Any, **kwargs: Any) -> None:
        super().__init__(name, *args, **kwargs)
        self._cached_name = name.name if isinstance(name, enum.Enum) else name

    @property
    def name(self) -> str:
        return self._cached_name


class _KVMachine(Machine):
    """``Machine`` with memoised state lookups; the states never change after the build."""

    state_cls = _KVState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._state_cache: dict[str | enum.Enum, State] = {}
        super().__init__(*args, **kwargs)

    def get_state(self, state: str | enum.Enum) -> State:
        cached = self._state_cache.get(state)
        if cached is None:
            cached = self._state_cache[state] = super().get_state(state)
        return cached


def build_machine(table: Table) -> Machine:
    """A synchronous machine with exactly the edges of ``table`` and no model of its own."""
    transitions: list[dict[str, object]] = []
    for source, edges in table.items():
        for event_type, dest in edges.items():
            transitions.append(
                {
                    "trigger": trigger_name(event_type),
                    "source": [source],
                    "dest": None if dest is source else dest,
                }
            )
    return _KVMachine(
        model=None,
        states=KVPoll,
        initial=KVPoll.Bootstrapping,
        transitions=transitions,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        send_event=False,
    )


def machine_edges(machine: Machine) -> set[tuple[str, str, str]]:
    """Every (trigger, source, dest) edge the *built* machine has; internal edges end at source."""
    return {
        (name, source, transition.dest if transition.dest is not None else source)
        for name, event in machine.events.items()
        for source, transitions in event.transitions.items()
        for transition in transitions
    }


#: What a compiled machine answers: ``state -> {event type -> next state}``; a missing key is a
#: missing edge.
Dispatch = Mapping[KVPoll, Mapping[type[Event], KVPoll]]

_EVENTS_BY_TRIGGER: Final = {trigger_name(event_type): event_type for event_type in EVENT_TYPES}
#: Machine-wide callback lists of ``transitions.Machine``; all must be empty to compile.
_MACHINE_CALLBACKS: Final = (
    "before_state_change",
    "after_state_change",
    "prepare_event",
    "finalize_event",
    "on_exception",
    "on_final",
)
_TRANSITION_CALLBACKS: Final = ("prepare", "conditions", "before", "after")  # unless: in conditions
_STATE_CALLBACKS: Final = ("on_enter", "on_exit")


def compile_dispatch(machine: Machine) -> Dispatch:
    """The built machine's edges as a lookup table, for a hot path that cannot afford
    ``trigger``. Read from ``machine`` (its events, transitions and states), never from the
    tables it was built from. Raises ``ValueError`` if firing the machine could do anything
    the lookup would not: a callback or a condition anywhere, two transitions for one
    (trigger, source), a trigger or a state that is not one of kvfsm's."""
    for attr in _MACHINE_CALLBACKS:
        if getattr(machine, attr, None):
            raise ValueError(f"machine has {attr} callbacks: a dispatch would skip them")
    states: dict[str, KVPoll] = {}
    for name, state in machine.states.items():
        for attr in _STATE_CALLBACKS:
            if getattr(state, attr):
                raise ValueError(f"state {name} has {attr} callbacks: a dispatch would skip them")
        states[name] = KVPoll[name]
    dispatch: dict[KVPoll, dict[type[Event], KVPoll]] = {state: {} for state in states.values()}
    for trigger, event in machine.events.items():
        event_type = _EVENTS_BY_TRIGGER.get(trigger)
        if event_type is None:
            raise ValueError(f"trigger {trigger!r} carries no kvfsm event")
        for source, transitions in event.transitions.items():
            if len(transitions) != 1:
                raise ValueError(f"{len(transitions)} transitions for {trigger} from {source}")
            (transition,) = transitions
            for attr in _TRANSITION_CALLBACKS:
                if getattr(transition, attr):
                    raise ValueError(f"{trigger} from {source} has {attr}: not compilable")
            dest = source if transition.dest is None else transition.dest
            dispatch[states[source]][event_type] = states[dest]
    return MappingProxyType({state: MappingProxyType(row) for state, row in dispatch.items()})


MACHINES: Final[Mapping[Role, Machine]] = MappingProxyType(
    {role: build_machine(table) for role, table in TABLES.items()}
)

#: Each role's machine, compiled (see the module docstring): what ``RoomCore`` changes state by.
DISPATCH: Final[Mapping[Role, Dispatch]] = MappingProxyType(
    {role: compile_dispatch(machine) for role, machine in MACHINES.items()}
)
