"""``kvfsm.workload.receiver_steps``: the table of a receiving room's steps, walked pair by pair,
and its driver on the real ``RoomLoop`` with scripted rooms (no engine, no NIXL)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest

from kvfsm.states import KVPoll
from kvfsm.workload.loop import Phase
from kvfsm.workload.receiver_steps import (
    LOOP_PHASE,
    RECEIVER_STEPS,
    SEEN_IN_POLL,
    Do,
    ReceiverSteps,
    ReceivingRoom,
    Seen,
    Step,
    follow,
)

Pages = Any

#: The calls each action makes, hooks and calls on the room alike, in order (COUNT makes
#: none: it counts ``item.step``). The rank's plan here says abort whenever it is asked.
CALLS: dict[Do, list[str]] = {
    Do.SEND_PAGES: ["send_pages", "send_metadata"],
    Do.COUNT: [],
    Do.PLANNED_ABORT: ["abort_due", "abort_planned", "abort"],
    Do.CHECK_BYTES: ["check_bytes"],
    Do.CLEAR: ["clear"],
    Do.RELEASE: ["release_pages"],
}
#: What the loop can report of a room it still polls: any poll's status, or its wedge timeout.
POLLED_OR_WEDGED = {*SEEN_IN_POLL.values(), Seen.WEDGED}
OUT_OF_THE_LOOP = {step for step, phase in LOOP_PHASE.items() if phase is Phase.DONE}


class _Room:
    """A receiver whose status the test sets; it records the calls made on it."""

    def __init__(self, calls: list[str]) -> None:
        self.status = KVPoll.Bootstrapping
        self.reason = ""
        self.settled = False
        self.calls = calls

    def poll(self) -> KVPoll:
        return self.status

    def init(self, peer_rank: int) -> None:
        self.calls.append(f"init {peer_rank}")

    def send_metadata(self, pages: Pages, aux: int) -> None:
        self.calls.append(f"send_metadata {np.asarray(pages).tolist()} {aux}")
        self.status = KVPoll.Transferring

    def abort(self, reason: str) -> None:
        self.calls.append(f"abort {reason}")
        self.status, self.reason = KVPoll.Failed, reason

    def clear(self) -> None:
        self.calls.append("clear")


def _fake(item: ReceivingRoom) -> _Room:
    """The scripted room behind a loop's record."""
    return cast("_Room", item.room)


@dataclass(frozen=True)
class _Plan:
    room: int
    pages: int = 2
    abort_at: int | None = None


