"""The NIXL data path between two OS processes, DRAM to DRAM, on real NIXL (UCX).

The prefill side is this process: a ``RoomEngine`` whose sink is a ``NixlTransport``. The decode
side is ``kvfsm.workload.peer.PeerProcess`` in its own process (this process's side:
``tests/helpers/transport.py``), with its own agent and pages. Rooms are
driven through the real facades; the decode side reports what landed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvfsm._child import environ
from kvfsm.rooms import RoomKey
from kvfsm.states import TERMINAL, Command, DestinationReceived, KVPoll, PostChunk, ReportOutcome
from kvfsm.transport import NixlTransport
from kvfsm.transport import _transport as transport_module
from kvfsm.transport._chunks import Xfer
from kvfsm.transport._poster import Poster
from kvfsm.transport._transport import TransferConfig
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, page_digests
from kvfsm.workload.peer import PeerProcess
from tests.helpers.transport import SHAPE, Prefill
from tests.helpers.waiting import stays_true_sync, wait_until_sync


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    process = PeerProcess(SHAPE)
    yield process
    process.close()


@pytest.fixture
def prefill(peer: PeerProcess) -> Iterator[Prefill]:
    side = Prefill()
    side.connect(peer)
    yield side
    side.close()


@pytest.fixture
def three_peers(peer: PeerProcess) -> Iterator[dict[str, PeerProcess]]:
    """Three decode peers by id: ``peer`` as "decode", two more processes."""
    others = [PeerProcess(SHAPE, name=f"decode{i}-{os.getpid()}") for i in (1, 2)]
    yield {"decode": peer, "decode1": others[0], "decode2": others[1]}
    for process in others:
        process.close()


def expected(prefill: Prefill, src: list[int]) -> list[int]:
    return page_digests(prefill.kv, np.asarray(src, np.int32))


def test_many_concurrent_rooms_land_every_byte(prefill: Prefill, peer: PeerProcess) -> None:
    rng = random.Random(3)
    free = list(range(SHAPE.num_pages))
    rng.shuffle(free)
    rooms = []
    for room in range(40):
        n = rng.randint(0, 12)
        dst = [free.pop() for _ in range(n)]
        src = rng.sample(range(SHAPE.num_pages), n)
        aux = (rng.randrange(SHAPE.aux_rows), room)  # decode aux row = room id: all distinct
        rooms.append((prefill.room(room, src, dst, rng.randint(1, 4), aux), src, dst, aux))
    wait_until_sync(lambda: all(s.poll() in TERMINAL for s, *_ in rooms))
    for sender, src, dst, (src_aux, dst_aux) in rooms:
        assert sender.poll() is KVPoll.Success, sender.reason
        assert peer.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(prefill, src)
        assert peer.ask("aux", dst_aux) == prefill.aux[src_aux].tobytes()
        assert prefill.control.outcomes(sender.key) == [ReportOutcome(KVPoll.Success)]
    wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
    stats = prefill.transport.snapshot()
    assert stats["chunks_failed"] == 0
    assert stats["in_flight"] == 0


def test_out_of_range_page_fails_that_room_only(prefill: Prefill, peer: PeerProcess) -> None:
    good = prefill.room(1, [1, 2, 3], [10, 11, 12])
    bad = prefill.room(2, [4, 5], [13, SHAPE.num_pages + 7])
    bad_src = prefill.room(3, [SHAPE.num_pages], [20])
    also_good = prefill.room(4, [6], [21], aux=(2, 4))
    wait_until_sync(lambda: all(s.poll() in TERMINAL for s in (good, bad, bad_src, also_good)))
    assert good.poll() is KVPoll.Success
    assert also_good.poll() is KVPoll.Success
    assert bad.poll() is KVPoll.Failed
    assert f"destination page index {SHAPE.num_pages + 7} out of range" in bad.reason
    assert bad_src.poll() is KVPoll.Failed
    assert f"source page index {SHAPE.num_pages} out of range" in bad_src.reason
    assert prefill.transport.stats.chunks_rejected == 2
    # The rejected chunks never reached NIXL: only the two good rooms' kv and aux handles did.
    assert prefill.transport.stats.handles_created == 4
    assert peer.ask("digests", np.asarray([10, 11, 12], np.int32).tobytes()) == expected(
        prefill, [1, 2, 3]
    )


def ready_senders(
    prefill: Prefill,
    rooms: dict[int, tuple[list[int], list[int]]],
    peers: Sequence[str] = ("decode",),
) -> dict:
    """A sender per room id with decode's pages (``rooms``: id -> (src, dst)), each
    WaitingForInput; decode's aux row is the room id. Room ``r`` goes to the decode peer
    ``peers[r % len(peers)]``."""
    senders = {}
    for room, (_, dst) in rooms.items():
        sender = prefill.engine.sender(room)
        packed = np.asarray(dst, np.int32).tobytes()
        peer = peers[room % len(peers)]
        prefill.engine.post(sender.key, DestinationReceived(packed, room, peer=peer))
        senders[room] = sender
    wait_until_sync(lambda: all(s.poll() is KVPoll.WaitingForInput for s in senders.values()))
    return senders


def burst(prefill: Prefill, senders: dict, rooms: dict[int, tuple[list[int], list[int]]]) -> None:
    """Every room's init and chunks (two each) posted from one loop callback: the engine
    handles them as one batch of steps, as it does a scheduler iteration's calls."""

    async def post_all() -> None:
        for room, (src, _) in rooms.items():
            sender = senders[room]
            sender.init(len(src), room % SHAPE.aux_rows)
            half = len(src) // 2
            sender.send(np.asarray(src[:half], np.int32))
            sender.send(np.asarray(src[half:], np.int32))

    prefill.engine.call(post_all())
    wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders.values()))


