"""Which bytes of each state item a prefill rank writes into a decode rank: the state plan.

Pure: it reads two fingerprints and the two sides' state regions and returns a
:class:`~kvfsm.transport.StatePiece` (or None: whole items, the path of equal attention TP), or
raises ``ValueError`` naming what cannot pair. Prefill runs it when it admits a decode agent;
a refusal reaches decode as the handshake's error, so its rooms fail at once with the reason.

Rules (SGLang 0.5.23's NIXL backend moves the same bytes: ``maybe_send_extra``,
``compute_mamba_state_slice_byte_blocks`` and ``_send_swa_state_slice`` in
sglang/srt/disaggregation)
-------------------------------------------------------------------------------------------

1. **Equal attention TP, or MLA**: every state item moves whole. With MLA the state, like the
   latent cache, is the same on every rank, and the one prefill rank that writes a decode
   rank's KV (``_slices``' rule 2) writes its state too; the others are dummies there.
2. **Mamba, sharded** (``state_dims`` > 0): an item is ``outer`` rows of the sharded channel
   axis (1 for a plain ``[channels, ...]`` tensor), each channel the same number of bytes on
   both sides. Several prefill ranks into one decode rank (prefill's TP the larger): prefill
   rank ``p`` writes its channels into decode rank ``p // w`` at channel ``(p % w) * dims``
   (``w`` the ratio). One prefill rank into several: decode rank ``d`` takes channels ``(d %
   w) * dims`` onward of prefill rank ``d // w``'s. A conv state whose sub-blocks are sharded
   apart (``state_conv``: GDN's ``q | k | v``) moves each sub-block's share into the same
   sub-block on the other side, so decode's item is again ``q | k | v``.
3. **Mamba, replicated** (``state_dims`` 0): every rank holds the whole item; one prefill rank
   per decode rank writes it (the first of the ranks feeding it; all of them when one prefill
   rank feeds several decode ranks).
4. **SWA without MLA**: a page of the sliding-window pool is ``page_tokens`` rows of the
   rank's KV heads, as a KV page is; it moves as the KV heads do (``_slices``), a head slice
   of every row.
5. **DSA's indexer cache** moves whole, by the rank that rule 3 elects (it is per token, not
   per head).
6. Every other state type pairs only at equal attention TP (or with MLA): the handshake's
   fingerprint rules refuse the rest by name, quoting SGLang where it refuses them too.
7. **DSA tail rings** (``dsa_tail``) of one size on both sides move whole rows. Rings of
   different sizes (other speculative slot counts: each side's ring is its pool's compression
   ring plus ``tail_extra_slots``) cannot move whole: a request's live slots start at its
   length, less the live count, modulo each side's own ring. Such a region gets no blocks
   here and is named in the piece's ``rings``: the transport moves its live slots per request,
   from prefill's live segments to decode's (``RoomMetadata.rings``), as SGLang's
   ``build_dsa_tail_transfer_blocks`` remaps them (``_ring_regions``, at equal TP or MLA, the
   shapes ``dsa_tail`` pairs under).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfsm.control._fingerprint import Fingerprint
from kvfsm.transport import Block, RegionSpec, StatePiece, link_piece, state_groups

__all__ = ["mamba_blocks", "state_link_plan"]


def state_link_plan(
    prefill: Fingerprint,
    decode: Fingerprint,
    local: Sequence[RegionSpec],
    remote: Sequence[RegionSpec],
    groups: tuple[int, ...],
) -> StatePiece | None:
    """What prefill rank ``prefill`` writes of each state item into decode rank ``decode``
    (a pair that passed the fingerprint rules): None for whole items (rules 1), or a piece.
    ``local``/``remote``: both sides' state regions; ``groups``: regions per state type."""
    if not local:
        return None
    if prefill.attn_tp == decode.attn_tp or prefill.mla:
        rings = _ring_regions(prefill, local, remote, groups)
        if not rings:
            return None
        whole = tuple(() if j in rings else ((0, 0, spec[2]),) for j, spec in enumerate(local))
        return StatePiece(whole, rings)
    counts = state_groups(groups, len(local))
    if len(counts) != len(prefill.state_types):
        raise ValueError(
            f"{len(counts)} state types in the layout, {len(prefill.state_types)} declared"
        )
    blocks: list[tuple[Block, ...]] = []
    j = 0
    for name, members in zip(prefill.state_types, counts, strict=True):
        for _ in range(members):
            blocks.append(_region(name, j, prefill, decode, src=local[j][2], dst=remote[j][2]))
            j += 1
    return StatePiece(tuple(blocks))