class _Receiving(ReceiverSteps[_Plan, ReceivingRoom]):
    """Scripted hooks: every one records its name in ``calls``, where the rooms record theirs;
    the pools hand out ``free`` pages."""

    def __init__(self, *, free: int = 8, abort_always: bool = False) -> None:
        super().__init__()
        self.window, self.room_timeout_s, self.settle_grace_s = 4, 10.0, 10.0
        self.idle_sleep_s = 0.0
        self.t = 0.0
        self.free = free
        self.abort_always = abort_always
        self.calls: list[str] = []
        self.plans: dict[int, _Plan] = {}
        self.retired: list[tuple[int, bool]] = []

    # the loop's hooks, as a decode rank forwards them
    def clock(self) -> float:
        return self.t

    def call(self, name: str, fn: Any, *args: Any) -> Any:
        if name == "create":  # the other calls are on a room, which records them
            self.calls.append(name)
        return fn(*args)

    def start(self, plan: _Plan) -> ReceivingRoom | None:
        return self.start_receiver(plan)

    def advance(self, item: ReceivingRoom, status: KVPoll) -> bool:
        return self.advance_receiver(item, status)

    def ended(self, item: ReceivingRoom, status: KVPoll) -> None:
        self.receiver_ended(item, status)

    def wedging(self, item: ReceivingRoom, status: KVPoll) -> None:
        self.receiver_wedged(item)

    def retire(self, item: ReceivingRoom, *, settled: bool, now: float) -> None:
        self.receiver_retired(item, settled=settled)
        self.retired.append((id(item), settled))

    # the receiver steps' hooks
    def pages_for(self, plan: _Plan) -> tuple[Pages, int] | None:
        self.calls.append("pages_for")
        if self.free < plan.pages:
            return None
        self.free -= plan.pages
        return np.arange(plan.pages, dtype=np.int32), 5

    def new_receiver(self, plan: _Plan) -> Any:
        return _Room(self.calls)

    def receiving_item(self, plan: _Plan, receiver: Any, dst: Pages, aux: int) -> ReceivingRoom:
        item = ReceivingRoom(room=receiver, started=self.clock(), dst=dst, dst_aux=aux)
        self.plans[id(item)] = plan
        return item

    def abort_due(self, item: ReceivingRoom) -> bool:
        self.calls.append("abort_due")
        return self.abort_always or self.plans[id(item)].abort_at == item.step

    def abort_planned(self, item: ReceivingRoom) -> None:
        self.calls.append("abort_planned")
        self.call("abort", item.room.abort, "planned")

    def send_pages(self, item: ReceivingRoom) -> None:
        self.calls.append("send_pages")
        super().send_pages(item)

    def check_bytes(self, item: ReceivingRoom) -> None:
        self.calls.append("check_bytes")

    def release_pages(self, item: ReceivingRoom) -> None:
        self.calls.append("release_pages")
        assert item.dst is not None
        self.free += len(item.dst)


@pytest.fixture(autouse=True)
def _scripted_receivers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default send_pages checks that the room is a ReceiverRoom facade.
    monkeypatch.setattr("kvfsm.workload.receiver_steps.ReceiverRoom", _Room)


# -- the table, pair by pair ---------------------------------------------------------------


@pytest.mark.parametrize(("step", "seen"), list(itertools.product(Step, Seen)))
def test_every_step_and_what_it_can_see(step: Step, seen: Seen) -> None:
    """Every (step, seen) pair through the driver's one advancing method: an edge of the table
    moves the room to its step (and the loop's phase of it) and calls exactly its actions'
    hooks, in order; a pair the table lacks raises and leaves the room as it was."""
    rank = _Receiving(abort_always=True)
    room = cast("Any", _Room(rank.calls))
    item = ReceivingRoom(room=room, started=0.0, dst=np.arange(3, dtype=np.int32))
    rank.plans[id(item)] = _Plan(room=1)
    item.receiver_step = step
    item.phase = LOOP_PHASE[step]
    item.step = 4
    edge = RECEIVER_STEPS[step].get(seen)
    if edge is None:
        with pytest.raises(LookupError, match=f"{step.name} cannot have {seen.name}"):
            rank.receive(item, seen)
        assert (item.receiver_step, item.phase, item.step) == (step, LOOP_PHASE[step], 4)
        assert rank.calls == []
        return
    assert rank.receive(item, seen) == edge == follow(step, seen)
    assert item.receiver_step is edge.to
    assert item.phase is LOOP_PHASE[edge.to]
    assert item.step == 4 + edge.do.count(Do.COUNT)
    assert [c.split()[0] for c in rank.calls] == [call for do in edge.do for call in CALLS[do]]


def test_the_table_has_every_step_and_a_way_out_of_the_loop_from_each() -> None:
    assert set(RECEIVER_STEPS) == set(Step) == set(LOOP_PHASE)
    for step, edges in RECEIVER_STEPS.items():
        assert (not edges) == (step in OUT_OF_THE_LOOP), step
        assert {edge.to for edge in edges.values()} <= set(Step)
    # Every step is reached from the one a created room enters, and leads out of the loop.
    reached, todo = {Step.BOOTSTRAPPING}, [Step.BOOTSTRAPPING]
    while todo:
        for edge in RECEIVER_STEPS[todo.pop()].values():
            if edge.to not in reached:
                reached.add(edge.to)
                todo.append(edge.to)
    assert reached == set(Step)
    for step in Step:
        seen, todo = {step}, [step]
        while todo:
            for edge in RECEIVER_STEPS[todo.pop()].values():
                if edge.to not in seen:
                    seen.add(edge.to)
                    todo.append(edge.to)
        assert seen & OUT_OF_THE_LOOP, step


