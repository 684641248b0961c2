"""The handshake fingerprint: the pure rules (``mismatch``), its place in the Hello, and a real
prefill-decode pair that disagrees about the model, refused at the handshake on both sides."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.control import ChannelConfig, Fingerprint
from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._fingerprint import (
    DECLARED_MATCH,
    MUST_MATCH,
    SHAPE_RULES,
    link_plan,
    link_slot,
    mismatch,
    stage_buffers,
    stage_state,
    stage_types,
)
from kvfsm.control._frames import PROTOCOL_VERSION, Hello
from kvfsm.control._stage_rows import StageRows
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.states import TERMINAL
from kvfsm.transport._slices import KvPiece, RowSlice
from kvfsm.workload.buffers import make_buffers, make_layout
from tests.helpers.prefill_process import SHAPE, fill_sources
from tests.helpers.registry import running_registry
from tests.helpers.waiting import wait_until_sync

LLAMA = Fingerprint(
    layers=32, kv_heads=8, head_bytes=256, dtype="bfloat16", page_tokens=16, attn_tp=2
)

#: For each field that must match (where declared, for the head fields), a value other than
#: LLAMA's.
OTHER = {
    "layers": 40,
    "kv_heads": 4,
    "head_bytes": 128,
    "dtype": "float8_e4m3fn",
    "page_tokens": 32,
    "mla": True,
    "state_types": ("mamba",),
}


# -- the rules -----------------------------------------------------------------------------


def test_equal_declarations_pair() -> None:
    assert mismatch(LLAMA, LLAMA) is None
    assert mismatch(Fingerprint(), Fingerprint()) is None


def test_every_must_match_field_is_covered() -> None:
    # layers has its own rule (a pipeline stage holds a span of them).
    assert {name for name, _ in (*MUST_MATCH, *DECLARED_MATCH)} | {"layers"} == set(OTHER)
    shaped = {name for name, _, _ in SHAPE_RULES}
    # attn_rank says which heads the rank holds (link_plan); pp_rank and first_layer which
    # layers (the layers rule, stage_buffers).
    placed = {"attn_rank", "pp_rank", "first_layer"}
    # How state is sharded over attention TP (the state plan of unequal TP) and which layer
    # each state buffer belongs to (a pipeline stage's, stage_state).
    placed |= {"state_dims", "state_conv", "state_outer", "state_layers"}
    assert set(Fingerprint.__struct_fields__) == set(OTHER) | shaped | placed


def test_head_fields_are_compared_only_where_both_sides_declare_them() -> None:
    # SGLang's decode does not know its head counts: it declares 0 and still pairs.
    undeclared = msgspec.structs.replace(LLAMA, kv_heads=0, head_bytes=0)
    assert mismatch(LLAMA, undeclared) is None
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, head_bytes=128)) == (
        "fingerprint mismatch: head size in bytes (head_bytes): prefill has 256, decode has 128"
    )


@pytest.mark.parametrize(("name", "label"), [("layers", "layers"), *MUST_MATCH, *DECLARED_MATCH])
def test_a_layout_difference_names_the_field_and_both_values(name: str, label: str) -> None:
    theirs = msgspec.structs.replace(LLAMA, **{name: OTHER[name]})
    reason = mismatch(LLAMA, theirs)
    assert reason is not None
    assert reason.startswith(f"fingerprint mismatch: {label} ({name}): prefill has ")
    mine_shown, theirs_shown = reason.split("prefill has ")[1].split(", decode has ")
    assert mine_shown != theirs_shown
    # The other way round names the values the other way round: the roles are fixed.
    back = mismatch(theirs, LLAMA)
    assert back is not None
    assert back.split("prefill has ")[1] == f"{theirs_shown}, decode has {mine_shown}"


def test_the_values_are_shown_readably() -> None:
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, kv_heads=4)) == (
        "fingerprint mismatch: KV heads (kv_heads): prefill has 8, decode has 4"
    )
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, dtype="float16")) == (
        "fingerprint mismatch: KV dtype (dtype): prefill has 'bfloat16', decode has 'float16'"
    )
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, mla=True)) == (
        "fingerprint mismatch: MLA (mla): prefill has no, decode has yes"
    )
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, state_types=("mamba", "swa"))) == (
        "fingerprint mismatch: state types (state_types): prefill has none, decode has [mamba, swa]"
    )


def test_a_side_that_declares_nothing_pairs_only_with_another() -> None:
    reason = mismatch(Fingerprint(), LLAMA)
    assert reason == (
        "fingerprint mismatch: layers (layers): prefill has 0 (not declared), decode has 32"
    )


def _tp(fp: Fingerprint, tp: int, rank: int = 0, **changes: object) -> Fingerprint:
    return msgspec.structs.replace(fp, attn_tp=tp, attn_rank=rank, **changes)


def test_unsupported_parallel_shapes_are_named() -> None:
    assert mismatch(_tp(LLAMA, 6), _tp(LLAMA, 4)) == (
        "fingerprint mismatch: one attention TP must be a multiple of the other (attn_tp): "
        "prefill has 6, decode has 4"
    )
    assert mismatch(LLAMA, _tp(LLAMA, 4)) is None  # decode's the larger: each prefill rank
    assert mismatch(_tp(LLAMA, 4), LLAMA) is None  # writes 2 decode ranks, or the reverse
    assert mismatch(_stage(0, 2, 16), msgspec.structs.replace(LLAMA, pp=2)) == (
        "fingerprint mismatch: pipeline parallelism on decode is not supported (pp): "
        "prefill has 2, decode has 2"
    )


def _stage(rank: int, stages: int, layers: int, first: int | None = None) -> Fingerprint:
    """LLAMA's prefill pipeline stage ``rank`` of ``stages``, holding ``layers`` layers."""
    first = rank * layers if first is None else first
    return msgspec.structs.replace(LLAMA, pp=stages, pp_rank=rank, layers=layers, first_layer=first)