def test_chunks_of_one_batch_go_out_as_one_request_and_a_bad_page_fails_only_its_room(
    prefill: Prefill, peer: PeerProcess
) -> None:
    bad_page = SHAPE.num_pages + 3
    rooms = {
        r: ([4 * r + i for i in range(4)], [64 + 4 * r + i for i in range(4)]) for r in range(6)
    }
    rooms[2] = (rooms[2][0], [100, 101, bad_page, 102])  # its second chunk names a bad page
    senders = ready_senders(prefill, rooms)
    burst(prefill, senders, rooms)
    for room, (src, dst) in rooms.items():
        sender = senders[room]
        if room == 2:
            assert sender.poll() is KVPoll.Failed
            assert f"destination page index {bad_page} out of range" in sender.reason
            continue
        assert sender.poll() is KVPoll.Success, sender.reason
        assert peer.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(prefill, src)
        assert peer.ask("aux", room) == prefill.aux[room % SHAPE.aux_rows].tobytes()
    stats = prefill.transport.snapshot()
    assert stats["chunks_posted"] == 12
    assert stats["chunks_rejected"] == 1
    assert stats["chunks_done"] == 11  # room 2's first chunk landed too (its pages are fine)
    # Eleven chunks, five aux rows, one kv and one aux request: merged (rule 8).
    assert stats["handles_created"] == 2
    wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)


def test_a_room_that_fails_in_the_batch_that_sent_its_chunk_never_posts_it(
    prefill: Prefill, peer: PeerProcess
) -> None:
    rooms = {r: ([2 * r, 2 * r + 1], [30 + 2 * r, 31 + 2 * r]) for r in range(3)}
    senders = ready_senders(prefill, rooms)

    async def send_then_abort_one() -> None:
        for room, (src, _) in rooms.items():
            senders[room].init(len(src), room % SHAPE.aux_rows)
            senders[room].send(np.asarray(src, np.int32))
        senders[1].abort("changed its mind")  # same batch: its chunk is still staged

    prefill.engine.call(send_then_abort_one())
    wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders.values()))
    wait_until_sync(lambda: senders[1].settled)
    assert senders[1].poll() is KVPoll.Failed
    assert [s.poll() for r, s in senders.items() if r != 1] == [KVPoll.Success] * 2
    stats = prefill.transport.snapshot()
    assert stats["chunks_dropped"] == 1
    assert stats["chunks_done"] == 2
    assert stats["handles_created"] == 2  # the other two rooms' kv and aux, merged
    assert peer.ask("digests", np.asarray([32, 33], np.int32).tobytes()) != expected(
        prefill, [2, 3]
    )  # nothing of the aborted room landed


