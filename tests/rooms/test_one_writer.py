"""Law 2: only a room's own task changes its state. Every write to every publication in a busy
engine (pairs completing, aborts from the caller's thread and from the peer, duplicates) is
checked for who made it: the thread, and the room task that was running (the engine's
scheduler names it, as ``asyncio.current_task`` names a task), which must be the room whose
publication it is."""

from __future__ import annotations

import random
import threading

import numpy as np

from kvfsm.rooms import RoomEngine
from kvfsm.rooms import _engine as engine_module
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._ports import Publication
from kvfsm.states import TERMINAL, KVPoll
from tests.helpers.waiting import wait_until_sync

#: (thread, the running room task's own publication? None outside any room task, value)
WRITES: list[tuple[str, bool | None, object]] = []
ENGINE: list[RoomEngine] = []


class WatchedPublication(Publication):
    """Records the thread and the room task behind every status write."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        initialised = hasattr(self, "status")  # the creator's first write is not a change
        if name == "status" and initialised:
            running = ENGINE[0].registry_on_loop().tasks.current()
            own = None if running is None else running.publication is self  # type: ignore[attr-defined]
            WRITES.append((threading.current_thread().name, own, value))
        super().__setattr__(name, value)


def test_only_the_room_task_writes_its_status(monkeypatch: object) -> None:
    WRITES.clear()
    monkeypatch.setattr(engine_module, "Publication", WatchedPublication)  # type: ignore[attr-defined]
    rng = random.Random(7)
    with RoomEngine(LoopbackSink(), name="kvfsm-loop-under-test") as engine:
        ENGINE[:] = [engine]
        pairs = []
        for room in range(60):
            sender, receiver = engine.sender(room), engine.receiver(room)
            receiver.init(0)
            pairs.append((sender, receiver))
        engine.receiver(0)  # a duplicate: refused by the registry, not by a room task
        wait_until_sync(lambda: all(r.poll() is not KVPoll.Bootstrapping for _, r in pairs))
        for room, (sender, receiver) in enumerate(pairs):
            if rng.random() < 0.3:
                (sender if rng.random() < 0.5 else receiver).abort()
            # Each room its own pages and aux row: one owner per destination.
            receiver.send_metadata(np.arange(4 * room, 4 * room + 4), room)
        wait_until_sync(lambda: all(s.poll() is not KVPoll.Bootstrapping for s, _ in pairs))
        for sender, _ in pairs:
            sender.init(4, 0)
            sender.send(np.arange(4))
        wait_until_sync(
            lambda: all(s.poll() in TERMINAL and r.poll() in TERMINAL for s, r in pairs)
        )
        wait_until_sync(lambda: engine.stats()["live"] == 0)

    assert len(WRITES) > 200
    threads = {thread for thread, _, _ in WRITES}
    assert threads == {"kvfsm-loop-under-test"}, threads
    refused = [w for w in WRITES if w[1] is None]
    # The single write outside a room task is the registry refusing the duplicate.
    assert [value for _, _, value in refused] == [KVPoll.Failed]
    # Every other write was made by the task of the room whose publication it is.
    assert all(own for _, own, _ in WRITES if own is not None)
    assert len([w for w in WRITES if w[1]]) == len(WRITES) - 1
