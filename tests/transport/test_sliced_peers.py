"""Sliced peers (unequal attention TP) in the data path, on real NIXL (UCX), DRAM to DRAM: a
``KvPiece`` link writes exactly its head slice of each row of each page, a ``NO_KV`` (dummy) link
writes no KV at all, layouts of different KV page sizes are compatible only when sliced, and
the agent prepares one local list per distinct slice."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kvfsm.rooms import SenderRoom
from kvfsm.states import TERMINAL, DestinationReceived, KVPoll, Part, ReportOutcome
from kvfsm.transport._agent import Agent
from kvfsm.transport._layout import Layout, Region
from kvfsm.transport._slices import NO_KV, KvPiece, RowSlice, link_piece
from kvfsm.workload.buffers import Shape, make_buffers, make_layout, page_digests
from kvfsm.workload.peer import PeerProcess
from tests.helpers.transport import Prefill
from tests.helpers.waiting import wait_until_sync

HEAD_BYTES, ROWS = 64, 4  # a page is ROWS token rows of (heads x HEAD_BYTES) bytes
CANARY = 0xAB


def shape_for(heads: int, num_pages: int = 16) -> Shape:
    return Shape(layers=2, num_pages=num_pages, page_bytes=ROWS * heads * HEAD_BYTES, aux_rows=8)


def piece_for(total: int, tp_p: int, p: int, tp_d: int, d: int) -> KvPiece:
    piece = link_piece(
        total_heads=total,
        head_bytes=HEAD_BYTES,
        rows=ROWS,
        prefill_tp=tp_p,
        prefill_rank=p,
        decode_tp=tp_d,
        decode_rank=d,
    )
    assert isinstance(piece, KvPiece), piece
    return piece


def sliced_room(
    prefill: Prefill, room: int, src: list[int], dst: list[int], *, peer_id: str, part: Part
) -> SenderRoom:
    sender = prefill.engine.sender(room)
    aux = 4 if part is Part.WHOLE else -1
    prefill.engine.post(
        sender.key,
        DestinationReceived(np.asarray(dst, np.int32).tobytes(), aux, peer=peer_id, part=part),
    )
    wait_until_sync(lambda: sender.poll() is not KVPoll.Bootstrapping)
    sender.init(len(src), 1 if part is Part.WHOLE else -1)
    cut = 1 if len(src) > 1 else len(src)  # two chunks where there are pages for two
    sender.send(np.asarray(src[:cut], np.int32))
    if cut < len(src):
        sender.send(np.asarray(src[cut:], np.int32))
    return sender


def expected_pages(
    prefill: Prefill, piece: KvPiece, src: list[int], dst: list[int], decode: Shape
) -> list[npt.NDArray[np.uint8]]:
    """Decode's KV buffers as they must be: canary bytes everywhere but the slice of each row
    of each destination page, which holds the source rows' slice."""
    out = []
    for buf in prefill.kv:
        want = np.full((decode.num_pages, decode.page_bytes), CANARY, np.uint8)
        rows_src = buf.reshape(buf.shape[0], ROWS, piece.src.row_bytes)
        rows_dst = want.reshape(decode.num_pages, ROWS, piece.dst.row_bytes)
        theirs = slice(piece.src.offset, piece.src.offset + piece.src.length)
        mine = slice(piece.dst.offset, piece.dst.offset + piece.dst.length)
        for i, j in zip(src, dst, strict=True):
            rows_dst[j, :, mine] = rows_src[i, :, theirs]
        out.append(want)
    return out