def test_a_merge_that_raises_posts_each_chunk_alone(
    prefill: Prefill, peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*_: object) -> None:
        raise MemoryError("joining the pages")

    monkeypatch.setattr("kvfsm.transport._transport.merge", out_of_memory)
    three_rooms_each_posted_alone(prefill, peer, first_page=50)
    assert prefill.transport.snapshot()["merge_errors"] == 1


def three_rooms_each_posted_alone(prefill: Prefill, peer: PeerProcess, first_page: int) -> None:
    """Three rooms of two chunks in one batch succeed with every byte in place, each chunk
    its own request (as with merging off: 6 kv handles, 3 aux), and end."""
    rooms = {
        r: ([2 * r, 2 * r + 1], [first_page + 2 * r, first_page + 1 + 2 * r]) for r in range(3)
    }
    senders = ready_senders(prefill, rooms)
    burst(prefill, senders, rooms)
    for room, (src, dst) in rooms.items():
        assert senders[room].poll() is KVPoll.Success, senders[room].reason
        assert peer.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(prefill, src)
    assert prefill.transport.snapshot()["handles_created"] == 9
    wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)


def test_a_grouping_that_raises_posts_each_chunk_alone(
    prefill: Prefill, peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged records were taken off the stage before they were grouped: a grouping that
    raises must still hand each of them over, or they would end only at their deadline."""

    def broken(*_: object) -> None:
        raise MemoryError("grouping the batch")

    monkeypatch.setattr("kvfsm.transport._transport.group_staged", broken)
    three_rooms_each_posted_alone(prefill, peer, first_page=60)


def test_a_hand_over_that_raises_fails_its_chunks_at_once_and_they_settle(
    prefill: Prefill, peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = prefill.transport
    accept = transport._accept
    raised: list[int] = []

    def accept_once_broken(record: Any, now: float, *, later: bool = False) -> None:
        if len(record.members) > 1 and not raised:  # the batch's merged request
            raised.append(len(record.members))
            raise RuntimeError("a bug in the hand-over")
        accept(record, now, later=later)

    monkeypatch.setattr(transport, "_accept", accept_once_broken)
    rooms = {r: ([2 * r, 2 * r + 1], [60 + 2 * r, 61 + 2 * r]) for r in range(3)}
    senders = ready_senders(prefill, rooms)
    burst(prefill, senders, rooms)  # returns once every room is terminal: not at a deadline
    assert raised == [6]
    for sender in senders.values():
        assert sender.poll() is KVPoll.Failed
        assert "could not post the chunk: RuntimeError: a bug in the hand-over" in sender.reason
    # Nothing was posted, so each room settles at once, and nothing is left in the ledger.
    wait_until_sync(lambda: all(s.settled for s in senders.values()), timeout=5)
    stats = transport.snapshot()
    assert stats["hand_over_errors"] == 1
    assert stats["handles_created"] == 0
    assert stats["in_flight"] == 0
    # The transport goes on: the next batch is posted as ever.
    later = {r: ([2 * r], [80 + r]) for r in range(3, 5)}
    burst(prefill, ready_senders(prefill, later), later)
    assert transport.snapshot()["chunks_done"] == 4  # two chunks each
    wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)


def test_chunks_whose_peer_was_lost_before_the_batch_ended_fail_unposted(
    prefill: Prefill, peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = prefill.transport
    rooms = {r: ([2 * r, 2 * r + 1], [90 + 2 * r, 91 + 2 * r]) for r in range(2)}
    senders = ready_senders(prefill, rooms)
    generation = transport.peer("decode")
    assert generation is not None
    rooms_ran = transport.rooms_ran
    lost: list[int] = []

    def lose_the_peer_then_end_the_batch() -> None:
        if len(transport._staged) == 2 * len(rooms) and not lost:
            # The agent reports the peer gone after the batch's chunks were staged and before
            # the batch ends: the staged chunks' generation is no longer current.
            lost.append(len(transport._staged))
            transport._peers.lost(generation, "remote disconnect (test)")
        rooms_ran()

    monkeypatch.setattr(transport, "rooms_ran", lose_the_peer_then_end_the_batch)
    burst(prefill, senders, rooms)
    for sender in senders.values():
        assert sender.poll() is KVPoll.Failed
        assert "peer decode lost before posting" in sender.reason, sender.reason
    wait_until_sync(lambda: all(s.settled for s in senders.values()), timeout=5)
    assert lost == [4]
    assert transport.snapshot()["handles_created"] == 0


def test_merging_off_posts_every_chunk_alone() -> None:
    process = PeerProcess(SHAPE)
    prefill = Prefill(TransferConfig(merge_max_chunks=1))
    try:
        prefill.connect(process)
        rooms = {r: ([2 * r, 2 * r + 1], [40 + 2 * r, 41 + 2 * r]) for r in range(3)}
        senders = ready_senders(prefill, rooms)
        burst(prefill, senders, rooms)
        assert all(s.poll() is KVPoll.Success for s in senders.values())
        # Two kv requests per room, and an aux request with each room's last chunk.
        assert prefill.transport.snapshot()["handles_created"] == 9
    finally:
        prefill.close()
        process.close()


def test_a_full_request_goes_to_the_poster_before_the_rest_of_the_batch_runs(
    peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a batch of room steps has staged ``merge_max_bytes``, that request is handed to
    the poster between two steps, not after the batch's last room (with 256 rooms, that is
    milliseconds of an idle poster). The requests are exactly those one flush at the batch's
    end would have made (the group that may still grow stays staged), in order, and every
    byte lands."""
    order: list[tuple[str, int]] = []
    staged = NixlTransport.submit
    posted = Poster.submit

    def stage(self: NixlTransport, key: RoomKey, command: Command) -> None:
        if isinstance(command, PostChunk):
            order.append(("staged", key.room))
        staged(self, key, command)

    def post(self: Poster[Xfer], record: Xfer) -> None:
        order.append(("posted", record.nbytes))
        posted(self, record)

    monkeypatch.setattr(NixlTransport, "submit", stage)  # before the router binds it
    monkeypatch.setattr(Poster, "submit", post)
    layout = make_layout(*make_buffers(SHAPE))
    page, aux = layout.page_bytes(), layout.aux_row_bytes()
    limit = 6 * page
    prefill = Prefill(TransferConfig(merge_max_bytes=limit))
    try:
        prefill.connect(peer)
        rooms = {
            r: ([4 * r + i for i in range(4)], [80 + 4 * r + i for i in range(4)]) for r in range(8)
        }
        senders = ready_senders(prefill, rooms)

        async def post_all() -> None:  # one batch: four chunks of one page per room
            for room, (src, _) in rooms.items():
                senders[room].init(len(src), room % SHAPE.aux_rows)
                for page_id in src:
                    senders[room].send(np.asarray([page_id], np.int32))

        prefill.engine.call(post_all())
        wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders.values()))
        for room, (src, dst) in rooms.items():
            assert senders[room].poll() is KVPoll.Success, senders[room].reason
            assert peer.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(
                prefill, src
            )
        last_staged = max(i for i, (what, _) in enumerate(order) if what == "staged")
        first_posted = min(i for i, (what, _) in enumerate(order) if what == "posted")
        assert first_posted < last_staged, order  # handed over before the batch ended
        # What one flush at the batch's end makes: greedy runs of at most `limit` bytes.
        requests, run = [], 0
        for nbytes in [page, page, page, page + aux] * len(rooms):
            if run and run + nbytes > limit:
                requests.append(run)
                run = 0
            run += nbytes
        requests.append(run)
        assert [nbytes for what, nbytes in order if what == "posted"] == requests, order
    finally:
        prefill.close()