def test_pipeline_stages_that_tile_decode_layers_pair() -> None:
    assert mismatch(_stage(0, 2, 16), LLAMA) is None
    assert mismatch(_stage(1, 2, 16), LLAMA) is None
    # Unequal spans (SGLang gives the remainder to some stages) pair as long as they tile.
    assert mismatch(_stage(0, 3, 11), LLAMA) is None
    assert mismatch(_stage(1, 3, 11, 11), LLAMA) is None
    assert mismatch(_stage(2, 3, 10, 22), LLAMA) is None


@pytest.mark.parametrize(
    ("stage", "words"),
    [
        (
            _stage(1, 2, 20, 16),
            "prefill pipeline stage 1 of 2 holds layers 16 to 35, decode has 32",
        ),
        (_stage(0, 2, 16, 4), "prefill pipeline stage 0 of 2 starts at layer 4, not 0"),
        (_stage(1, 2, 15, 16), "stage 1 of 2, the last, ends at layer 30 but decode has 32"),
        (_stage(0, 2, 0), "prefill pipeline stage 0 of 2 declares no layers (layers: 0)"),
    ],
)
def test_a_stage_whose_layers_do_not_fit_decode_is_refused_by_name(
    stage: Fingerprint, words: str
) -> None:
    reason = mismatch(stage, LLAMA)
    assert reason is not None
    assert reason.startswith("fingerprint mismatch: ")
    assert words in reason


def test_pipeline_stages_refuse_the_combinations_not_built_by_name() -> None:
    unequal = mismatch(_stage(0, 2, 16), _tp(LLAMA, 1))
    assert unequal == (
        "fingerprint mismatch: prefill pipeline parallelism (pp 2) with unequal attention TP "
        "(prefill 2, decode 1) is not supported (pp, attn_tp)"
    )
    mamba = msgspec.structs.replace(LLAMA, state_types=("mamba",))
    stage = msgspec.structs.replace(mamba, pp=2, pp_rank=1, layers=16, first_layer=16)
    assert mismatch(stage, mamba) == (
        "fingerprint mismatch: prefill pipeline parallelism (pp 2) with state pools (mamba) "
        "needs the model layer of every state buffer (SGLang's state_layer_ids), and prefill "
        "does not declare them all (pp, state_layers); SGLang's own NIXL backend refuses it "
        "too: PP-heterogeneous transfer requires layer ids on both peers"
    )
    named = msgspec.structs.replace(mamba, state_layers=(20,))
    assert mismatch(msgspec.structs.replace(stage, state_layers=(20,)), named) is None