@pytest.mark.parametrize(
    ("total", "tp_p", "p", "tp_d", "d"),
    [(4, 2, 1, 1, 0), (4, 1, 0, 2, 1), (8, 4, 2, 2, 1)],
    ids=["tp2-rank1-into-tp1", "tp1-into-tp2-rank1", "tp4-rank2-into-tp2-rank1"],
)
def test_a_sliced_peer_gets_exactly_the_slice_of_each_row(
    total: int, tp_p: int, p: int, tp_d: int, d: int
) -> None:
    prefill_shape, decode_shape = shape_for(total // tp_p), shape_for(total // tp_d)
    piece = piece_for(total, tp_p, p, tp_d, d)
    peer = PeerProcess(decode_shape)
    prefill = Prefill(shape=prefill_shape)
    try:
        prefill.engine.call(
            prefill.transport.connect_peer("decode", peer.metadata, peer.summary, piece)
        )
        assert peer.ask("fill", CANARY)
        src, dst = [3, 1, 7], [5, 12, 0]
        sender = sliced_room(prefill, 1, src, dst, peer_id="decode", part=Part.WHOLE)
        wait_until_sync(lambda: sender.poll() in TERMINAL)
        assert sender.poll() is KVPoll.Success, sender.reason
        assert prefill.control.outcomes(sender.key) == [ReportOutcome(KVPoll.Success)]
        want = expected_pages(prefill, piece, src, dst, decode_shape)
        everything = np.arange(decode_shape.num_pages, dtype=np.int32)
        got = peer.ask("digests", everything.tobytes())
        assert got == page_digests(want, everything)  # the slice, and nothing else, landed
        assert peer.ask("aux", 4) == prefill.aux[1].tobytes()  # the WHOLE leg's aux row
        assert prefill.transport.snapshot()["chunks_failed"] == 0
        # Pages out of range on either side fail the room before NIXL sees the sliced chunk.
        n = decode_shape.num_pages
        beyond = sliced_room(prefill, 2, [2], [n], peer_id="decode", part=Part.WHOLE)
        wait_until_sync(lambda: beyond.poll() in TERMINAL)
        assert f"destination page index {n} out of range" in beyond.reason, beyond.reason
        assert peer.ask("digests", everything.tobytes()) == got  # nothing else landed
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
    finally:
        prefill.close()
        peer.close()


def test_a_dummy_link_refuses_pages_and_completes_an_empty_last_chunk() -> None:
    shape = shape_for(2)
    peer = PeerProcess(shape)
    prefill = Prefill(shape=shape)
    try:
        prefill.engine.call(
            prefill.transport.connect_peer("dummy", peer.metadata, peer.summary, NO_KV)
        )
        assert peer.ask("fill", CANARY)
        # A room that names pages over a link that carries no KV fails instead of writing.
        writer = sliced_room(prefill, 1, [2, 3], [4, 5], peer_id="dummy", part=Part.KV)
        wait_until_sync(lambda: writer.poll() in TERMINAL)
        assert writer.poll() is KVPoll.Failed
        assert "which this rank writes no KV into" in writer.reason, writer.reason
        assert "a dummy link" in writer.reason
        # The dummy leg proper: no pages, no aux row, one empty last chunk, Success.
        dummy = sliced_room(prefill, 2, [], [], peer_id="dummy", part=Part.NONE)
        assert dummy.part is Part.NONE
        wait_until_sync(lambda: dummy.poll() in TERMINAL)
        assert dummy.poll() is KVPoll.Success, dummy.reason
        wait_until_sync(lambda: prefill.engine.stats()["live"] == 0)
        everything = np.arange(shape.num_pages, dtype=np.int32)
        canary = [np.full((shape.num_pages, shape.page_bytes), CANARY, np.uint8)] * 4
        assert peer.ask("digests", everything.tobytes()) == page_digests(canary, everything)
        stats = prefill.transport.stats
        assert stats.chunks_failed == stats.chunks_rejected == 2  # both of the writer's chunks
        assert stats.handles_created == 0  # nothing over the dummy link reached NIXL
    finally:
        prefill.close()
        peer.close()


# -- layouts and the agent (two agents in this process) -----------------------------------------

_NAMES = itertools.count()


def _agent(shape: Shape, *, state: bool = False) -> Agent:
    kv, aux = make_buffers(shape)
    buf = np.zeros((4, 128), np.uint8) if state else None
    return Agent(f"sliced-{os.getpid()}-{next(_NAMES)}", make_layout(kv, aux, buf))


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for agent in made:
        agent.close()


def test_sliced_compatibility_lets_kv_page_sizes_differ_and_nothing_else() -> None:
    two, four = shape_for(2), shape_for(4)
    mine = make_layout(*make_buffers(two))
    wider = make_layout(*make_buffers(four))
    assert mine.compatible_with(wider) is not None  # whole pages would not land on pages
    assert "kv region 0 item_bytes differs" in str(mine.compatible_with(wider))
    assert mine.compatible_with(wider, sliced=True) is None
    fewer = make_layout(*make_buffers(Shape(layers=1, page_bytes=four.page_bytes, aux_rows=8)))
    assert mine.compatible_with(fewer, sliced=True) == (
        "kv region count differs: local 4, remote 2"
    )
    other_aux = make_layout(*make_buffers(Shape(layers=2, page_bytes=1024, aux_row_bytes=128)))
    assert "aux region 0 item_bytes differs" in str(mine.compatible_with(other_aux, sliced=True))
    kv, aux = make_buffers(four)
    with_state = make_layout(kv, aux, np.zeros((4, 128), np.uint8))
    assert "state region count differs" in str(mine.compatible_with(with_state, sliced=True))


def test_connect_refuses_a_piece_that_does_not_fit_either_side(agents: list[Agent]) -> None:
    mine, theirs = _agent(shape_for(2)), _agent(shape_for(4))  # rows of 128 and 256 bytes
    agents += [mine, theirs]
    summary = theirs.layout.summary()
    good = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(256, 128, 128))
    bad_src = KvPiece(ROWS, RowSlice(96, 0, 96), RowSlice(256, 0, 96))  # not prefill's rows
    bad_dst = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(128, 0, 128))  # not decode's rows
    outside = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(256, 192, 128))  # past the row
    prepped = mine.dlists_prepped
    for piece in (bad_src, bad_dst, outside):
        with pytest.raises(ValueError, match=r"layouts are incompatible: head slice KvPiece"):
            mine.connect("decode", theirs.metadata(), summary, piece)
    assert mine.peers_added == 0  # refused before NIXL heard of the peer
    assert mine.dlists_prepped == prepped
    peer = mine.connect("decode", theirs.metadata(), summary, good)
    assert peer.piece == good
    mine.disconnect(peer)