class Watch:
    """What the transport staged (peer, room, chunk) and what it handed the poster, each
    request as its peer and its members' (room, chunk), in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.staged: list[tuple[str, int, int]] = []
        self.posted: list[tuple[str, list[tuple[int, int]], int]] = []
        self.order: list[str] = []  # "staged" / "posted", interleaved as they happened
        stage, post = NixlTransport.submit, Poster.submit

        def staging(transport: NixlTransport, key: RoomKey, command: Command) -> None:
            if isinstance(command, PostChunk):
                self.staged.append((command.peer, key.room, command.chunk))
                self.order.append("staged")
            stage(transport, key, command)

        def posting(poster: Poster[Xfer], record: Xfer) -> None:
            members = [(key.room, chunk) for key, chunk, _ in record.members]
            self.posted.append((record.peer.peer_id, members, record.nbytes))
            self.order.append("posted")
            post(poster, record)

        monkeypatch.setattr(NixlTransport, "submit", staging)  # before the router binds it
        monkeypatch.setattr(Poster, "submit", posting)

    def assert_each_peer_s_order_kept(self) -> None:
        """Every staged chunk posted once, each request to one peer, and each peer's chunks
        handed over in the order its rooms posted them."""
        peer_of = {(room, chunk): peer for peer, room, chunk in self.staged}
        for peer in {peer for peer, _, _ in self.staged}:
            sent = [m for p, members, _ in self.posted if p == peer for m in members]
            assert sent == [(r, c) for p, r, c in self.staged if p == peer], peer
        for peer, members, _ in self.posted:
            assert {peer_of[m] for m in members} == {peer}


def test_a_batch_whose_rooms_alternate_between_three_peers_merges_per_peer(
    three_peers: dict[str, PeerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that spreads its rooms round-robin over three decode peers (no two rooms in a
    row to one peer) still merges: each peer's chunks go out as one request, in the order its
    rooms posted them, and every byte lands at its room's peer."""
    watch = Watch(monkeypatch)
    prefill = Prefill()
    try:
        for peer_id, process in three_peers.items():
            prefill.connect(process, peer_id)
        ids = list(three_peers)
        rooms = {r: ([2 * r, 2 * r + 1], [40 + 2 * r, 41 + 2 * r]) for r in range(9)}
        senders = ready_senders(prefill, rooms, ids)
        burst(prefill, senders, rooms)
        for room, (src, dst) in rooms.items():
            assert senders[room].poll() is KVPoll.Success, senders[room].reason
            process = three_peers[ids[room % len(ids)]]
            assert process.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(
                prefill, src
            )
            assert process.ask("aux", room) == prefill.aux[room % SHAPE.aux_rows].tobytes()
        # Per peer, its three rooms' six chunks (and three aux rows) as one request.
        assert sorted(p for p, _, _ in watch.posted) == sorted(ids), watch.posted
        watch.assert_each_peer_s_order_kept()
        stats = prefill.transport.snapshot()
        assert stats["chunks_done"] == 18
        assert stats["handles_created"] == 2 * len(ids)  # a kv and an aux handle each
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
    finally:
        prefill.close()