def test_stage_buffers_map_each_stage_buffer_to_decodes_layer() -> None:
    assert stage_buffers(LLAMA, LLAMA, 64, 64) is None  # no pipeline: one to one
    # MHA: K of layers 0..31 then V of layers 0..31 on decode; stage 1 holds layers 16..31.
    assert stage_buffers(_stage(1, 2, 16), LLAMA, 32, 64) == (
        *range(16, 32),
        *range(48, 64),
    )
    assert stage_buffers(_stage(0, 2, 16), LLAMA, 32, 64) == (*range(0, 16), *range(32, 48))
    mla = msgspec.structs.replace(LLAMA, mla=True, kv_heads=1)
    stage = msgspec.structs.replace(mla, pp=3, pp_rank=2, layers=10, first_layer=22)
    assert stage_buffers(stage, mla, 10, 32) == tuple(range(22, 32))
    problem = stage_buffers(_stage(1, 2, 16), LLAMA, 32, 60)
    assert isinstance(problem, str)
    assert "not the same number of buffers per layer" in problem


def test_a_pipeline_rank_must_be_below_the_pipeline_size() -> None:
    with pytest.raises(ValueError, match="pipeline rank 2 of pipeline size 2"):
        msgspec.structs.replace(LLAMA, pp=2, pp_rank=2)


def test_unequal_attention_tp_pairs_when_heads_split() -> None:
    undeclared = _tp(LLAMA, 1, kv_heads=0, head_bytes=0)
    assert mismatch(_tp(LLAMA, 4, 3), undeclared) is None  # 8 heads over 4 and over 1
    assert mismatch(_tp(LLAMA, 8, 7), _tp(LLAMA, 2, 1)) is None


def test_unequal_attention_tp_needs_prefill_to_declare_its_heads() -> None:
    reason = mismatch(_tp(LLAMA, 2, kv_heads=0), _tp(LLAMA, 1, kv_heads=0))
    assert reason is not None
    assert "needs prefill to declare its KV heads (kv_heads: 0)" in reason


def test_heads_that_do_not_split_are_refused_by_name() -> None:
    six = msgspec.structs.replace(LLAMA, kv_heads=6)
    reason = mismatch(_tp(six, 4), _tp(six, 2))
    assert reason == (
        "fingerprint mismatch: the model's 6 KV heads cannot be split over prefill attention "
        "TP 4 (kv_heads, attn_tp)"
    )


def test_replicated_prefill_heads_need_decode_to_declare_them() -> None:
    two = msgspec.structs.replace(LLAMA, kv_heads=2)
    reason = mismatch(_tp(two, 4), _tp(two, 2, kv_heads=0))
    assert reason is not None
    assert "replicates the model's 2 KV heads, so decode must declare them" in reason
    assert mismatch(_tp(two, 4), _tp(two, 2)) is None


@pytest.mark.parametrize("mla", [False, True])
def test_state_pools_pair_under_unequal_tp_as_sglang_pairs_them(mla: bool) -> None:
    model = msgspec.structs.replace(LLAMA, mla=mla, kv_heads=0 if mla else 8)
    for types in (("mamba",), ("swa",), ("dsa",), ("mamba", "swa", "dsa")):
        hybrid = msgspec.structs.replace(model, state_types=types)
        assert mismatch(hybrid, hybrid) is None
        assert mismatch(_tp(hybrid, 4), _tp(hybrid, 2)) is None, types
        assert mismatch(_tp(hybrid, 2), _tp(hybrid, 4)) is None, types
    # Whole-row types that SGLang slices only for MLA models.
    rows = msgspec.structs.replace(model, state_types=("mamba", "swa_ring", "qsa_pending"))
    reason = mismatch(_tp(rows, 4), _tp(rows, 2))
    if mla:
        assert reason is None
    else:
        assert reason is not None
        assert reason.startswith(
            "fingerprint mismatch: state pools (swa_ring, qsa_pending) with unequal attention TP "
            "(prefill 4, decode 2) are not supported (state_types, attn_tp); SGLang's own NIXL "
            "backend refuses it too: "
        )


