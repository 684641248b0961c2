"""The handshake fingerprint: the pure rules (``mismatch``), its place in the Hello, and a real
prefill-decode pair that disagrees about the model, refused at the handshake on both sides."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvfsm import KVPoll
from kvfsm.bootstrap import ChannelConfig, Fingerprint
from kvfsm.bootstrap._fingerprint import MUST_MATCH, SHAPE_RULES, mismatch
from kvfsm.bootstrap._frames import PROTOCOL_VERSION, FrameCodec, FrameReader, Hello
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.states import TERMINAL
from kvfsm.transport._peer import make_buffers, make_layout, wait_for
from tests.bootstrap.prefill_process import SHAPE, fill_sources
from tests.registry import running_registry

LLAMA = Fingerprint(
    layers=32, kv_heads=8, head_bytes=256, dtype="bfloat16", page_tokens=16, attn_tp=2
)

#: For each field that must match, a value other than LLAMA's.
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
    assert {name for name, _ in MUST_MATCH} == set(OTHER)
    shaped = {name for name, _, _ in SHAPE_RULES}
    assert set(Fingerprint.__struct_fields__) == set(OTHER) | shaped


@pytest.mark.parametrize(("name", "label"), MUST_MATCH)
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


def test_unsupported_parallel_shapes_are_named() -> None:
    assert mismatch(LLAMA, msgspec.structs.replace(LLAMA, attn_tp=4)) == (
        "fingerprint mismatch: unequal attention TP is not supported (attn_tp): "
        "prefill has 2, decode has 4"
    )
    assert mismatch(msgspec.structs.replace(LLAMA, pp=2), msgspec.structs.replace(LLAMA, pp=2)) == (
        "fingerprint mismatch: pipeline parallelism is not supported (pp): "
        "prefill has 2, decode has 2"
    )


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
            wait_for(lambda: receiver.poll() is not KVPoll.Bootstrapping, timeout=10)
            if receiver.poll() is KVPoll.WaitingForInput:
                receiver.send_metadata(np.asarray([1, 2], np.int32), aux_index=3)
                wait_for(lambda: sender.poll() is KVPoll.WaitingForInput, timeout=10)
                sender.init(2, aux_index=1)
                sender.send(np.asarray([5, 6], np.int32))
            wait_for(lambda: receiver.poll() in TERMINAL, timeout=10)
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