@pytest.mark.parametrize(("hand_back_bytes", "hand_backs"), [(512 << 10, 2), (0, 4)])
def test_small_requests_posted_back_to_back_go_back_to_the_loop_together(
    three_peers: dict[str, PeerProcess],
    monkeypatch: pytest.MonkeyPatch,
    hand_back_bytes: int,
    hand_backs: int,
) -> None:
    """The poster is held inside one room's request while a batch of three rooms, one per
    decode peer, hands it three more (small: two pages each). Those three are posted back to
    back and their results go back to the loop in one hand-back (one loop wake-up), or each
    alone with ``hand_back_bytes=0``; the held request's result goes back first, alone. Every
    byte lands at its peer either way."""
    watch = Watch(monkeypatch)
    post = transport_module.post_xfer
    held = threading.Event()

    def hold_the_first(agent: Any, leases: Any, stats: Any, record: Xfer) -> None:
        if not held.is_set():
            held.set()
            wait_until_sync(lambda: len(watch.posted) >= 4, message="the batch's requests queued")
        post(agent, leases, stats, record)

    monkeypatch.setattr(transport_module, "post_xfer", hold_the_first)  # before it is bound
    prefill = Prefill(TransferConfig(hand_back_bytes=hand_back_bytes))
    try:
        for peer_id, process in three_peers.items():
            prefill.connect(process, peer_id)
        ids = list(three_peers)
        rooms = {r: ([2 * r, 2 * r + 1], [40 + 2 * r, 41 + 2 * r]) for r in range(4)}
        senders = ready_senders(prefill, rooms, ids)  # room 3 (the held one) to "decode"
        before = prefill.transport.snapshot()["poster_hand_backs"]

        async def send_the_held_room() -> None:
            senders[3].init(2, 3 % SHAPE.aux_rows)
            senders[3].send(np.asarray(rooms[3][0], np.int32))

        prefill.engine.call(send_the_held_room())
        wait_until_sync(held.is_set, message="the poster inside the held room's request")
        batch = {r: rooms[r] for r in range(3)}
        burst(prefill, {r: senders[r] for r in batch}, batch)
        wait_until_sync(lambda: senders[3].poll() in TERMINAL)
        for room, (src, dst) in rooms.items():
            assert senders[room].poll() is KVPoll.Success, senders[room].reason
            process = three_peers[ids[room % len(ids)]]
            assert process.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(
                prefill, src
            )
        assert len(watch.posted) == 4  # the held room's request, then one a peer
        stats = prefill.transport.snapshot()
        assert stats["poster_hand_backs"] - before == hand_backs
        assert stats["handles_created"] == stats["handles_released"]
    finally:
        prefill.close()