def _ring_regions(
    prefill: Fingerprint,
    local: Sequence[RegionSpec],
    remote: Sequence[RegionSpec],
    groups: tuple[int, ...],
) -> tuple[int, ...]:
    """Rule 7: the DSA tail ring regions whose rows differ in size on the two sides (SGLang
    requires equal slot bytes, so other row bytes mean other slot counts). Every other region
    must then be of one item size on both sides, as the layout check requires of whole
    items."""
    counts = state_groups(groups, len(local))
    if len(counts) != len(prefill.state_types) or len(remote) != len(local):
        return ()  # the layout check names these
    rings: list[int] = []
    j = 0
    for name, members in zip(prefill.state_types, counts, strict=True):
        for _ in range(members):
            if name == "dsa_tail" and local[j][2] != remote[j][2]:
                rings.append(j)
            j += 1
    if not rings:
        return ()
    for j, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        if j not in rings and mine[2] != theirs[2]:
            raise ValueError(f"state region {j}: items of {mine[2]} bytes, decode {theirs[2]}")
    return tuple(rings)


def _elected(prefill: Fingerprint, decode: Fingerprint) -> bool:
    """Rule 3: does this prefill rank write a replicated item into this decode rank?"""
    if prefill.attn_tp < decode.attn_tp:
        ratio = decode.attn_tp // prefill.attn_tp
        return decode.attn_rank // ratio == prefill.attn_rank
    ratio = prefill.attn_tp // decode.attn_tp
    return prefill.attn_rank // ratio == decode.attn_rank and prefill.attn_rank % ratio == 0


def _region(
    name: str, j: int, prefill: Fingerprint, decode: Fingerprint, *, src: int, dst: int
) -> tuple[Block, ...]:
    where = f"state region {j} ({name})"
    if name == "mamba":
        dims = _declared(prefill.state_dims, j), _declared(decode.state_dims, j)
        if dims[0] is None or dims[1] is None:
            raise ValueError(
                f"{where}: Mamba state under unequal attention TP needs each side's sharded "
                "channels per tensor (SGLang's state_dim_per_tensor); "
                f"prefill declares {list(prefill.state_dims)}, decode {list(decode.state_dims)}"
            )
        if (dims[0] == 0) != (dims[1] == 0):
            raise ValueError(f"{where}: replicated on one side only (dims {dims[0]}, {dims[1]})")
        if dims[0] == 0:
            if src != dst:
                raise ValueError(f"{where}: a replicated item of {src} bytes, decode {dst}")
            return ((0, 0, src),) if _elected(prefill, decode) else ()
        return mamba_blocks(
            src_item=src,
            dst_item=dst,
            src_dims=dims[0],
            dst_dims=dims[1],
            outer=_declared(prefill.state_outer, j) or 1,
            conv=_conv(prefill, decode, j),
            prefill_tp=prefill.attn_tp,
            prefill_rank=prefill.attn_rank,
            decode_tp=decode.attn_tp,
            decode_rank=decode.attn_rank,
            where=where,
        )
    if name == "swa":
        return _head_blocks(where, prefill, decode, src, dst)
    if name == "dsa":
        if src != dst:
            raise ValueError(f"{where}: items of {src} bytes, decode {dst}")
        return ((0, 0, src),) if _elected(prefill, decode) else ()
    raise ValueError(f"{where}: state type {name!r} does not pair under unequal attention TP")


def _declared(values: tuple[int, ...], j: int) -> int | None:
    return values[j] if j < len(values) and values[j] >= 0 else None


