"""``kvfsm.transport._chunks``: a ``PostChunk`` accepted into a record (sans-IO, against a real
ledger), then made into NIXL transfers and posted, on real NIXL (UCX) between two agents in
this process, DRAM to DRAM: what lands is compared with what was sent."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.rooms import RoomKey
from kvfsm.states import ChunkDone, ChunkFailed, PostChunk
from kvfsm.transport import NO_KV, AgentConfig, LayoutError, Leases
from kvfsm.transport._chunks import Xfer, merge, prepare
from kvfsm.transport._fence import FenceError
from kvfsm.transport._ledger import QUEUED, Deliver, Finish
from kvfsm.workload.buffers import page_digests
from tests.helpers.interpose import Interposer
from tests.helpers.nixl_pair import HYBRID, KEY, SHAPE, Pair, chunk, ints


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    yield made
    made.close()


# -- accept: sans-IO -------------------------------------------------------------------------


def test_a_chunk_is_sized_and_handed_to_the_poster(pair: Pair) -> None:
    record = pair.record(chunk([1, 2, 3], [4, 5, 6], is_last=True, src_aux=1, dst_aux=2))
    page_bytes = 2 * SHAPE.layers * SHAPE.page_bytes  # every K and V buffer
    assert record.nbytes == 3 * page_bytes + SHAPE.aux_row_bytes
    assert record.phase == QUEUED
    assert record.peer is pair.peer
    assert pair.ledger.in_flight == 1
    assert record.src_aux is not None
    assert record.dst_aux is not None


def test_aux_rows_travel_only_with_the_last_chunk(pair: Pair) -> None:
    record = pair.record(chunk([1], [4], src_aux=1, dst_aux=2))  # not the last
    assert record.src_aux is None
    assert record.dst_aux is None
    assert record.nbytes == 2 * SHAPE.layers * SHAPE.page_bytes


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (chunk([1, 2], [3]), "2 source pages but 1 destination pages"),
        (chunk([1], [3], is_last=True, src_aux=0, dst_aux=SHAPE.aux_rows), "destination aux row"),
        (chunk([1], [3], src_state=ints([1, 2]), dst_state=ints([1])), "2 source state rows"),
    ],
    ids=["pages", "aux-row", "state-rows"],
)
def test_bad_input_fails_the_chunk_before_the_ledger(
    pair: Pair, command: PostChunk, reason: str
) -> None:
    (deliver,) = pair.accept(command)
    assert type(deliver) is Deliver
    assert deliver.key == KEY
    assert type(deliver.event) is ChunkFailed
    assert reason in deliver.event.reason, deliver.event.reason
    assert pair.ledger.in_flight == 0
    assert (pair.stats.chunks_rejected, pair.stats.chunks_failed) == (1, 1)


def test_a_chunk_for_no_connected_peer_fails(pair: Pair) -> None:
    actions = pair.accept(chunk([1], [2]), peer=None)
    assert [type(a) for a in actions] == [Deliver]
    assert "no connected peer 'decode'" in actions[0].event.reason


def test_an_empty_chunk_is_done_without_nixl(pair: Pair) -> None:
    (deliver,) = pair.accept(chunk([], [], is_last=True))  # no pages, no aux row, no state
    assert type(deliver) is Deliver
    assert deliver.event == ChunkDone(0)
    assert pair.ledger.in_flight == 0
    assert pair.stats.chunks_done == 1


def test_a_fenced_ledger_refuses_a_chunk_without_a_valid_lease(pair: Pair) -> None:
    pair.ledger_with(Leases())
    (finish,) = pair.accept(chunk([1], [2], fence=7))
    assert type(finish) is Finish
    assert "write lease of fence 7 never granted: not posted" in finish.event.reason
    assert pair.ledger.in_flight == 0


# -- post_xfer: real NIXL --------------------------------------------------------------------


def test_posted_pages_aux_and_state_rows_land_in_the_peer(pair: Pair) -> None:
    src, dst = [9, 2, 7, 3], [11, 0, 5, 6]  # unsorted: posted in destination order
    record = pair.record(
        chunk(
            src,
            dst,
            is_last=True,
            src_aux=3,
            dst_aux=1,
            src_state=ints([2, 0]),
            dst_state=ints([1, 3]),
        )
    )
    pair.post(record)
    assert len(record.states) == 3  # kv, aux, state: one prepped transfer each
    assert pair.settle(record) == ["DONE"] * 3
    assert pair.theirs.pages(dst) == pair.mine.pages(src)
    assert pair.theirs.aux[1].tobytes() == pair.mine.aux[3].tobytes()
    assert pair.theirs.state[1].tobytes() == pair.mine.state[2].tobytes()
    assert pair.theirs.state[3].tobytes() == pair.mine.state[0].tobytes()
    untouched = [p for p in range(SHAPE.num_pages) if p not in dst]
    zeros = [np.zeros((1, SHAPE.page_bytes), np.uint8)] * (2 * SHAPE.layers)
    assert pair.theirs.pages(untouched) == page_digests(zeros, np.zeros(1, np.int32)) * len(
        untouched
    )


@pytest.fixture
def hybrid() -> Iterator[Pair]:
    made = Pair(hybrid=True)
    yield made
    made.close()


def pool_rows(side: Any, kind: int, row: int) -> list[bytes]:
    """Item ``row`` of each pool of state type ``kind`` on ``side``."""
    first = sum(len(k) for k in HYBRID[:kind])
    return [side.pools[first + i][row].tobytes() for i in range(len(HYBRID[kind]))]


def test_state_rows_of_several_types_land_in_their_pools(hybrid: Pair) -> None:
    # Global rows: type 0 is 0-4, type 1 is 5-11, type 2 is 12-14 (see HYBRID).
    src_state, dst_state = [3, 5 + 6, 12 + 2, 0], [1, 5 + 0, 12 + 1, 4]
    record = hybrid.record(
        chunk([1], [2], is_last=True, src_state=ints(src_state), dst_state=ints(dst_state))
    )
    assert record.nbytes == 2 * SHAPE.layers * SHAPE.page_bytes + (64 + 192) * 2 + 32 + 16 + 48
    hybrid.post(record)
    assert hybrid.settle(record) == ["DONE"] * 2
    for (kind, s_row), (_, d_row) in zip(
        [(0, 3), (1, 6), (2, 2), (0, 0)], [(0, 1), (1, 0), (2, 1), (0, 4)], strict=True
    ):
        assert pool_rows(hybrid.theirs, kind, d_row) == pool_rows(hybrid.mine, kind, s_row)
    written = {(0, 1), (0, 4), (1, 0), (2, 1)}
    for kind, pools in enumerate(HYBRID):
        for row in range(min(rows for rows, _ in pools)):
            if (kind, row) not in written:
                assert set(b"".join(pool_rows(hybrid.theirs, kind, row))) == {0}


@pytest.mark.parametrize(
    ("src_state", "dst_state", "reason"),
    [
        (
            [0],
            [5],
            "source state row 0 is of state type 0 but destination row 5 is of state type 1",
        ),
        (
            [12],
            [4],
            "source state row 12 is of state type 2 but destination row 4 is of state type 0",
        ),
        ([15], [0], r"source state row index 15 out of range \[0, 15\)"),
        ([0], [15], r"destination state row index 15 out of range \[0, 15\)"),
    ],
    ids=["0-into-1", "2-into-0", "source-range", "destination-range"],
)
def test_a_state_row_into_another_type_fails_the_chunk(
    hybrid: Pair, src_state: list[int], dst_state: list[int], reason: str
) -> None:
    command = chunk([1], [2], is_last=True, src_state=ints(src_state), dst_state=ints(dst_state))
    (deliver,) = hybrid.accept(command)
    assert type(deliver.event) is ChunkFailed
    assert re.search(reason, deliver.event.reason), deliver.event.reason
    assert hybrid.ledger.in_flight == 0


@pytest.mark.parametrize(
    ("src", "dst", "reason"),
    [([1], [SHAPE.num_pages], "destination page index"), ([-1], [1], "source page index")],
    ids=["destination", "source"],
)
def test_a_page_out_of_range_raises_before_any_handle(
    pair: Pair, src: list[int], dst: list[int], reason: str
) -> None:
    record = pair.record(chunk(src, dst))
    with pytest.raises(LayoutError, match=reason):
        pair.post(record)
    assert record.handles == []
    assert pair.stats.handles_created == 0


def test_pages_for_a_peer_this_rank_writes_no_kv_into_are_refused(pair: Pair) -> None:
    theirs = pair.theirs.agent
    dummy = pair.mine.agent.connect("dummy", theirs.metadata(), theirs.layout.summary(), NO_KV)
    try:
        (post,) = pair.accept(chunk([1], [1]), peer=dummy)  # O(1) checks pass: sized as none
        assert isinstance(post.record, Xfer)
        with pytest.raises(LayoutError, match="writes no KV"):
            pair.post(post.record)
        assert pair.stats.handles_created == 0
    finally:
        pair.mine.agent.disconnect(dummy)


def test_a_dropped_record_is_skipped(pair: Pair) -> None:
    record = pair.record(chunk([1], [1]))
    record.dropped = True
    pair.post(record)
    assert (record.handles, record.states) == ([], [])
    assert pair.theirs.pages([1]) != pair.mine.pages([1])


def test_a_lease_gone_before_the_post_stops_it_after_the_handle_is_made(pair: Pair) -> None:
    leases = Leases()
    pair.ledger_with(leases)
    leases.grant(7, 1e18)  # valid at acceptance
    record = pair.record(chunk([4], [8], fence=7))
    leases.revoke(7)  # meanwhile: the writer was frozen with the chunk queued
    with pytest.raises(FenceError, match="write lease of fence 7 revoked: not posted"):
        pair.post(record)
    assert record.states == []  # nothing transferred...
    assert len(record.handles) == 1  # ...but the handle was made: the pump must release it
    assert pair.settle(record) == []
    assert pair.theirs.pages([8]) != pair.mine.pages([4])


class Synchronous(Interposer):
    """Wraps the raw agent so that ``transfer()`` returns only once the WRITE is over, as the
    cross-process shared-memory path does (the copy runs inside the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Pair | None = None  # in one process the receiver must be progressed too

    def transfer(self, handle: Any) -> str:
        state = str(self.inner.transfer(handle))
        while state == "PROC" and self.target is not None:
            self.target.progress()
            state = str(self.inner.check_xfer_state(handle))
        return state


def test_a_post_over_inside_transfer_leaves_nothing_open_for_the_gate() -> None:
    """The stale-progress gate counts a record open from just before its first transfer().
    A copy over inside the call closes it at once: a freeze right after it, past the lease,
    has nothing of it to push, so it fences nothing out."""
    synchronous = Synchronous()
    pair = Pair(AgentConfig(interpose=synchronous))
    synchronous.target = pair
    try:
        leases = Leases(margin_s=1.0)
        pair.ledger_with(leases)
        leases.grant(7, time.monotonic() + 0.05)
        record = pair.record(chunk([4], [8], fence=7))
        pair.post(record)
        assert record.states == ["DONE"]
        assert not record.opened
        assert leases.progress_allowed(time.monotonic() + 60.0)  # long after the lease's end
        assert leases.fenced_out is None
        assert pair.theirs.pages([8]) == pair.mine.pages([4])
    finally:
        pair.close()


def test_a_post_still_in_progress_stays_open_for_the_gate(pair: Pair) -> None:
    leases = Leases(margin_s=1.0)
    pair.ledger_with(leases)
    now = time.monotonic()
    leases.grant(7, now + 0.05)
    record = pair.record(chunk([4], [8], fence=7))
    pair.post(record)
    assert record.states == ["PROC"]  # (in one process the WRITE is not over inside the call)
    assert record.opened
    assert not leases.progress_allowed(now + 60.0)  # frozen past the lease with it open
    assert pair.settle(record) == ["DONE"]


# -- merge: several chunks, one NIXL request (the ledger's rule 8) -----------------------------


def prepared(
    pair: Pair, command: PostChunk, key: RoomKey = KEY, merge_bytes: int = 1 << 30
) -> Xfer:
    record = prepare(
        pair.stats, key, command, layout=pair.mine.agent.layout, peer=pair.peer,
        merge_bytes=merge_bytes,
    )  # fmt: skip
    assert isinstance(record, Xfer)
    return record


def test_merged_chunks_of_several_rooms_land_as_one_request(pair: Pair) -> None:
    a = prepared(pair, chunk([1, 2], [9, 3], index=0), RoomKey(1, 1))
    b = prepared(pair, chunk([5], [0], index=1, is_last=True, src_aux=2, dst_aux=1), RoomKey(1, 1))
    c = prepared(
        pair, chunk([7, 4], [12, 6], index=0, is_last=True, src_aux=0, dst_aux=3), RoomKey(2, 1)
    )
    assert all(r.mergeable for r in (a, b, c))
    merged, bad = merge([a, b, c], pair.mine.agent.layout)
    assert bad == []
    assert merged is not None
    assert merged.checked
    assert merged.members == (
        (RoomKey(1, 1), 0, a.nbytes), (RoomKey(1, 1), 1, b.nbytes), (RoomKey(2, 1), 0, c.nbytes)
    )  # fmt: skip
    assert merged.nbytes == a.nbytes + b.nbytes + c.nbytes
    pair.ledger.accepted(merged, time.monotonic())
    pair.post(merged)
    assert len(merged.states) == 2  # one kv request, one aux request, for all three chunks
    assert pair.stats.handles_created == 2
    assert pair.settle(merged) == ["DONE", "DONE"]
    assert pair.theirs.pages([9, 3, 0, 12, 6]) == pair.mine.pages([1, 2, 5, 7, 4])
    assert pair.theirs.aux[1].tobytes() == pair.mine.aux[2].tobytes()
    assert pair.theirs.aux[3].tobytes() == pair.mine.aux[0].tobytes()


@pytest.mark.parametrize(
    ("bad_src", "bad_dst", "reason"),
    [([1], [SHAPE.num_pages], "destination page index"), ([-1], [2], "source page index")],
    ids=["destination", "source"],
)
def test_a_bad_page_leaves_only_its_own_chunk_out_of_a_merge(
    pair: Pair, bad_src: list[int], bad_dst: list[int], reason: str
) -> None:
    good = [prepared(pair, chunk([i], [i + 4], index=i), RoomKey(i, 1)) for i in (1, 3)]
    bad = prepared(pair, chunk(bad_src, bad_dst), RoomKey(2, 1))
    assert bad.mergeable  # pages are checked when merged, not when prepared
    merged, left_out = merge([good[0], bad, good[1]], pair.mine.agent.layout)
    assert [(record, reason in str(exc)) for record, exc in left_out] == [(bad, True)]
    assert merged is not None
    assert merged.checked
    assert [key for key, _, _ in merged.members] == [RoomKey(1, 1), RoomKey(3, 1)]
    pair.ledger.accepted(merged, time.monotonic())
    pair.post(merged)
    assert pair.settle(merged) == ["DONE"]
    assert pair.theirs.pages([5, 7]) == pair.mine.pages([1, 3])


def test_a_merge_with_only_bad_chunks_leaves_nothing_and_one_good_chunk_goes_alone(
    pair: Pair,
) -> None:
    layout = pair.mine.agent.layout
    bad = [prepared(pair, chunk([SHAPE.num_pages + i], [1]), RoomKey(i, 1)) for i in (1, 2)]
    merged, left_out = merge(bad, layout)
    assert merged is None
    assert [record for record, _ in left_out] == bad
    good = prepared(pair, chunk([3], [4]), RoomKey(3, 1))
    merged, left_out = merge([bad[0], good], layout)
    assert merged is good  # not copied: checked, and posted alone
    assert good.checked


def test_only_small_chunks_without_state_rows_are_mergeable_and_only_alike_ones_merge(
    pair: Pair,
) -> None:
    page = 2 * SHAPE.layers * SHAPE.page_bytes
    assert not prepared(pair, chunk([1, 2], [3, 4]), merge_bytes=page).mergeable  # too big
    assert prepared(pair, chunk([1], [3]), merge_bytes=page).mergeable
    with_state = chunk([1], [3], is_last=True, src_state=ints([1]), dst_state=ints([2]))
    assert not prepared(pair, with_state).mergeable  # its rows are checked on the poster
    one, other = prepared(pair, chunk([1], [3])), prepared(pair, chunk([2], [4], fence=3))
    with pytest.raises(ValueError, match="one peer generation and fence"):
        merge([one, other], pair.mine.agent.layout)