def test_early_requests_of_a_batch_over_two_peers_merge_per_peer_and_keep_each_order(
    peer: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rooms alternating between two peers, and a request limit that the batch passes twice:
    each time, between two steps, every group is handed over but the one of the peer a room
    posted to last, which stays staged and grows with that peer's next rooms. So each request
    still merges its peer's rooms across the other peer's, within the limit, in posting
    order, and every byte lands."""
    watch = Watch(monkeypatch)
    other = PeerProcess(SHAPE, name=f"decode1-{os.getpid()}")
    processes = {"decode": peer, "decode1": other}
    layout = make_layout(*make_buffers(SHAPE))
    limit = 12 * layout.page_bytes()  # twelve chunks of one page (the aux rows are small)
    prefill = Prefill(TransferConfig(merge_max_bytes=limit))
    try:
        for peer_id, process in processes.items():
            prefill.connect(process, peer_id)
        ids = list(processes)
        rooms = {r: ([2 * r, 2 * r + 1], [80 + 2 * r, 81 + 2 * r]) for r in range(12)}
        senders = ready_senders(prefill, rooms, ids)

        async def post_all() -> None:  # one batch: two chunks of one page per room
            for room, (src, _) in rooms.items():
                senders[room].init(len(src), room % SHAPE.aux_rows)
                for page_id in src:
                    senders[room].send(np.asarray([page_id], np.int32))

        prefill.engine.call(post_all())
        wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders.values()))
        for room, (src, dst) in rooms.items():
            assert senders[room].poll() is KVPoll.Success, senders[room].reason
            process = processes[ids[room % len(ids)]]
            assert process.ask("digests", np.asarray(dst, np.int32).tobytes()) == expected(
                prefill, src
            )
        order = watch.order
        assert order.index("posted") < len(order) - order[::-1].index("staged") - 1, order
        watch.assert_each_peer_s_order_kept()
        # The staged bytes pass the limit at room 5 (rooms 0-4 and 5: 12 pages and 6 aux
        # rows): room 5's peer stays staged, room 4's goes; again at room 8 (room 8's peer
        # stays, room 7's goes); the rest at the batch's end.
        rooms_of = [sorted({room for room, _ in members}) for _, members, _ in watch.posted]
        assert rooms_of == [[0, 2, 4], [1, 3, 5, 7], [6, 8, 10], [9, 11]], watch.posted
        assert all(nbytes <= limit for _, _, nbytes in watch.posted), watch.posted
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
    finally:
        prefill.close()
        other.close()


def test_peer_killed_fails_its_rooms_and_a_restarted_peer_serves_new_ones(
    peer: PeerProcess,
) -> None:
    prefill = Prefill()
    try:
        assert prefill.connect(peer) == 1
        warm = prefill.room(1, [1], [1])
        wait_until_sync(lambda: warm.poll() is KVPoll.Success)
        peer.kill()
        doomed = [prefill.room(10 + i, [i, i + 1], [30 + 2 * i, 31 + 2 * i], 2) for i in range(8)]
        wait_until_sync(lambda: all(s.poll() in TERMINAL for s in doomed), timeout=10)
        assert all(s.poll() is KVPoll.Failed for s in doomed)
        reasons = {s.reason for s in doomed}
        # the disconnect failed them (not their deadlines, which are minutes away)
        assert any("peer lost: NIXL remote disconnect" in r for r in reasons), reasons
        wait_until_sync(lambda: all(s.settled for s in doomed))
        assert prefill.transport.stats.peers_lost >= 1

        restarted = PeerProcess(SHAPE)
        try:
            assert prefill.connect(restarted) >= 2  # a new generation of the same peer id
            fresh = prefill.room(100, [5, 6, 7], [40, 41, 42], 2, aux=(1, 9))
            wait_until_sync(lambda: fresh.poll() in TERMINAL)
            assert fresh.poll() is KVPoll.Success, fresh.reason
            digests = restarted.ask("digests", np.asarray([40, 41, 42], np.int32).tobytes())
            assert digests == expected(prefill, [5, 6, 7])
            assert restarted.ask("aux", 9) == prefill.aux[1].tobytes()
        finally:
            wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
            prefill.close()
            restarted.close()
    except BaseException:
        prefill.engine.close()
        raise


def read_remote_pages(pid: int, peer: PeerProcess, pages: list[int]) -> bytes:
    """Read a (stopped) process's KV pages straight from its memory."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        out = [
            os.pread(fd, item, addr + page * item)
            for addr, _nbytes, item, _device in peer.summary.kv
            for page in pages
        ]
    finally:
        os.close(fd)
    return b"".join(out)