def _conv(prefill: Fingerprint, decode: Fingerprint, j: int) -> tuple[int, ...]:
    mine = prefill.state_conv[j] if j < len(prefill.state_conv) else ()
    theirs = decode.state_conv[j] if j < len(decode.state_conv) else ()
    if mine != theirs:
        raise ValueError(
            f"state region {j}: conv sub-blocks differ: prefill {list(mine)}, decode {list(theirs)}"
        )
    return mine


def _head_blocks(
    where: str, prefill: Fingerprint, decode: Fingerprint, src: int, dst: int
) -> tuple[Block, ...]:
    rows, total = prefill.page_tokens, prefill.kv_heads
    src_heads = max(1, total // prefill.attn_tp)
    dst_heads = max(1, total // decode.attn_tp)
    if rows <= 0 or total <= 0:
        raise ValueError(f"{where}: head slices need prefill's page size and KV heads declared")
    head = src // (rows * src_heads) if src % (rows * src_heads) == 0 else 0
    if not head or head * rows * dst_heads != dst:
        raise ValueError(
            f"{where}: items of {src} (prefill) and {dst} (decode) bytes do not split into "
            f"{rows} rows of {src_heads} and {dst_heads} heads of the model's {total}"
        )
    piece = link_piece(
        total_heads=total,
        head_bytes=head,
        rows=rows,
        prefill_tp=prefill.attn_tp,
        prefill_rank=prefill.attn_rank,
        decode_tp=decode.attn_tp,
        decode_rank=decode.attn_rank,
    )
    if piece == "none":
        return ()
    if piece is None or isinstance(piece, str):
        return ((0, 0, src),)
    return tuple(
        (
            t * piece.src.row_bytes + piece.src.offset,
            t * piece.dst.row_bytes + piece.dst.offset,
            piece.src.length,
        )
        for t in range(rows)
    )


def mamba_blocks(
    *,
    src_item: int,
    dst_item: int,
    src_dims: int,
    dst_dims: int,
    outer: int,
    conv: tuple[int, ...],
    prefill_tp: int,
    prefill_rank: int,
    decode_tp: int,
    decode_rank: int,
    where: str = "Mamba state",
) -> tuple[Block, ...]:
    """Rule 2: the byte blocks of one sharded Mamba item that prefill rank ``prefill_rank``
    writes into decode rank ``decode_rank`` (empty: it writes none there)."""
    if src_dims * prefill_tp != dst_dims * decode_tp:
        raise ValueError(
            f"{where}: {src_dims} channels x attention TP {prefill_tp} on prefill, "
            f"{dst_dims} x {decode_tp} on decode: not the same tensor"
        )
    per = src_item // (src_dims * outer)
    if per <= 0 or per * src_dims * outer != src_item or per * dst_dims * outer != dst_item:
        raise ValueError(
            f"{where}: items of {src_item} (prefill) and {dst_item} (decode) bytes are not "
            f"{outer} rows of {src_dims} and {dst_dims} equal channels"
        )
    if conv and sum(conv) != src_dims * prefill_tp:
        conv = ()  # SGLang's rule: sub-blocks that do not cover the tensor are not used
    if any(g % prefill_tp or g % decode_tp for g in conv):
        raise ValueError(f"{where}: conv sub-blocks {list(conv)} do not split over both TPs")
    subs = conv or (src_dims * prefill_tp,)
    logical: list[tuple[int, int, int]] = []  # (source channel, destination channel, channels)
    src_at = dst_at = 0
    for full in subs:
        src_sub, dst_sub = full // prefill_tp, full // decode_tp
        if prefill_tp > decode_tp:  # several prefill ranks fill one decode item
            ratio = prefill_tp // decode_tp
            if prefill_rank // ratio != decode_rank:
                return ()
            logical.append((src_at, dst_at + (prefill_rank % ratio) * src_sub, src_sub))
        else:  # one prefill item feeds several decode ranks
            ratio = decode_tp // prefill_tp
            if decode_rank // ratio != prefill_rank:
                return ()
            logical.append((src_at + (decode_rank % ratio) * dst_sub, dst_at, dst_sub))
        src_at += src_sub
        dst_at += dst_sub
    return tuple(
        (row * src_dims * per + s * per, row * dst_dims * per + d * per, n * per)
        for row in range(outer)
        for s, d, n in logical
    )
