"""``kvfsm.sglang._args``: from SGLang's ``KVArgs``/``ServerArgs`` to a layout, a topology and
addresses. Pure functions: the layouts here are built from made-up addresses and never
registered with NIXL."""

from __future__ import annotations

import enum
import ipaddress
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvfsm.control import Fingerprint
from kvfsm.control._fingerprint import mismatch
from kvfsm.sglang._args import (
    Topology,
    UnsupportedError,
    advertised_host,
    bootstrap_url,
    fingerprint_from_kv_args,
    layout_from_kv_args,
    mode_name,
)
from kvfsm.sglang._bases import DisaggregationMode, KVArgs
from kvfsm.sglang._states import StateMap
from kvfsm.transport import LayoutError, MemKind

LAYERS, PAGES, PAGE_BYTES = 3, 16, 512
AUX = ((32, 64), (32, 128))  # (rows, row bytes) of SGLang's metadata buffers
STATE_ROWS, STATE_ROW_BYTES = 8, 256


class _Addresses:
    """Disjoint, 4 KiB-aligned made-up buffer addresses."""

    def __init__(self) -> None:
        self.next = 0x10_0000

    def __call__(self, nbytes: int) -> int:
        addr = self.next
        self.next += (nbytes + 0xFFF) & ~0xFFF
        return addr


