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
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from transitions import Machine

from kvfsm.states import TABLES, KVPoll, Role, Table

__all__ = ["MACHINES", "build_machine", "machine_edges", "trigger_name"]


def trigger_name(event_type: type) -> str:
    """The ``transitions`` trigger that carries events of ``event_type``: the class name."""
    return event_type.__name__


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
    return Machine(
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
