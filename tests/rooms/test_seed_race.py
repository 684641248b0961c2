"""The production incident that started kvfsm (docs/design.md, The problem) as a
regression test, and its cousins.

In the incident an abort arrived while a non-last chunk was in flight; the chunk's completion
then resurrected the room to Transferring, the last chunk was skipped, and the request hung
forever. Here the same interleaving is forced with a scripted transport through the real
engine, facade and loop thread, while another thread polls as SGLang's scheduler would.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.rooms import RoomConfig, RoomEngine, SenderRoom
from kvfsm.states import (
    TERMINAL,
    AbortRequested,
    ChunkDone,
    DestinationReceived,
    KVPoll,
    PostChunk,
    ReleaseHandles,
    ReportOutcome,
    ReportSettled,
)
from tests.helpers.rooms import DST, SCRIPTED_GRACE_S, ScriptedSink
from tests.helpers.waiting import wait_until_sync


class Poller:
    """A scheduler-like thread that polls a room as fast as it can and records every change."""

    def __init__(self, room: SenderRoom) -> None:
        self.room = room
        self.seen: list[KVPoll] = [room.poll()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            status = self.room.poll()
            if status is not self.seen[-1]:
                self.seen.append(status)

    def stop(self) -> list[KVPoll]:
        self._stop.set()
        self._thread.join(5)
        last = self.room.poll()
        if last is not self.seen[-1]:
            self.seen.append(last)
        return self.seen


@pytest.fixture
def engine() -> Iterator[RoomEngine]:
    eng = RoomEngine(
        ScriptedSink(), RoomConfig(strict=True, shutdown_timeout_s=SCRIPTED_GRACE_S)
    ).start()
    yield eng
    eng.close()
    assert eng.registry_on_loop().errors == []


def sink_of(engine: RoomEngine) -> ScriptedSink:
    sink = engine.registry_on_loop().sink
    assert isinstance(sink, ScriptedSink)
    return sink


def test_abort_during_non_last_chunk_then_late_completion_then_last_chunk(
    engine: RoomEngine,
) -> None:
    sink = sink_of(engine)
    sender = engine.sender(4242)
    engine.post(sender.key, DestinationReceived(DST, 5))  # decode's page list arrives
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(8, aux_index=1)
    sender.send(np.arange(4))  # chunk 0: not the last
    wait_until_sync(lambda: len(sink.of(sender.key, PostChunk)) == 1)
    (chunk0,) = sink.of(sender.key, PostChunk)
    assert isinstance(chunk0, PostChunk)
    assert not chunk0.is_last
    poller = Poller(sender)

    # 1. decode aborts while chunk 0 is in flight (it arrives over the control channel)
    engine.post(sender.key, AbortRequested("decode aborted the request", origin="peer"))
    wait_until_sync(lambda: sender.poll() is KVPoll.Failed)
    # 2. chunk 0's completion arrives afterwards (the write that resurrected the room)
    engine.post(sender.key, ChunkDone(0))
    # 3. the scheduler sends the real last chunk
    sender.send(np.arange(4, 8))

    wait_until_sync(lambda: sender.settled)
    seen = poller.stop()
    assert sender.poll() is KVPoll.Failed
    assert seen == [KVPoll.Transferring, KVPoll.Failed], seen  # never back to Transferring
    # The last chunk was not written into decode's pages after the abort...
    assert [c.chunk for c in sink.of(sender.key, PostChunk)] == [0]  # type: ignore[attr-defined]
    # ...chunk 0's handle was released and settled, and decode heard both facts.
    kinds = [type(c) for c in sink.of(sender.key)]
    assert kinds == [PostChunk, ReleaseHandles, ReportSettled]  # no echo of decode's abort
    stats = engine.stats()
    # The late completion was dropped by the table (the room still drained chunk 0); the
    # post-abort chunk was dropped too: late if it beat the reaping, stale if it came after.
    assert stats["late_events"] >= 1
    assert stats["late_events"] + stats["stale_events"] == 2
    assert stats["rejected_events"] == 0
    assert "aborted (peer): decode aborted the request" in sender.reason
    wait_until_sync(lambda: engine.stats()["live"] == 0)
    for _ in range(1000):
        assert sender.poll() is KVPoll.Failed


def test_abort_after_success_is_a_noop(engine: RoomEngine) -> None:
    sink = sink_of(engine)
    sender = engine.sender(1)
    engine.post(sender.key, DestinationReceived(DST, 5))
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(2, aux_index=0)
    sender.send([3, 4])
    wait_until_sync(lambda: len(sink.of(sender.key, PostChunk)) == 1)
    engine.post(sender.key, ChunkDone(0))
    wait_until_sync(lambda: sender.poll() is KVPoll.Success)
    sender.abort()
    assert sender.poll() is KVPoll.Success
    assert sender.reason == ""
    wait_until_sync(lambda: engine.stats()["live"] == 0)
    assert engine.stats()["failed"] == 0
    assert not [c for c in sink.of(sender.key) if isinstance(c, ReportOutcome) and c.status == 0]


@pytest.mark.parametrize("seed", range(40))
def test_abort_racing_the_last_chunk_never_moves_a_terminal_status(
    engine: RoomEngine, seed: int
) -> None:
    rng = random.Random(seed)
    sink = sink_of(engine)
    sender = engine.sender(seed)
    engine.post(sender.key, DestinationReceived(DST, 5))
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(4, aux_index=2)
    sender.send([0, 1, 2, 3])  # the only, hence last, chunk
    wait_until_sync(lambda: len(sink.of(sender.key, PostChunk)) == 1)
    poller = Poller(sender)
    spin = rng.randrange(0, 3000)

    def completion() -> None:
        for _ in range(spin):
            pass
        engine.post(sender.key, ChunkDone(0))

    racer = threading.Thread(target=completion)
    racer.start()
    for _ in range(rng.randrange(0, 3000)):
        pass
    sender.abort()
    racer.join()
    wait_until_sync(lambda: sender.settled)
    seen = poller.stop()
    final = sender.poll()
    assert final in TERMINAL
    assert seen[-1] is final
    terminal_at = next(i for i, s in enumerate(seen) if s in TERMINAL)
    assert seen[terminal_at:] == [final], seen
    # Whichever won, the room and the caller agree on Failed or the room was Success first.
    assert final is KVPoll.Failed or engine.stats()["failed"] == 0