def test_the_table_answers_everything_the_loop_can_report_in_each_phase() -> None:
    assert set(SEEN_IN_POLL) == set(KVPoll)
    for step, edges in RECEIVER_STEPS.items():
        phase = LOOP_PHASE[step]
        if phase in (Phase.BOOTSTRAP, Phase.SENDING):  # the loop polls it, or wedges it
            assert set(edges) == POLLED_OR_WEDGED, step
        elif phase is Phase.SETTLING:  # the loop waits for it to settle, within a grace
            assert set(edges) == {Seen.SETTLED, Seen.UNSETTLED}, step
        else:
            assert phase is Phase.DONE
            assert not edges
        for seen, edge in edges.items():
            # The loop moves a room to SETTLING when it is terminal or wedged, and out of the
            # loop once it settled or its grace is over: the table agrees.
            if seen in (Seen.SUCCEEDED, Seen.FAILED, Seen.WEDGED):
                assert LOOP_PHASE[edge.to] is Phase.SETTLING, (step, seen)
            elif seen in (Seen.SETTLED, Seen.UNSETTLED):
                assert LOOP_PHASE[edge.to] is Phase.DONE, (step, seen)
            else:
                assert LOOP_PHASE[edge.to] in (Phase.BOOTSTRAP, Phase.SENDING), (step, seen)


def test_each_action_comes_where_it_must() -> None:
    edges = [(step, seen, edge) for step, e in RECEIVER_STEPS.items() for seen, edge in e.items()]
    # The page list goes out once: on the one edge from bootstrapped to receiving.
    sends = [(step, seen, edge.to) for step, seen, edge in edges if Do.SEND_PAGES in edge.do]
    assert sends == [(Step.BOOTSTRAPPING, Seen.BOOTSTRAPPED, Step.RECEIVING)]
    # The loop's phases say the same (``Phase``: decode's SENDING is "its page list went
    # out"; the chaos rank counts those rooms as what a freeze of decode would catch).
    assert LOOP_PHASE[Step.BOOTSTRAPPING] is Phase.BOOTSTRAP
    assert LOOP_PHASE[Step.RECEIVING] is Phase.SENDING
    for step, seen, edge in edges:
        assert (Do.CHECK_BYTES in edge.do) == (seen is Seen.SUCCEEDED), (step, seen)
        assert (Do.RELEASE in edge.do) == (seen is Seen.SETTLED), (step, seen)
        # Cleared when it ends; a wedged room is aborted and cleared by the loop itself.
        ends = seen in (Seen.SUCCEEDED, Seen.FAILED)
        assert (Do.CLEAR in edge.do) == ends, (step, seen)
        # A planned abort is due right after the page list went out or after an iteration.
        if Do.PLANNED_ABORT in edge.do:
            assert edge.to is Step.RECEIVING
            assert edge.do[-1] is Do.PLANNED_ABORT
        assert (Do.COUNT in edge.do) == (step is Step.RECEIVING and edge.to is step)
        if ends:
            assert edge.do[-1] is Do.CLEAR  # the bytes are checked before the room is cleared


# -- the driver on the room loop -----------------------------------------------------------


def _run(rank: _Receiving, plans: list[_Plan], script: Any, rounds: int = 12) -> None:
    """Iterate the loop ``rounds`` times, calling ``script(i, live rooms)`` before each; after
    each, every live room's loop phase is its step's."""
    rank.feed(plans)
    for i in range(rounds):
        script(i, rank.live)
        rank.t = float(i)
        rank.iterate()
        for item in rank.live:
            assert item.phase is LOOP_PHASE[item.receiver_step]