@pytest.mark.parametrize("tls", ["tcp", "default"])
def test_a_stopped_peer_fails_the_rooms_at_their_deadline_and_settles_them_only_once_flushed(
    tls: str,
) -> None:
    """A stopped peer cannot take a WRITE: every chunk hits its deadline and its room fails at
    once, with the reason. Its pages are not settled while the peer is stopped, however long
    past the quarantine: the released WRITEs' bytes wait for the peer and land when it resumes.
    They settle only when a flush posted after the release ends, which it does only once those
    bytes have landed: after that, nothing changes in the pages."""
    config = TransferConfig(deadline_base_s=0.3, floor_bandwidth_bps=1e12, quarantine_s=0.5)
    # UCX over TCP, or the transports UCX picks on one host (CMA with TCP active messages):
    # on both a WRITE into a stopped process stays in progress until it resumes.
    with environ({} if tls == "default" else {"UCX_TLS": tls}):
        peer = PeerProcess(SHAPE, name=f"stopped-peer-{os.getpid()}")
        prefill = Prefill(config)
    pages = [0, 1, 2, 3]
    try:
        prefill.connect(peer)
        assert peer.ask("fill", 0xAB)  # canary bytes in decode's pages
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            senders = [prefill.room(i, [i + 8], [i]) for i in pages]
            wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders), timeout=10)
            for sender in senders:
                assert sender.poll() is KVPoll.Failed
                assert "stalled" in sender.reason, sender.reason
            # Held while the peer is stopped, however long past the quarantine (four here).
            stays_true_sync(
                lambda: not any(s.settled for s in senders),
                duration=4 * config.quarantine_s,
                message="no room settled while the peer is stopped",
            )
            snapshot = prefill.transport.snapshot()
            assert snapshot["awaiting_flush"] >= 1, snapshot
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        wait_until_sync(lambda: all(s.settled for s in senders), timeout=10)
        at_settle = read_remote_pages(peer.pid, peer, pages)
        # Anything still buffered for the peer would land in this half second.
        stays_true_sync(
            lambda: read_remote_pages(peer.pid, peer, pages) == at_settle,
            duration=0.5,
            interval=0.02,
            message="no late write after settle",
        )
        # Released, not cancelled: the WRITEs landed whole, before the flush that settled them.
        sources = b"".join(bytes(buf[page + 8]) for buf in prefill.kv for page in pages)
        assert at_settle == sources
        stats = prefill.transport.stats
        assert stats.chunks_stalled == len(pages)
        assert stats.flushes_done >= 1
    finally:
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
        prefill.close()
        peer.close()


