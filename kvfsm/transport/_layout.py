"""The memory one rank exposes for KV transfer: typed, validated, turned into NIXL descriptors.

Pure: no NIXL calls, no threads, no IO. The transport registers ``Layout.regions()`` with NIXL,
preps one descriptor list per group from ``kv_descs()``/``aux_descs()``/``state_descs()`` (once per
peer, for its own layout and for the peer's ``LayoutSummary``), and per chunk hands
``make_prepped_xfer`` the int32 indices that ``page_index()``/``aux_index()``/``state_index()``
compute, on both sides.

Regions are few and large
-------------------------

A *region* is one contiguous buffer: a whole per-layer K or V buffer (one per layer for MLA), an
aux buffer (SGLang's metadata rows), a state buffer (hybrid models). Each is registered with NIXL
once. Registering per page instead would mean thousands of registrations (each pins memory and
enters NIXL's region lookup) and would cut the address space into pieces NIXL never merges back.
The page structure lives in the *descriptors* instead: a region of ``items`` equal items of
``item_bytes`` yields ``items`` descriptor rows ``(addr + i * item_bytes, item_bytes, device)``.

The descriptor-index convention
-------------------------------

Regions come in three groups (kv, aux, state); each group is one descriptor array and so one
prepped NIXL list. Inside a group every region has the same number of items, and rows are
**buffer-major**: row ``b * items + i`` is item ``i`` of region ``b``. Moving pages ``P`` across all
kv buffers is therefore the index array ``[b * num_pages + p for b in range(len(kv)) for p in P]``,
built with numpy, never a Python loop over pages. The sender computes it for the source pages on
its own layout and for the destination pages on the receiver's summary; NIXL pairs the two arrays
element by element. Buffer-major matters for bandwidth: pages ``p, p+1`` of one buffer get
consecutive indices *and* adjacent addresses, which is when ``make_prepped_xfer`` merges
descriptors (measured: 8.2 vs 1.2 GB/s for 4 KiB pages, NIXL's UCX backend, DRAM). Sorting a
chunk's (source, destination) pairs jointly by page id is the caller's job; this module keeps the
order it is given.

Indices travel as int32 (NIXL ``memcpy``-s int32 numpy arrays and converts anything else element
by element), so every group must have at most 2**31 - 1 descriptor rows.

Validation (every failure is a ``LayoutError`` naming the region)
-----------------------------------------------------------------

* at least one kv region; names unique; ``addr > 0``, ``nbytes > 0``, ``item_bytes > 0``,
  ``nbytes % item_bytes == 0``, and the region ends inside the 64-bit address space;
* ``addr`` and ``item_bytes`` are multiples of 8, for DRAM **and** VRAM. NIXL itself does not ask
  for alignment; this is a sanity check. Real items are far larger and always 8-aligned (a KV page
  is ``page_tokens * heads * head_dim * dtype_bytes``; SGLang pads aux rows to 64 bytes or more;
  allocators hand out 64- to 512-byte aligned blocks), so a misaligned value almost always means a
  unit mix-up (elements for bytes) or a pointer into the middle of a view. That reasoning does not
  depend on the memory kind, so neither does the rule;
* one memory kind per group: NIXL preps a list with a single ``mem_type`` (SGLang's NIXL backend
  refuses mixed KV kinds too). Groups may differ: SGLang keeps KV and state in VRAM and aux rows
  in DRAM. DRAM regions use device 0 (what NIXL uses for host memory);
* every region of a group has the same number of items;
* no two regions of the same kind and device overlap: overlapping registrations alias, so a WRITE
  into one buffer's page would also land in another's.

The wire form
-------------

``Layout.summary()`` is what a peer needs to WRITE into this rank: a ``LayoutSummary`` of plain
integers (per region ``(addr, nbytes, item_bytes, device)``, one memory kind per group; names stay
local) that round-trips through ``msgspec.msgpack``. A summary is validated when it is built,
decoded ones included (msgspec runs ``__post_init__`` and reports its ``LayoutError`` as a
``msgspec.ValidationError``), by the same rules as a ``Layout``. So a hostile summary never gets
as far as a descriptor list, and the per-chunk methods on a summary (``check_pages``,
``page_index``, ``check_row``, ``aux_index``, ...) can stay as cheap as the ``Layout`` ones, which
run the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import msgspec

from kvfsm.transport._geometry import (
    Descs,
    Geometry,
    Group,
    Indices,
    LayoutError,
    RegionSpec,
    StateKind,
    _items,
    state_groups,
    state_plan,
)
from kvfsm.transport._regions import (
    ALIGNMENT,
    MemKind,
    Region,
    _check_group,
    _check_overlap,
    _regions_from_pointers,
    _regions_from_tensors,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGNMENT",
    "Descs",
    "Indices",
    "Layout",
    "LayoutError",
    "LayoutSummary",
    "MemKind",
    "Region",
    "RegionSpec",
]


def _rows(kinds: tuple[StateKind, ...]) -> int:
    return kinds[-1].first_row + kinds[-1].rows if kinds else 0


def _groups_mismatch(mine: tuple[int, ...], theirs: tuple[int, ...], regions: int) -> str | None:
    # Equal region lists could still split into other types: row r would then be another
    # type's row on each side.
    theirs = state_groups(theirs, regions)
    if mine != theirs:
        return f"state types differ: regions per type local {list(mine)}, remote {list(theirs)}"
    return None


def _count_mismatch(
    group: Group, mine: tuple[Region, ...], theirs: Sequence[RegionSpec]
) -> str | None:
    if len(mine) != len(theirs):
        return f"{group} region count differs: local {len(mine)}, remote {len(theirs)}"
    return None


def _mismatch(group: Group, mine: tuple[Region, ...], theirs: Sequence[RegionSpec]) -> str | None:
    counts = _count_mismatch(group, mine, theirs)
    if counts is not None:
        return counts
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a.item_bytes != b[2]:
            return (
                f"{group} region {i} item_bytes differs: local {a.item_bytes} ({a.name!r}), "
                f"remote {b[2]}"
            )
    return None


@dataclass(frozen=True, slots=True)
class Layout(Geometry):
    """Every region one rank exposes for KV transfer, validated as a whole.

    ``kv``: per-layer K and V buffers (or one per layer for MLA), all with ``num_pages`` pages.
    ``aux``: SGLang's per-request metadata buffers, all with ``aux_rows`` rows.
    ``state``: optional per-request state buffers (hybrid models), grouped by state type:
    ``state_groups`` counts each type's regions, in order (empty: one type). A type's regions
    may differ in item size and count; row ``r`` of a type moves item ``r`` of each of them.
    The layout's state rows are its types' rows one after another (``state_type_of``).
    Any sequence is accepted for a group and stored as a tuple.

    ``keepalive``: objects that own the memory (tensors, arrays). A layout only holds addresses;
    if the buffers were freed while an agent still has them registered, every transfer would
    fail (NIXL reports it as a remote disconnect). :meth:`from_tensors` fills it in; callers who
    build regions from raw pointers keep their buffers alive themselves. Not compared.
    """

    kv: tuple[Region, ...]
    aux: tuple[Region, ...] = ()
    state: tuple[Region, ...] = ()
    keepalive: tuple[object, ...] = field(default=(), compare=False, repr=False)
    state_groups: tuple[int, ...] = ()
    #: Bytes per page and aux row (summed over each group's regions): read per chunk, and a
    #: model's 2 x layers kv regions make the sum microseconds (4.5 us for 64).
    _row_bytes: tuple[int, int] = field(init=False, compare=False, repr=False)
    _kinds: tuple[StateKind, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        groups: tuple[tuple[Group, object], ...] = (
            ("kv", self.kv),
            ("aux", self.aux),
            ("state", self.state),
        )
        for group, regions in groups:
            if isinstance(regions, Region | str | bytes) or not isinstance(regions, Sequence):
                raise LayoutError(f"{group} must be a sequence of Region, got {regions!r}")
            for r in regions:
                if not isinstance(r, Region):
                    raise LayoutError(f"{group} must hold Region objects, got {r!r}")
            # Frozen, so assign through object; tuples keep the layout hashable and immutable.
            object.__setattr__(self, group, tuple(regions))
        if not self.kv:
            raise LayoutError("a layout needs at least one kv region")
        seen: set[str] = set()
        for r in self.regions():
            if r.name in seen:
                raise LayoutError(f"region name {r.name!r} is used twice; names must be unique")
            seen.add(r.name)
        _check_group("kv", self.kv)
        _check_group("aux", self.aux)
        _check_group("state", self.state)
        _check_overlap(self.regions())
        counts = state_groups(self.state_groups, len(self.state))
        object.__setattr__(self, "state_groups", counts)
        object.__setattr__(self, "_kinds", state_plan(tuple(r.spec() for r in self.state), counts))
        # Geometry's own sums, once: the one formula, not a second copy of it.
        object.__setattr__(
            self, "_row_bytes", (Geometry.page_bytes(self), Geometry.aux_row_bytes(self))
        )

    # -- shape ---------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages in every kv region."""
        return self.kv[0].items

    @property
    def aux_rows(self) -> int:
        """Rows in every aux region (0 without aux regions)."""
        return self.aux[0].items if self.aux else 0

    @property
    def state_rows(self) -> int:
        """State rows over every state type (0 without state regions)."""
        return _rows(self._kinds)

    @property
    def kv_kind(self) -> MemKind:
        return self.kv[0].kind

    @property
    def aux_kind(self) -> MemKind:
        """Memory kind of the aux regions (DRAM when there are none)."""
        return self.aux[0].kind if self.aux else MemKind.DRAM

    @property
    def state_kind(self) -> MemKind:
        """Memory kind of the state regions (DRAM when there are none)."""
        return self.state[0].kind if self.state else MemKind.DRAM

    def regions(self) -> tuple[Region, ...]:
        """Every region, kv then aux then state: what the transport registers with NIXL."""
        return self.kv + self.aux + self.state

    # -- sizes (cached: Geometry's sums, computed once) ----------------------------------------

    def page_bytes(self) -> int:
        """Bytes moved per page, summed over the kv regions."""
        return self._row_bytes[0]

    def aux_row_bytes(self) -> int:
        """Bytes moved per aux row, summed over the aux regions."""
        return self._row_bytes[1]

    def _state_kinds(self) -> tuple[StateKind, ...]:
        return self._kinds

    # -- descriptors ---------------------------------------------------------------------------

    def kv_specs(self) -> tuple[RegionSpec, ...]:
        """The KV regions as a peer's summary lists them."""
        return tuple(r.spec() for r in self.kv)

    def state_specs(self) -> tuple[RegionSpec, ...]:
        """The state regions as a peer's summary lists them."""
        return tuple(r.spec() for r in self.state)

    def _shape(self, group: Group) -> tuple[int, int]:
        if group == "kv":
            return len(self.kv), self.kv[0].items
        regions = self.aux if group == "aux" else self.state
        return len(regions), regions[0].items if regions else 0

    def _specs(self, group: Group) -> Sequence[RegionSpec]:
        regions = self.kv if group == "kv" else self.aux if group == "aux" else self.state
        return [r.spec() for r in regions]

    # -- peers ---------------------------------------------------------------------------------

    def summary(self) -> LayoutSummary:
        """What travels to a peer so that it can WRITE into this rank."""
        return LayoutSummary(
            kv=tuple(r.spec() for r in self.kv),
            aux=tuple(r.spec() for r in self.aux),
            state=tuple(r.spec() for r in self.state),
            state_groups=self.state_groups if len(self.state_groups) > 1 else (),
            kv_kind=self.kv_kind,
            aux_kind=self.aux_kind,
            state_kind=self.state_kind,
        )

    def compatible_with(
        self, remote: LayoutSummary | Layout, *, sliced: bool = False, state_sliced: bool = False
    ) -> str | None:
        """``None`` if a WRITE from this layout into ``remote`` is well-formed, else the reason.

        Well-formed: each group has as many regions on both sides, with pairwise equal
        ``item_bytes``, so a page (row) lands on a page (row) byte for byte. Page and row
        *counts* may differ (each side sizes its own pool), and so may memory kinds (NIXL moves
        DRAM to VRAM and back). ``sliced`` (unequal attention TP: a head slice of each KV page
        moves): KV item sizes may differ, as each side holds its own heads; the slice's own
        geometry is checked against both (``_slices.sliced_descs``). ``state_sliced``: the
        same for state items (``_state_slices``): each side holds its own shard of the state,
        and only the region counts must agree.
        """
        if isinstance(remote, Layout):
            remote = remote.summary()
        if sliced and len(self.kv) != len(remote.kv):
            return f"kv region count differs: local {len(self.kv)}, remote {len(remote.kv)}"
        return (
            (None if sliced else _mismatch("kv", self.kv, remote.kv))
            or _mismatch("aux", self.aux, remote.aux)
            or (
                _count_mismatch("state", self.state, remote.state)
                if state_sliced
                else _mismatch("state", self.state, remote.state)
            )
            or _groups_mismatch(self.state_groups, remote.state_groups, len(remote.state))
        )

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_tensors(
        cls,
        kv: Sequence[torch.Tensor],
        aux: Sequence[torch.Tensor] = (),
        state: Sequence[torch.Tensor] = (),
        *,
        num_pages: int | None = None,
        aux_rows: int | None = None,
        state_rows: int | None = None,
        state_groups: Sequence[int] = (),
    ) -> Layout:
        """A layout over contiguous CPU (DRAM) or CUDA (VRAM, that device) tensors, named
        kv0.., aux0.., state0.. in order.

        By default ``shape[0]`` is the page (row) count and ``item_bytes = nbytes // shape[0]``;
        pass ``num_pages`` / ``aux_rows`` / ``state_rows`` when it is not (``nbytes`` must then
        divide evenly by it).
        """
        return cls(
            kv=_regions_from_tensors("kv", kv, num_pages),
            aux=_regions_from_tensors("aux", aux, aux_rows),
            state=_regions_from_tensors("state", state, state_rows),
            keepalive=(*kv, *aux, *state),
            state_groups=tuple(state_groups),
        )

    @classmethod
    def from_pointers(  # noqa: PLR0917 - positional on purpose: it mirrors SGLang's KVArgs lists
        cls,
        kv_ptrs: Sequence[int],
        kv_lens: Sequence[int],
        kv_item_lens: Sequence[int],
        aux_ptrs: Sequence[int] = (),
        aux_lens: Sequence[int] = (),
        aux_item_lens: Sequence[int] = (),
        state_ptrs: Sequence[int] = (),
        state_lens: Sequence[int] = (),
        state_item_lens: Sequence[int] = (),
        *,
        kind: MemKind = MemKind.DRAM,
        device: int = 0,
        aux_kind: MemKind = MemKind.DRAM,
        aux_device: int = 0,
        state_kind: MemKind | None = None,
        state_device: int | None = None,
        state_groups: Sequence[int] = (),
    ) -> Layout:
        """A layout from SGLang ``KVArgs``-style lists (``kv_data_ptrs``, ``kv_data_lens``,
        ``kv_item_lens``, ``aux_data_*``, flattened ``state_data_*``), named kv0.., aux0..,
        state0.. in order.

        ``kind``/``device`` apply to kv. Aux defaults to DRAM device 0 and state to kv's kind and
        device, which is where SGLang keeps them (MetadataBuffers are CPU tensors; state lives
        with the KV pool).
        """
        return cls(
            kv=_regions_from_pointers("kv", kv_ptrs, kv_lens, kv_item_lens, kind, device),
            aux=_regions_from_pointers(
                "aux", aux_ptrs, aux_lens, aux_item_lens, aux_kind, aux_device
            ),
            state=_regions_from_pointers(
                "state",
                state_ptrs,
                state_lens,
                state_item_lens,
                kind if state_kind is None else state_kind,
                device if state_device is None else state_device,
            ),
            state_groups=tuple(state_groups),
        )


