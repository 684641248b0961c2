"""The flight recorder: each room's bounded timeline, the JSON line of a failed room, and the
engine's ring of finished rooms."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.rooms import RoomConfig, RoomEngine
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.rooms._timeline import (
    CAPACITY,
    ENCODERS,
    HEAD,
    SLOTS,
    STATE_MARKS,
    Finished,
    RoomRecord,
    compact,
    dropped,
    entries,
    freeze,
    new_timeline,
    reason_kind,
    thaw,
)
from kvfsm.states import (
    AbortRequested,
    ChunkDone,
    ChunkFailed,
    DestinationReceived,
    KVPoll,
    PeerFailed,
    PostChunk,
    Role,
)
from tests.helpers.rooms import pages
from tests.helpers.waiting import wait_until_sync


@pytest.fixture
def loopback() -> Iterator[RoomEngine]:
    eng = RoomEngine(LoopbackSink(), RoomConfig(strict=True)).start()
    yield eng
    eng.close()
    assert eng.registry_on_loop().errors == []


def run_pair(engine: RoomEngine, room: int, chunks: int = 2) -> None:
    sender, receiver = engine.sender(room), engine.receiver(room)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(np.arange(100, 100 + 4 * chunks), aux_index=3)
    wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(4 * chunks, aux_index=1)
    for i in range(chunks):
        sender.send(np.arange(4 * i, 4 * i + 4))
    wait_until_sync(lambda: receiver.poll() is KVPoll.Success)
    wait_until_sync(lambda: sender.poll() is KVPoll.Success)
    wait_until_sync(lambda: engine.stats()["live"] == 0)


def states(rows: list[dict[str, object]]) -> list[object]:
    return [r["state"] for r in rows if r["kind"] == "state"]


def test_a_finished_pair_tells_its_story(loopback: RoomEngine) -> None:
    loopback.registry_on_loop().page_bytes = 4096
    run_pair(loopback, 7)
    story = loopback.story(7)
    by_role = {row["role"]: row for row in story}
    assert set(by_role) == {"sender", "receiver"}
    sender, receiver = by_role["sender"], by_role["receiver"]
    assert sender["live"] is False
    assert sender["state"] == "Success"
    assert states(sender["timeline"]) == ["WaitingForInput", "Transferring", "Success"]
    assert states(receiver["timeline"]) == ["WaitingForInput", "Transferring", "Success"]
    kinds = [r["kind"] for r in sender["timeline"]]
    assert kinds.count("chunk_posted") == 2
    assert kinds.count("chunk_done") == 2
    posted = [r for r in sender["timeline"] if r["kind"] == "chunk_posted"]
    assert [(r["chunk"], r["pages"], r["bytes"]) for r in posted] == [(0, 4, 16384), (1, 4, 16384)]
    done = [r for r in sender["timeline"] if r["kind"] == "chunk_done"]
    assert [(r["chunk"], r["bytes"]) for r in done] == [(0, 16384), (1, 16384)]
    assert any(r["kind"] == "frame_in" and "RoomMetadata" in r["what"] for r in sender["timeline"])
    assert any(r["kind"] == "frame_out" and "Success" in r["what"] for r in sender["timeline"])
    out = [r["what"] for r in receiver["timeline"] if r["kind"] == "frame_out"]
    assert any("RoomMetadata" in what for what in out)
    times = [r["t_ms"] for r in sender["timeline"]]
    assert times == sorted(times)
    assert times[0] >= 0
    # The peer is named from the moment the room knew it: a receiver from its init on.
    assert receiver["peer"] == {"rank": 0}
    first = receiver["timeline"][0]
    assert first["what"] == "init"
    assert first["peer"] == {"rank": 0}


def test_a_live_room_shows_its_timeline_too(loopback: RoomEngine) -> None:
    receiver = loopback.receiver(8)
    receiver.init(0)
    wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
    (row,) = loopback.story(8)
    assert row["live"] is True
    assert row["state"] == "WaitingForInput"
    assert [r["what"] for r in row["timeline"]][:3] == [
        "init",
        "resolve prefill rank",
        "prefill rank resolved, link up",
    ]
    receiver.abort()
    wait_until_sync(lambda: loopback.stats()["live"] == 0)
    assert loopback.story(404) == []


def test_a_failed_room_logs_one_json_line(
    loopback: RoomEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvfsm.rooms.failed"):
        sender = loopback.sender(9)
        sender.abort("operator test")
        wait_until_sync(lambda: loopback.stats()["live"] == 0)
        receiver = loopback.receiver(10)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() is KVPoll.WaitingForInput)
        loopback.post(receiver.key, PeerFailed("prefill said no"))
        wait_until_sync(lambda: loopback.stats()["live"] == 0)
    records = [r for r in caplog.records if r.name == "kvfsm.rooms.failed"]
    assert len(records) == 2
    lines = [json.loads(r.getMessage()) for r in records]
    aborted, rejected = lines
    assert aborted["room"] == 9
    assert aborted["role"] == "sender"
    assert aborted["reason_kind"] == "aborted (local)"
    assert "operator test" in aborted["reason"]
    assert aborted["duration_s"] >= 0
    # The abort, the state it caused, and what the room did about it (told its peer).
    assert [r["what"] for r in aborted["timeline"]] == [
        "abort",
        "entered Failed",
        "RoomOutcome out: Failed",
    ]
    # The caller's own abort is routine (INFO); anything else is WARNING.
    assert records[0].levelno == logging.INFO
    assert records[1].levelno == logging.WARNING
    assert rejected["room"] == 10
    assert rejected["generation"] > aborted["generation"]
    assert rejected["role"] == "receiver"
    assert states(rejected["timeline"])[-1] == "Failed"
    assert rejected["reason_kind"] == "peer failed"
    assert rejected["timeline"][-2]["reason"] == "prefill said no"
    assert rejected["peer"] == {"rank": 0}
    failures = loopback.failures()
    assert [f["room"] for f in failures] == [10, 9]  # newest first
    assert failures[1]["reason_kind"] == "aborted (local)"
    assert "timeline" not in failures[0]


def test_without_the_recorder_nothing_is_kept_or_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = RoomEngine(LoopbackSink(), RoomConfig(flight_recorder=False)).start()
    try:
        with caplog.at_level(logging.INFO, logger="kvfsm.rooms.failed"):
            run_pair(engine, 3)
            engine.sender(4).abort()
            wait_until_sync(lambda: engine.stats()["live"] == 0)
        assert engine.story(3) == []
        assert engine.failures() == []
        assert not [r for r in caplog.records if r.name == "kvfsm.rooms.failed"]
    finally:
        engine.close()


def test_a_long_room_keeps_its_head_and_its_latest_entries(loopback: RoomEngine) -> None:
    run_pair(loopback, 11, chunks=60)
    sender = next(r for r in loopback.story(11) if r["role"] == "sender")
    rows = sender["timeline"]
    assert len(rows) <= CAPACITY
    assert sender["dropped"] > 0
    gap = [r for r in rows if r["kind"] == "dropped"]
    assert len(gap) == 1
    assert rows.index(gap[0]) == HEAD
    assert rows[0]["kind"] == "frame_in"  # how it began: the destination arrived
    assert states(rows)[-1] == "Success"  # how it ended
    assert any(r.get("chunk") == 59 for r in rows[-6:])


def test_compaction_bounds_the_list_and_counts_what_it_dropped() -> None:
    timeline = new_timeline()
    born = timeline[0]
    assert isinstance(born, float)
    for i in range(500):
        if len(timeline) >= SLOTS:
            compact(timeline)
        timeline.append(born + i)
        timeline.append(ChunkDone(i))
        timeline.append(ENCODERS[PostChunk](PostChunk(i, pages(1, 2), pages(3, 4), False)))
        assert len(timeline) <= SLOTS + 3
    rows = entries(timeline, Role.SENDER, page_bytes=10)
    assert len(rows) <= CAPACITY
    kept = [r for r in rows if r["kind"] != "dropped"]
    assert dropped(timeline) + len(kept) == 1000  # every entry is shown or counted
    assert rows[HEAD]["what"] == f"{dropped(timeline)} entries not kept"
    assert rows[0]["chunk"] == 0
    assert rows[0]["t_ms"] == 0
    assert rows[-1]["kind"] == "chunk_posted"
    assert rows[-1]["chunk"] == 499
    assert rows[-1]["t_ms"] == 499_000
    assert rows[-1]["bytes"] == 20


def test_leases_fences_and_peer_aborts_are_named() -> None:
    timeline = new_timeline()
    timeline.append(timeline[0])
    timeline.append(ENCODERS[DestinationReceived](DestinationReceived(pages(1), 0, "a", fence=7)))
    timeline.append(STATE_MARKS[KVPoll.WaitingForInput])
    timeline.append(ChunkFailed(3, "write lease of fence 7 ended: not posted"))
    timeline.append(AbortRequested("bye", origin="peer"))
    peer = {"agent": "a", "fence": 7}
    rows = entries(timeline, Role.SENDER, peer)
    assert [r["kind"] for r in rows] == ["lease", "state", "fenced", "frame_in"]
    assert rows[0]["fence"] == 7
    assert all(r["peer"] == peer for r in rows)
    assert rows[2]["reason"].startswith("write lease")


def test_finished_keeps_failures_apart_from_successes() -> None:
    finished = Finished(kept=3)

    def record(room: int, state: KVPoll) -> RoomRecord:
        return RoomRecord(room, room, Role.SENDER, state, "", True, new_timeline(), 0.0, "", -1, 0)

    finished.add(record(1, KVPoll.Failed))
    for room in range(2, 10):
        finished.add(record(room, KVPoll.Success))
    assert [r.room for r in finished.recent] == [7, 8, 9]
    assert [r.room for r in finished.failed] == [1]  # a burst of successes did not push it out
    assert finished.find(1)[0].state is KVPoll.Failed


def test_reason_kinds_strip_numbers() -> None:
    assert reason_kind("chunk 12 stalled: no progress") == "chunk # stalled"
    assert reason_kind("") == "unknown"


def test_a_frozen_timeline_reads_as_the_live_one() -> None:
    """The ring keeps a reaped room's timeline frozen into bytes: it reads back the same rows,
    events, markers and times included."""
    timeline = new_timeline()
    born = timeline[0]
    assert isinstance(born, float)
    for i in range(60):
        if len(timeline) >= SLOTS:
            compact(timeline)
        timeline.append(born + i / 1000)
        timeline.append(ChunkDone(i))
        timeline.append(ENCODERS[PostChunk](PostChunk(i, pages(1, 2), pages(3, 4), False)))
    timeline.append(STATE_MARKS[KVPoll.Failed])
    timeline.append(AbortRequested("bye", origin="peer"))
    frozen = freeze(timeline)
    assert type(frozen) is bytes
    assert thaw(frozen) == timeline
    assert entries(frozen, Role.SENDER, page_bytes=10) == entries(
        timeline, Role.SENDER, page_bytes=10
    )
    assert dropped(frozen) == dropped(timeline) > 0
    record = RoomRecord(1, 1, Role.SENDER, KVPoll.Failed, "", True, frozen, born + 1, "", -1, 0)
    assert record.born == born
    odd: list[object] = [born, object()]  # something that does not encode stays a list
    assert freeze(odd) is odd


def test_a_step_timed_before_the_room_was_created_reads_as_its_creation() -> None:
    """A step's time is the scheduler's clock, read at most a few steps before the step: a room
    created inside a batch may carry a step time just before its creation. It reads as 0 ms,
    never negative, and its record's duration is never negative either."""
    born = 100.0
    timeline: list[object] = [born, born - 1e-5, ChunkDone(0), born + 0.002, ChunkDone(1)]
    rows = entries(timeline, Role.SENDER)
    assert [r["t_ms"] for r in rows] == [0.0, 2.0]
    record = RoomRecord(
        1, 1, Role.SENDER, KVPoll.Success, "", True, freeze(timeline), born - 1e-5, "", -1, 0
    )
    assert record.duration_s == 0.0


