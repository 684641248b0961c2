"""The phase table of kvfsm.transport._phases is the truth about the chunk ledger's phases.

Every (phase, event) pair is walked: an edge of the table leads to its target and every other
pair is refused, FINAL has no way out, and the production ledger, driven through its public
methods, crosses every edge of the table (and nothing else: ``_move`` raises off the table).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any

import pytest

from kvfsm.rooms._actor import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed
from kvfsm.transport import Leases, _ledger, _phases
from kvfsm.transport._ledger import ChunkLedger, Finish, Record
from kvfsm.transport._phases import PHASES, Phase, PhaseError, PhaseEvent, step

KEY = RoomKey(1, 1)
DEADLINE = 1.0
Q = 2.0
FENCE = 1

Edge = tuple[Phase, PhaseEvent, Phase]


def table_edges() -> set[Edge]:
    return {(src, event, dst) for src, row in PHASES.items() for event, dst in row.items()}


# -- the table's shape -------------------------------------------------------------------------


def test_every_phase_has_a_row_and_final_has_none_out() -> None:
    assert set(PHASES) == set(Phase)
    assert dict(PHASES[Phase.FINAL]) == {}
    assert [int(p) for p in Phase] == [0, 1, 2, 3, 4]  # NEW is 0: a record not accepted yet


def test_phases_only_move_forward() -> None:
    for src, event, dst in table_edges():
        assert dst > src, (src, event, dst)


def test_every_event_labels_an_edge_and_every_phase_can_end() -> None:
    assert {event for _, event, _ in table_edges()} == set(PhaseEvent)
    reach = {Phase.NEW}
    while True:
        more = {dst for src, _, dst in table_edges() if src in reach} - reach
        if not more:
            break
        reach |= more
    assert reach == set(Phase)
    for phase in Phase:
        ends = {phase}
        for _ in Phase:
            ends |= {dst for src, _, dst in table_edges() if src in ends}
        assert Phase.FINAL in ends, phase


@pytest.mark.parametrize(("phase", "event"), list(product(Phase, PhaseEvent)))
def test_each_pair_reaches_the_tables_target_or_is_refused(phase: Phase, event: PhaseEvent) -> None:
    expected = PHASES[phase].get(event)
    rec = Record(KEY, 0, object(), 4096)
    rec.phase = phase
    if expected is None:
        with pytest.raises(PhaseError, match=f"{phase.name} has no edge for {event.name}"):
            step(phase, event)
        with pytest.raises(PhaseError):
            _ledger._move(rec, event)
        assert rec.phase is phase
    else:
        assert step(phase, event) is expected
        _ledger._move(rec, event)
        assert rec.phase is expected


# -- the production ledger crosses every edge ----------------------------------------------------


def book(leases: Leases | None = None) -> ChunkLedger:
    return ChunkLedger(deadline_s=lambda nbytes: DEADLINE, quarantine_s=Q, leases=leases)


def fenced_book() -> tuple[ChunkLedger, Leases]:
    leases = Leases()
    leases.grant(FENCE, 1.0)
    return book(leases), leases


def queued(ledger: ChunkLedger, fence: int = 0) -> Record:
    rec = Record(KEY, 0, "peer", 4096, fence)
    ledger.accepted(rec, 0.0)
    return rec


def in_flight(rec: Record, *states: str) -> None:
    """What the poster leaves on a record it posted: a handle and a state per part."""
    rec.handles = [object() for _ in states]
    rec.states = list(states)


def active(ledger: ChunkLedger, fence: int = 0) -> Record:
    rec = queued(ledger, fence)
    in_flight(rec, "PROC")
    assert ledger.posted(rec, 0.1) == []
    return rec


def held(ledger: ChunkLedger) -> Record:
    rec = active(ledger)
    ledger.take_active()
    ledger.polled(rec, ["PROC"], DEADLINE + 0.5)  # stalled
    return rec


def _new_accepted() -> Record:
    rec = Record(KEY, 0, "peer", 4096)
    book().accepted(rec, 0.0)
    return rec


def _new_refused() -> Record:
    ledger, _ = fenced_book()
    rec = Record(KEY, 0, "peer", 4096, fence=0)  # unfenced on a fenced transport
    (finish,) = ledger.accepted(rec, 0.0)
    assert isinstance(finish, Finish)
    return rec


def _queued_posted() -> Record:
    return active(book())


def _queued_done() -> Record:
    ledger = book()
    rec = queued(ledger)
    rec.states = ["DONE"]  # done inside transfer(): released at post
    (finish,) = ledger.posted(rec, 0.1)
    assert isinstance(finish, Finish)
    assert finish.event == ChunkDone(0)
    return rec


def _queued_failed() -> Record:
    ledger = book()
    rec = queued(ledger)
    ledger.release_requested(KEY)
    ledger.posted(rec, 0.1)  # the poster skipped it: nothing posted
    return rec


def _queued_fenced() -> Record:
    ledger, _ = fenced_book()
    rec = queued(ledger, FENCE)
    in_flight(rec, "PROC")
    rec.handles.append(object())  # the second part was stopped by the lease check
    ledger.fenced(rec, "lease gone", 0.5)
    return rec


def _queued_raised() -> Record:
    ledger = book()
    rec = queued(ledger)
    in_flight(rec, "PROC")
    rec.handles.append(object())  # the second part's transfer() raised
    ledger.errored(rec, "nixlBackendError", 0.2)
    return rec


def _queued_peer_lost() -> Record:
    ledger = book()
    rec = queued(ledger)
    ledger.peer_lost(rec.peer, "gone", 0.1)
    in_flight(rec, "PROC")  # the poster had posted it already
    ledger.posted(rec, 0.2)
    return rec


def _queued_drained() -> Record:
    ledger = book()
    rec = queued(ledger)
    assert ledger.drain() == [rec]
    return rec


def _active_done() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.take_active()
    (finish,) = ledger.polled(rec, ["DONE"], 0.2)
    assert isinstance(finish, Finish)
    return rec


def _active_failed() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.take_active()
    (finish,) = ledger.polled(rec, ["ERR"], 0.2)
    assert isinstance(finish, Finish)
    assert isinstance(finish.event, ChunkFailed)
    return rec


def _active_stalled() -> Record:
    return held(book())


def _active_fenced() -> Record:
    ledger, _ = fenced_book()
    rec = active(ledger, FENCE)
    ledger.leases_checked(2.0)  # the lease ran out at 1.0
    return rec


def _active_raised() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.take_active()
    ledger.errored(rec, "check_xfer_state raised", 0.2)
    return rec


def _active_peer_lost() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.peer_lost(rec.peer, "remote disconnect", 0.2)
    return rec


def _active_abandoned() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.abandon("fenced out")
    return rec


def _active_drained() -> Record:
    ledger = book()
    rec = active(ledger)
    ledger.drain()
    return rec


def _held_settled() -> Record:
    ledger = book()
    rec = held(ledger)
    assert ledger.flushed(rec.peer, rec.flush, 2.0) == []  # proven over, still quarantined
    (finish,) = ledger.quarantine_over(rec)
    assert isinstance(finish, Finish)
    return rec


def _held_abandoned() -> Record:
    ledger = book()
    rec = held(ledger)
    ledger.abandon("fenced out")
    return rec


def _held_drained() -> Record:
    ledger = book()
    rec = held(ledger)
    ledger.drain()
    return rec


#: For each edge of the table, the production ledger driven to cross it (the edge is last).
SCENARIOS: dict[tuple[Phase, PhaseEvent], Callable[[], Record]] = {
    (Phase.NEW, PhaseEvent.ACCEPTED): _new_accepted,
    (Phase.NEW, PhaseEvent.REFUSED): _new_refused,
    (Phase.QUEUED, PhaseEvent.POSTED): _queued_posted,
    (Phase.QUEUED, PhaseEvent.DONE): _queued_done,
    (Phase.QUEUED, PhaseEvent.FAILED): _queued_failed,
    (Phase.QUEUED, PhaseEvent.FENCED): _queued_fenced,
    (Phase.QUEUED, PhaseEvent.RAISED): _queued_raised,
    (Phase.QUEUED, PhaseEvent.PEER_LOST): _queued_peer_lost,
    (Phase.QUEUED, PhaseEvent.DRAINED): _queued_drained,
    (Phase.ACTIVE, PhaseEvent.DONE): _active_done,
    (Phase.ACTIVE, PhaseEvent.FAILED): _active_failed,
    (Phase.ACTIVE, PhaseEvent.STALLED): _active_stalled,
    (Phase.ACTIVE, PhaseEvent.FENCED): _active_fenced,
    (Phase.ACTIVE, PhaseEvent.RAISED): _active_raised,
    (Phase.ACTIVE, PhaseEvent.PEER_LOST): _active_peer_lost,
    (Phase.ACTIVE, PhaseEvent.ABANDONED): _active_abandoned,
    (Phase.ACTIVE, PhaseEvent.DRAINED): _active_drained,
    (Phase.HELD, PhaseEvent.SETTLED): _held_settled,
    (Phase.HELD, PhaseEvent.ABANDONED): _held_abandoned,
    (Phase.HELD, PhaseEvent.DRAINED): _held_drained,
}


@pytest.fixture
def crossed(monkeypatch: pytest.MonkeyPatch) -> list[Edge]:
    """Every edge the ledger crosses, in order, as its one phase change (``_move``) asks."""
    edges: list[Edge] = []

    def spy(phase: Phase, event: PhaseEvent) -> Phase:
        to = step(phase, event)
        edges.append((phase, event, to))
        return to

    monkeypatch.setattr(_ledger, "step", spy)
    return edges


def test_there_is_a_scenario_for_every_edge_and_only_for_edges() -> None:
    assert set(SCENARIOS) == {(src, event) for src, event, _ in table_edges()}


@pytest.mark.parametrize("edge", list(SCENARIOS), ids=lambda e: f"{e[0].name}-{e[1].name}")
def test_the_ledger_crosses_the_edge(edge: tuple[Phase, PhaseEvent], crossed: list[Edge]) -> None:
    src, event = edge
    rec = SCENARIOS[edge]()
    assert crossed[-1] == (src, event, PHASES[src][event])
    assert rec.phase is PHASES[src][event]
    assert set(crossed) <= table_edges()


def test_every_edge_is_crossed_by_production_code(crossed: list[Edge]) -> None:
    for scenario in SCENARIOS.values():
        scenario()
    assert set(crossed) == table_edges()


# -- a final record stays final; the table is what is in force -----------------------------------


def test_a_final_record_stays_final_whatever_the_ledger_is_told(crossed: list[Edge]) -> None:
    ledger = book()
    rec = active(ledger)
    ledger.take_active()
    ledger.polled(rec, ["DONE"], 0.2)
    assert rec.phase is Phase.FINAL
    before = len(crossed)
    calls: list[Callable[[], Any]] = [
        lambda: ledger.posted(rec, 0.3),
        lambda: ledger.rejected(rec, "bad"),
        lambda: ledger.fenced(rec, "lease", 0.3),
        lambda: ledger.errored(rec, "raised", 0.3),
        lambda: ledger.polled(rec, ["ERR"], 0.3),
        lambda: ledger.quarantine_over(rec),
        lambda: ledger.peer_lost(rec.peer, "gone", 0.3),
        lambda: ledger.abandon("fenced out"),
        lambda: ledger.leases_checked(0.3),
        ledger.drain,
    ]
    for call in calls:
        call()
        assert rec.phase is Phase.FINAL
    assert crossed[before:] == []


def test_the_ledger_moves_by_the_table_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without ACTIVE --DONE--> FINAL, a record polled DONE cannot end: the ledger looks its
    # edges up at the moment it moves, so the table checked above is the one it obeys.
    rows: dict[Phase, Any] = {phase: dict(row) for phase, row in PHASES.items()}
    del rows[Phase.ACTIVE][PhaseEvent.DONE]
    monkeypatch.setattr(_phases, "PHASES", rows)
    ledger = book()
    rec = active(ledger)
    ledger.take_active()
    with pytest.raises(PhaseError, match="ACTIVE has no edge for DONE"):
        ledger.polled(rec, ["DONE"], 0.2)
    assert rec.phase is Phase.ACTIVE


def test_the_old_names_are_the_phases() -> None:
    old = (_ledger.NEW, _ledger.QUEUED, _ledger.ACTIVE, _ledger.HELD, _ledger.FINAL)
    assert all(name is phase for name, phase in zip(old, Phase, strict=True))
