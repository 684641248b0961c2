"""``kvfsm.transport._chunks``: a ``PostChunk`` accepted into a record (sans-IO, against a real
ledger), then made into NIXL transfers and posted, on real NIXL (UCX) between two agents in
this process, DRAM to DRAM: what lands is compared with what was sent."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.states import ChunkDone, ChunkFailed, PostChunk
from kvfsm.transport import NO_KV, LayoutError, Leases
from kvfsm.transport._chunks import Xfer, accept
from kvfsm.transport._fence import FenceError
from kvfsm.transport._ledger import QUEUED, Deliver, Finish
from kvfsm.workload.buffers import page_digests
from tests.helpers.nixl_pair import KEY, SHAPE, Pair, chunk, ints


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
    actions = accept(
        pair.ledger, KEY, chunk([1], [2]), layout=pair.mine.agent.layout, peer=None, now=0.0
    )
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