def kv_args(*, state_types: int = 1, **overrides: Any) -> KVArgs:
    """A ``KVArgs`` shaped like a scheduler's (K and V per layer, two aux buffers, state)."""
    alloc = _Addresses()
    args = KVArgs()
    args.engine_rank = 0
    n_kv = 2 * LAYERS
    args.kv_data_ptrs = [alloc(PAGES * PAGE_BYTES) for _ in range(n_kv)]
    args.kv_data_lens = [PAGES * PAGE_BYTES] * n_kv
    args.kv_item_lens = [PAGE_BYTES] * n_kv
    args.kv_layer_ids = [i // 2 for i in range(n_kv)]
    args.aux_data_ptrs = [alloc(rows * size) for rows, size in AUX]
    args.aux_data_lens = [rows * size for rows, size in AUX]
    args.aux_item_lens = [size for _rows, size in AUX]
    names = ["mamba", "swa", "dsa"][:state_types]
    args.state_types = names
    args.state_data_ptrs = [[alloc(STATE_ROWS * STATE_ROW_BYTES)] for _ in names]
    args.state_data_lens = [[STATE_ROWS * STATE_ROW_BYTES] for _ in names]
    args.state_item_lens = [[STATE_ROW_BYTES] for _ in names]
    args.gpu_id = 0
    args.page_size = 16
    args.system_dp_rank = 0
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


# -- fingerprint_from_kv_args ---------------------------------------------------------------------


def test_the_fingerprint_declares_what_both_schedulers_set_before_the_manager() -> None:
    args = kv_args(kv_cache_dtype_str="bfloat16")
    got = fingerprint_from_kv_args(args, is_mla=False, attn_tp_size=2, pp_size=1)
    assert got == Fingerprint(
        layers=LAYERS,
        dtype="bfloat16",
        page_tokens=16,
        mla=False,
        state_types=("mamba",),
        attn_tp=2,
        pp=1,
    )
    # Head counts are declared where the scheduler set them: SGLang's prefill does, its decode
    # does not (it sets them only after building the manager), and the two still pair.
    prefill = kv_args(kv_cache_dtype_str="bfloat16", kv_head_num=4, total_kv_head_num=8)
    declared = fingerprint_from_kv_args(prefill, is_mla=False, attn_tp_size=2, pp_size=1)
    assert (declared.kv_heads, declared.head_bytes) == (8, prefill.kv_item_lens[0] // 16 // 4)
    assert mismatch(declared, got) is None


def test_a_pipeline_stage_declares_its_own_span_of_layers() -> None:
    # Each stage's pool holds its own layers (3 here); prefill_start_layer says where they sit.
    stage = kv_args(kv_cache_dtype_str="bfloat16")
    stage.prefill_start_layer = 3
    got = fingerprint_from_kv_args(stage, is_mla=False, attn_tp_size=1, pp_size=2, pp_rank=1)
    assert (got.pp, got.pp_rank, got.first_layer, got.layers) == (2, 1, 3, 3)
    whole = msgspec.structs.replace(got, pp=1, pp_rank=0, first_layer=0, layers=6)
    # (the rig's KVArgs have a Mamba pool, which a pipeline refuses by name)
    assert "with state pools (mamba)" in str(mismatch(got, whole))
    got, whole = (msgspec.structs.replace(f, state_types=()) for f in (got, whole))
    assert mismatch(got, whole) is None
    # Without pipeline parallelism prefill_start_layer is ignored (SGLang sets it to 0 anyway).
    flat = fingerprint_from_kv_args(stage, is_mla=False, attn_tp_size=1, pp_size=1)
    assert flat.first_layer == 0


def test_the_fingerprint_tells_mla_and_mha_and_dtypes_apart() -> None:
    mha = fingerprint_from_kv_args(
        kv_args(kv_cache_dtype_str="bfloat16"), is_mla=False, attn_tp_size=1, pp_size=1
    )
    # An MLA pool of as many buffers has twice the layers (one latent buffer per layer).
    mla = fingerprint_from_kv_args(
        kv_args(kv_cache_dtype_str="bfloat16"), is_mla=True, attn_tp_size=1, pp_size=1
    )
    assert mla.layers == 2 * mha.layers
    assert (
        mismatch(mha, mla) == "fingerprint mismatch: layers (layers): prefill has 3, decode has 6"
    )
    fp8 = fingerprint_from_kv_args(
        kv_args(kv_cache_dtype_str="fp8_e4m3"), is_mla=False, attn_tp_size=1, pp_size=1
    )
    assert mismatch(mha, fp8) == (
        "fingerprint mismatch: KV dtype (dtype): prefill has 'bfloat16', decode has 'fp8_e4m3'"
    )


# -- layout_from_kv_args --------------------------------------------------------------------------


def test_layout_has_kv_aux_and_state_regions() -> None:
    args = kv_args(kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    layout = layout_from_kv_args(args)
    assert [r.addr for r in layout.kv] == args.kv_data_ptrs
    assert [r.name for r in layout.kv] == [f"kv{i}" for i in range(2 * LAYERS)]
    assert layout.num_pages == PAGES
    assert layout.page_bytes() == 2 * LAYERS * PAGE_BYTES
    assert [r.addr for r in layout.aux] == args.aux_data_ptrs
    assert layout.aux_rows == 32
    assert layout.aux_row_bytes() == 64 + 128
    assert [r.addr for r in layout.state] == args.state_data_ptrs[0]
    assert layout.state_rows == STATE_ROWS
    assert layout.state_row_bytes() == STATE_ROW_BYTES
    assert (layout.kv_kind, layout.aux_kind, layout.state_kind) == (MemKind.DRAM,) * 3
    assert {r.device for r in layout.regions()} == {0}


def test_dram_kind_is_read_case_insensitively() -> None:
    layout = layout_from_kv_args(kv_args(kv_data_mem_kinds=["dram"] * (2 * LAYERS), gpu_id=3))
    assert layout.kv_kind is MemKind.DRAM
    assert {r.device for r in layout.kv} == {0}  # DRAM is device 0 whatever gpu_id says


@pytest.mark.parametrize("kinds", [None, []])
def test_kv_defaults_to_vram_on_the_scheduler_gpu(kinds: list[str] | None) -> None:
    layout = layout_from_kv_args(kv_args(kv_data_mem_kinds=kinds, gpu_id=3))
    assert layout.kv_kind is MemKind.VRAM
    assert {r.device for r in layout.kv} == {3}
    # State lives with the pool; aux rows (SGLang's metadata buffers) are host memory.
    assert layout.state_kind is MemKind.VRAM
    assert {r.device for r in layout.state} == {3}
    assert layout.aux_kind is MemKind.DRAM
    assert {r.device for r in layout.aux} == {0}


def test_explicit_vram_kinds_use_gpu_id() -> None:
    layout = layout_from_kv_args(kv_args(kv_data_mem_kinds=["VRAM"] * (2 * LAYERS), gpu_id=1))
    assert layout.kv_kind is MemKind.VRAM
    assert {r.device for r in layout.kv} == {1}


def test_mixed_kv_kinds_are_refused_naming_them() -> None:
    kinds = ["VRAM", "DRAM"] * LAYERS
    with pytest.raises(UnsupportedError, match=r"mixed memory kinds \['DRAM', 'VRAM'\]") as info:
        layout_from_kv_args(kv_args(kv_data_mem_kinds=kinds))
    assert "kv_data_mem_kinds" in str(info.value)


def test_unknown_kv_kind_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedError, match=r"memory kind 'NVME'"):
        layout_from_kv_args(kv_args(kv_data_mem_kinds=["NVME"] * (2 * LAYERS)))


def test_every_state_type_with_buffers_is_one_state_group_in_kvargs_order() -> None:
    args = kv_args(state_types=3, kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    layout = layout_from_kv_args(args)
    assert layout.state_groups == (1, 1, 1)
    assert [r.addr for r in layout.state] == [g[0] for g in args.state_data_ptrs]
    assert layout.state_type_rows() == ((0, STATE_ROWS), (STATE_ROWS, STATE_ROWS), (16, 8))
    got = fingerprint_from_kv_args(args, is_mla=False, attn_tp_size=1, pp_size=1)
    assert got.state_types == ("mamba", "swa", "dsa")


def test_state_type_names_come_from_enum_values() -> None:
    class StateType(str, enum.Enum):  # noqa: UP042 - the shape of SGLang's StateType
        MAMBA = "mamba"
        SWA = "swa"

    args = kv_args(state_types=2)
    args.state_types = [StateType.MAMBA, StateType.SWA]
    assert StateMap.from_kv_args(args).names == ("mamba", "swa")


def test_a_state_type_without_buffers_is_not_registered() -> None:
    args = kv_args(state_types=2, kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    swa_ptrs = args.state_data_ptrs[1]
    args.state_data_ptrs = [[], swa_ptrs]  # only the second type has buffers
    assert StateMap.from_kv_args(args).names == ("swa",)
    layout = layout_from_kv_args(args)
    assert [r.addr for r in layout.state] == swa_ptrs


def test_no_state_buffers_no_state_regions() -> None:
    args = kv_args(state_types=0, kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    assert StateMap.from_kv_args(args).names == ()
    assert layout_from_kv_args(args).state == ()
    bare = kv_args(kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens"):
        setattr(bare, name, None)
    assert StateMap.from_kv_args(bare).names == ()
    assert layout_from_kv_args(bare).state_rows == 0


def test_host_kv_destinations_are_refused() -> None:
    args = kv_args(host_kv_data_ptrs=[0x9000_0000], kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    with pytest.raises(UnsupportedError, match="host KV destinations"):
        layout_from_kv_args(args)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("kv_data_lens", [PAGES * PAGE_BYTES + 8] * (2 * LAYERS), "not a multiple of item_bytes"),
        ("kv_item_lens", [0] * (2 * LAYERS), "item_bytes must be > 0"),
        ("kv_data_ptrs", [], "at least one kv region"),
        ("kv_data_ptrs", "misaligned", "not a multiple of 8"),
    ],
)
def test_bad_sizes_give_a_layout_error_saying_so(
    field: str, value: list[int] | str, why: str
) -> None:
    args = kv_args(kv_data_mem_kinds=["DRAM"] * (2 * LAYERS))
    if value == "misaligned":  # a pointer into the middle of a buffer
        args.kv_data_ptrs = [args.kv_data_ptrs[0] + 4, *args.kv_data_ptrs[1:]]
    else:
        setattr(args, field, value)
    if value == []:
        args.kv_data_lens = args.kv_item_lens = []
    with pytest.raises(LayoutError) as info:
        layout_from_kv_args(args)
    assert not isinstance(info.value, UnsupportedError)
    message = str(info.value)
    assert message.startswith("KVArgs does not describe a usable layout: "), message
    assert why in message


def test_sglangs_cpu_device_registers_dram_whatever_the_labels_say() -> None:
    # SGLang 0.5.23 labels a CPU pool VRAM (decode) or nothing (prefill: VRAM by default).
    for kinds in (["VRAM"] * (2 * LAYERS), None):
        layout = layout_from_kv_args(kv_args(kv_data_mem_kinds=kinds, gpu_id=2), "cpu")
        assert {r.kind for r in layout.kv} == {MemKind.DRAM}
        assert {r.device for r in layout.kv} == {0}
    cuda = layout_from_kv_args(kv_args(kv_data_mem_kinds=None, gpu_id=2), "cuda")
    assert {(r.kind, r.device) for r in cuda.kv} == {(MemKind.VRAM, 2)}


# -- Topology -----------------------------------------------------------------------------------


def server(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "enable_dp_attention": False}
    base.update(fields)
    return SimpleNamespace(**base)


def ranks(engine_rank: int, system_dp_rank: int | None = 0, pp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(engine_rank=engine_rank, system_dp_rank=system_dp_rank, pp_rank=pp_rank)


def test_tp_only() -> None:
    topo = Topology.of(ranks(2), server(tp_size=4))
    assert topo == Topology(attn_tp_size=4, tp_rank=2, dp_size=1, dp_rank=0)
    assert topo.rank == 2


def test_missing_server_fields_mean_one() -> None:
    topo = Topology.of(ranks(0), SimpleNamespace())
    assert topo == Topology(1, 0, 1, 0)


def test_dp_attention_splits_tp_into_attention_groups() -> None:
    # tp 8, dp 2: attention TP 4; engine rank 6 is attention rank 2 of DP group 1.
    args = server(tp_size=8, dp_size=2, enable_dp_attention=True)
    topo = Topology.of(ranks(6, system_dp_rank=0), args)
    assert topo == Topology(attn_tp_size=4, tp_rank=2, dp_size=2, dp_rank=1)
    assert topo.rank == 6
    assert [Topology.of(ranks(r), args).rank for r in range(8)] == list(range(8))


def test_dp_without_attention_reads_the_system_dp_rank() -> None:
    args = server(tp_size=2, dp_size=3)
    topo = Topology.of(ranks(1, system_dp_rank=2), args)
    assert topo == Topology(attn_tp_size=2, tp_rank=1, dp_size=3, dp_rank=2)
    assert topo.rank == 2 * 2 + 1
    assert Topology.of(ranks(1, system_dp_rank=None), args).dp_rank == 0
    assert Topology.of(SimpleNamespace(engine_rank=1), args).dp_rank == 0


def test_registry_ranks_are_unique_over_dp_and_tp() -> None:
    args = server(tp_size=2, dp_size=3)
    seen = {Topology.of(ranks(t, system_dp_rank=d), args).rank for d in range(3) for t in range(2)}
    assert seen == set(range(6))


def test_registry_ranks_are_unique_over_dp_pp_and_tp() -> None:
    args = server(tp_size=2, dp_size=2, pp_size=3)
    seen = set()
    for d in range(2):
        for p in range(3):
            for t in range(2):
                topo = Topology.of(ranks(t, system_dp_rank=d, pp_rank=p), args)
                assert (topo.pp_size, topo.pp_rank) == (3, p)
                seen.add(topo.rank)
                # stage 0 of the rank's pipeline: same DP and TP rank
                assert topo.rank_of(d, 0, t) == topo.rank - p * 2
    assert seen == set(range(12))


def test_a_pipeline_rank_out_of_range_is_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"pp_rank 2 out of range \(pp_size 2\)"):
        Topology.of(ranks(0, pp_rank=2), server(tp_size=2, pp_size=2))


def test_tp_not_a_multiple_of_dp_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="tp_size 6 is not a multiple of dp_size 4"):
        Topology.of(ranks(0), server(tp_size=6, dp_size=4, enable_dp_attention=True))


# -- addresses ------------------------------------------------------------------------------------


def test_bootstrap_url_uses_host_and_bootstrap_port() -> None:
    args = SimpleNamespace(host="10.1.2.3", disaggregation_bootstrap_port=9100)
    assert bootstrap_url(args) == "http://10.1.2.3:9100"


def test_bootstrap_url_defaults() -> None:
    assert bootstrap_url(SimpleNamespace()) == "http://127.0.0.1:8998"
    assert bootstrap_url(SimpleNamespace(host=None, dist_init_addr=None)) == (
        "http://127.0.0.1:8998"
    )


def test_dist_init_addr_host_wins_over_host() -> None:
    args = SimpleNamespace(
        host="10.1.2.3", dist_init_addr="10.9.8.7:5000", disaggregation_bootstrap_port=9100
    )
    assert bootstrap_url(args) == "http://10.9.8.7:9100"
    args.dist_init_addr = "node0.cluster:5000"
    assert bootstrap_url(args) == "http://node0.cluster:9100"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_wildcard_host_is_reached_on_loopback(host: str) -> None:
    args = SimpleNamespace(host=host, disaggregation_bootstrap_port=9100)
    assert bootstrap_url(args) == "http://127.0.0.1:9100"


@pytest.mark.parametrize("dist", ["0.0.0.0:5000", "[::]:5000"])
def test_wildcard_dist_init_addr_is_reached_on_loopback(dist: str) -> None:
    args = SimpleNamespace(host="10.1.2.3", dist_init_addr=dist, disaggregation_bootstrap_port=1)
    assert bootstrap_url(args) == "http://127.0.0.1:1"


def test_ipv6_hosts_are_bracketed() -> None:
    args = SimpleNamespace(host="fd00::5", disaggregation_bootstrap_port=9100)
    assert bootstrap_url(args) == "http://[fd00::5]:9100"
    args.dist_init_addr = "[fd00::7]:5000"
    assert bootstrap_url(args) == "http://[fd00::7]:9100"


@pytest.mark.parametrize("host", ["10.1.2.3", "node0.cluster", "fd00::5", "127.0.0.1"])
def test_a_specific_bind_host_is_advertised_as_is(host: str) -> None:
    assert advertised_host(host, "http://192.0.2.1:8998") == host


@pytest.mark.parametrize("bind", ["0.0.0.0", "", "::"])
def test_a_wildcard_is_advertised_as_the_route_toward_the_registry(bind: str) -> None:
    assert advertised_host(bind, "http://127.0.0.1:8998") == "127.0.0.1"
    # Toward another address: the local address of that route (or loopback without one), never
    # the wildcard itself.
    for toward in ("http://192.0.2.1:8998", "http://[2001:db8::1]:8998", "http://localhost:1"):
        found = ipaddress.ip_address(advertised_host(bind, toward))
        assert not found.is_unspecified, (bind, toward, found)


# -- mode_name ------------------------------------------------------------------------------------


def test_mode_name() -> None:
    class SGLangMode(enum.Enum):  # SGLang's DisaggregationMode has the same values
        NULL = "null"
        PREFILL = "prefill"
        DECODE = "decode"

    assert mode_name(DisaggregationMode.PREFILL) == "prefill"
    assert mode_name(DisaggregationMode.DECODE) == "decode"
    assert mode_name(SGLangMode.PREFILL) == "prefill"
    assert mode_name(SGLangMode.DECODE) == "decode"
    assert mode_name("decode") == "decode"
    for bad in (SGLangMode.NULL, DisaggregationMode.NULL, "null", None):
        with pytest.raises(UnsupportedError, match="prefill or decode"):
            mode_name(bad)
