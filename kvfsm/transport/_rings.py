"""DSA tail rings of different sizes: a request's live slots, remapped from prefill's ring row
into decode's.

Pure: no NIXL, no threads, no IO. DeepSeek V4's compressed-KV tail keeps, per request, one
ring row per layer (a key ring and a score ring), ``ring`` slots of equal bytes. Each side's
ring is its pool's compression ring plus its speculative slots (``tail_extra_slots``), and a
request's ``live`` slots start at ``(length - live) mod ring`` of that side's own ring, wrapping
at most once (``get_dsa_tail_state_indices`` in sglang/srt/disaggregation/utils.py). When the
two rings are of one size both sides put them at the same offsets and the row moves whole
(the state plan gives it no remap). When they differ, the sender pairs its live slots with
decode's in order, segment by segment, exactly as SGLang's ``build_dsa_tail_transfer_blocks``
does: each side names its segments per request (``PostChunk.src_rings``/``dst_rings``,
``kvfsm.states.RING_FIELDS`` per ring row, keyed by the row's position among the request's
state rows), and the state plan names the regions to remap (``StatePiece.rings``).

The blocks differ from request to request, so they are not prepared descriptor lists: they are
descriptors (address, length, device) on both sides, posted with NIXL's ``initialize_xfer``.
Bad segments (a count that differs on the two sides, a segment past its ring, a ring that does
not divide its row into slots of one size on both sides, a position that names no state row
or a row of another type) raise ``LayoutError``: the chunk fails, and with it only its room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfsm.states import RING_FIELDS
from kvfsm.transport._geometry import LayoutError, RegionSpec, state_groups, state_plan

__all__ = ["RingBlocks", "ring_blocks"]

Descs = npt.NDArray[np.uint64]


class RingBlocks(NamedTuple):
    """What a request's remapped ring slots post: descriptor rows on each side, paired in
    order, and the bytes they move."""

    local: Descs
    remote: Descs
    nbytes: int


def _entries(packed: bytes, rows: int, side: str) -> dict[int, tuple[int, ...]]:
    """``RING_FIELDS``-int32 entries by position; raise ``LayoutError`` if malformed."""
    if len(packed) % (4 * RING_FIELDS):
        raise LayoutError(f"{side} ring segments of {len(packed)} bytes: not whole entries")
    out: dict[int, tuple[int, ...]] = {}
    for entry in np.frombuffer(packed, "<i4").reshape(-1, RING_FIELDS).tolist():
        at, first_at, first_n, second_at, second_n, ring = entry
        if not 0 <= at < rows or at in out:
            raise LayoutError(
                f"{side} ring segments name state row position {at} (of {rows}, or twice)"
            )
        if ring <= 0:
            raise LayoutError(f"{side} ring of {ring} slots")
        for off, n in ((first_at, first_n), (second_at, second_n)):
            if min(off, n) < 0 or off + n > ring:
                raise LayoutError(
                    f"{side} ring segment ({off}, {n}) exceeds its ring of {ring} slots"
                )
        out[at] = (first_at, first_n, second_at, second_n, ring)
    return out


def _pairs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(source slot, destination slot, slots)`` runs pairing the live slots in order."""
    mine = [(o, n) for o, n in ((src[0], src[1]), (src[2], src[3])) if n]
    theirs = [(o, n) for o, n in ((dst[0], dst[1]), (dst[2], dst[3])) if n]
    if sum(n for _, n in mine) != sum(n for _, n in theirs):
        raise LayoutError(
            f"ring live slots differ: {sum(n for _, n in mine)} on prefill (segments {mine}), "
            f"{sum(n for _, n in theirs)} on decode (segments {theirs})"
        )
    runs: list[tuple[int, int, int]] = []
    i = j = used_i = used_j = 0
    while i < len(mine):
        n = min(mine[i][1] - used_i, theirs[j][1] - used_j)
        runs.append((mine[i][0] + used_i, theirs[j][0] + used_j, n))
        used_i += n
        used_j += n
        if used_i == mine[i][1]:
            i, used_i = i + 1, 0
        if used_j == theirs[j][1]:
            j, used_j = j + 1, 0
    return runs


