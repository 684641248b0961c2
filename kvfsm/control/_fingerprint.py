"""What prefill and decode must agree on before any byte moves: the handshake fingerprint.

A prefill rank and a decode rank that disagree about the model's KV layout do not fail loudly
on their own: a WRITE of a page whose heads, head size or dtype differ lands wrong bytes, and a
parallel shape the data path does not support fails every request at transfer time (llm-d hit a
hang on exactly that). So each side puts a :class:`Fingerprint` in its ``Hello``, and each side
checks the other's with :func:`mismatch` before anything else happens on the link: before
prefill loads decode's NIXL metadata, before any room frame is read. A mismatch refuses the
handshake on both sides with a reason that names the field and both values; decode's rooms
for that rank fail at once with it (never a deadline, never wrong bytes).

Rules
-----

1. **Layout fields must be equal** (:data:`MUST_MATCH`): dtype, page size in tokens, MLA or
   not, and the state types; and the layers, except that a prefill pipeline stage holds only
   its own span of them, and of the state types those its layers have buffers of (rule 5).
   A field left at its default (0 or empty: "not declared") is compared like any other
   value, so a side that declares nothing pairs only with a side that declares nothing; the
   layout check of the data path (item sizes, ``Layout.compatible_with``) still applies to
   those.
2. **Head fields must be equal where both sides declare them** (:data:`DECLARED_MATCH`): KV
   heads of the whole model and head size in bytes. SGLang's decode does not know its head
   counts (its scheduler sets them only for staging, after the manager exists), so decode may
   leave them at 0. Prefill, which plans the head slices it writes, must declare them when
   attention TP differs (rule 4).
3. **Parallel shapes must be a pair the data path supports** (:data:`SHAPE_RULES`): one
   attention TP a multiple of the other (prefill's larger: several prefill ranks feed each
   decode rank; decode's larger: each prefill rank writes every room into several decode
   ranks) and no pipeline parallelism on decode.
4. **Unequal attention TP must split** (:func:`mismatch`): the model's KV heads split over
   both TPs (one divides the other, ``_slices.HeadShard``); if prefill replicates heads (its
   TP above the head count), decode must declare the head count too, since which replica
   writes depends on it. State pools pair as SGLang's NIXL backend pairs them
   (``_state_plan``): with MLA every type but MiniMax's, whole; without MLA Mamba (its
   channel shards), SWA (head slices, as KV) and DSA's indexer cache, and the rest are refused
   by name. A decode rank takes Mamba's shards (and DSA's indexer) from the prefill ranks
   SGLang pairs it with (``_slices.state_group``), over a state-only leg where that rank
   writes it no KV (``_slices.state_legs``); where heads are replicated on both sides, a
   prefill rank may write KV into one decode rank and its state into another, and then has a
   leg in each (:func:`link_slot`).
5. **A prefill pipeline stage writes its span of layers** (``first_layer``, ``layers``) into
   decode's whole model: the span must lie inside decode's layers, stage 0 must start at
   layer 0 and the last stage must end at decode's last layer (SGLang splits layers into
   contiguous spans in stage order, so the stages then cover decode's layers exactly, whatever
   their sizes). Pipeline parallelism pairs only with equal attention TP, and with state
   pools only when both sides name the model layer of every state buffer (SGLang's
   ``state_layer_ids``): a stage's state buffers then pair with decode's by layer
   (:func:`stage_state`). A stage that holds no buffer of one of decode's state types (that
   type's layers all sit on other stages) sends nothing of it, as SGLang's NIXL backend does
   (``stage_types``); decode's rows of that type are left out of the page lists its link
   hands that stage's senders (``_stage_rows``). MiniMax's state and state without layer ids
   are refused by name, as SGLang's NIXL backend refuses them.
6. The protocol version is checked before the fingerprint (``check_hello``): a peer of another
   version may not even have one.

:func:`link_plan` then says what prefill writes of each page over the link: whole pages, a
head slice (``KvPiece``), or no KV at all (a dummy link), by the rules of ``_slices``, and
:func:`stage_buffers` which of decode's KV buffers a pipeline stage's buffers land in.

The rules are data and :func:`mismatch` is pure: it is tested directly, and the control plane
only carries its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final

import msgspec

from kvfsm.transport import KvPiece, link_piece, prefill_legs

__all__ = [
    "DECLARED_MATCH",
    "GROUP_LEGS",
    "MUST_MATCH",
    "PAIR_UNDER_UNEQUAL_TP",
    "SGLANG_REFUSES_PP",
    "SGLANG_REFUSES_UNEQUAL_TP",
    "SHAPE_RULES",
    "Fingerprint",
    "link_plan",
    "link_slot",
    "mismatch",
    "stage_buffers",
    "stage_state",
    "stage_types",
]

_Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's declaration of the model layout and parallel shape it serves."""

    #: Transformer layers whose KV moves (draft layers included when they move too).
    layers: _Small = 0
    #: KV heads of the whole model (not per rank); 1 for MLA's latent cache.
    kv_heads: _Small = 0
    #: Bytes of one head of one token in one K or V buffer (MLA: of the latent row, rope part
    #: included): the head size times the dtype's size, which both sides can compute.
    head_bytes: _Small = 0
    #: The KV cache dtype, as torch names it ("bfloat16", "float8_e4m3fn", ...).
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    #: Tokens per KV page.
    page_tokens: _Small = 0
    #: MLA (one latent cache shared by all heads) rather than per-head K and V.
    mla: bool = False
    #: State pools that move with the KV (SGLang ``StateType`` names: "mamba", "swa", ...).
    state_types: tuple[Annotated[str, msgspec.Meta(max_length=32)], ...] = ()
    #: Attention tensor-parallel size of this side, and its pipeline-parallel size.
    attn_tp: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1
    pp: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1
    #: This rank's index in its attention-TP group (which heads it holds).
    attn_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    #: This rank's pipeline stage, and the first (global) layer of its span: with ``pp > 1``
    #: ``layers`` counts the stage's own layers, ``first_layer`` to ``first_layer + layers``.
    pp_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    first_layer: _Small = 0
    #: Per state region, in layout order: the channels of its attention-TP-sharded axis this
    #: rank holds (SGLang's ``state_dim_per_tensor``, Mamba's conv and SSM tensors), 0 for an
    #: item replicated over attention TP, -1 or missing for a region it declares none for;
    #: empty: not declared. Read only under unequal TP.
    state_dims: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)], ...],
        msgspec.Meta(max_length=1 << 12),
    ] = ()
    #: Per state region: the whole-model channels of each sub-block of a conv state whose
    #: sub-blocks are sharded apart (GDN's ``q | k | v``: SGLang's
    #: ``state_conv_shard_groups``); empty: one block.
    state_conv: Annotated[
        tuple[Annotated[tuple[_Small, ...], msgspec.Meta(max_length=16)], ...],
        msgspec.Meta(max_length=1 << 12),
    ] = ()
    #: Per state region: rows of the sharded axis in one item (SGLang's
    #: ``state_slice_outer_counts``); empty: 1.
    state_outer: Annotated[tuple[_Small, ...], msgspec.Meta(max_length=1 << 12)] = ()
    #: Per state region: the model layer it belongs to (SGLang's ``state_layer_ids``), -1
    #: where none is declared; empty: none. A pipeline stage's state regions pair with
    #: decode's by layer (:func:`stage_state`).
    state_layers: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)], ...],
        msgspec.Meta(max_length=1 << 12),
    ] = ()

    def __post_init__(self) -> None:
        # (attn_tp or pp < 1: msgspec says so on decode; Python callers get it from here)
        if self.attn_tp >= 1 and self.attn_rank >= self.attn_tp:
            raise ValueError(f"attention-TP rank {self.attn_rank} of attention TP {self.attn_tp}")
        if self.pp >= 1 and self.pp_rank >= self.pp:
            raise ValueError(f"pipeline rank {self.pp_rank} of pipeline size {self.pp}")