class LayoutSummary(msgspec.Struct, Geometry, frozen=True, gc=False, forbid_unknown_fields=True):
    """A peer's layout as it travels on the wire (msgpack): per region ``(addr, nbytes,
    item_bytes, device)``, and one memory kind per group (a group is one prepped NIXL list, so it
    has exactly one kind; groups may differ, e.g. VRAM kv and DRAM aux).

    Validated on construction and on decode by the ``Layout`` rules (``LayoutError`` when built
    directly, ``msgspec.ValidationError`` when decoded), so every instance is well-formed and the
    methods below, which run the same code as ``Layout``'s, are safe and cheap per chunk.
    """

    kv: tuple[RegionSpec, ...]
    aux: tuple[RegionSpec, ...] = ()
    state: tuple[RegionSpec, ...] = ()
    kv_kind: MemKind = MemKind.DRAM
    aux_kind: MemKind = MemKind.DRAM
    state_kind: MemKind = MemKind.DRAM
    #: Regions per state type, in order; empty when there is one type (or none).
    state_groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.to_layout()

    def to_layout(self) -> Layout:
        """The equivalent ``Layout``, regions named kv0.., aux0.., state0.. (the names a
        ``Layout.from_pointers``/``from_tensors`` gives); ``LayoutError`` if malformed."""

        def regions(group: Group, specs: object, kind: object) -> tuple[Region, ...]:
            # msgspec type-checks decoded summaries but not ones built in Python.
            if not isinstance(specs, tuple):
                raise LayoutError(f"{group} must be a tuple of region specs, got {specs!r}")
            out = []
            for i, spec in enumerate(specs):
                if not isinstance(spec, tuple) or len(spec) != 4:
                    raise LayoutError(
                        f"{group}{i}: expected (addr, nbytes, item_bytes, device), got {spec!r}"
                    )
                addr, nbytes, item, device = spec
                # Region checks every field's type and value at runtime.
                out.append(Region(f"{group}{i}", addr, nbytes, item, cast("MemKind", kind), device))
            return tuple(out)

        return Layout(
            kv=regions("kv", self.kv, self.kv_kind),
            aux=regions("aux", self.aux, self.aux_kind),
            state=regions("state", self.state, self.state_kind),
            state_groups=self.state_groups,
        )

    @property
    def num_pages(self) -> int:
        return _items(self.kv)

    @property
    def aux_rows(self) -> int:
        return _items(self.aux)

    @property
    def state_rows(self) -> int:
        return _rows(self._state_kinds())

    def _state_kinds(self) -> tuple[StateKind, ...]:
        return state_plan(self.state, state_groups(self.state_groups, len(self.state)))

    def _shape(self, group: Group) -> tuple[int, int]:
        specs = self.kv if group == "kv" else self.aux if group == "aux" else self.state
        return len(specs), _items(specs)

    def _specs(self, group: Group) -> Sequence[RegionSpec]:
        return self.kv if group == "kv" else self.aux if group == "aux" else self.state

    def select_kv(self, buffers: Sequence[int]) -> LayoutSummary:
        """This summary with only the KV regions ``buffers``, in that order: what a writer that
        holds some of the layers (a pipeline stage) pairs its own KV buffers with, one to one.
        ``LayoutError`` if an index is out of range or repeated (two local buffers would land
        in one remote region)."""
        picked = list(buffers)
        if len(set(picked)) != len(picked):
            raise LayoutError(f"KV buffers selected twice: {picked}")
        for index in picked:
            if not 0 <= index < len(self.kv):
                raise LayoutError(f"KV buffer {index} out of range (the layout has {len(self.kv)})")
        return msgspec.structs.replace(self, kv=tuple(self.kv[i] for i in picked))

    def select_state(self, regions: Sequence[int], groups: Sequence[int]) -> LayoutSummary:
        """This summary with only the state regions ``regions``, in that order, ``groups`` of
        them per state type: what a pipeline stage holding some of the model's state buffers
        pairs its own with, one to one. ``LayoutError`` as for :meth:`select_kv`."""
        picked = list(regions)
        if len(set(picked)) != len(picked):
            raise LayoutError(f"state regions selected twice: {picked}")
        for index in picked:
            if not 0 <= index < len(self.state):
                raise LayoutError(
                    f"state region {index} out of range (the layout has {len(self.state)})"
                )
        counts = tuple(groups)
        return msgspec.structs.replace(
            self,
            state=tuple(self.state[i] for i in picked),
            state_groups=counts if len(counts) > 1 else (),
        )