def ring_blocks(
    *,
    rings: Sequence[int],
    local: tuple[RegionSpec, ...],
    local_groups: tuple[int, ...],
    remote: tuple[RegionSpec, ...],
    remote_groups: tuple[int, ...],
    src_rows: npt.NDArray[np.int32],
    dst_rows: npt.NDArray[np.int32],
    src_rings: bytes,
    dst_rings: bytes,
) -> RingBlocks | None:
    """The descriptors that move the live slots of the request's ring rows in the remapped
    regions ``rings`` (state region indices, the state plan's ``StatePiece.rings``), from
    ``src_rows`` (this side's state rows) into ``dst_rows`` (decode's, paired by position and
    already checked to be of the same types); None when no such row is named. Raise
    ``LayoutError`` for bad segments."""
    if not rings:
        return None
    mine = _entries(src_rings, len(src_rows), "prefill")
    theirs = _entries(dst_rings, len(dst_rows), "decode")
    if set(mine) != set(theirs):
        raise LayoutError(
            f"ring segments for state row positions {sorted(mine)} on prefill, "
            f"{sorted(theirs)} on decode"
        )
    kinds, their_kinds = state_plan(local, local_groups), state_plan(remote, remote_groups)
    counts = state_groups(local_groups, len(local))
    starts = [sum(counts[:t]) for t in range(len(counts))]
    remapped = set(rings)
    for t, kind in enumerate(kinds):  # every row of a remapped type needs its segments
        if remapped.intersection(range(starts[t], starts[t] + counts[t])):
            rows = src_rows
            named = np.flatnonzero((rows >= kind.first_row) & (rows < kind.first_row + kind.rows))
            if not set(named.tolist()) <= set(mine):
                raise LayoutError(
                    f"ring rows at state row positions {sorted(set(named.tolist()) - set(mine))} "
                    "have no live segments"
                )
    loc: list[tuple[int, int, int]] = []
    rem: list[tuple[int, int, int]] = []
    for at in sorted(mine):
        src_row, dst_row = int(src_rows[at]), int(dst_rows[at])
        t = next(
            (t for t, k in enumerate(kinds) if k.first_row <= src_row < k.first_row + k.rows), -1
        )
        if t < 0:
            raise LayoutError(f"source state row {src_row} is outside the layout's state rows")
        members = [j for j in range(starts[t], starts[t] + counts[t]) if j in remapped]
        if not members:
            continue  # a ring of one size on both sides: it moves whole
        s_item, d_item = src_row - kinds[t].first_row, dst_row - their_kinds[t].first_row
        if not 0 <= d_item < their_kinds[t].rows:
            raise LayoutError(f"destination state row {dst_row} is not a row of its type")
        src, dst = mine[at], theirs[at]
        runs = _pairs(src, dst)
        for j in members:
            (s_addr, _, s_bytes, s_dev), (d_addr, _, d_bytes, d_dev) = local[j], remote[j]
            if s_bytes % src[4] or d_bytes % dst[4] or s_bytes // src[4] != d_bytes // dst[4]:
                raise LayoutError(
                    f"state region {j}: ring rows of {s_bytes} bytes in {src[4]} slots on "
                    f"prefill and {d_bytes} bytes in {dst[4]} slots on decode are not slots of "
                    "one size"
                )
            slot = s_bytes // src[4]
            s_base, d_base = s_addr + s_bytes * s_item, d_addr + d_bytes * d_item
            for s_slot, d_slot, n in runs:
                loc.append((s_base + s_slot * slot, n * slot, s_dev))
                rem.append((d_base + d_slot * slot, n * slot, d_dev))
    if not loc:
        return None
    local_descs = np.asarray(loc, np.uint64).reshape(-1, 3)
    remote_descs = np.asarray(rem, np.uint64).reshape(-1, 3)
    return RingBlocks(local_descs, remote_descs, int(local_descs[:, 1].sum()))