def test_state_from_prefill_ranks_that_also_feed_another_decode_rank_pairs() -> None:
    # 2 KV heads over prefill TP 4: ranks 0 and 1 hold head 0, only rank 0 writes decode rank
    # 0's KV, and rank 1 sends decode rank 0 its Mamba shard over a state-only leg: pairs.
    two = msgspec.structs.replace(LLAMA, kv_heads=2, state_types=("mamba",))
    assert mismatch(_tp(two, 4), _tp(two, 2)) is None
    # 1 KV head over prefill TP 4 and decode TP 2: prefill rank 1 writes decode rank 1's KV
    # and its state shard into decode rank 0 (two legs), as SGLang's backend sends it.
    for types in (("mamba",), ("dsa",), ("mamba", "swa", "dsa")):
        one = msgspec.structs.replace(LLAMA, kv_heads=1, state_types=types)
        assert mismatch(_tp(one, 4), _tp(one, 2)) is None
        assert mismatch(_tp(one, 2), _tp(one, 4)) is None


def test_several_state_types_pair_only_when_both_sides_declare_the_same_ones_in_order() -> None:
    hybrid = msgspec.structs.replace(LLAMA, state_types=("mamba", "swa"))
    assert mismatch(hybrid, hybrid) is None
    swapped = msgspec.structs.replace(LLAMA, state_types=("swa", "mamba"))
    assert mismatch(hybrid, swapped) == (
        "fingerprint mismatch: state types (state_types): prefill has [mamba, swa], decode has "
        "[swa, mamba]"
    )


def test_a_refusal_sglang_makes_too_says_so_in_its_words() -> None:
    minimax = msgspec.structs.replace(LLAMA, state_types=("minimax_index_k", "minimax_dense_kv"))
    unequal = mismatch(_tp(minimax, 4), _tp(minimax, 2))
    assert unequal is not None
    assert unequal.endswith(
        "(state_types, attn_tp); SGLang's own NIXL backend refuses it too: heterogeneous TP not "
        "supported for MiniMax state yet"
    )
    stage = msgspec.structs.replace(minimax, pp=2, pp_rank=1, layers=16, first_layer=16)
    staged = mismatch(stage, minimax)
    assert staged is not None
    assert staged.endswith("refuses it too: PP>1 not supported for MiniMax state yet")


def test_mla_pairs_over_unequal_tp_without_head_counts() -> None:
    mla = Fingerprint(layers=61, head_bytes=1152, dtype="bfloat16", page_tokens=1, mla=True)
    assert mismatch(_tp(mla, 8, 5), _tp(mla, 1)) is None


