"""Which bytes of each state item move over one link when the two sides shard state apart.

Pure: no NIXL, no threads, no IO. With equal attention TP a state item (a Mamba slot, an SWA
page) lands whole, item ``src`` into item ``dst`` (``_geometry``'s whole-row lists). With
unequal attention TP each side holds its own shard of the state, as it does of the KV heads: a
Mamba conv or SSM tensor is split along its channel axis, an SWA page along its heads. One
prefill rank then writes a few byte runs of each item into a decode rank's item, at other
offsets on each side. A :class:`StatePiece` says which: per state region, a tuple of
``(source offset, destination offset, length)`` blocks, the same for every item of the region.
An empty tuple means the region moves nothing over this link (another prefill rank writes it:
a state replicated over attention TP is written by one elected rank per destination).

Which blocks a link moves is the control plane's decision (``kvfsm.control``'s state plan,
from both sides' fingerprints); this module turns a piece into NIXL descriptors and indices,
prepared once per (peer, piece) like the head slices of KV pages (``_slices``).

Descriptors and indices
-----------------------

A piece's descriptor list on one side has one row per (region, item, block), region-major, then
item, then block: region ``j``'s rows start at ``base[j] = sum(items[k] * blocks[k] for k <
j)``, and item ``i`` of it is rows ``base[j] + i * len(blocks[j]) + [0, len(blocks[j]))``.
Moving state row ``first_row(t) + i`` moves item ``i`` of every region of type ``t``, so its
indices are those runs for each region of the type. Both sides list the blocks in the same
order, so NIXL pairs each source block with its destination block. Blocks of one item that are
adjacent on both sides (a whole item split in two) merge back in ``make_prepped_xfer``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from kvfsm.transport._geometry import (
    INT32_MAX,
    Descs,
    Indices,
    LayoutError,
    RegionSpec,
    state_groups,
    state_plan,
)

__all__ = ["DESTINATION", "SOURCE", "Block", "StatePiece", "check_state_piece"]

#: ``(offset in the source item, offset in the destination item, bytes)``.
Block: TypeAlias = tuple[int, int, int]
#: The side of a block: where it is read (prefill), where it is written (decode).
SOURCE, DESTINATION = 0, 1


@dataclass(frozen=True, slots=True)
class StatePiece:
    """The byte runs of each state item one prefill rank writes into one decode rank: one
    tuple of blocks per state region, in the layouts' region order."""

    blocks: tuple[tuple[Block, ...], ...]
    #: State regions whose items are DSA tail rings of different sizes on the two sides: they
    #: have no blocks here, their live slots move per request, remapped between both sides'
    #: live segments (``PostChunk.src_rings``/``dst_rings``, :mod:`kvfsm.transport._rings`).
    rings: tuple[int, ...] = ()

    @classmethod
    def whole(cls, item_bytes: Sequence[int]) -> StatePiece:
        """Every region's items whole: what equal attention TP moves."""
        return cls(tuple(((0, 0, int(n)),) for n in item_bytes))

    @property
    def moves_nothing(self) -> bool:
        """No region moves a byte over this link."""
        return not any(self.blocks)

    def runs(self, side: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per region, its blocks as ``(offset, length)`` on one side (0: source, 1:
        destination)."""
        return tuple(tuple((b[side], b[2]) for b in region) for region in self.blocks)

    def descs(self, specs: Sequence[RegionSpec], side: int) -> Descs:
        """The descriptor rows of this piece over the state regions ``specs`` of one side
        (checked with :func:`check_state_piece` first)."""
        parts = []
        for (addr, nbytes, item, device), runs in zip(specs, self.runs(side), strict=True):
            if not runs:
                continue
            items = nbytes // item
            offsets = np.array([r[0] for r in runs], np.uint64)
            lengths = np.array([r[1] for r in runs], np.uint64)
            rows = np.empty((items, len(runs), 3), np.uint64)
            base = np.uint64(addr) + np.arange(items, dtype=np.uint64) * np.uint64(item)
            rows[:, :, 0] = base[:, None] + offsets[None, :]
            rows[:, :, 1] = lengths[None, :]
            rows[:, :, 2] = device
            parts.append(rows.reshape(-1, 3))
        return np.concatenate(parts) if parts else np.empty((0, 3), np.uint64)

    def index(
        self, specs: tuple[RegionSpec, ...], groups: tuple[int, ...], side: int, row: int
    ) -> Indices:
        """Indices into :meth:`descs` (same ``specs`` and ``side``) for state row ``row``: its
        item's blocks in every region of its state type (empty when none moves here). The row
        must already be checked against the layout (the transport does)."""
        table = _table(specs, groups, tuple(len(b) for b in self.blocks))
        for first, rows, runs in table:
            if first <= row < first + rows:
                if not runs:
                    return np.empty(0, np.int32)
                offset = row - first
                ranges = [base + offset * n + np.arange(n, dtype=np.int32) for base, n in runs]
                return np.concatenate(ranges).astype(np.int32)
        raise LayoutError(f"state row {row} is outside the layout's state rows")

    def row_bytes(self, groups: tuple[int, ...], row_type: int) -> int:
        """Bytes moved per item of state type ``row_type`` (its position), over its regions."""
        counts = state_groups(groups, len(self.blocks))
        start = sum(counts[:row_type])
        return sum(b[2] for region in self.blocks[start : start + counts[row_type]] for b in region)


@functools.lru_cache(maxsize=64)
def _table(
    specs: tuple[RegionSpec, ...], groups: tuple[int, ...], counts: tuple[int, ...]
) -> tuple[tuple[int, int, tuple[tuple[np.int32, int], ...]], ...]:
    """Per state type: its first row, its rows, and ``(base, blocks)`` of each of its regions
    that moves something (cached: a peer's piece and layout never change)."""
    kinds = state_plan(specs, groups)
    bases: list[int] = []
    total = 0
    for (_, nbytes, item, _), count in zip(specs, counts, strict=True):
        bases.append(total)
        total += (nbytes // item) * count
    if total > INT32_MAX:
        raise LayoutError(f"{total} state descriptor rows do not fit int32 indices")
    out = []
    region = 0
    for kind, members in zip(kinds, state_groups(groups, len(specs)), strict=True):
        runs = tuple(
            (np.int32(bases[j]), counts[j]) for j in range(region, region + members) if counts[j]
        )
        out.append((kind.first_row, kind.rows, runs))
        region += members
    return tuple(out)


def check_state_piece(
    piece: StatePiece, local: Sequence[RegionSpec], remote: Sequence[RegionSpec]
) -> None:
    """Raise ``LayoutError`` unless ``piece`` has one block tuple per state region on both sides
    and every block fits in its item on both sides."""
    if not len(piece.blocks) == len(local) == len(remote):
        raise LayoutError(
            f"state piece for {len(piece.blocks)} regions, local {len(local)}, remote {len(remote)}"
        )
    for j in piece.rings:
        if not 0 <= j < len(local) or piece.blocks[j]:
            raise LayoutError(f"state region {j}: a remapped ring region with blocks or none")
    for j, (region, mine, theirs) in enumerate(zip(piece.blocks, local, remote, strict=True)):
        for src, dst, length in region:
            if length <= 0 or src < 0 or dst < 0:
                raise LayoutError(f"state region {j}: block {(src, dst, length)} is empty")
            if src + length > mine[2] or dst + length > theirs[2]:
                raise LayoutError(
                    f"state region {j}: block {(src, dst, length)} does not fit items of "
                    f"{mine[2]} (local) and {theirs[2]} (remote) bytes"
                )
