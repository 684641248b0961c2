"""The heterogeneous-TP plan (``kvfsm.transport._slices``): its rules for every shape, its
descriptors against a numpy reference, and real NIXL WRITEs of head slices between agents of
different TP, every byte of every head slice checked on decode."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvfsm.states import Part
from kvfsm.transport._layout import LayoutError
from kvfsm.transport._nixl import nixl_agent, nixl_agent_config
from kvfsm.transport._slices import (
    NO_KV,
    HeadShard,
    HeadSlice,
    KvPiece,
    RowSlice,
    dummy_of,
    legs,
    link_piece,
    prefill_legs,
    sliced_descs,
    sliced_index,
    sources,
    state_legs,
    targets,
)

HEADS = (1, 2, 4, 8, 16)
TPS = (1, 2, 4, 8, 16)


def _shapes() -> Iterator[tuple[int, int, int]]:
    for total, tp_p, tp_d in itertools.product(HEADS, TPS, TPS):
        if all(total % tp == 0 or tp % total == 0 for tp in (tp_p, tp_d)):
            yield total, tp_p, tp_d


# -- the rules -----------------------------------------------------------------------------


def test_shards_split_or_replicate_heads_as_sglang_does() -> None:
    assert [HeadShard(8, 4, r).first for r in range(4)] == [0, 2, 4, 6]
    assert {HeadShard(8, 4, r).heads for r in range(4)} == {2}
    # More ranks than heads: each holds one head, shared by tp // total ranks.
    assert [HeadShard(2, 8, r).first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [HeadShard(2, 8, r).replica for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot be split"):
        HeadShard(6, 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        HeadShard(8, 4, 4)


@pytest.mark.parametrize(("total", "tp_p", "tp_d"), list(_shapes()))
def test_every_decode_head_is_written_exactly_once(total: int, tp_p: int, tp_d: int) -> None:
    for d in range(tp_d):
        decode = HeadShard(total, tp_d, d)
        written = [0] * decode.heads
        for piece in sources(decode, tp_p):
            prefill = HeadShard(total, tp_p, piece.prefill_rank)
            assert piece.decode_rank == d
            assert piece.src_head >= 0
            assert piece.src_head + piece.count <= prefill.heads
            for i in range(piece.count):
                written[piece.dst_head + i] += 1
                # The same model head on both sides.
                assert prefill.first + piece.src_head + i == decode.first + piece.dst_head + i
        assert written == [1] * decode.heads


@pytest.mark.parametrize(("total", "tp_p", "tp_d"), list(_shapes()))
def test_sources_and_targets_are_one_relation(total: int, tp_p: int, tp_d: int) -> None:
    by_targets = sorted(
        (piece for p in range(tp_p) for piece in targets(HeadShard(total, tp_p, p), tp_d)),
        key=lambda s: (s.decode_rank, s.prefill_rank),
    )
    by_sources = [piece for d in range(tp_d) for piece in sources(HeadShard(total, tp_d, d), tp_p)]
    assert by_targets == by_sources


def test_mla_moves_one_replica_per_decode_rank_spread_over_prefill() -> None:
    # MLA: one latent "head" on every rank. Prefill TP 4 into decode TP 2 (DP attention style):
    # each decode rank hears from exactly one prefill rank, and they differ.
    writers = [sources(HeadShard(1, 2, d), 4) for d in range(2)]
    assert [[s.prefill_rank for s in w] for w in writers] == [[0], [1]]
    assert [len(targets(HeadShard(1, 4, p), 2)) for p in range(4)] == [1, 1, 0, 0]
    # TP 8 into TP 1: one writer, seven dummy ranks.
    assert [s.prefill_rank for s in sources(HeadShard(1, 1, 0), 8)] == [0]


def test_row_slices_in_bytes() -> None:
    # Prefill TP 1 (8 heads) into decode TP 2, rank 1: heads 4..7 of prefill's row.
    (piece,) = sources(HeadShard(8, 2, 1), 1)
    src, dst = piece.rows(HeadShard(8, 1, 0), HeadShard(8, 2, 1), head_bytes=256)
    assert src == RowSlice(row_bytes=2048, offset=1024, length=1024)
    assert dst == RowSlice(row_bytes=1024, offset=0, length=1024)


# -- descriptors ---------------------------------------------------------------------------


def test_sliced_descs_and_index_address_the_slice_of_each_row() -> None:
    rows, row_bytes, items = 4, 64, 3
    specs = [
        (1 << 20, items * rows * row_bytes, rows * row_bytes, 0),
        (1 << 24, items * rows * row_bytes, rows * row_bytes, 0),
    ]
    piece = RowSlice(row_bytes, 16, 32)
    descs = sliced_descs(specs, rows, piece)
    assert descs.shape == (2 * items * rows, 3)
    for b, p, t in itertools.product(range(2), range(items), range(rows)):
        row = descs[(b * items + p) * rows + t]
        assert tuple(int(x) for x in row) == (
            specs[b][0] + p * rows * row_bytes + t * row_bytes + 16,
            32,
            0,
        )
    pages = np.array([2, 0], np.int32)
    index = sliced_index(2, items, rows, pages)
    want = [(b * items + p) * rows + t for b in range(2) for p in (2, 0) for t in range(rows)]
    assert index.tolist() == want
    assert index.dtype == np.int32


def test_sliced_descs_refuse_what_does_not_fit() -> None:
    spec = [(1 << 20, 3 * 4 * 64, 4 * 64, 0)]
    with pytest.raises(LayoutError, match="does not fit in its row"):
        sliced_descs(spec, 4, RowSlice(64, 48, 32))
    with pytest.raises(LayoutError, match="not 4 rows of 32"):
        sliced_descs(spec, 4, RowSlice(32, 0, 32))


# -- real NIXL ----------------------------------------------------------------------------

TOKENS, HEAD_BYTES, LAYERS, PAGES = 4, 64, 2, 6


class Rank:
    """One TP rank's K and V buffers (``LAYERS`` each) of ``PAGES`` pages, its heads only."""

    def __init__(self, role: str, shard: HeadShard, fill: bool) -> None:
        self.shard = shard
        name = f"slices-{role}-{shard.tp}-{shard.rank}-{os.getpid()}-{time.monotonic_ns()}"
        self.agent: Any = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.name = name
        shape = (PAGES, TOKENS, shard.heads, HEAD_BYTES)
        rng = np.random.default_rng(shard.rank + 1)
        self.bufs = [
            rng.integers(0, 256, shape, dtype=np.uint8) if fill else np.zeros(shape, np.uint8)
            for _ in range(2 * LAYERS)
        ]
        descs = [(b.ctypes.data, b.nbytes, 0, "") for b in self.bufs]
        self.reg = self.agent.register_memory(self.agent.get_reg_descs(descs, "DRAM"))

    def specs(self) -> list[tuple[int, int, int, int]]:
        return [(b.ctypes.data, b.nbytes, b.nbytes // PAGES, 0) for b in self.bufs]

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def _write(prefill: Rank, decode: Rank, piece: HeadSlice, src: np.ndarray, dst: np.ndarray) -> None:
    src_rows, dst_rows = piece.rows(prefill.shard, decode.shard, HEAD_BYTES)
    peer = prefill.agent.add_remote_agent(decode.agent.get_agent_metadata())
    local = prefill.agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", sliced_descs(prefill.specs(), TOKENS, src_rows), "DRAM"
    )
    remote = prefill.agent.prep_xfer_dlist(
        peer, sliced_descs(decode.specs(), TOKENS, dst_rows), "DRAM"
    )
    n = len(prefill.bufs)
    handle = prefill.agent.make_prepped_xfer(
        "WRITE",
        local,
        sliced_index(n, PAGES, TOKENS, src),
        remote,
        sliced_index(n, PAGES, TOKENS, dst),
    )
    state = prefill.agent.transfer(handle)
    deadline = time.monotonic() + 10
    while state != "DONE":
        assert state == "PROC", state
        assert time.monotonic() < deadline, "the WRITE did not complete"
        decode.agent.get_new_notifs()
        state = prefill.agent.check_xfer_state(handle)
    prefill.agent.release_xfer_handle(handle)
    prefill.agent.release_dlist_handle(local)
    prefill.agent.release_dlist_handle(remote)
    prefill.agent.remove_remote_agent(peer)


@pytest.mark.parametrize(
    ("total", "tp_p", "tp_d"),
    [(4, 2, 1), (4, 1, 2), (8, 4, 2), (2, 4, 1), (1, 2, 1)],
    ids=["tp2-to-tp1", "tp1-to-tp2", "tp4-to-tp2", "gqa-replicated-tp4-to-tp1", "mla-tp2-to-tp1"],
)
def test_head_slices_land_from_the_right_prefill_rank(total: int, tp_p: int, tp_d: int) -> None:
    """Every decode rank's pages are written by the prefill ranks the plan names; afterwards
    every head of every written page equals that head on the prefill rank that holds it, and
    pages not in the room are untouched."""
    prefill = [Rank("p", HeadShard(total, tp_p, r), fill=True) for r in range(tp_p)]
    decode = [Rank("d", HeadShard(total, tp_d, r), fill=False) for r in range(tp_d)]
    src = np.array([4, 1, 2], np.int32)
    dst = np.array([0, 5, 3], np.int32)
    try:
        for d in decode:
            for piece in sources(d.shard, tp_p):
                _write(prefill[piece.prefill_rank], d, piece, src, dst)
        for d in decode:
            covered = np.zeros(d.shard.heads, int)
            for piece in sources(d.shard, tp_p):
                # Each rank's bytes are its own (random per rank, replicas included), so a
                # slice from the wrong rank, head or page cannot pass.
                writer = prefill[piece.prefill_rank]
                theirs = slice(piece.src_head, piece.src_head + piece.count)
                mine = slice(piece.dst_head, piece.dst_head + piece.count)
                for got, want in zip(d.bufs, writer.bufs, strict=True):
                    assert np.array_equal(got[dst][:, :, mine], want[src][:, :, theirs]), piece
                covered[mine] += 1
            assert covered.tolist() == [1] * d.shard.heads
            untouched = np.setdiff1d(np.arange(PAGES), dst)
            assert all(not buf[untouched].any() for buf in d.bufs)
    finally:
        for rank in (*prefill, *decode):
            rank.close()


# -- legs: which rooms a decode rank opens (prefill TP a multiple of decode TP) -----------------

#: Every shape with one attention TP a multiple of the other, up to TP 16 (prefill's the larger:
#: decode requests of several legs; decode's the larger: prefill rooms of several legs), with
#: any head count up to 64 that both TPs can split (or replicate).
LEG_SHAPES = [
    (total, tp_p, tp_d)
    for tp_d in range(1, 17)
    for tp_p in range(1, 17)
    if tp_p % tp_d == 0 or tp_d % tp_p == 0
    for total in range(1, 65)
    if all(total % tp == 0 or tp % total == 0 for tp in (tp_p, tp_d))
]
WRITES_KV = (Part.WHOLE, Part.KV)


def _piece(total: int, tp_p: int, p: int, tp_d: int, d: int) -> KvPiece | str | None:
    return link_piece(
        total_heads=total,
        head_bytes=3,
        rows=4,
        prefill_tp=tp_p,
        prefill_rank=p,
        decode_tp=tp_d,
        decode_rank=d,
    )


def test_leg_shapes_cover_the_interesting_cases() -> None:
    shapes = set(LEG_SHAPES)
    assert (1, 16, 1) in shapes  # MLA
    assert (8, 16, 2) in shapes  # GQA replicated on prefill
    assert (2, 8, 4) in shapes  # replicated on both sides
    assert (12, 6, 3) in shapes  # a TP that is no power of two
    assert (4, 2, 8) in shapes  # decode's TP the larger
    assert (6, 4, 2) not in shapes  # 6 heads cannot be split over TP 4
    assert (8, 4, 6) not in shapes  # neither TP a multiple of the other
    assert len(LEG_SHAPES) > 600


def test_every_prefill_rank_gets_a_leg_and_every_decode_rank_one_whole_leg() -> None:
    for total, tp_p, tp_d in LEG_SHAPES:
        shape = (total, tp_p, tp_d)
        heard: dict[int, list[tuple[int, Part]]] = {p: [] for p in range(tp_p)}
        for d in range(tp_d):
            plan = legs(total, tp_p, tp_d, d)
            ranks = [p for p, _ in plan]
            assert len(ranks) == len(set(ranks)), (shape, d, plan)  # one leg per prefill rank
            assert [part for _, part in plan].count(Part.WHOLE) == 1, (shape, d, plan)
            # Writers first, in prefill rank order, the first of them WHOLE; then the dummies.
            writers = [p for p, part in plan if part in WRITES_KV]
            assert plan[0][1] is Part.WHOLE, (shape, d, plan)
            assert writers == sorted(writers)
            assert [part for _, part in plan] == sorted(part for _, part in plan), (shape, d)
            for p, part in plan:
                heard[p].append((d, part))
        for p, got in heard.items():
            assert got, (shape, f"prefill rank {p} has no leg: its room would never end")
            dummies = [d for d, part in got if part is Part.NONE]
            if any(part in WRITES_KV for _, part in got):
                assert dummies == [], (shape, p, got)  # a writer is never also a dummy
            else:
                assert dummies == [dummy_of(tp_d, p)], (shape, p, got)  # exactly one partner


def test_the_legs_agree_with_link_piece_and_tile_every_decode_row() -> None:
    for total, tp_p, tp_d in LEG_SHAPES:
        for d in range(tp_d):
            parts = dict(legs(total, tp_p, tp_d, d))
            decode = HeadShard(total, tp_d, d)
            row_bytes = decode.heads * 3
            covered: list[tuple[int, int]] = []
            for p in range(tp_p):
                piece = _piece(total, tp_p, p, tp_d, d)
                where = (total, tp_p, tp_d, d, p, piece, parts.get(p))
                # A NONE leg (or no leg) exactly where the link carries no KV.
                assert (piece == "none") == (parts.get(p) in (None, Part.NONE)), where
                if piece == "none":
                    continue
                if piece is None:  # whole rows: the two sides hold the same heads
                    assert HeadShard(total, tp_p, p).heads == decode.heads, where
                    covered.append((0, row_bytes))
                    continue
                assert isinstance(piece, KvPiece), where
                assert piece.rows == 4
                assert piece.dst.row_bytes == row_bytes, where
                assert piece.src.row_bytes == HeadShard(total, tp_p, p).heads * 3, where
                assert piece.src.length == piece.dst.length > 0, where
                assert piece.src.offset + piece.src.length <= piece.src.row_bytes, where
                assert piece.page_bytes(2) == 2 * 4 * piece.src.length
                covered.append((piece.dst.offset, piece.dst.length))
            # The KV legs' slices tile the decode row: every byte written, by one leg only.
            at = 0
            for offset, length in sorted(covered):
                assert offset == at, (total, tp_p, tp_d, d, covered)
                at += length
            assert at == row_bytes, (total, tp_p, tp_d, d, covered)


def test_mla_has_exactly_one_kv_writer_per_decode_rank() -> None:
    for _, tp_p, tp_d in [s for s in LEG_SHAPES if s[0] == 1]:
        writers_of = []
        for d in range(tp_d):
            plan = legs(1, tp_p, tp_d, d)
            writers = [p for p, part in plan if part in WRITES_KV]
            assert len(writers) == 1, (tp_p, tp_d, d, plan)
            assert plan[0] == (writers[0], Part.WHOLE)
            assert _piece(1, tp_p, writers[0], tp_d, d) is None  # the whole latent row
            writers_of.append(writers[0])
        dummies = [
            p for d in range(tp_d) for p, part in legs(1, tp_p, tp_d, d) if part is Part.NONE
        ]
        if tp_p >= tp_d:
            assert len(set(writers_of)) == tp_d  # spread over the replicas, one each
            assert sorted(dummies + writers_of) == list(range(tp_p))  # the rest: dummies
        else:  # each prefill rank feeds tp_d // tp_p decode ranks, and none is a dummy
            assert sorted(writers_of) == sorted(list(range(tp_p)) * (tp_d // tp_p))
            assert dummies == []


def test_equal_tp_is_one_whole_leg_of_whole_rows() -> None:
    for total, tp, _ in [s for s in LEG_SHAPES if s[1] == s[2]]:
        for d in range(tp):
            assert legs(total, tp, tp, d) == [(d, Part.WHOLE)]
            assert _piece(total, tp, d, tp, d) is None
            assert all(_piece(total, tp, p, tp, d) == "none" for p in range(tp) if p != d)


def test_a_known_split_in_bytes() -> None:
    # 8 heads, prefill TP 4 (2 heads a rank) into decode TP 2 (4 heads a rank), decode rank 1:
    # prefill ranks 2 and 3 write its first and second halves.
    assert legs(8, 4, 2, 1) == [(2, Part.WHOLE), (3, Part.KV)]
    assert _piece(8, 4, 3, 2, 1) == KvPiece(4, RowSlice(6, 0, 6), RowSlice(12, 6, 6))
    # MLA, prefill TP 4 into decode TP 2: ranks 2 and 3 are dummies, one per decode rank.
    assert legs(1, 4, 2, 0) == [(0, Part.WHOLE), (2, Part.NONE)]
    assert legs(1, 4, 2, 1) == [(1, Part.WHOLE), (3, Part.NONE)]
    assert NO_KV.page_bytes(4) == 0


def _sglang_state_ranks(tp_p: int, tp_d: int, d: int) -> list[int]:
    """The prefill ranks SGLang 0.5.23's decode rank ``d`` pairs with and takes its state from
    (``target_tp_ranks`` in sglang/srt/disaggregation/common/conn.py), written out here."""
    if tp_p >= tp_d:
        ratio = tp_p // tp_d
        return list(range(d * ratio, (d + 1) * ratio))
    return [d // (tp_d // tp_p)]


def test_state_legs_reach_every_prefill_rank_sglang_takes_state_from() -> None:
    for total, tp_p, tp_d in LEG_SHAPES:
        if tp_p == tp_d:
            continue
        shape = (total, tp_p, tp_d)
        plans = [state_legs(total, tp_p, tp_d, d) for d in range(tp_d)]
        for d, plan in enumerate(plans):
            group = _sglang_state_ranks(tp_p, tp_d, d)
            kv = [(p, part) for p, part in legs(total, tp_p, tp_d, d) if part in WRITES_KV]
            # KV writers as legs() says, the rest of SGLang's group state-only, in rank order;
            # no dummies.
            assert [(p, part) for p, part in plan if part in WRITES_KV] == kv, (shape, d)
            assert [p for p, _ in plan] == sorted({*group, *(p for p, _ in kv)}), (shape, d)
            assert all(part in (*WRITES_KV, Part.STATE) for _, part in plan), (shape, d)
            assert all(p in group for p, part in plan if part is Part.STATE), (shape, d)
        # Each prefill rank's legs, as prefill numbers them, are the decode ranks that list it.
        for p in range(tp_p):
            listing = [d for d, plan in enumerate(plans) if p in dict(plan)]
            assert prefill_legs(total, tp_p, tp_d, p, grouped=True) == listing, (shape, p)
        if tp_p > tp_d and total >= tp_d:
            # Decode's heads not replicated: the KV writers lie in the group, one leg each.
            ratio = tp_p // tp_d
            for d, plan in enumerate(plans):
                assert [p for p, _ in plan] == list(range(d * ratio, (d + 1) * ratio)), shape


def test_replicated_heads_on_both_sides_give_a_kv_writer_a_state_only_leg_elsewhere() -> None:
    # One KV head, prefill TP 4 into decode TP 2: prefill rank 1 writes decode rank 1's KV
    # (replica 1 of the head) and its state shard into decode rank 0, as SGLang sends it.
    assert state_legs(1, 4, 2, 0) == [(0, Part.WHOLE), (1, Part.STATE)]
    assert state_legs(1, 4, 2, 1) == [(1, Part.WHOLE), (2, Part.STATE), (3, Part.STATE)]
    assert prefill_legs(1, 4, 2, 1, grouped=True) == [0, 1]
    assert prefill_legs(1, 4, 2, 1, grouped=False) == [1]
    # And the reverse, prefill TP 2 into decode TP 4: decode rank 1's KV comes from prefill
    # rank 1, its state from prefill rank 0 (SGLang's only source for it).
    assert state_legs(1, 2, 4, 1) == [(0, Part.STATE), (1, Part.WHOLE)]
    assert state_legs(1, 2, 4, 2) == [(0, Part.WHOLE), (1, Part.STATE)]
    assert prefill_legs(1, 2, 4, 0, grouped=True) == [0, 1, 2]