def test_link_slot_numbers_the_decode_ranks_of_a_prefill_rank() -> None:
    # 8 heads; prefill TP 2 (4 heads a rank) into decode TP 4 (2 heads a rank): prefill rank 1
    # writes every room into decode ranks 2 and 3, as its legs 0 and 1.
    assert link_slot(_tp(LLAMA, 2, 1), _tp(LLAMA, 4, 2)) == (0, 2)
    assert link_slot(_tp(LLAMA, 2, 1), _tp(LLAMA, 4, 3)) == (1, 2)
    assert link_slot(_tp(LLAMA, 2, 1), _tp(LLAMA, 2, 1)) == (0, 1)  # equal TP
    assert link_slot(_tp(LLAMA, 4, 1), _tp(LLAMA, 2, 0)) == (0, 1)  # prefill's the larger
    # 1 KV head with Mamba state, prefill TP 4 into decode TP 2: prefill rank 1 writes decode
    # rank 1's KV and decode rank 0 its state shard, legs 1 and 0 of two; without sharded
    # state it has the KV leg alone.
    one = msgspec.structs.replace(LLAMA, kv_heads=1, state_types=("mamba",))
    assert [link_slot(_tp(one, 4, 1), _tp(one, 2, d)) for d in range(2)] == [(0, 2), (1, 2)]
    assert [link_slot(_tp(one, 4, 2), _tp(one, 2, d)) for d in range(2)] == [(0, 1), (0, 1)]
    swa = msgspec.structs.replace(one, state_types=("swa",))  # follows the KV heads
    assert link_slot(_tp(swa, 4, 1), _tp(swa, 2, 1)) == (0, 1)
    # The reverse, prefill TP 2 into decode TP 4: prefill rank 0 writes KV into decode ranks
    # 0 and 2 and state into 0 and 1.
    assert [link_slot(_tp(one, 2, 0), _tp(one, 4, d)) for d in range(4)] == [
        (0, 3),
        (1, 3),
        (2, 3),
        (0, 1),
    ]
    mla = Fingerprint(layers=2, head_bytes=64, page_tokens=1, mla=True)
    assert [link_slot(_tp(mla, 1), _tp(mla, 4, d)) for d in range(4)] == [
        (0, 4),
        (1, 4),
        (2, 4),
        (3, 4),
    ]


def test_link_plan_names_what_each_link_carries() -> None:
    # 8 heads, 256 bytes each, 16 rows a page. Prefill TP 4 (2 heads a rank) into decode TP 2
    # (4 heads a rank): prefill rank 3 writes its 2 heads at heads 2..3 of decode rank 1's row.
    piece = link_plan(_tp(LLAMA, 4, 3), _tp(LLAMA, 2, 1))
    assert piece == KvPiece(16, RowSlice(512, 0, 512), RowSlice(1024, 512, 512))
    assert link_plan(_tp(LLAMA, 4, 3), _tp(LLAMA, 2, 0)) == "none"  # heads 6..7: not rank 0's
    assert link_plan(LLAMA, LLAMA) is None  # equal TP: whole pages
    # MLA: one replica writes whole rows into a decode rank, the others nothing.
    mla = Fingerprint(layers=2, head_bytes=64, page_tokens=1, mla=True)
    assert link_plan(_tp(mla, 2, 0), _tp(mla, 1)) is None
    assert link_plan(_tp(mla, 2, 1), _tp(mla, 1)) == "none"


# -- on the wire ---------------------------------------------------------------------------


def _hello(fingerprint: Fingerprint) -> Hello:
    return Hello(PROTOCOL_VERSION, "decode", 0, "a", b"", b"", 1, 2000, b"", fingerprint)


def test_the_fingerprint_travels_in_the_hello() -> None:
    codec = FrameCodec(None)
    (got,) = FrameReader(codec).feed(codec.encode(_hello(LLAMA)))
    assert isinstance(got, Hello)
    assert got.fingerprint == LLAMA


def test_a_hello_with_an_out_of_range_fingerprint_is_rejected() -> None:
    codec = FrameCodec(None)
    bad = msgspec.structs.replace(_hello(LLAMA), fingerprint=Fingerprint(attn_tp=0))
    (got,) = FrameReader(codec).feed(codec.encode(bad))
    assert not isinstance(got, Hello)
    assert "attn_tp" in str(got)


# -- a real pair that disagrees --------------------------------------------------------------

_ENGINES = itertools.count()


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    with running_registry(ttl_s=3) as url:
        yield url


def _config(fingerprint: Fingerprint) -> ManagerConfig:
    return ManagerConfig(
        channel=ChannelConfig(heartbeat_s=0.25),
        register_interval_s=0.5,
        fingerprint=fingerprint,
    )