def test_one_local_list_per_distinct_slice_released_at_close(agents: list[Agent]) -> None:
    mine = _agent(shape_for(2))
    decodes = [_agent(shape_for(4)) for _ in range(4)]
    agents += decodes
    base = mine.dlists_prepped  # its own kv and aux lists
    first = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(256, 0, 128))
    same_src = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(256, 128, 128))
    half = KvPiece(ROWS, RowSlice(128, 64, 64), RowSlice(256, 0, 64))
    peers = []
    for i, (decode, piece) in enumerate(zip(decodes, [first, same_src, half, NO_KV], strict=True)):
        summary = decode.layout.summary()
        peers.append(mine.connect(f"decode-{i}", decode.metadata(), summary, piece))
    # Remote lists: kv and aux per sliced peer, aux only for the dummy link (3 * 2 + 1), and
    # one flush list per peer (4). Local lists: one per distinct source slice (first and
    # same_src share one), none for NO_KV.
    assert mine.dlists_prepped == base + 7 + 4 + 2
    assert peers[0].local_kv is peers[1].local_kv
    assert peers[2].local_kv is not peers[0].local_kv
    assert peers[3].kv is None
    assert peers[3].local_kv is None
    for peer in peers:
        mine.disconnect(peer)
    assert mine.dlists_released == 7 + 4  # the peers' own; the local ones live with the agent
    again = mine.connect("decode-0", decodes[0].metadata(), decodes[0].layout.summary(), first)
    assert again.local_kv is peers[0].local_kv  # prepared once per slice, not per connect
    mine.disconnect(again)
    mine.close()
    assert mine.dlists_prepped == mine.dlists_released
    assert mine.peers_added == mine.peers_removed == 5


