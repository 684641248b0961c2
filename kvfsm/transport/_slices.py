"""Which KV heads move between which ranks when prefill and decode use different attention TP.

Pure: no NIXL, no threads, no IO. This is the plan the data path follows for heterogeneous
tensor parallelism (docs/heterogeneous-tp.md): for a prefill rank and a decode rank it says
which heads the one writes into the other, where they sit in each side's page, and it builds the
NIXL descriptors of that slice for every page of a layout, prepared once per (peer, layout) like
the whole-page lists of :mod:`kvfsm.transport._layout`.

Heads and shards
----------------

SGLang splits the ``total`` KV heads of an MHA/GQA model over attention-TP ranks. With
``tp <= total`` (``total % tp == 0``) rank ``r`` holds heads ``[r * total // tp, ...)``, ``total //
tp`` of them. With ``tp > total`` (``tp % total == 0``) heads are replicated: every rank holds one
head, rank ``r`` head ``r // (tp // total)``, and ``tp // total`` ranks share each head. MLA is
the extreme case, ``total = 1``: every rank holds the one latent cache. A rank's K (or V) page
is ``page_tokens`` rows, one per token, each row its heads side by side (SGLang's token-major
pool), so a head slice of a page is ``page_tokens`` runs of bytes, one per row.

Rules
-----

1. **Every decode head is written exactly once.** For each decode rank and each head it
   holds, exactly one prefill rank writes it (:func:`sources` and :func:`targets` are the two
   views of one relation, and tests prove it for every shape).
2. **Replicas write once.** When several prefill ranks hold the same heads (``tp > total``,
   and always for MLA), the one among them whose index in its replica group equals the decode
   rank's index modulo the group size writes: one replica per decode rank moves the bytes, as
   SGLang does for MLA, and the work spreads over the replicas. The others write nothing to
   that decode rank (they are SGLang's "dummy" ranks for it).
3. **A slice is contiguous in heads.** The heads one prefill rank writes into one decode rank
   are an interval on both sides (both sides split heads into contiguous intervals), so a slice
   is one byte run per row: ``(offset, length)`` inside each side's row.

Descriptors
-----------

NIXL's descriptor lists have no stride in 1.5 (its ``(addr, len, dev, stride, count)`` input is
expanded into ``count`` plain descriptors), so a sliced list has one descriptor per (region,
page, row): row ``(b * items + p) * rows + t`` is row ``t`` of page ``p`` of region ``b``
(:func:`sliced_descs`), and moving pages ``P`` is :func:`sliced_index` of them on both sides.
Where a slice is a whole row on both sides (equal TP), consecutive rows of a page are adjacent
on both sides and ``make_prepped_xfer`` merges them back into one run per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from kvfsm.states import Part
from kvfsm.transport._geometry import INT32_MAX, Descs, Indices, LayoutError, RegionSpec

__all__ = [
    "NO_KV",
    "HeadShard",
    "HeadSlice",
    "KvPiece",
    "RowSlice",
    "check_slice",
    "dummy_of",
    "legs",
    "link_piece",
    "prefill_legs",
    "sliced_descs",
    "sliced_index",
    "sources",
    "state_group",
    "state_legs",
    "state_targets",
    "targets",
]

_MAX_TP: Final = 1 << 16


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The KV heads one attention-TP rank holds: ``tp`` ranks share ``total`` heads."""

    total: int
    tp: int
    rank: int

    def __post_init__(self) -> None:
        if not (0 < self.total <= _MAX_TP and 0 < self.tp <= _MAX_TP):
            raise ValueError(f"heads {self.total} and TP {self.tp} must be in [1, {_MAX_TP}]")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"TP rank {self.rank} out of range [0, {self.tp})")
        if self.total % self.tp and self.tp % self.total:
            raise ValueError(
                f"{self.total} KV heads cannot be split over TP {self.tp}: one must divide the "
                "other"
            )

    @property
    def heads(self) -> int:
        """Heads this rank holds (1 when heads are replicated)."""
        return max(1, self.total // self.tp)

    @property
    def first(self) -> int:
        """The first head this rank holds."""
        if self.tp <= self.total:
            return self.rank * self.heads
        return self.rank // self.replicas

    @property
    def replicas(self) -> int:
        """Ranks that hold this rank's heads, itself included."""
        return max(1, self.tp // self.total)

    @property
    def replica(self) -> int:
        """This rank's index among them."""
        return self.rank % self.replicas


@dataclass(frozen=True, slots=True)
class RowSlice:
    """A run of bytes inside every row of one side's pages."""

    row_bytes: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """The heads one prefill rank writes into one decode rank: ``count`` heads, starting at
    head ``src_head`` of the prefill rank's own heads and ``dst_head`` of the decode rank's."""

    prefill_rank: int
    decode_rank: int
    src_head: int
    dst_head: int
    count: int

    def rows(
        self, prefill: HeadShard, decode: HeadShard, head_bytes: int
    ) -> tuple[RowSlice, RowSlice]:
        """Where the slice sits in a prefill row and in a decode row, in bytes."""
        if head_bytes <= 0:
            raise ValueError(f"head_bytes must be > 0, got {head_bytes}")
        length = self.count * head_bytes
        return (
            RowSlice(prefill.heads * head_bytes, self.src_head * head_bytes, length),
            RowSlice(decode.heads * head_bytes, self.dst_head * head_bytes, length),
        )


def _pair(prefill: HeadShard, decode: HeadShard) -> HeadSlice | None:
    """What ``prefill`` writes into ``decode`` (None: nothing), by rules 1 to 3."""
    if prefill.total != decode.total:
        raise ValueError(f"prefill has {prefill.total} KV heads, decode {decode.total}")
    if prefill.replicas > 1 and prefill.replica != decode.rank % prefill.replicas:
        return None  # another replica of these heads writes to this decode rank (rule 2)
    lo = max(prefill.first, decode.first)
    hi = min(prefill.first + prefill.heads, decode.first + decode.heads)
    if lo >= hi:
        return None
    return HeadSlice(prefill.rank, decode.rank, lo - prefill.first, lo - decode.first, hi - lo)


def sources(decode: HeadShard, prefill_tp: int) -> list[HeadSlice]:
    """The prefill ranks (of ``prefill_tp``) that write into ``decode``, with their slices,
    in prefill rank order."""
    out = []
    for rank in range(prefill_tp):
        piece = _pair(HeadShard(decode.total, prefill_tp, rank), decode)
        if piece is not None:
            out.append(piece)
    return out


def targets(prefill: HeadShard, decode_tp: int) -> list[HeadSlice]:
    """The decode ranks (of ``decode_tp``) that ``prefill`` writes into, with their slices, in
    decode rank order. Empty: this prefill rank moves nothing (a dummy rank for every decode
    rank)."""
    out = []
    for rank in range(decode_tp):
        piece = _pair(prefill, HeadShard(prefill.total, decode_tp, rank))
        if piece is not None:
            out.append(piece)
    return out


@dataclass(frozen=True, slots=True)
class KvPiece:
    """What one prefill rank writes of each KV page into one decode rank: the same byte run
    in each of a page's ``rows`` rows (one row per token), at ``src`` in the prefill row and
    ``dst`` in the decode row. A link whose piece is None writes whole pages, as with equal
    TP."""

    rows: int
    src: RowSlice
    dst: RowSlice

    def page_bytes(self, regions: int) -> int:
        """Bytes of one page moved, over ``regions`` KV buffers."""
        return regions * self.rows * self.src.length


#: The piece of a link that carries no KV (a dummy link: the prefill rank's heads reach the
#: decode rank through another rank or replica). Its peer gets no KV descriptor lists, so a
#: chunk with pages over it fails instead of writing.
NO_KV: Final = KvPiece(0, RowSlice(0, 0, 0), RowSlice(0, 0, 0))


def link_piece(
    *,
    total_heads: int,
    head_bytes: int,
    rows: int,
    prefill_tp: int,
    prefill_rank: int,
    decode_tp: int,
    decode_rank: int,
) -> KvPiece | str | None:
    """What prefill rank ``prefill_rank`` writes into decode rank ``decode_rank``: a
    :class:`KvPiece`, None when it writes whole rows (its heads are exactly the decode rank's),
    or ``"none"`` when it writes no KV there (another rank, or another replica, does: it is a
    dummy for that decode rank). Raises ``ValueError`` for a shape the rules cannot split."""
    prefill = HeadShard(total_heads, prefill_tp, prefill_rank)
    decode = HeadShard(total_heads, decode_tp, decode_rank)
    piece = _pair(prefill, decode)
    if piece is None:
        return "none"
    src, dst = piece.rows(prefill, decode, head_bytes)
    if src == dst and src.offset == 0 and src.length == src.row_bytes:
        return None
    return KvPiece(rows, src, dst)


def dummy_of(decode_tp: int, prefill_rank: int) -> int:
    """The decode rank that tells a prefill rank with no KV for any decode rank that it is a
    dummy: each such prefill rank gets exactly one (dummy) leg, so its room still ends."""
    return prefill_rank % decode_tp


def state_group(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks whose state a decode rank takes when the state is sharded over
    attention TP (Mamba's channels; a replicated tensor or DSA's indexer from one of them):
    SGLang's pairing of ranks, KV or not (``target_tp_ranks`` in its common backend).
    Prefill's TP the larger: the ``w`` ranks ``[d * w, (d + 1) * w)`` (``w`` the ratio).
    Decode's the larger: the one rank ``d // w``."""
    if prefill_tp >= decode_tp:
        ratio = prefill_tp // decode_tp
        return range(decode_rank * ratio, (decode_rank + 1) * ratio)
    first = decode_rank // (decode_tp // prefill_tp)
    return range(first, first + 1)


def state_targets(prefill_tp: int, decode_tp: int, prefill_rank: int) -> range:
    """The decode ranks a prefill rank writes its state into: the other view of
    :func:`state_group`."""
    if prefill_tp >= decode_tp:
        first = prefill_rank // (prefill_tp // decode_tp)
        return range(first, first + 1)
    ratio = decode_tp // prefill_tp
    return range(prefill_rank * ratio, (prefill_rank + 1) * ratio)


def state_legs(
    total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int
) -> list[tuple[int, Part]]:
    """:func:`legs` for a model whose state is sharded over attention TP (Mamba's channels, and
    DSA's indexer, which follows the same ranks): decode rank ``d`` hears from the prefill
    ranks that write it KV (as in :func:`legs`: the first ``Part.WHOLE``, the others
    ``Part.KV``) and from every rank of its :func:`state_group` that writes it none
    (``Part.STATE``), in prefill rank order. No dummy legs: every prefill rank has a leg in
    each decode rank of its :func:`state_targets`.

    When heads are replicated on both sides, the replica that writes a decode rank's KV (rule
    2) may lie outside that rank's state group: one KV head over prefill TP 4 and decode TP 2
    has prefill rank 1 write decode rank 1's KV while its state shard belongs in decode rank
    0, where SGLang sends it (each prefill rank sends everything to decode rank ``p // 2``,
    its KV head redundantly). Such a prefill rank then has two legs for one request: its KV
    leg and a state-only leg (:func:`prefill_legs`), so every state byte lands where
    SGLang's does and each decode head is still written once."""
    writers = [
        p.prefill_rank for p in sources(HeadShard(total_heads, decode_tp, decode_rank), prefill_tp)
    ]
    out: list[tuple[int, Part]] = []
    for rank in sorted({*writers, *state_group(prefill_tp, decode_tp, decode_rank)}):
        if rank not in writers:
            out.append((rank, Part.STATE))
        else:
            out.append((rank, Part.WHOLE if rank == writers[0] else Part.KV))
    return out


def prefill_legs(
    total_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int, *, grouped: bool
) -> list[int]:
    """The decode ranks one prefill rank writes each request into, in decode rank order: its
    legs, numbered by position (a link's leg is its decode rank's index here). Those it writes
    KV into, and with state sharded over attention TP (``grouped``, :func:`state_legs`) those
    of its :func:`state_targets` too. Empty: only a dummy leg (:func:`dummy_of`)."""
    ranks = {
        p.decode_rank for p in targets(HeadShard(total_heads, prefill_tp, prefill_rank), decode_tp)
    }
    if grouped:
        ranks.update(state_targets(prefill_tp, decode_tp, prefill_rank))
    return sorted(ranks)


def legs(
    total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int
) -> list[tuple[int, Part]]:
    """The rooms a decode rank opens for one request, one per prefill rank it hears from, in
    prefill rank order: each prefill rank that writes KV into it (the first of them also
    carries the aux and state rows: ``Part.WHOLE``; the others ``Part.KV``), then the prefill
    ranks it is the dummy partner of (``Part.NONE``, :func:`dummy_of`). Over all decode ranks,
    every prefill rank gets at least one leg (a room no decode claims would wait out its
    deadline), and each decode head exactly one writer (rule 1)."""
    decode = HeadShard(total_heads, decode_tp, decode_rank)
    out = [
        (piece.prefill_rank, Part.WHOLE if i == 0 else Part.KV)
        for i, piece in enumerate(sources(decode, prefill_tp))
    ]
    for rank in range(prefill_tp):
        shard = HeadShard(total_heads, prefill_tp, rank)
        if not targets(shard, decode_tp) and dummy_of(decode_tp, rank) == decode_rank:
            out.append((rank, Part.NONE))
    return out


def check_slice(specs: Sequence[RegionSpec], rows: int, piece: RowSlice) -> None:
    """Raise ``LayoutError`` unless every region's pages are exactly ``rows`` rows of
    ``piece.row_bytes``, all regions have as many pages, and ``piece`` fits in a row: what
    :func:`sliced_descs` needs, checked without building a descriptor."""
    if rows <= 0:
        raise LayoutError(f"rows per page must be > 0, got {rows}")
    if not (
        piece.offset >= 0 and piece.length > 0 and piece.offset + piece.length <= piece.row_bytes
    ):
        raise LayoutError(f"slice {piece} does not fit in its row")
    if not specs:
        return
    items = specs[0][1] // specs[0][2]
    for i, (_, nbytes, item_bytes, _) in enumerate(specs):
        if item_bytes != rows * piece.row_bytes:
            raise LayoutError(
                f"region {i}: a page is {item_bytes} bytes, not {rows} rows of {piece.row_bytes}"
            )
        if nbytes // item_bytes != items:
            raise LayoutError(f"region {i} has {nbytes // item_bytes} pages, region 0 {items}")
    if len(specs) * items * rows > INT32_MAX:
        raise LayoutError(
            f"{len(specs)} regions x {items} pages x {rows} rows do not fit int32 indices"
        )


def sliced_descs(specs: Sequence[RegionSpec], rows: int, piece: RowSlice) -> Descs:
    """``(len(specs) * items * rows, 3)`` descriptors of ``piece`` in every row of every page of
    every region: row ``(b * items + p) * rows + t`` is row ``t`` of page ``p`` of region ``b``.
    Each region's pages must be exactly ``rows`` rows of ``piece.row_bytes``
    (:func:`check_slice`)."""
    check_slice(specs, rows, piece)
    if not specs:
        return np.empty((0, 3), np.uint64)
    items = specs[0][1] // specs[0][2]
    addr = np.array([s[0] for s in specs], np.uint64)
    device = np.array([s[3] for s in specs], np.uint64)
    page = np.arange(items, dtype=np.uint64) * np.uint64(rows * piece.row_bytes)
    row = np.arange(rows, dtype=np.uint64) * np.uint64(piece.row_bytes) + np.uint64(piece.offset)
    out = np.empty((len(specs), items, rows, 3), np.uint64)
    out[..., 0] = addr[:, None, None] + page[None, :, None] + row[None, None, :]
    out[..., 1] = piece.length
    out[..., 2] = device[:, None, None]
    return out.reshape(-1, 3)


def sliced_index(n_regions: int, items: int, rows: int, pages: Indices) -> Indices:
    """Indices into :func:`sliced_descs` for ``pages`` (already range-checked against
    ``items``) across all regions, region-major, rows of a page consecutive."""
    base = (np.arange(n_regions, dtype=np.int64)[:, None] * items + pages[None, :]) * rows
    return (
        (base[:, :, None] + np.arange(rows, dtype=np.int64)[None, None, :])
        .reshape(-1)
        .astype(np.int32)
    )