#: Rule 1: the fields that must be equal, with how a reason names each.
MUST_MATCH: Final[tuple[tuple[str, str], ...]] = (
    ("dtype", "KV dtype"),
    ("page_tokens", "page size (tokens)"),
    ("mla", "MLA"),
    ("state_types", "state types"),
)

#: Rule 2: equal where both sides declare them (non-zero).
DECLARED_MATCH: Final[tuple[tuple[str, str], ...]] = (
    ("kv_heads", "KV heads"),
    ("head_bytes", "head size in bytes"),
)


def _multiple(prefill: int, decode: int) -> bool:
    return prefill % decode == 0 or decode % prefill == 0


def _decode_one(prefill: int, decode: int) -> bool:
    return decode == 1


#: Rule 3: (field, supported(prefill value, decode value), what an unsupported pair is).
SHAPE_RULES: Final[tuple[tuple[str, Callable[[int, int], bool], str], ...]] = (
    (
        "attn_tp",
        _multiple,
        "one attention TP must be a multiple of the other",
    ),
    ("pp", _decode_one, "pipeline parallelism on decode is not supported"),
)


def mismatch(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """``None`` if a prefill rank declaring ``prefill`` may serve a decode rank declaring
    ``decode``; otherwise the first reason, naming the field and both values. Both sides call
    it with the roles in this order, so both refuse with the same words."""
    problem = _layers_problem(prefill, decode)
    if problem is not None:
        return problem
    for name, label in MUST_MATCH:
        mine, theirs = getattr(prefill, name), getattr(decode, name)
        if name == "state_types" and prefill.pp > 1:
            if isinstance(stage_types(prefill, decode), str):
                return (
                    f"fingerprint mismatch: {label} ({name}): prefill pipeline stage "
                    f"{prefill.pp_rank} has {_show(mine)}, not among decode's {_show(theirs)} "
                    "in their order"
                )
        elif mine != theirs:
            return (
                f"fingerprint mismatch: {label} ({name}): prefill has {_show(mine)}, "
                f"decode has {_show(theirs)}"
            )
    for name, label in DECLARED_MATCH:
        mine, theirs = getattr(prefill, name), getattr(decode, name)
        if mine and theirs and mine != theirs:
            return (
                f"fingerprint mismatch: {label} ({name}): prefill has {mine}, decode has {theirs}"
            )
    for name, supported, what in SHAPE_RULES:
        mine, theirs = getattr(prefill, name), getattr(decode, name)
        if not supported(mine, theirs):
            return f"fingerprint mismatch: {what} ({name}): prefill has {mine}, decode has {theirs}"
    return _stage_problem(prefill, decode) or _split_problem(prefill, decode)


def _layers_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Rules 1 and 5 for ``layers``: equal without pipeline parallelism, a stage's span inside
    decode's layers (and the first and last stages at its ends) with it."""
    if prefill.pp == 1:
        if prefill.layers != decode.layers:
            return (
                f"fingerprint mismatch: layers (layers): prefill has {_show(prefill.layers)}, "
                f"decode has {_show(decode.layers)}"
            )
        return None
    first, end = prefill.first_layer, prefill.first_layer + prefill.layers
    stage = f"prefill pipeline stage {prefill.pp_rank} of {prefill.pp}"
    if not prefill.layers:
        return f"fingerprint mismatch: {stage} declares no layers (layers: 0)"
    if end > decode.layers:
        return (
            f"fingerprint mismatch: layers (first_layer, layers): {stage} holds layers "
            f"{first} to {end - 1}, decode has {_show(decode.layers)}"
        )
    if prefill.pp_rank == 0 and first:
        return f"fingerprint mismatch: layers (first_layer): {stage} starts at layer {first}, not 0"
    if prefill.pp_rank == prefill.pp - 1 and end != decode.layers:
        return (
            f"fingerprint mismatch: layers (first_layer, layers): {stage}, the last, ends at "
            f"layer {end - 1} but decode has {decode.layers} layers"
        )
    return None


def _stage_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Rule 5: what pipeline parallelism on prefill does not combine with."""
    if prefill.pp == 1:
        return None
    if prefill.attn_tp != decode.attn_tp:
        return (
            f"fingerprint mismatch: prefill pipeline parallelism (pp {prefill.pp}) with unequal "
            f"attention TP (prefill {prefill.attn_tp}, decode {decode.attn_tp}) is not "
            "supported (pp, attn_tp)"
        )
    # Every stage declares the model's types, its buffers or none (SGLang's
    # ``setup_state_kv_args``), and SGLang refuses by type: a stage without MiniMax buffers is
    # refused as the others are.
    refused = [t for t in decode.state_types if t in SGLANG_REFUSES_PP]
    if refused:
        return (
            f"fingerprint mismatch: prefill pipeline parallelism (pp {prefill.pp}) with state "
            f"pools ({', '.join(refused)}) is not supported (pp, state_types)"
            + _sglang_says(tuple(refused), SGLANG_REFUSES_PP)
        )
    if prefill.state_types:
        for side, fp in (("prefill", prefill), ("decode", decode)):
            if not fp.state_layers or min(fp.state_layers) < 0:
                return (
                    f"fingerprint mismatch: prefill pipeline parallelism (pp {prefill.pp}) with "
                    f"state pools ({', '.join(prefill.state_types)}) needs the model layer of "
                    f"every state buffer (SGLang's state_layer_ids), and {side} does not "
                    f"declare them all (pp, state_layers); SGLang's own NIXL backend refuses it "
                    "too: PP-heterogeneous transfer requires layer ids on both peers"
                )
    return None


def stage_state(
    prefill: Fingerprint,
    decode: Fingerprint,
    local_groups: tuple[int, ...],
    remote_groups: tuple[int, ...],
) -> tuple[int, ...] | str | None:
    """For a pair that passed :func:`mismatch`: which of decode's state regions
    (``remote_groups`` of them per state type) each of a prefill pipeline stage's state regions
    (``local_groups`` per type) lands in; None without pipeline parallelism or state; or why
    they cannot pair. Regions pair by model layer within their state type, occurrences in order
    (a layer has several state tensors: Mamba's conv and SSM), as SGLang's
    ``build_transfer_entry_pairs`` pairs them."""
    if prefill.pp == 1:
        return None
    if not local_groups:  # a stage holding no state buffer: it writes none of decode's
        return () if remote_groups else None
    kinds = stage_types(prefill, decode)
    if isinstance(kinds, str):
        return kinds
    mine, theirs = prefill.state_layers, decode.state_layers
    if len(mine) != sum(local_groups) or len(theirs) != sum(remote_groups):
        return (
            f"prefill pipeline stage {prefill.pp_rank}: {len(mine)} state layer ids for "
            f"{sum(local_groups)} state buffers, decode {len(theirs)} for {sum(remote_groups)}"
        )
    decode_types = [t for t, n in enumerate(remote_groups) for _ in range(n)]
    picked: list[int] = []
    start = 0
    for t, count in enumerate(local_groups):
        free: dict[int, list[int]] = {}
        for j, layer in enumerate(theirs):
            if decode_types[j] == kinds[t]:
                free.setdefault(layer, []).append(j)
        for layer in mine[start : start + count]:
            if not free.get(layer):
                name = prefill.state_types[t] if t < len(prefill.state_types) else t
                return (
                    f"prefill pipeline stage {prefill.pp_rank}: decode has no {name} state "
                    f"buffer left for model layer {layer}"
                )
            picked.append(free[layer].pop(0))
        start += count
    return tuple(picked)


def stage_types(prefill: Fingerprint, decode: Fingerprint) -> tuple[int, ...] | str:
    """Which of decode's state types each of a prefill rank's state types is (its position
    in decode's ``state_types``), or why they do not pair. A pipeline stage holds the state
    buffers of its own layers only, so it may hold no buffer of a type (a hybrid model whose
    linear-attention layers all sit on another stage): SGLang then sends nothing of that type
    from that stage and goes on, and so does kvfsm. Its types must be decode's in decode's
    order, some left out; without pipeline parallelism they must be decode's exactly."""
    mine, theirs = prefill.state_types, decode.state_types
    if prefill.pp == 1:
        return tuple(range(len(mine))) if mine == theirs else "state types differ"
    picked: list[int] = []
    at = 0
    for name in mine:
        while at < len(theirs) and theirs[at] != name:
            at += 1
        if at == len(theirs):
            return f"state type {name!r} is not among decode's {_show(theirs)} in their order"
        picked.append(at)
        at += 1
    return tuple(picked)


def stage_buffers(
    prefill: Fingerprint, decode: Fingerprint, local_kv: int, remote_kv: int
) -> tuple[int, ...] | str | None:
    """For a pair that passed :func:`mismatch`: which of decode's ``remote_kv`` KV buffers each
    of this prefill rank's ``local_kv`` buffers lands in, or None when they pair one to one (no
    pipeline parallelism), or why they cannot pair. Both sides order buffers as SGLang's pools
    register them: each kind of per-layer buffer (K, then V; MLA's one latent) for every
    layer in turn, so local buffer ``k * layers + i`` is decode's ``k * decode.layers +
    first_layer + i``."""
    if prefill.pp == 1:
        return None
    per_layer, rest = divmod(local_kv, prefill.layers)
    if rest or not per_layer or remote_kv != per_layer * decode.layers:
        return (
            f"prefill pipeline stage {prefill.pp_rank}: {local_kv} KV buffers for "
            f"{prefill.layers} layers, decode {remote_kv} for {decode.layers}: not the same "
            "number of buffers per layer"
        )
    return tuple(
        kind * decode.layers + prefill.first_layer + i
        for kind in range(per_layer)
        for i in range(prefill.layers)
    )


def _split_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Rule 4, for unequal attention TP."""
    if prefill.attn_tp == decode.attn_tp:
        return None
    problem = None if prefill.mla else _heads_problem(prefill, decode)
    return problem or _state_split_problem(prefill, decode)


#: State types that pair under unequal attention TP without MLA (``_state_plan``: Mamba's
#: channel shards, SWA's head slices, DSA's per-token indexer cache); with MLA every type but
#: MiniMax's does, whole.
PAIR_UNDER_UNEQUAL_TP: Final = frozenset({"mamba", "swa", "dsa"})
_MINIMAX: Final = frozenset({"minimax_index_k", "minimax_dense_kv"})
#: Types whose state a decode rank takes from the prefill ranks SGLang pairs it with under
#: unequal attention TP (``_slices.state_group``: Mamba's shards; a replicated item or DSA's
#: indexer from one of them), whether or not that rank writes it KV: ``_slices.state_legs``.
GROUP_LEGS: Final = frozenset({"mamba", "dsa"})


def _state_split_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Rule 4 for state pools."""
    types = prefill.state_types
    if prefill.mla:
        refused = [t for t in types if t in _MINIMAX]
    else:
        refused = [t for t in types if t not in PAIR_UNDER_UNEQUAL_TP]
    if refused:
        return (
            f"fingerprint mismatch: state pools ({', '.join(refused)}) with unequal attention "
            f"TP (prefill {prefill.attn_tp}, decode {decode.attn_tp}) are not supported "
            "(state_types, attn_tp)" + _sglang_says(tuple(refused), SGLANG_REFUSES_UNEQUAL_TP)
        )
    return None


#: State types SGLang 0.5.23's NIXL backend itself refuses under unequal attention TP (non-MLA)
#: or prefill pipeline parallelism, with its own words (``maybe_send_extra``,
#: sglang/srt/disaggregation/nixl/conn.py): kvfsm's refusal then says so.
SGLANG_REFUSES_UNEQUAL_TP: Final[dict[str, str]] = {
    "minimax_index_k": "heterogeneous TP not supported for MiniMax state yet",
    "minimax_dense_kv": "heterogeneous TP not supported for MiniMax state yet",
    "block_scale": "PD different TP sizes for non-MLA BLOCK_SCALE hybrid models",
    "block_scale_swa": "PD different TP sizes for non-MLA BLOCK_SCALE_SWA hybrid models",
    "swa_ring": "PD different TP sizes for non-MLA SWA_RING hybrid models",
    "c128_state": "PD different TP sizes for non-MLA C128_STATE hybrid models",
    "request_row": "PD different TP sizes for non-MLA REQUEST_ROW hybrid models",
    "qsa_pending": "PD different TP sizes for non-MLA QSA_PENDING hybrid models",
    "qsa_compressed": "PD different TP sizes for non-MLA QSA_COMPRESSED hybrid models",
}
SGLANG_REFUSES_PP: Final[dict[str, str]] = {
    "minimax_index_k": "PP>1 not supported for MiniMax state yet",
    "minimax_dense_kv": "PP>1 not supported for MiniMax state yet",
}


def _sglang_says(types: tuple[str, ...], refusals: dict[str, str]) -> str:
    said = sorted({refusals[t] for t in types if t in refusals})
    return f"; SGLang's own NIXL backend refuses it too: {'; '.join(said)}" if said else ""


def _heads_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    heads = prefill.kv_heads
    if not heads or not prefill.head_bytes:
        return (
            "fingerprint mismatch: unequal attention TP (prefill "
            f"{prefill.attn_tp}, decode {decode.attn_tp}) needs prefill to declare its KV heads "
            f"(kv_heads: {heads}) and head size (head_bytes: {prefill.head_bytes})"
        )
    for side, tp in (("prefill", prefill.attn_tp), ("decode", decode.attn_tp)):
        if heads % tp and tp % heads:
            return (
                f"fingerprint mismatch: the model's {heads} KV heads cannot be split over "
                f"{side} attention TP {tp} (kv_heads, attn_tp)"
            )
    if prefill.attn_tp > heads and not decode.kv_heads:
        return (
            f"fingerprint mismatch: prefill attention TP {prefill.attn_tp} replicates the "
            f"model's {heads} KV heads, so decode must declare them too (kv_heads: 0)"
        )
    return None


def link_slot(prefill: Fingerprint, decode: Fingerprint) -> tuple[int, int]:
    """``(leg, legs)``: which of the decode ranks this prefill rank writes each room into the
    link's decode rank is, and how many there are (one sender room, a leg, for each;
    ``_slices.prefill_legs``). 0 of 1 at equal attention TP, and for a decode rank this
    prefill rank writes nothing into (a dummy link). Several when decode's attention TP is
    larger, or when state sharded over attention TP goes to another decode rank than the
    prefill rank's KV (replicated heads on both sides: ``_slices.state_legs``)."""
    if decode.attn_tp == prefill.attn_tp:
        return 0, 1
    grouped = not prefill.mla and any(t in GROUP_LEGS for t in prefill.state_types)
    if decode.attn_tp < prefill.attn_tp and not grouped:
        return 0, 1
    total = 1 if prefill.mla else prefill.kv_heads
    ranks = prefill_legs(total, prefill.attn_tp, decode.attn_tp, prefill.attn_rank, grouped=grouped)
    if decode.attn_rank not in ranks:
        return 0, 1  # no KV and no state for it: a dummy link
    return ranks.index(decode.attn_rank), len(ranks)


def link_plan(prefill: Fingerprint, decode: Fingerprint) -> KvPiece | str | None:
    """What prefill writes of each KV page into this decode rank, for a pair that passed
    :func:`mismatch`: None for whole pages (equal TP, or a prefill rank whose heads are the
    decode rank's), a :class:`KvPiece`, or ``"none"``: no KV at all (a dummy link)."""
    if prefill.attn_tp == decode.attn_tp:
        return None
    return link_piece(
        total_heads=1 if prefill.mla else prefill.kv_heads,
        head_bytes=max(1, prefill.head_bytes),
        rows=prefill.page_tokens,
        prefill_tp=prefill.attn_tp,
        prefill_rank=prefill.attn_rank,
        decode_tp=decode.attn_tp,
        decode_rank=decode.attn_rank,
    )


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]" if value else "none"
    if value in {0, ""}:
        return f"{value!r} (not declared)"
    return repr(value) if isinstance(value, str) else str(value)