def test_concurrent_connects_of_one_peer_share_one_attempt(peer: PeerProcess) -> None:
    prefill = Prefill()
    try:
        transport = prefill.transport

        async def both() -> tuple[int, int]:
            import asyncio

            a, b = await asyncio.gather(
                transport.connect_peer("decode", peer.metadata, peer.summary),
                transport.connect_peer("decode", peer.metadata, peer.summary),
            )
            return a.generation, b.generation

        first, second = prefill.engine.call(both())
        assert first == second
        assert prefill.agent.peers_added == 1
        # A later connect of the same process (its control link came back) keeps the
        # generation: its endpoint is the one whose flush proves earlier WRITEs over.
        assert prefill.connect(peer) == first
        assert prefill.agent.peers_added == 1
        assert prefill.transport.stats.peers_kept == 1
    finally:
        prefill.close()


def test_incompatible_layout_is_refused_with_a_reason(peer: PeerProcess) -> None:
    from kvfsm.transport import LayoutSummary

    prefill = Prefill()
    try:
        wrong = LayoutSummary(kv=peer.summary.kv[:2], aux=peer.summary.aux)
        with pytest.raises(ValueError, match="incompatible"):
            prefill.engine.call(prefill.transport.connect_peer("odd", peer.metadata, wrong))
        assert prefill.transport.peer("odd") is None
        prefill.connect(peer)  # the engine and the transport are fine
    finally:
        prefill.close()


def test_state_rows_travel_with_the_last_chunk() -> None:
    shape = Shape(state_rows=16)
    peer = PeerProcess(shape)
    prefill = Prefill(shape=shape)
    try:
        prefill.connect(peer)
        sender = prefill.engine.sender(1)
        dst_state = np.asarray([3, 9], np.int32).tobytes()
        prefill.engine.post(
            sender.key,
            DestinationReceived(np.asarray([5, 6], np.int32).tobytes(), 2, "decode", dst_state),
        )
        wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput)
        sender.init(2, 1)
        sender.send([1], state_indices=[7])  # not the last chunk: refused, the room fails
        wait_until_sync(lambda: sender.poll() is KVPoll.Failed)
        assert "state rows sent with a chunk that is not the last" in sender.reason

        good = prefill.engine.sender(2)
        prefill.engine.post(
            good.key,
            DestinationReceived(np.asarray([5, 6], np.int32).tobytes(), 2, "decode", dst_state),
        )
        wait_until_sync(lambda: good.poll() is KVPoll.WaitingForInput)
        good.init(2, 1)
        good.send([1])
        good.send([2], state_indices=[7, 0])
        wait_until_sync(lambda: good.poll() in TERMINAL)
        assert good.poll() is KVPoll.Success, good.reason
        assert prefill.state is not None
        assert peer.ask("state", 3) == prefill.state[7].tobytes()
        assert peer.ask("state", 9) == prefill.state[0].tobytes()
        assert peer.ask("aux", 2) == prefill.aux[1].tobytes()
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
    finally:
        prefill.close()
        peer.close()