def test_a_room_goes_through_every_step_to_released() -> None:
    rank = _Receiving()
    rooms: list[ReceivingRoom] = []

    def script(i: int, live: list[ReceivingRoom]) -> None:
        rooms.extend(item for item in live if all(item is not r for r in rooms))
        if i == 2:
            _fake(live[0]).status = KVPoll.WaitingForInput  # bootstrapped
        if i == 5:
            _fake(live[0]).status = KVPoll.Success
        if i == 7:
            _fake(live[0]).settled = True

    _run(rank, [_Plan(room=3)], script)
    (item,) = rooms
    assert item.receiver_step is Step.RELEASED
    assert item.phase is Phase.DONE
    assert rank.retired == [(id(item), True)]
    assert rank.free == 8  # its pages went back
    # Iterations 0-1 Bootstrapping, 2 the page list, 3-4 with it out, 5 Success.
    assert rank.calls == [
        "pages_for",
        "create",
        "init 0",
        "send_pages",
        "send_metadata [0, 1] 5",
        "abort_due",  # right after the page list
        "abort_due",
        "abort_due",
        "check_bytes",
        "clear",
        "release_pages",
    ]
    assert item.step == 2
    assert not rank.busy


@pytest.mark.parametrize("abort_at", [0, 1, 3])
def test_a_planned_abort_comes_at_its_count_and_the_room_settles_failed(abort_at: int) -> None:
    rank = _Receiving()
    rooms: list[ReceivingRoom] = []

    def script(i: int, live: list[ReceivingRoom]) -> None:
        rooms.extend(item for item in live if all(item is not r for r in rooms))
        if i == 1:
            _fake(live[0]).status = KVPoll.WaitingForInput
        if live and live[0].receiver_step is Step.SETTLING:
            _fake(live[0]).settled = True

    _run(rank, [_Plan(room=4, abort_at=abort_at)], script)
    (item,) = rooms
    assert rank.calls.count("abort planned") == 1
    assert rank.calls.count("abort_due") == abort_at + 1  # 0 right after the page list
    sent = rank.calls.index("send_pages")
    aborted = rank.calls.index("abort planned")
    assert rank.calls[sent:aborted].count("abort_due") == abort_at + 1
    assert (item.status, item.reason) == (int(KVPoll.Failed), "planned")
    assert "check_bytes" not in rank.calls
    assert rank.calls[-2:] == ["clear", "release_pages"]
    assert item.receiver_step is Step.RELEASED


def test_no_pages_no_receiver_and_a_wedged_room_is_written_off_unsettled() -> None:
    rank = _Receiving(free=3)
    rank.room_timeout_s, rank.settle_grace_s = 2.5, 1.5
    rooms: list[ReceivingRoom] = []

    def script(i: int, live: list[ReceivingRoom]) -> None:
        rooms.extend(item for item in live if all(item is not r for r in rooms))

    _run(rank, [_Plan(room=5, pages=2), _Plan(room=6, pages=2)], script, rounds=8)
    # The second plan waited for pages and never got any: no receiver was created for it.
    assert rank.calls.count("pages_for") > 2
    assert rank.calls.count("create") == 1
    # The first never left Bootstrapping: wedged at 3 s (the loop aborts and clears it, the
    # steps add nothing), then written off unsettled at 5 s; its pages stay out.
    assert rank.calls.count("abort wedged") == 1
    assert rank.calls.count("clear") == 1
    assert "release_pages" not in rank.calls
    (item,) = rooms
    assert rank.retired == [(id(item), False)]
    assert (item.status, item.reason, item.wedged) == (int(KVPoll.Failed), "wedged", True)
    assert item.receiver_step is Step.WRITTEN_OFF
    assert rank.free == 1
