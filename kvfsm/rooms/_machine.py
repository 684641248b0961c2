"""Build one ``transitions.Machine`` per role from the tables in :mod:`kvfsm.states`.

The machines are built once, at import, and shared by every room of their role: a room is the
*model* an event is fired on (``MACHINES[role].events[name].trigger(room)``). That keeps the
per-room cost at zero (no ``add_model``, whose bookkeeping grows with the number of live rooms)
while every state change still goes through ``transitions``' own checks and ``set_state``.

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
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from transitions import Machine, State

from kvfsm.states import TABLES, KVPoll, Role, Table

__all__ = ["MACHINES", "build_machine", "machine_edges", "trigger_name"]


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


MACHINES: Final[Mapping[Role, Machine]] = MappingProxyType(
    {role: build_machine(table) for role, table in TABLES.items()}
)
