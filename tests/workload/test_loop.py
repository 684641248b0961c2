"""``RoomLoop`` without an engine: scripted rooms and a scripted clock, so that the wedge bound,
this process's stops and the call hook are checked exactly."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfsm.states import KVPoll
from kvfsm.workload.loop import LiveRoom, Phase, RoomLoop


class _Room:
    """Never leaves Bootstrapping unless aborted; settles when told."""

    def __init__(self) -> None:
        self.status = KVPoll.Bootstrapping
        self.reason = ""
        self.settled = False
        self.sent: list[list[int]] = []

    def poll(self) -> KVPoll:
        return self.status

    def abort(self, reason: str) -> None:
        self.status, self.reason = KVPoll.Failed, reason

    def clear(self) -> None:
        pass


class _Loop(RoomLoop[int, LiveRoom]):
    def __init__(self, *, stop_gap_s: float) -> None:
        super().__init__()
        self.window, self.room_timeout_s, self.settle_grace_s = 4, 1.0, 1.0
        self.idle_sleep_s = 0.0
        self.stop_gap_s = stop_gap_s
        self.t = 0.0
        self.calls: list[str] = []
        self.retired: list[tuple[LiveRoom, bool]] = []

    def clock(self) -> float:
        return self.t

    def call(self, name: str, fn: Any, *args: Any) -> Any:
        self.calls.append(name)
        return fn(*args)

    def start(self, plan: int) -> LiveRoom:
        return LiveRoom(room=_Room(), started=self.now)  # type: ignore[arg-type]

    def advance(self, item: LiveRoom, status: KVPoll) -> bool:
        return False

    def retire(self, item: LiveRoom, *, settled: bool, now: float) -> None:
        self.retired.append((item, settled))


def _wedged_at(loop: _Loop, times: Sequence[float]) -> float:
    loop.feed([0])
    for t in times:
        loop.t = t
        loop.iterate()
        if loop.live and loop.live[0].wedged:
            return t
    raise AssertionError("never wedged")


def test_a_stop_of_this_process_stretches_the_wedge_bound_by_its_length() -> None:
    # A 4 s gap (SIGSTOP) between two iterations, then iterations 1/8 s apart (exact floats).
    times = [0.0, 0.125, 4.125, *(4.125 + 0.125 * i for i in range(1, 30))]
    stopped = _Loop(stop_gap_s=0.25)
    at = _wedged_at(stopped, times)
    assert stopped.stopped_s == 4.0
    assert at == 5.125  # the first iteration past 1 s of unstopped time
    item = stopped.live[0]
    assert item.stopped_s == 4.0
    assert (item.status, item.reason) == (int(KVPoll.Failed), "wedged")
    # Every call the loop made on the room went through the hook.
    assert stopped.calls[-3:] == ["poll", "abort", "clear"]
    assert set(stopped.calls) == {"poll", "abort", "clear"}
    # Without stop accounting (run, demo) the same gap counts against the room.
    plain = _Loop(stop_gap_s=math.inf)
    assert _wedged_at(plain, times) == 4.125
    assert plain.stopped_s == 0.0


def test_a_stop_stretches_the_settle_grace_and_only_stops_after_the_room_joined() -> None:
    loop = _Loop(stop_gap_s=0.25)
    loop.t = 10.0
    loop.iterate()  # the first iteration: no gap to count yet
    loop.t = 20.0  # a stop before the room exists
    loop.feed([0])
    loop.iterate()
    assert loop.stopped_s == 10.0
    item = loop.live[0]
    assert loop.stopped_since(item) == 0.0
    item.room.abort("x")
    loop.t = 20.125
    loop.iterate()
    assert item.phase is Phase.SETTLING
    # Stopped 3 s while settling: not settled, it is written off past 1 + 3 s from 20.125.
    for t in (23.125, 23.25, 23.5, 23.75, 24.0, 24.125):
        loop.t = t
        loop.iterate()
        assert item.phase is Phase.SETTLING, t
    loop.t = 24.25
    loop.iterate()
    assert loop.retired == [(item, False)]
    assert not loop.busy


class _Sender(_Loop):
    def __init__(self, abort_at: int | None) -> None:
        super().__init__(stop_gap_s=math.inf)
        self.abort_at = abort_at
        self.chunks = [np.arange(2, dtype=np.int32), np.arange(2, 3, dtype=np.int32)]

    def start(self, plan: int) -> LiveRoom:
        room = _Room()
        room.status = KVPoll.WaitingForInput
        room.init = lambda n, aux: self.calls.append(f"init {n} {aux}")  # type: ignore[attr-defined]
        room.send = lambda pages: room.sent.append(pages.tolist())  # type: ignore[attr-defined]
        return LiveRoom(room=room, started=self.now)  # type: ignore[arg-type]

    def advance(self, item: LiveRoom, status: KVPoll) -> bool:
        return self.advance_sender(item, status, self.chunks, 7, self.abort_at)

    def abort_planned(self, item: LiveRoom) -> None:
        self.call("abort", item.room.abort, "planned")


def test_advance_sender_inits_sends_a_chunk_per_iteration_and_aborts_right_after_chunk_k(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr("kvfsm.workload.loop.SenderRoom", _Room)
    for abort_at, sent, inits in ((None, [[0, 1], [2]], 1), (0, [], 0), (1, [[0, 1]], 1)):
        loop = _Sender(abort_at)
        loop.feed([0])
        for _ in range(4):
            loop.iterate()
        item = loop.live[0]
        assert item.room.sent == sent  # type: ignore[attr-defined]
        assert loop.calls.count("init 3 7") == inits
        if abort_at is None:
            assert item.phase is Phase.FINISHING
            assert "abort" not in loop.calls
        else:
            assert item.phase is Phase.SETTLING
            assert item.reason == "planned"