def _kv_layout(k_bytes: int, v_bytes: int) -> Agent:
    """An agent whose K and V pages differ in size (one layer): K and V rows of their own."""
    bufs = [np.zeros((16, k_bytes), np.uint8), np.zeros((16, v_bytes), np.uint8)]
    aux = np.zeros((8, 256), np.uint8)
    regions = tuple(
        Region(f"{'kv'[i]}0", b.ctypes.data, b.nbytes, b.shape[1]) for i, b in enumerate(bufs)
    )
    layout = Layout(
        kv=regions,
        aux=(Region("aux0", aux.ctypes.data, aux.nbytes, 256),),
        keepalive=(*bufs, aux),
    )
    return Agent(f"sliced-{os.getpid()}-{next(_NAMES)}", layout)


def test_a_piece_that_misfits_any_region_is_refused_before_nixl(agents: list[Agent]) -> None:
    # Region 0 fits the piece on both sides; region 1 (V) does not, on one side or the other.
    piece = KvPiece(ROWS, RowSlice(128, 0, 128), RowSlice(256, 128, 128))
    for mine, theirs in (
        (_kv_layout(512, 256), _kv_layout(1024, 1024)),  # local V rows are not 128 bytes
        (_kv_layout(512, 512), _kv_layout(1024, 512)),  # remote V rows are not 256 bytes
    ):
        agents += [mine, theirs]
        with pytest.raises(ValueError, match=r"incompatible: head slice .*region 1: a page is"):
            mine.connect("decode", theirs.metadata(), theirs.layout.summary(), piece)
        assert mine.peers_added == 0


def test_two_prefill_ranks_fill_the_two_halves_of_the_same_decode_pages() -> None:
    # 4 KV heads, prefill TP 2 into decode TP 1: each prefill rank's rooms write its 2 heads
    # into the same decode pages, rank 0's leg also the aux row.
    decode_shape = shape_for(4)
    peer = PeerProcess(decode_shape)
    ranks = [Prefill(shape=shape_for(2)) for _ in range(2)]
    rng = np.random.default_rng(99)
    for rank in ranks[1:]:
        for buf in rank.kv:  # other bytes than rank 0's (both were filled from one seed)
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
    try:
        pieces = [piece_for(4, 2, p, 1, 0) for p in range(2)]
        for rank, piece in zip(ranks, pieces, strict=True):
            rank.engine.call(
                rank.transport.connect_peer("decode", peer.metadata, peer.summary, piece)
            )
        assert peer.ask("fill", CANARY)
        src, dst = [6, 2], [1, 11]
        senders = [
            sliced_room(rank, 7, src, dst, peer_id="decode", part=part)
            for rank, part in zip(ranks, (Part.WHOLE, Part.KV), strict=True)
        ]
        wait_until_sync(lambda: all(s.poll() in TERMINAL for s in senders))
        assert [s.poll() for s in senders] == [KVPoll.Success] * 2, [s.reason for s in senders]
        want = [
            np.full((decode_shape.num_pages, decode_shape.page_bytes), CANARY, np.uint8)
            for _ in ranks[0].kv
        ]
        for rank, piece in zip(ranks, pieces, strict=True):
            for mine, theirs in zip(
                want, expected_pages(rank, piece, src, dst, decode_shape), strict=True
            ):
                # Each rank's slice from its own expectation, the rest from the other's.
                rows = mine.reshape(decode_shape.num_pages, ROWS, -1)
                cut = slice(piece.dst.offset, piece.dst.offset + piece.dst.length)
                rows[:, :, cut] = theirs.reshape(rows.shape)[:, :, cut]
        everything = np.arange(decode_shape.num_pages, dtype=np.int32)
        assert peer.ask("digests", everything.tobytes()) == page_digests(want, everything)
        assert peer.ask("aux", 4) == ranks[0].aux[1].tobytes()
        for rank in ranks:
            wait_until_sync(lambda rank=rank: rank.engine.stats()["live"] == 0)  # type: ignore[misc]
    finally:
        for rank in ranks:
            rank.close()
        peer.close()
