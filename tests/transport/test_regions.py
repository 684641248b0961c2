"""``_regions`` directly: a region is validated on its own, a group as a whole (equal item
counts and sizes, int32 indices), overlaps within one memory space are refused, and the two
constructors (torch tensors, raw pointers) name what is wrong."""

from __future__ import annotations

import pytest
import torch

from kvfsm.transport._geometry import LayoutError
from kvfsm.transport._regions import (
    MemKind,
    Region,
    _check_group,
    _check_overlap,
    _regions_from_pointers,
    _regions_from_tensors,
)


def test_a_region_knows_its_items_and_end() -> None:
    region = Region("kv0", 0x1000, 4096, 1024)
    assert (region.items, region.end, region.kind) == (4, 0x2000, MemKind.DRAM)
    assert region.spec() == (0x1000, 4096, 1024, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("kv0", 0x1000, 4096, 1000), "multiple"),
        (("kv0", 0x1001, 4096, 1024), "aligned|multiple"),
        (("kv0", 0x1000, 0, 1024), "positive|at least|> 0"),
    ],
)
def test_a_malformed_region_is_refused(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Region(*args)  # type: ignore[arg-type]


def test_a_group_must_have_equal_item_counts() -> None:
    ok = (Region("kv0", 0x1000, 4096, 1024), Region("kv1", 0x3000, 8192, 2048))
    _check_group("kv", ok)  # 4 pages each, sizes may differ per buffer
    bad = (Region("kv0", 0x1000, 4096, 1024), Region("kv1", 0x3000, 4096, 2048))
    with pytest.raises(LayoutError, match="kv"):
        _check_group("kv", bad)


def test_overlap_is_refused_within_one_memory_space_only() -> None:
    a, b = Region("kv0", 0x1000, 4096, 1024), Region("kv1", 0x1800, 4096, 1024)
    with pytest.raises(LayoutError, match="overlap"):
        _check_overlap((a, b))
    other_gpu = Region("kv1", 0x1800, 4096, 1024, MemKind.VRAM, 1)
    _check_overlap((a, other_gpu))


def test_regions_from_tensors_name_the_bad_one() -> None:
    good = torch.zeros(4, 256, dtype=torch.uint8)
    (region,) = _regions_from_tensors("kv", [good], None)
    assert (region.name, region.items, region.item_bytes) == ("kv0", 4, 256)
    with pytest.raises(LayoutError, match="kv1: tensor is not contiguous"):
        _regions_from_tensors("kv", [good, torch.zeros(8, 8, dtype=torch.uint8).t()], None)
    with pytest.raises(LayoutError, match="do not split into 3 equal pages"):
        _regions_from_tensors("kv", [good], 3)


def test_regions_from_pointers_want_one_of_each_per_buffer() -> None:
    (region,) = _regions_from_pointers("aux", [0x1000], [512], [64], MemKind.DRAM, 0)
    assert (region.name, region.items) == ("aux0", 8)
    with pytest.raises(LayoutError, match="need exactly one of each"):
        _regions_from_pointers("aux", [0x1000], [512, 512], [64], MemKind.DRAM, 0)
    with pytest.raises(LayoutError, match="pointer must be an int"):
        _regions_from_pointers("aux", [4096.0], [512], [64], MemKind.DRAM, 0)  # type: ignore[list-item]