def _one_room(registry: str, prefill_fp: Fingerprint, decode_fp: Fingerprint) -> dict[str, object]:
    """One room between a prefill and a decode manager declaring these fingerprints."""
    engine = f"fp-{next(_ENGINES)}"
    src_kv, src_aux = make_buffers(SHAPE)
    fill_sources(src_kv, src_aux)
    dst_kv, dst_aux = make_buffers(SHAPE)
    prefill = PrefillManager(
        make_layout(src_kv, src_aux), registry, engine_id=engine, config=_config(prefill_fp)
    )
    try:
        decode = DecodeManager(
            make_layout(dst_kv, dst_aux), registry, engine_id=engine, config=_config(decode_fp)
        )
        try:
            receiver = decode.receiver(7)
            receiver.init(0)
            sender = prefill.sender(7)
            wait_until_sync(lambda: receiver.poll() is not KVPoll.Bootstrapping, timeout=10)
            if receiver.poll() is KVPoll.WaitingForInput:
                receiver.send_metadata(np.asarray([1, 2], np.int32), aux_index=3)
                wait_until_sync(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
                sender.init(2, aux_index=1)
                sender.send(np.asarray([5, 6], np.int32))
            wait_until_sync(lambda: receiver.poll() in TERMINAL, timeout=10)

            def concluded(manager: PrefillManager | DecodeManager) -> bool:
                control = manager.stats()["control"]
                return bool(control["handshakes_refused"] or control["links_opened"])

            # The receiver can end on decode's verdict before prefill's loop thread has
            # counted its own: read the counters once both sides are through the handshake.
            wait_until_sync(lambda: concluded(prefill) and concluded(decode), timeout=10)
            out: dict[str, object] = {
                "status": receiver.poll(),
                "reason": receiver.reason,
                "prefill_control": prefill.stats()["control"],
                "decode_control": decode.stats()["control"],
                "peers_connected": prefill.transport.stats.peers_connected,
            }
            sender.abort("test over")
            return out
        finally:
            decode.close()
    finally:
        prefill.close()


def test_a_pair_that_disagrees_is_refused_at_the_handshake_on_both_sides(registry: str) -> None:
    got = _one_room(registry, LLAMA, msgspec.structs.replace(LLAMA, kv_heads=4))
    assert got["status"] is KVPoll.Failed
    reason = str(got["reason"])
    # At once, with the handshake's reason (not a deadline, not a transfer error).
    assert "fingerprint mismatch: KV heads (kv_heads): prefill has 8, decode has 4" in reason
    assert "cannot reach prefill rank 0" in reason
    assert got["peers_connected"] == 0  # prefill never loaded decode's NIXL metadata
    for side in ("prefill_control", "decode_control"):
        stats = got[side]
        assert isinstance(stats, dict)
        assert stats["handshakes_refused"] >= 1, (side, stats)
        assert stats["links_opened"] == 0, (side, stats)


def test_a_pair_that_agrees_moves_the_room(registry: str) -> None:
    got = _one_room(registry, LLAMA, LLAMA)
    assert got["status"] is KVPoll.Success, got["reason"]
    assert got["peers_connected"] == 1


def test_a_stage_state_buffers_pair_with_decodes_by_layer_in_order() -> None:
    # Decode: Mamba conv tensors of layers 0, 2, 3, then their SSM tensors; a DSA pool on
    # layers 0 to 3. Prefill stage 1 holds layers 2 and 3.
    decode = msgspec.structs.replace(
        LLAMA, layers=4, state_types=("mamba", "dsa"), state_layers=(0, 2, 3, 0, 2, 3, 0, 1, 2, 3)
    )
    stage = msgspec.structs.replace(
        decode, pp=2, pp_rank=1, layers=2, first_layer=2, state_layers=(2, 3, 2, 3, 2, 3)
    )
    assert mismatch(stage, decode) is None
    assert stage_state(stage, decode, (4, 2), (6, 4)) == (1, 2, 4, 5, 8, 9)
    assert stage_state(decode, decode, (6, 4), (6, 4)) is None  # no pipeline parallelism
    missing = msgspec.structs.replace(stage, state_layers=(2, 3, 2, 3, 2, 4))
    assert stage_state(missing, decode, (4, 2), (6, 4)) == (
        "prefill pipeline stage 1: decode has no dsa state buffer left for model layer 4"
    )
    unnamed = msgspec.structs.replace(decode, state_layers=())
    reason = mismatch(stage, unnamed)
    assert reason is not None
    assert "needs the model layer of every state buffer (SGLang's state_layer_ids)" in reason
    assert reason.endswith("PP-heterogeneous transfer requires layer ids on both peers")


def test_a_stage_without_buffers_of_a_state_type_pairs_its_other_types() -> None:
    # Mamba on layers 0 and 1 only, DSA on layers 0 to 3; stage 1 holds layers 2 and 3: no
    # Mamba buffer (SGLang declares the type there with no buffers, and sends none of it).
    decode = msgspec.structs.replace(
        LLAMA, layers=4, state_types=("mamba", "dsa"), state_layers=(0, 1, 0, 1, 0, 1, 2, 3)
    )
    stage = msgspec.structs.replace(
        decode, pp=2, pp_rank=1, layers=2, first_layer=2, state_types=("dsa",), state_layers=(2, 3)
    )
    assert mismatch(stage, decode) is None
    assert stage_types(stage, decode) == (1,)
    assert stage_state(stage, decode, (2,), (4, 4)) == (6, 7)
    # A stage with no state buffer at all writes none of decode's.
    bare = msgspec.structs.replace(stage, state_types=(), state_layers=())
    assert mismatch(bare, decode) is None
    assert stage_state(bare, decode, (), (4, 4)) == ()
    # Out of decode's order, or a type decode lacks: refused by name.
    swapped = msgspec.structs.replace(decode, state_types=("dsa", "mamba"))
    odd = msgspec.structs.replace(stage, state_types=("mamba", "dsa"), state_layers=(2, 2, 3))
    assert mismatch(odd, swapped) == (
        "fingerprint mismatch: state types (state_types): prefill pipeline stage 1 has "
        "[mamba, dsa], not among decode's [dsa, mamba] in their order"
    )
    swa = msgspec.structs.replace(stage, state_types=("swa",))
    assert "not among decode's [mamba, dsa]" in str(mismatch(swa, decode))
    # Without pipeline parallelism the types stay equal.
    assert stage_types(msgspec.structs.replace(decode, state_types=("dsa",)), decode) == (
        "state types differ"
    )
    # MiniMax is refused on every stage, whether or not it holds MiniMax buffers.
    minimax = msgspec.structs.replace(decode, state_types=("minimax_index_k", "dsa"))
    assert "PP>1 not supported for MiniMax state yet" in str(mismatch(stage, minimax))


def test_decodes_state_rows_are_renumbered_for_a_stage_that_lacks_a_type() -> None:
    # Decode: Mamba rows 0-9, DSA rows 10-109, a tail ring's rows 110-119. The stage holds DSA
    # and the ring: its summary numbers DSA 0-99 and the ring 100-109.
    rows = StageRows.plan(((0, 10), (10, 100), (110, 10)), ((0, 100), (100, 10)), (1, 2))
    assert rows is not None
    packed = np.asarray([3, 10, 57, 109, 111, 500], np.int32).tobytes()
    got = np.frombuffer(rows.translate(packed), np.int32).tolist()
    assert got == [0, 47, 99, 101, -1]  # Mamba's row left out; a row past decode's: -1
    assert rows.translate(b"") == b""
    # The ring row's live segments are keyed by its position among the rows: 4 there, 3 in
    # the translated rows; an entry for a row the stage leaves out goes with it, and one that
    # names no row stays for the transport to refuse.
    rings = np.asarray(
        [[4, 5, 3, 0, 0, 11], [0, 1, 1, 0, 0, 11], [9, 0, 1, 0, 0, 11]], "<i4"
    ).tobytes()
    moved = np.frombuffer(rows.translate_rings(packed, rings), "<i4").reshape(-1, 6).tolist()
    assert moved == [[3, 5, 3, 0, 0, 11], [9, 0, 1, 0, 0, 11]]
    assert rows.translate_rings(packed, b"") == b""
    # Every type held: the numberings agree, nothing to translate.
    assert StageRows.plan(((0, 10), (10, 100)), ((0, 10), (10, 100)), (0, 1)) is None