def test_the_recorder_encodes_paged_entries_as_encoders_do() -> None:
    # The room's task encodes page-carrying events and commands inline (no call per entry):
    # what it records must be what ENCODERS gives, a destination under a lease included.
    import asyncio

    from kvfsm.rooms._ports import Publication, RoomKey
    from kvfsm.rooms._registry import Registry
    from kvfsm.rooms._timeline import PAGED
    from kvfsm.states import (
        ChunkSubmitted,
        Command,
        Event,
        Initialized,
        MetadataSubmitted,
        PeerResolved,
        PeerSettled,
    )

    assert set(PAGED) == set(ENCODERS)
    commands: list[Command] = []

    class Recording(LoopbackSink):  # keeps what the rooms command, routes nothing
        def submit(self, key: RoomKey, command: Command) -> None:
            commands.append(command)

    sender, receiver = RoomKey(5, 1), RoomKey(6, 2)
    to_sender: list[Event] = [
        DestinationReceived(pages(10, 11, 12), 0, "agent", fence=7),
        Initialized(num_pages=3, aux_index=1),
        ChunkSubmitted(pages(1, 2, 3)),
    ]
    to_receiver: list[Event] = [
        Initialized(peer_rank=0),
        PeerResolved(peer_rank=0),
        MetadataSubmitted(pages(10, 11, 12, 13), 0),
    ]

    async def main() -> dict[Role, list[object]]:
        registry = Registry(Recording(), RoomConfig(strict=True))
        registry.spawn(sender, Role.SENDER, Publication())
        registry.spawn(receiver, Role.RECEIVER, Publication())
        for key, events in ((sender, to_sender), (receiver, to_receiver)):
            for event in events:
                registry.deliver(key, event)
                await asyncio.sleep(0)
            registry.deliver(key, AbortRequested("done"))
        # What the rooms wait for before they end: the posted chunk released, the peer settled.
        registry.deliver(sender, ChunkFailed(0, "released"))
        registry.deliver(receiver, PeerSettled(0))
        while len(registry):
            await asyncio.sleep(0)
        await registry.shutdown()
        return {r.role: thaw(r.timeline) for r in registry.finished.failed}

    lines = asyncio.run(main())
    marks = set(STATE_MARKS.values())

    def coded(role: Role) -> list[object]:
        return [x for x in lines[role] if type(x) is int and x not in marks]

    def expected(items: list[object]) -> list[int]:
        return [ENCODERS[type(x)](x) for x in items if type(x) in ENCODERS]

    posted = [c for c in commands if type(c) is PostChunk]
    assert posted
    assert coded(Role.SENDER) == expected([*to_sender[:3], *posted])
    assert coded(Role.SENDER)[0] & 0x3F == 3  # the lease's code: its fence, not its pages
    metadata = [c for c in commands if type(c) in ENCODERS and type(c) is not PostChunk]
    assert metadata
    assert coded(Role.RECEIVER) == expected([to_receiver[2], *metadata])
