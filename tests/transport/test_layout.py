"""Layout: regions from real tensors and from pointer lists, every validation rule, descriptor rows
that point at the right bytes, buffer-major page indices, and the summary that travels to a peer.

Buffers are CPU tensors, so every address is real and a descriptor can be read back with ctypes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.transport._layout import (
    ALIGNMENT,
    Layout,
    LayoutError,
    LayoutSummary,
    MemKind,
    Region,
)

LAYERS = 4
PAGES = 32
PAGE_TOKENS = 16
HEADS = 2
HEAD_DIM = 64
PAGE_BYTES = PAGE_TOKENS * HEADS * HEAD_DIM * 2  # bf16
AUX_ROWS = 8
AUX_ROW_BYTES = 192
STATE_ROWS = 4
STATE_ROW_BYTES = 256

GIB = 2**30


def make_kv(pages: int = PAGES) -> list[torch.Tensor]:
    """K and V of each layer, SGLang-MHA style: (pages, page_tokens, heads, head_dim) bf16."""
    g = torch.Generator().manual_seed(pages)
    return [
        torch.randn(pages, PAGE_TOKENS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        for _ in range(2 * LAYERS)
    ]


def make_aux(rows: int = AUX_ROWS) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (rows, AUX_ROW_BYTES), dtype=torch.uint8) for _ in range(2)]


def make_state(rows: int = STATE_ROWS) -> list[torch.Tensor]:
    return [torch.randn(rows, STATE_ROW_BYTES // 4) for _ in range(3)]


@pytest.fixture
def kv() -> list[torch.Tensor]:
    return make_kv()


@pytest.fixture
def aux() -> list[torch.Tensor]:
    return make_aux()


@pytest.fixture
def layout(kv: list[torch.Tensor], aux: list[torch.Tensor]) -> Layout:
    return Layout.from_tensors(kv, aux)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def read(row: npt.NDArray[np.uint64]) -> bytes:
    """The bytes a descriptor row ``(addr, len, device)`` points at (DRAM)."""
    return ctypes.string_at(int(row[0]), int(row[1]))


def pointers_of(
    kv: Sequence[torch.Tensor],
    aux: Sequence[torch.Tensor] = (),
    state: Sequence[torch.Tensor] = (),
) -> Layout:
    """``Layout.from_pointers`` over the same tensors, as SGLang's KVArgs would list them."""

    def cols(ts: Sequence[torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
        lens = [t.numel() * t.element_size() for t in ts]
        return (
            [t.data_ptr() for t in ts],
            lens,
            [n // t.shape[0] for n, t in zip(lens, ts, strict=True)],
        )

    return Layout.from_pointers(*cols(kv), *cols(aux), *cols(state))


# -- construction ------------------------------------------------------------------------------


def test_from_tensors_realistic_layout(kv: list[torch.Tensor], aux: list[torch.Tensor]) -> None:
    state = make_state()
    layout = Layout.from_tensors(kv, aux, state)

    assert [r.name for r in layout.kv] == [f"kv{i}" for i in range(2 * LAYERS)]
    assert [r.name for r in layout.aux] == ["aux0", "aux1"]
    assert [r.name for r in layout.state] == ["state0", "state1", "state2"]
    assert layout.regions() == layout.kv + layout.aux + layout.state
    for region, t in zip(layout.regions(), [*kv, *aux, *state], strict=True):
        assert region.kind is MemKind.DRAM
        assert region.device == 0
        assert region.addr == t.data_ptr()
        assert region.nbytes == t.numel() * t.element_size()
    assert {r.item_bytes for r in layout.kv} == {PAGE_BYTES}
    assert {r.item_bytes for r in layout.aux} == {AUX_ROW_BYTES}
    assert {r.item_bytes for r in layout.state} == {STATE_ROW_BYTES}
    assert (layout.num_pages, layout.aux_rows, layout.state_rows) == (PAGES, AUX_ROWS, STATE_ROWS)
    assert layout.page_bytes() == 2 * LAYERS * PAGE_BYTES
    assert layout.aux_row_bytes() == 2 * AUX_ROW_BYTES
    assert layout.state_row_bytes() == 3 * STATE_ROW_BYTES
    assert (layout.kv_kind, layout.aux_kind, layout.state_kind) == (MemKind.DRAM,) * 3


def test_from_tensors_explicit_counts() -> None:
    """A flat buffer has no page dimension: the count comes from the caller."""
    flat = torch.zeros(PAGES * PAGE_BYTES, dtype=torch.uint8)
    rows = torch.zeros(AUX_ROWS * AUX_ROW_BYTES // 8, dtype=torch.int64)
    layout = Layout.from_tensors([flat], [rows], num_pages=PAGES, aux_rows=AUX_ROWS)
    assert (layout.num_pages, layout.kv[0].item_bytes) == (PAGES, PAGE_BYTES)
    assert (layout.aux_rows, layout.aux[0].item_bytes) == (AUX_ROWS, AUX_ROW_BYTES)


def test_groups_are_stored_as_tuples(layout: Layout) -> None:
    again = Layout(kv=list(layout.kv), aux=list(layout.aux))  # type: ignore[arg-type]
    assert again == layout
    assert isinstance(again.kv, tuple)
    assert hash(again) == hash(layout)


def test_from_pointers_equals_from_tensors(kv: list[torch.Tensor], aux: list[torch.Tensor]) -> None:
    state = make_state()
    assert pointers_of(kv, aux, state) == Layout.from_tensors(kv, aux, state)
    assert pointers_of(kv) == Layout.from_tensors(kv)


def test_from_pointers_accepts_numpy_integers(kv: list[torch.Tensor]) -> None:
    ptrs = np.array([t.data_ptr() for t in kv], dtype=np.uint64)
    layout = Layout.from_pointers(
        list(ptrs), [PAGES * PAGE_BYTES] * len(kv), [PAGE_BYTES] * len(kv)
    )
    assert layout == Layout.from_tensors(kv)
    assert all(type(r.addr) is int for r in layout.kv)


def test_from_pointers_memory_kinds() -> None:
    """SGLang's placement: KV and state in VRAM on the rank's GPU, aux rows in host DRAM."""
    layout = Layout.from_pointers(
        [1 * GIB, 2 * GIB],
        [PAGES * PAGE_BYTES] * 2,
        [PAGE_BYTES] * 2,
        [1 * GIB],
        [AUX_ROWS * AUX_ROW_BYTES],
        [AUX_ROW_BYTES],
        [3 * GIB],
        [STATE_ROWS * STATE_ROW_BYTES],
        [STATE_ROW_BYTES],
        kind=MemKind.VRAM,
        device=3,
    )
    assert [(r.kind, r.device) for r in layout.kv] == [(MemKind.VRAM, 3)] * 2
    assert [(r.kind, r.device) for r in layout.state] == [(MemKind.VRAM, 3)]
    # Same address as kv0 but another address space: not an overlap.
    assert [(r.kind, r.device) for r in layout.aux] == [(MemKind.DRAM, 0)]
    assert (layout.kv_kind, layout.aux_kind, layout.state_kind) == (
        MemKind.VRAM,
        MemKind.DRAM,
        MemKind.VRAM,
    )
    assert set(layout.kv_descs()[:, 2].tolist()) == {3}
    assert set(layout.aux_descs()[:, 2].tolist()) == {0}


def test_same_address_on_two_gpus_is_not_an_overlap() -> None:
    regions = (
        Region("kv0", GIB, PAGE_BYTES * 4, PAGE_BYTES, MemKind.VRAM, 0),
        Region("kv1", GIB, PAGE_BYTES * 4, PAGE_BYTES, MemKind.VRAM, 1),
    )
    assert Layout(kv=regions).num_pages == 4


# -- descriptors -------------------------------------------------------------------------------


def test_kv_descs_point_at_pages(layout: Layout, kv: list[torch.Tensor]) -> None:
    descs = layout.kv_descs()
    assert descs.dtype == np.uint64
    assert descs.shape == (len(kv) * PAGES, 3)
    for b in (0, 1, len(kv) - 1):
        for p in (0, 1, PAGES // 2, PAGES - 1):
            row = descs[b * PAGES + p]
            assert row.tolist() == [kv[b].data_ptr() + p * PAGE_BYTES, PAGE_BYTES, 0]
            # The row really addresses page p of buffer b: read the bytes back.
            assert read(row) == tensor_bytes(kv[b][p])


def test_aux_and_state_descs_point_at_rows(aux: list[torch.Tensor]) -> None:
    state = make_state()
    layout = Layout.from_tensors(make_kv(), aux, state)
    aux_descs, state_descs = layout.aux_descs(), layout.state_descs()
    assert aux_descs.shape == (len(aux) * AUX_ROWS, 3)
    assert state_descs.shape == (len(state) * STATE_ROWS, 3)
    for b, t in enumerate(aux):
        for r in range(AUX_ROWS):
            assert read(aux_descs[b * AUX_ROWS + r]) == tensor_bytes(t[r])
    for b, t in enumerate(state):
        for r in range(STATE_ROWS):
            assert read(state_descs[b * STATE_ROWS + r]) == tensor_bytes(t[r])


def test_empty_groups_give_empty_descs(kv: list[torch.Tensor]) -> None:
    layout = Layout.from_tensors(kv)
    for descs in (layout.aux_descs(), layout.state_descs()):
        assert descs.shape == (0, 3)
        assert descs.dtype == np.uint64
    assert (layout.aux_rows, layout.state_rows) == (0, 0)


# -- indices -----------------------------------------------------------------------------------


def naive_page_index(n_buffers: int, num_pages: int, pages: list[int]) -> list[int]:
    return [b * num_pages + p for b in range(n_buffers) for p in pages]


def test_page_index_matches_reference(layout: Layout) -> None:
    rng = np.random.default_rng(7)
    for size in (0, 1, 5, PAGES):
        pages = rng.choice(PAGES, size=size, replace=False).astype(np.int32)
        index = layout.page_index(pages)
        assert index.dtype == np.int32
        assert index.tolist() == naive_page_index(len(layout.kv), PAGES, pages.tolist())


def test_page_index_accepts_any_integer_dtype(layout: Layout) -> None:
    pages = [3, 0, 7]
    want = layout.page_index(np.array(pages, dtype=np.int32))
    for dtype in (np.int8, np.int16, np.int64, np.uint8, np.uint32, np.uint64):
        got = layout.page_index(np.array(pages, dtype=dtype))
        assert got.dtype == np.int32
        assert np.array_equal(got, want)
    assert np.array_equal(layout.page_index(pages), want)


def test_page_index_selects_the_pages_bytes(layout: Layout, kv: list[torch.Tensor]) -> None:
    pages = np.array([5, 2, 31], dtype=np.int32)
    rows = layout.kv_descs()[layout.page_index(pages)]
    got = [read(row) for row in rows]
    assert got == [tensor_bytes(kv[b][int(p)]) for b in range(len(kv)) for p in pages]


def test_aux_and_state_index() -> None:
    layout = Layout.from_tensors(make_kv(), make_aux(), make_state())
    assert layout.aux_index(3).tolist() == [3, AUX_ROWS + 3]
    assert layout.aux_index(np.int64(3)).tolist() == [3, AUX_ROWS + 3]  # type: ignore[arg-type]
    assert layout.state_index(1).tolist() == [1, STATE_ROWS + 1, 2 * STATE_ROWS + 1]
    assert layout.aux_index(0).dtype == np.int32
    assert layout.state_index(0).dtype == np.int32


# -- validation --------------------------------------------------------------------------------


def dram(name: str, addr: int, items: int = 4, item_bytes: int = 64) -> Region:
    return Region(name, addr, items * item_bytes, item_bytes)


def aligned_base() -> int:
    return 1 << 20


REGION_ERRORS: list[tuple[str, Callable[[], object], str]] = [
    ("zero addr", lambda: Region("kv0", 0, 64, 64), r"region 'kv0': addr must be > 0, got 0"),
    ("zero length", lambda: Region("kv0", 4096, 0, 64), r"'kv0': nbytes must be > 0, got 0"),
    ("negative length", lambda: Region("kv0", 4096, -64, 64), r"nbytes must be > 0"),
    ("zero item", lambda: Region("kv0", 4096, 64, 0), r"'kv0': item_bytes must be > 0"),
    (
        "ragged",
        lambda: Region("kv3", 4096, 100, 24),
        r"'kv3': nbytes 100 is not a multiple of item_bytes 24 \(4 whole items and 4 bytes",
    ),
    (
        "misaligned addr",
        lambda: Region("aux0", 4097, 64, 64),
        r"'aux0': addr 0x1001 is not a multiple of 8",
    ),
    (
        "misaligned item",
        lambda: Region("kv0", 4096, 48, 12),
        r"'kv0': item_bytes 12 is not a multiple of 8",
    ),
    (
        "past 64 bits",
        lambda: Region("kv0", 2**64 - 64, 128, 64),
        r"'kv0': .* runs past the 64-bit address space",
    ),
    ("float addr", lambda: Region("kv0", 4096.0, 64, 64), r"'kv0': addr must be an int, got float"),  # type: ignore[arg-type]
    ("bool item", lambda: Region("kv0", 4096, 64, True), r"item_bytes must be an int, got bool"),
    ("no name", lambda: Region("", 4096, 64, 64), r"region name must be a non-empty str"),
    ("bad kind", lambda: Region("kv0", 4096, 64, 64, "DRAM"), r"'kv0': kind must be a MemKind"),  # type: ignore[arg-type]
    (
        "dram device",
        lambda: Region("kv0", 4096, 64, 64, MemKind.DRAM, 1),
        r"'kv0': DRAM regions use device 0, got device 1",
    ),
    (
        "negative device",
        lambda: Region("kv0", 4096, 64, 64, MemKind.VRAM, -1),
        r"'kv0': device must be >= 0",
    ),
]

B = aligned_base()
LAYOUT_ERRORS: list[tuple[str, Callable[[], object], str]] = [
    ("no kv", lambda: Layout(kv=()), r"at least one kv region"),
    ("not regions", lambda: Layout(kv=((1, 2, 3, 4),)), r"kv must hold Region objects"),  # type: ignore[arg-type]
    ("a region, not a tuple", lambda: Layout(kv=dram("kv0", B)), r"kv must be a sequence"),  # type: ignore[arg-type]
    (
        "page counts",
        lambda: Layout(kv=(dram("kv0", B, 4), dram("kv1", 2 * B, 5))),
        r"kv region 'kv1' has 5 pages but 'kv0' has 4; every kv region must hold the same",
    ),
    (
        "aux rows",
        lambda: Layout(kv=(dram("kv0", B),), aux=(dram("aux0", 2 * B, 8), dram("aux1", 3 * B, 2))),
        r"aux region 'aux1' has 2 rows but 'aux0' has 8",
    ),
    (
        "state groups",
        lambda: Layout(
            kv=(dram("kv0", B),),
            state=(dram("s0", 2 * B, 1), dram("s1", 3 * B, 3)),
            state_groups=(1,),
        ),
        r"state_groups \[1\] must be positive region counts summing to the 2 state regions",
    ),
    (
        "state group of none",
        lambda: Layout(
            kv=(dram("kv0", B),),
            state=(dram("s0", 2 * B, 1), dram("s1", 3 * B, 3)),
            state_groups=(2, 0),
        ),
        r"state_groups \[2, 0\] must be positive",
    ),
    (
        "mixed kinds",
        lambda: Layout(
            kv=(dram("kv0", B), Region("kv1", B, 256, 64, MemKind.VRAM, 0)),
        ),
        r"kv region 'kv1' is VRAM but 'kv0' is DRAM; all kv regions must share one memory kind",
    ),
    (
        "duplicate names",
        lambda: Layout(kv=(dram("kv0", B),), aux=(dram("kv0", 2 * B),)),
        r"region name 'kv0' is used twice",
    ),
    (
        "overlap",
        lambda: Layout(kv=(dram("kv0", B), dram("kv1", B + 128))),
        r"regions 'kv0' \[0x100000, 0x100100\) and 'kv1' \[0x100080, 0x100180\) overlap "
        r"\(DRAM device 0\)",
    ),
    (
        "nested across groups",
        lambda: Layout(kv=(dram("kv0", B, items=64),), aux=(dram("aux0", B + 1024, 1),)),
        r"regions 'kv0' .* and 'aux0' .* overlap",
    ),
    (
        "int32 pages",
        lambda: Layout(kv=(Region("kv0", GIB, 8 * 2**31, 8),)),
        r"kv: 1 regions x 2147483648 pages = 2147483648 descriptors do not fit int32",
    ),
    (
        "int32 descriptors",
        lambda: Layout(kv=(Region("kv0", 8, 8 * 2**30, 8), Region("kv1", 16 * GIB, 8 * 2**30, 8))),
        r"kv: 2 regions x 1073741824 pages = 2147483648 descriptors do not fit int32",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"),
    [pytest.param(build, msg, id=name) for name, build, msg in REGION_ERRORS + LAYOUT_ERRORS],
)
def test_validation_errors(build: Callable[[], object], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        build()


def test_adjacent_regions_are_not_an_overlap() -> None:
    layout = Layout(kv=(dram("kv0", B), dram("kv1", B + 256)), aux=(dram("aux0", B + 512),))
    assert len(layout.regions()) == 3


def test_layout_error_is_a_value_error() -> None:
    assert issubclass(LayoutError, ValueError)
    assert ALIGNMENT == 8


def test_mismatched_page_counts_from_tensors() -> None:
    kv = [*make_kv(PAGES)[:3], make_kv(PAGES // 2)[0]]
    with pytest.raises(LayoutError, match=r"kv region 'kv3' has 16 pages but 'kv0' has 32"):
        Layout.from_tensors(kv)


def test_non_contiguous_tensor() -> None:
    kv = make_kv()
    kv[2] = kv[2].transpose(1, 2)
    with pytest.raises(
        LayoutError, match=r"kv2: tensor is not contiguous \(shape \(32, 2, 16, 64\)"
    ):
        Layout.from_tensors(kv)
    with pytest.raises(LayoutError, match=r"aux0: tensor is not contiguous"):
        Layout.from_tensors(make_kv(), [make_aux()[0][:, ::2]])


def test_overlapping_tensors() -> None:
    """Two views of one buffer: each is contiguous, together they alias."""
    pool = torch.zeros(2 * PAGES, PAGE_BYTES, dtype=torch.uint8)
    kv = [pool[:PAGES], pool[PAGES // 2 : PAGES // 2 + PAGES]]
    with pytest.raises(LayoutError, match=r"regions 'kv0' .* and 'kv1' .* overlap"):
        Layout.from_tensors(kv)
    # The two halves, side by side, are fine.
    assert Layout.from_tensors([pool[:PAGES], pool[PAGES:]]).num_pages == PAGES


def test_misaligned_tensor() -> None:
    raw = torch.zeros(PAGES * 64 + 1, dtype=torch.uint8)
    shifted = raw[1:].view(PAGES, 64)  # contiguous, but starts one byte in
    assert shifted.is_contiguous()
    with pytest.raises(LayoutError, match=r"'kv0': addr 0x[0-9a-f]+ is not a multiple of 8"):
        Layout.from_tensors([shifted])
    with pytest.raises(LayoutError, match=r"'kv0': item_bytes 12 is not a multiple of 8"):
        Layout.from_tensors([torch.zeros(PAGES, 3, dtype=torch.float32)])


def test_tensor_shape_errors() -> None:
    with pytest.raises(LayoutError, match=r"kv0: pages count must be positive, got 0"):
        Layout.from_tensors([torch.zeros(0, 64, dtype=torch.uint8)])
    with pytest.raises(LayoutError, match=r"kv0: a 0-d tensor has no pages dimension"):
        Layout.from_tensors([torch.tensor(1.0)])
    with pytest.raises(LayoutError, match=r"kv0: 4096 bytes do not split into 3 equal pages"):
        Layout.from_tensors([torch.zeros(4096, dtype=torch.uint8)], num_pages=3)
    with pytest.raises(LayoutError, match=r"aux0: 512 bytes do not split into 3 equal rows"):
        Layout.from_tensors(make_kv(), [torch.zeros(512, dtype=torch.uint8)], aux_rows=3)
    with pytest.raises(LayoutError, match=r"kv0: tensor is on meta; only cpu and cuda"):
        Layout.from_tensors([torch.empty(4, 64, device="meta")])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([GIB, 2 * GIB], [512], [64]), r"kv: 2 pointers, 1 lengths and 1 item lengths"),
        (([GIB], [512], [64, 64]), r"kv: 1 pointers, 1 lengths and 2 item lengths"),
        (([GIB], [512], [64], [2 * GIB], [], [64]), r"aux: 1 pointers, 0 lengths and 1 item"),
        (
            ([GIB], [512], [64], [], [], [], [2 * GIB], [512], []),
            r"state: 1 pointers, 1 lengths and 0 item lengths",
        ),
        (([GIB], [512.0], [64]), r"kv0: length must be an int, got float"),
    ],
)
def test_pointer_list_errors(args: tuple[list[int], ...], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Layout.from_pointers(*args)


# -- page and row checks -----------------------------------------------------------------------


def test_check_pages_names_the_first_bad_index(layout: Layout) -> None:
    layout.check_pages(np.array([0, PAGES - 1], dtype=np.int32))
    layout.check_pages(np.array([], dtype=np.int32))
    with pytest.raises(LayoutError, match=r"^page index 40 out of range \[0, 32\)$"):
        layout.check_pages(np.array([3, 40, -1], dtype=np.int32))
    with pytest.raises(LayoutError, match=r"^page index -1 out of range \[0, 32\)$"):
        layout.check_pages(np.array([3, -1, 40], dtype=np.int32))
    with pytest.raises(LayoutError, match=r"^destination page index 32 out of range \[0, 32\)$"):
        layout.check_pages(np.array([32], dtype=np.int32), "destination page")
    with pytest.raises(LayoutError, match=r"page index -3 out of range"):
        layout.check_pages(np.array([-3], dtype=np.int8))
    with pytest.raises(LayoutError, match=r"page index 4294967296 out of range"):
        layout.check_pages(np.array([2**32], dtype=np.uint64))


def test_page_index_fails_closed(layout: Layout) -> None:
    with pytest.raises(LayoutError, match=r"page index 32 out of range \[0, 32\)"):
        layout.page_index(np.array([1, 32], dtype=np.int32))
    with pytest.raises(LayoutError, match=r"page indices must be integers, got dtype float64"):
        layout.page_index(np.array([1.0]))
    with pytest.raises(LayoutError, match=r"page indices must be a 1-D array, got shape \(1, 2\)"):
        layout.page_index(np.zeros((1, 2), dtype=np.int32))
    assert layout.page_index(np.array([], dtype=np.int32)).shape == (0,)


def test_check_row(layout: Layout) -> None:
    layout.check_row(0)
    layout.check_row(AUX_ROWS - 1)
    with pytest.raises(LayoutError, match=r"^aux row index 8 out of range \[0, 8\)$"):
        layout.check_row(AUX_ROWS)
    with pytest.raises(LayoutError, match=r"^destination aux row index -1 out of range"):
        layout.check_row(-1, "destination aux row")
    with pytest.raises(LayoutError, match=r"aux row index True out of range"):
        layout.check_row(True)
    with pytest.raises(LayoutError, match=r"aux row must be an int, got float"):
        layout.check_row(1.0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"aux row index 8 out of range"):
        layout.aux_index(AUX_ROWS)
    with pytest.raises(LayoutError, match=r"state row index 0 out of range \[0, 0\)"):
        layout.state_index(0)
    with pytest.raises(LayoutError, match=r"state row index 0 out of range \[0, 0\)"):
        layout.check_state_row(0)


def test_rows_without_aux(kv: list[torch.Tensor]) -> None:
    with pytest.raises(LayoutError, match=r"aux row index 0 out of range \[0, 0\)"):
        Layout.from_tensors(kv).aux_index(0)


# -- peers -------------------------------------------------------------------------------------


def test_compatible_with_equal_shape(layout: Layout) -> None:
    # The peer's pool is a different size, in other memory: still a well-formed WRITE target.
    remote = Layout.from_tensors(make_kv(PAGES * 2), make_aux(AUX_ROWS * 4))
    assert layout.compatible_with(remote.summary()) is None
    assert layout.compatible_with(remote) is None
    assert layout.compatible_with(layout.summary()) is None


def test_compatible_with_rejects_item_bytes(layout: Layout) -> None:
    kv = make_kv()
    kv[5] = torch.zeros(PAGES, PAGE_BYTES // 2, dtype=torch.uint8)
    remote = Layout.from_tensors(kv, make_aux())
    reason = layout.compatible_with(remote.summary())
    assert (
        reason
        == f"kv region 5 item_bytes differs: local {PAGE_BYTES} ('kv5'), remote {PAGE_BYTES // 2}"
    )

    aux = [torch.zeros(AUX_ROWS, 64, dtype=torch.uint8), make_aux()[0]]
    reason = layout.compatible_with(Layout.from_tensors(make_kv(), aux).summary())
    assert reason == f"aux region 0 item_bytes differs: local {AUX_ROW_BYTES} ('aux0'), remote 64"


def test_compatible_with_rejects_region_count(layout: Layout) -> None:
    remote = Layout.from_tensors(make_kv()[:-2], make_aux())
    assert layout.compatible_with(remote.summary()) == "kv region count differs: local 8, remote 6"
    remote = Layout.from_tensors(make_kv(), make_aux()[:1])
    assert layout.compatible_with(remote.summary()) == "aux region count differs: local 2, remote 1"
    remote = Layout.from_tensors(make_kv(), make_aux(), make_state())
    assert layout.compatible_with(remote) == "state region count differs: local 0, remote 3"


def test_summary_round_trips_through_msgpack() -> None:
    layout = Layout.from_tensors(make_kv(), make_aux(), make_state())
    summary = layout.summary()
    wire = msgspec.msgpack.encode(summary)
    decoded = msgspec.msgpack.decode(wire, type=LayoutSummary)
    assert decoded == summary
    assert decoded.to_layout() == layout  # default names kv0.., aux0.., state0..
    for mine, theirs in (
        (layout.kv_descs(), decoded.kv_descs()),
        (layout.aux_descs(), decoded.aux_descs()),
        (layout.state_descs(), decoded.state_descs()),
    ):
        assert theirs.dtype == np.uint64
        assert np.array_equal(mine, theirs)
    assert (decoded.num_pages, decoded.aux_rows, decoded.state_rows) == (
        PAGES,
        AUX_ROWS,
        STATE_ROWS,
    )
    assert decoded.page_bytes() == layout.page_bytes()
    assert decoded.aux_row_bytes() == layout.aux_row_bytes()
    assert decoded.state_row_bytes() == layout.state_row_bytes()
    pages = np.array([9, 4, 30], dtype=np.int32)
    assert np.array_equal(decoded.page_index(pages), layout.page_index(pages))
    assert np.array_equal(decoded.aux_index(5), layout.aux_index(5))
    assert np.array_equal(decoded.state_index(2), layout.state_index(2))


def test_select_kv_keeps_the_chosen_buffers_in_the_order_asked() -> None:
    """A pipeline stage pairs its buffers with some of decode's, in its own order."""
    summary = Layout.from_tensors(make_kv(), make_aux(), make_state()).summary()
    assert len(summary.kv) >= 3
    picked = summary.select_kv([2, 0])
    assert picked.kv == (summary.kv[2], summary.kv[0])
    assert (picked.aux, picked.state) == (summary.aux, summary.state)
    assert picked.num_pages == summary.num_pages
    assert np.array_equal(
        picked.kv_descs()[: summary.num_pages],
        summary.kv_descs()[2 * summary.num_pages : 3 * summary.num_pages],
    )
    with pytest.raises(LayoutError, match="out of range"):
        summary.select_kv([len(summary.kv)])
    with pytest.raises(LayoutError, match="selected twice"):
        summary.select_kv([1, 1])


def test_summary_carries_kinds_devices_and_high_addresses() -> None:
    """VRAM kv on device 7 at a top-of-address-space pointer (> 2**63), DRAM aux."""
    top = 2**64 - 2 * GIB
    layout = Layout.from_pointers(
        [top], [PAGES * PAGE_BYTES], [PAGE_BYTES], [GIB], [4096], [512], kind=MemKind.VRAM, device=7
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(layout.summary()), type=LayoutSummary)
    assert (decoded.kv_kind, decoded.aux_kind) == (MemKind.VRAM, MemKind.DRAM)
    assert decoded.kv[0] == (top, PAGES * PAGE_BYTES, PAGE_BYTES, 7)
    assert decoded.kv_descs()[-1].tolist() == [top + (PAGES - 1) * PAGE_BYTES, PAGE_BYTES, 7]
    assert decoded.to_layout() == layout
    assert msgspec.json.decode(msgspec.json.encode(decoded), type=LayoutSummary) == decoded


def test_summary_wire_form_is_plain() -> None:
    layout = Layout.from_pointers([GIB], [256], [64], [2 * GIB], [128], [64])
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(layout.summary()))
    assert plain == {
        "kv": [[GIB, 256, 64, 0]],
        "aux": [[2 * GIB, 128, 64, 0]],
        "state": [],
        "kv_kind": "DRAM",
        "aux_kind": "DRAM",
        "state_kind": "DRAM",
        "state_groups": [],
    }


def hostile(**fields: object) -> bytes:
    base: dict[str, object] = {"kv": [[GIB, 256, 64, 0]], "aux": [[2 * GIB, 128, 64, 0]]}
    return msgspec.msgpack.encode({**base, **fields})


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (hostile(kv=[[GIB, 250, 64, 0]]), r"'kv0': nbytes 250 is not a multiple of item_bytes 64"),
        (hostile(kv=[]), r"at least one kv region"),
        (hostile(kv=[[GIB, 256, 64, 0], [GIB + 64, 256, 64, 0]]), r"'kv0' .* and 'kv1' .* overlap"),
        (hostile(aux=[[2 * GIB, 128, 64, 0], [3 * GIB, 64, 64, 0]]), r"'aux1' has 1 rows"),
        (hostile(kv=[[0, 256, 64, 0]]), r"'kv0': addr must be > 0"),
        (hostile(kv=[[GIB, 256, 64, 1]]), r"DRAM regions use device 0"),
        (hostile(kv=[[GIB, 256, 64]]), r"Expected `array` of length 4"),
        (hostile(kv=[[GIB, 256.0, 64, 0]]), r"Expected `int`, got `float`"),
        (hostile(kv=[[-GIB, 256, 64, 0]]), r"'kv0': addr must be > 0"),
        (hostile(kv_kind="HBM"), r"Invalid enum value 'HBM'"),
        (hostile(extra=1), r"unknown field `extra`"),
    ],
)
def test_hostile_summary_fails_decode(wire: bytes, message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(wire, type=LayoutSummary)


def test_summary_built_in_python_is_validated() -> None:
    with pytest.raises(LayoutError, match=r"'kv0': nbytes 100 is not a multiple of item_bytes 64"):
        LayoutSummary(kv=((GIB, 100, 64, 0),))
    with pytest.raises(LayoutError, match=r"kv0: expected \(addr, nbytes, item_bytes, device\)"):
        LayoutSummary(kv=((GIB, 256, 64),))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"kv must be a tuple of region specs"):
        LayoutSummary(kv=[(GIB, 256, 64, 0)])  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"'kv0': kind must be a MemKind"):
        LayoutSummary(kv=((GIB, 256, 64, 0),), kv_kind="DRAM")  # type: ignore[arg-type]


# -- property: page_index maps back to (buffer, page) ------------------------------------------


@st.composite
def layouts_and_pages(draw: st.DrawFn) -> tuple[Layout, list[int]]:
    n_buffers = draw(st.integers(1, 12))
    num_pages = draw(st.integers(1, 300))
    items = draw(st.lists(st.integers(1, 64), min_size=n_buffers, max_size=n_buffers))
    gaps = draw(st.lists(st.integers(0, 8), min_size=n_buffers, max_size=n_buffers))
    device = draw(st.integers(0, 3))
    ptrs, addr = [], 1 << 30
    for item, gap in zip(items, gaps, strict=True):
        ptrs.append(addr)
        addr += num_pages * item * ALIGNMENT + gap * ALIGNMENT
    order = draw(st.permutations(range(n_buffers)))  # buffers need not be in address order
    layout = Layout.from_pointers(
        [ptrs[i] for i in order],
        [num_pages * items[i] * ALIGNMENT for i in order],
        [items[i] * ALIGNMENT for i in order],
        kind=MemKind.VRAM,
        device=device,
    )
    pages = draw(st.lists(st.integers(0, num_pages - 1), max_size=2 * num_pages))
    return layout, pages


@settings(max_examples=200, deadline=None)
@given(layouts_and_pages())
def test_page_index_maps_back_to_buffer_and_page(case: tuple[Layout, list[int]]) -> None:
    layout, pages = case
    descs = layout.kv_descs()
    index = layout.page_index(np.array(pages, dtype=np.int32))
    n = layout.num_pages
    assert index.dtype == np.int32
    assert index.shape == (len(layout.kv) * len(pages),)
    assert ((index >= 0) & (index < len(descs))).all()
    assert index.tolist() == naive_page_index(len(layout.kv), n, pages)
    for k, i in enumerate(index.tolist()):
        b, p = divmod(i, n)
        assert (b, p) == (k // len(pages), pages[k % len(pages)])
        region = layout.kv[b]
        assert descs[i].tolist() == [
            region.addr + p * region.item_bytes,
            region.item_bytes,
            region.device,
        ]
    assert np.array_equal(layout.summary().page_index(np.array(pages, dtype=np.int64)), index)


def test_from_tensors_keeps_its_buffers_alive() -> None:
    # A layout holds addresses; freed buffers under a registered agent would make every
    # transfer fail (NIXL says "remote disconnect"), so from_tensors keeps them referenced.
    import gc
    import weakref

    kv = torch.zeros((4, 64), dtype=torch.uint8)
    ref = weakref.ref(kv)
    layout = Layout.from_tensors([kv])
    del kv
    gc.collect()
    assert ref() is not None
    assert layout == Layout.from_tensors([ref()])  # keepalive does not take part in equality


# -- several state types ----------------------------------------------------------------------


def hybrid_state() -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Three state types, as a hybrid model's pools are sized apart: a Mamba-like type of two
    pools (conv and temporal) with 5 slots of different item sizes, an SWA-like type of one
    pool with 7 pages, and a type whose two pools differ in item count (3 and 4 rows)."""
    mamba = [torch.randn(5, 16), torch.randn(5, 48)]
    swa = [torch.randn(7, 8)]
    ragged = [torch.randn(3, 2), torch.randn(4, 6)]
    return [*mamba, *swa, *ragged], (2, 1, 2)


def test_state_types_get_rows_one_after_another() -> None:
    state, groups = hybrid_state()
    layout = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=groups)
    assert layout.state_groups == groups
    assert layout.state_rows == 5 + 7 + 3  # the ragged type is bounded by its smaller pool
    assert [layout.state_type_of(r) for r in (0, 4, 5, 11, 12, 14)] == [0, 0, 1, 1, 2, 2]
    assert layout.state_row_bytes(0) == (16 + 48) * 4
    assert layout.state_row_bytes(5) == 8 * 4
    assert layout.state_row_bytes(12) == (2 + 6) * 4
    assert layout.state_bytes(np.array([0, 5, 12], np.int32)) == (64 + 8 + 8) * 4
    with pytest.raises(LayoutError, match=r"state row index 15 out of range \[0, 15\)"):
        layout.state_type_of(15)


def test_a_state_row_indexes_each_pool_of_its_type() -> None:
    state, groups = hybrid_state()
    layout = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=groups)
    descs = layout.state_descs()
    assert len(descs) == 5 + 5 + 7 + 3 + 4  # every item of every pool, pool after pool
    for row, pools in [(3, [(0, 3), (1, 3)]), (5 + 6, [(2, 6)]), (12 + 2, [(3, 2), (4, 2)])]:
        got = [read(descs[i]) for i in layout.state_index(row)]
        assert got == [tensor_bytes(state[p][item]) for p, item in pools]
    assert layout.state_index(0).dtype == np.int32


def test_one_state_type_needs_no_groups() -> None:
    state = make_state()
    plain = Layout.from_tensors(make_kv(), make_aux(), state)
    named = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=(3,))
    assert plain.state_groups == named.state_groups == (3,)
    assert plain.state_descs().tolist() == named.state_descs().tolist()
    assert plain.summary().state_groups == ()  # the wire says nothing of one type


def test_state_groups_travel_in_the_summary() -> None:
    state, groups = hybrid_state()
    layout = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=groups)
    wire = msgspec.msgpack.encode(layout.summary())
    summary = msgspec.msgpack.decode(wire, type=LayoutSummary)
    assert summary.state_groups == groups
    assert summary.state_rows == layout.state_rows
    assert summary.state_descs().tolist() == layout.state_descs().tolist()
    assert [summary.state_index(r).tolist() for r in range(15)] == [
        layout.state_index(r).tolist() for r in range(15)
    ]
    assert layout.compatible_with(summary) is None


def test_compatible_with_rejects_state_types_split_otherwise() -> None:
    state = [torch.randn(4, 8) for _ in range(3)]
    mine = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=(1, 2))
    theirs = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=(2, 1))
    assert mine.compatible_with(theirs.summary()) == (
        "state types differ: regions per type local [1, 2], remote [2, 1]"
    )
    assert mine.compatible_with(mine.summary()) is None


def test_hostile_state_groups_are_refused_on_decode() -> None:
    state, groups = hybrid_state()
    layout = Layout.from_tensors(make_kv(), make_aux(), state, state_groups=groups)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(layout.summary()))
    for bad in ([2, 1], [2, 1, 2, 1], [0, 5], [-1, 6]):
        wire = msgspec.msgpack.encode({**plain, "state_groups": bad})
        with pytest.raises((LayoutError, msgspec.ValidationError), match="state_groups"):
            msgspec.msgpack.decode(wire, type=LayoutSummary)
