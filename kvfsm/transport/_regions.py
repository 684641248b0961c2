"""Regions: the buffers one rank registers with NIXL, each validated on its own and as a group,
and built from torch tensors or raw pointers (the two ways a caller describes its memory).

A region is one contiguous buffer of ``items`` equal items (pages or rows) of ``item_bytes``;
``_layout`` assembles them into a ``Layout`` and ``_geometry`` turns them into descriptor rows.
The rules each region and group must meet are in ``_layout``'s module docstring.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvfsm.transport._geometry import INT32_MAX, Group, LayoutError, RegionSpec

if TYPE_CHECKING:
    import torch

__all__ = ["ADDRESS_LIMIT", "ALIGNMENT", "MemKind", "Region"]

#: Descriptor addresses are uint64; a region must end at or below this.
ADDRESS_LIMIT: Final = 2**64
#: ``addr`` and ``item_bytes`` must be multiples of this (a sanity check, see the module docstring).
ALIGNMENT: Final = 8

_UNIT: Final[dict[str, str]] = {"kv": "pages", "aux": "rows", "state": "rows"}


class MemKind(enum.Enum):
    """NIXL memory type of a region. The value is NIXL's ``mem_type`` string."""

    DRAM = "DRAM"
    VRAM = "VRAM"


def _require_int(owner: str, field: str, value: object) -> int:
    # Region fields are compared, summed and put into uint64 arrays; a float or a bool there is a
    # caller's bug that would otherwise surface as a numpy casting error far from its cause.
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{owner}: {field} must be an int, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous buffer, registered once with NIXL.

    Intrinsic checks (positive sizes, whole items, alignment, device) run at construction;
    relations between regions are checked by ``Layout``.
    """

    name: str  # e.g. "kv3", "aux0", "state0"; appears in every error message about the region
    addr: int  # base address (> 0)
    nbytes: int  # total length (> 0)
    item_bytes: int  # bytes per page (kv) or per row (aux/state); nbytes is a multiple of it
    kind: MemKind = MemKind.DRAM
    device: int = 0  # CUDA device id for VRAM, 0 for DRAM

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"region name must be a non-empty str, got {self.name!r}")
        who = f"region {self.name!r}"
        addr = _require_int(who, "addr", self.addr)
        nbytes = _require_int(who, "nbytes", self.nbytes)
        item = _require_int(who, "item_bytes", self.item_bytes)
        device = _require_int(who, "device", self.device)
        if not isinstance(self.kind, MemKind):
            raise LayoutError(f"{who}: kind must be a MemKind, got {self.kind!r}")
        if addr <= 0:
            raise LayoutError(f"{who}: addr must be > 0, got {addr}")
        if nbytes <= 0:
            raise LayoutError(f"{who}: nbytes must be > 0, got {nbytes} (empty buffer?)")
        if item <= 0:
            raise LayoutError(f"{who}: item_bytes must be > 0, got {item}")
        if nbytes % item:
            raise LayoutError(
                f"{who}: nbytes {nbytes} is not a multiple of item_bytes {item} "
                f"({nbytes // item} whole items and {nbytes % item} bytes left over)"
            )
        if addr + nbytes > ADDRESS_LIMIT:
            raise LayoutError(f"{who}: [{addr:#x}, +{nbytes}) runs past the 64-bit address space")
        for name, value, shown in (("addr", addr, f"{addr:#x}"), ("item_bytes", item, item)):
            if value % ALIGNMENT:
                raise LayoutError(
                    f"{who}: {name} {shown} is not a multiple of {ALIGNMENT}; a misaligned "
                    "value usually means elements were passed for bytes, or a pointer into the "
                    "middle of a view"
                )
        if self.kind is MemKind.DRAM and device != 0:
            raise LayoutError(f"{who}: DRAM regions use device 0, got device {device}")
        if device < 0:
            raise LayoutError(f"{who}: device must be >= 0, got {device}")

    @property
    def items(self) -> int:
        """Pages (kv) or rows (aux/state) in this region."""
        return self.nbytes // self.item_bytes

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.addr + self.nbytes

    def spec(self) -> RegionSpec:
        """The wire form: ``(addr, nbytes, item_bytes, device)``."""
        return (self.addr, self.nbytes, self.item_bytes, self.device)


def _check_group(group: Group, regions: tuple[Region, ...]) -> None:
    if not regions:
        return
    unit = _UNIT[group]
    first = regions[0]
    for r in regions[1:]:
        # State regions may hold different row counts: a model's state pools are sized apart
        # (``_geometry.state_plan`` bounds each state type's rows by its smallest region).
        if group != "state" and r.items != first.items:
            raise LayoutError(
                f"{group} region {r.name!r} has {r.items} {unit} but {first.name!r} has "
                f"{first.items}; every {group} region must hold the same number of {unit}"
            )
        if r.kind is not first.kind:
            # One group is one prepped NIXL list, and a list has a single mem_type.
            raise LayoutError(
                f"{group} region {r.name!r} is {r.kind.value} but {first.name!r} is "
                f"{first.kind.value}; all {group} regions must share one memory kind"
            )
    total = sum(r.items for r in regions)
    if total > INT32_MAX:
        sizes = (
            f"x {first.items} {unit}"
            if total == len(regions) * first.items
            else f"of {', '.join(str(r.items) for r in regions)} {unit}"
        )
        raise LayoutError(
            f"{group}: {len(regions)} regions {sizes} = {total} descriptors do not fit int32 "
            "indices"
        )


def _check_overlap(regions: tuple[Region, ...]) -> None:
    spaces: dict[tuple[MemKind, int], list[Region]] = {}
    for r in regions:
        spaces.setdefault((r.kind, r.device), []).append(r)
    for (kind, device), space in spaces.items():
        space.sort(key=lambda r: r.addr)
        # Sorted by start, any overlap shows up between neighbours: if a overlaps a later c,
        # every region starting between them starts before a ends, so it overlaps a too.
        for a, b in itertools.pairwise(space):
            if b.addr < a.end:
                raise LayoutError(
                    f"regions {a.name!r} [{a.addr:#x}, {a.end:#x}) and {b.name!r} "
                    f"[{b.addr:#x}, {b.end:#x}) overlap ({kind.value} device {device}); each "
                    "region must be its own memory, or a write to one lands in the other"
                )


def _regions_from_tensors(
    group: Group, tensors: Sequence[torch.Tensor], count: int | None
) -> tuple[Region, ...]:
    unit = _UNIT[group]
    regions = []
    for i, t in enumerate(tensors):
        name = f"{group}{i}"
        if not t.is_contiguous():
            raise LayoutError(
                f"{name}: tensor is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                "NIXL registers the byte range [data_ptr, data_ptr + nbytes), so pass the "
                "contiguous buffer itself, not a strided view of it"
            )
        if t.device.type == "cpu":
            kind, device = MemKind.DRAM, 0
        elif t.device.type == "cuda":
            kind, device = MemKind.VRAM, t.get_device()
        else:
            raise LayoutError(f"{name}: tensor is on {t.device}; only cpu and cuda tensors work")
        nbytes = t.numel() * t.element_size()
        if count is not None:
            n = count
        elif t.dim() == 0:
            raise LayoutError(f"{name}: a 0-d tensor has no {unit} dimension; pass the count")
        else:
            n = t.shape[0]
        if n <= 0:
            raise LayoutError(f"{name}: {unit} count must be positive, got {n} (empty tensor?)")
        if nbytes % n:
            raise LayoutError(f"{name}: {nbytes} bytes do not split into {n} equal {unit}")
        regions.append(Region(name, t.data_ptr(), nbytes, nbytes // n, kind, device))
    return tuple(regions)


def _regions_from_pointers(  # noqa: PLR0917 - private; one call per group
    group: Group,
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    kind: MemKind,
    device: int,
) -> tuple[Region, ...]:
    if not len(ptrs) == len(lens) == len(item_lens):
        raise LayoutError(
            f"{group}: {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
            "lengths; need exactly one of each per buffer"
        )

    def as_int(name: str, field: str, value: int) -> int:
        # SGLang hands Python ints and numpy integers are common in callers; floats are a bug.
        try:
            return operator.index(value)
        except TypeError:
            raise LayoutError(
                f"{name}: {field} must be an int, got {type(value).__name__} {value!r}"
            ) from None

    return tuple(
        Region(
            f"{group}{i}",
            as_int(f"{group}{i}", "pointer", p),
            as_int(f"{group}{i}", "length", n),
            as_int(f"{group}{i}", "item length", item),
            kind,
            device,
        )
        for i, (p, n, item) in enumerate(zip(ptrs, lens, item_lens, strict=True))
    )
