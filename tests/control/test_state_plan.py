"""The state plan of unequal attention TP (``kvfsm.control._state_plan``), on its own: the
blocks it gives are SGLang 0.5.23's own (its ``compute_mamba_state_slice_byte_blocks``, called
here for every shape), every decode byte has exactly one writer, and what cannot pair is
refused by name."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.control._fingerprint import Fingerprint
from kvfsm.control._state_plan import mamba_blocks, state_link_plan
from kvfsm.transport import StatePiece

sglang_utils = pytest.importorskip("sglang.srt.disaggregation.utils")

BASE = Fingerprint(layers=2, kv_heads=4, head_bytes=16, page_tokens=4, state_types=("mamba",))


def side(tp: int, rank: int, dims: tuple[int, ...], **kw: object) -> Fingerprint:
    return msgspec.structs.replace(BASE, attn_tp=tp, attn_rank=rank, state_dims=dims, **kw)


@st.composite
def mamba_shapes(draw: st.DrawFn) -> tuple[int, int, int, int, int, tuple[int, ...]]:
    prefill_tp, decode_tp = draw(st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]))
    biggest = max(prefill_tp, decode_tp)
    conv = draw(st.sampled_from([(), (1, 1, 2), (2, 2, 4), (1, 3)]))
    conv = tuple(g * biggest for g in conv)
    channels = sum(conv) if conv else biggest * draw(st.integers(1, 4))
    per = draw(st.sampled_from([2, 8, 24]))
    outer = draw(st.integers(1, 3))
    return prefill_tp, decode_tp, channels, per, outer, conv


@settings(max_examples=200, deadline=None)
@given(mamba_shapes())
def test_mamba_blocks_are_sglangs_own(
    shape: tuple[int, int, int, int, int, tuple[int, ...]],
) -> None:
    prefill_tp, decode_tp, channels, per, outer, conv = shape
    src_dims, dst_dims = channels // prefill_tp, channels // decode_tp
    for p, d in itertools.product(range(prefill_tp), range(decode_tp)):
        ours = mamba_blocks(
            src_item=outer * src_dims * per,
            dst_item=outer * dst_dims * per,
            src_dims=src_dims,
            dst_dims=dst_dims,
            outer=outer,
            conv=conv,
            prefill_tp=prefill_tp,
            prefill_rank=p,
            decode_tp=decode_tp,
            decode_rank=d,
        )
        # SGLang computes blocks only for the pairs it connects: a decode rank is fed by the
        # prefill ranks of its group (P > D) or by the one prefill rank of its group (P < D).
        ratio = max(prefill_tp, decode_tp) // min(prefill_tp, decode_tp)
        connected = p // ratio == d if prefill_tp > decode_tp else d // ratio == p
        if not connected:
            assert ours == ()
            continue
        theirs = sglang_utils.compute_mamba_state_slice_byte_blocks(
            src_item_len=outer * src_dims * per,
            dst_item_len=outer * dst_dims * per,
            src_dim=src_dims,
            dst_dim=dst_dims,
            outer_count=outer,
            src_attn_tp_size=prefill_tp,
            dst_attn_tp_size=decode_tp,
            dst_tp_rank_in_group=d,
            local_tp_rank_in_group=p,
            conv_shard_groups=list(conv) or None,
        )
        assert list(ours) == [tuple(b) for b in theirs], (p, d)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (4, 2), (1, 2), (2, 4), (4, 1)])
def test_every_decode_byte_of_a_state_item_has_exactly_one_writer(
    prefill_tp: int, decode_tp: int
) -> None:
    # One model: a GDN conv tensor, an SSM tensor, a replicated tensor (Mamba), a K and a V
    # buffer of an SWA window (4 heads of 16 bytes, 4 rows a page), and a DSA indexer item.
    types = ("mamba", "swa", "dsa")
    groups = (3, 2, 1)

    def regions(tp: int) -> list[tuple[int, int, int, int]]:
        items = [16 // tp * 8, 8 // tp * 32, 64, 4 * (4 // tp) * 16, 4 * (4 // tp) * 16, 40]
        return [(4096 * (j + 1), 8 * n, n, 0) for j, n in enumerate(items)]

    def fp(tp: int, rank: int) -> Fingerprint:
        dims = (16 // tp, 8 // tp, 0, -1, -1, -1)
        conv = ((4, 4, 8), (), (), (), (), ())
        return side(tp, rank, dims, state_types=types, state_conv=conv)

    for d in range(decode_tp):
        dst = regions(decode_tp)
        written = [bytearray(n) for _, _, n, _ in dst]
        for p in range(prefill_tp):
            piece = state_link_plan(
                fp(prefill_tp, p), fp(decode_tp, d), regions(prefill_tp), dst, groups
            )
            assert isinstance(piece, StatePiece)
            for j, blocks in enumerate(piece.blocks):
                for _, at, length in blocks:
                    for x in range(at, at + length):
                        written[j][x] += 1
        assert [set(w) for w in written] == [{1}] * len(dst), (d, [list(w) for w in written])


def test_equal_tp_and_mla_move_whole_items() -> None:
    specs = [(4096, 64, 8, 0)]
    same = side(2, 1, (4,))
    assert state_link_plan(same, same, specs, specs, (1,)) is None
    mla = msgspec.structs.replace(BASE, mla=True, state_types=("dsa",))
    assert state_link_plan(msgspec.structs.replace(mla, attn_tp=2), mla, specs, specs, (1,)) is None


@pytest.mark.parametrize(
    ("prefill", "decode", "src", "dst", "reason"),
    [
        (side(2, 0, ()), side(1, 0, ()), 64, 128, "needs each side's sharded channels"),
        (side(2, 0, (0,)), side(1, 0, (8,)), 64, 128, "replicated on one side only"),
        (side(2, 0, (4,)), side(1, 0, (4,)), 64, 64, "not the same tensor"),
        (side(2, 0, (4,)), side(1, 0, (8,)), 64, 96, "not 1 rows of 4 and 8 equal channels"),
        (side(2, 0, (0,)), side(1, 0, (0,)), 64, 72, "a replicated item of 64 bytes"),
        (
            side(2, 0, (4,), state_conv=((2, 6),)),
            side(1, 0, (8,), state_conv=((4, 4),)),
            64,
            128,
            "conv sub-blocks differ",
        ),
        (
            side(4, 0, (2,), state_conv=((2, 6),)),
            side(1, 0, (8,), state_conv=((2, 6),)),
            32,
            128,
            "do not split over both TPs",
        ),
    ],
)
def test_what_cannot_pair_is_refused_by_name(
    prefill: Fingerprint, decode: Fingerprint, src: int, dst: int, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        state_link_plan(prefill, decode, [(4096, src * 4, src, 0)], [(8192, dst * 4, dst, 0)], (1,))


def test_tail_rings_of_different_sizes_are_remapped_per_request_at_equal_tp_and_with_mla() -> None:
    # Two DSA tail buffers (key and score rings), 24 and 8 bytes a slot; a Mamba type first,
    # so the rings are regions 1 and 2. Decode's rings hold 4 more (speculative) slots: those
    # regions get no blocks and are named for the per-request remap; the rest moves whole.
    fp = msgspec.structs.replace(BASE, state_types=("mamba", "dsa_tail"))
    mamba = (4096, 4 * 32, 32, 0)
    src = [mamba, (8192, 4 * 8 * 24, 8 * 24, 0), (16384, 4 * 8 * 8, 8 * 8, 0)]
    assert state_link_plan(fp, fp, src, src, (1, 2)) is None
    dst = [mamba, (8192, 4 * 12 * 24, 12 * 24, 0), (16384, 4 * 12 * 8, 12 * 8, 0)]
    remapped = StatePiece((((0, 0, 32),), (), ()), rings=(1, 2))
    assert state_link_plan(fp, fp, src, dst, (1, 2)) == remapped
    mla = msgspec.structs.replace(fp, mla=True, attn_tp=2)
    assert state_link_plan(mla, msgspec.structs.replace(mla, attn_tp=1), src, dst, (1, 2)) == (
        remapped
    )
    # Another item size outside the rings still cannot pair.
    other = [(4096, 4 * 40, 40, 0), *dst[1:]]
    with pytest.raises(ValueError, match=r"^state region 0: items of 32 bytes, decode 40"):
        state_link_plan(fp, fp, src, other, (1, 2))
