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

1. **Layout fields must be equal** (:data:`MUST_MATCH`): layers, dtype, page size in tokens,
   MLA or not, and the state types. A field left at its default (0 or empty: "not declared")
   is compared like any other value, so a side that declares nothing pairs only with a side
   that declares nothing; the layout check of the data path (item sizes,
   ``Layout.compatible_with``) still applies to those.
2. **Head fields must be equal where both sides declare them** (:data:`DECLARED_MATCH`): KV
   heads of the whole model and head size in bytes. SGLang's decode does not know its head
   counts (its scheduler sets them only for staging, after the manager exists), so decode may
   leave them at 0. Prefill, which plans the head slices it writes, must declare them when
   attention TP differs (rule 4).
3. **Parallel shapes must be a pair the data path supports** (:data:`SHAPE_RULES`): one
   attention TP a multiple of the other (prefill's larger: several prefill ranks feed each
   decode rank; decode's larger: each prefill rank writes every room into several decode
   ranks) and no pipeline parallelism on either side.
4. **Unequal attention TP must split** (:func:`mismatch`): the model's KV heads split over
   both TPs (one divides the other, ``_slices.HeadShard``); if prefill replicates heads (its
   TP above the head count), decode must declare the head count too, since which replica
   writes depends on it. State pools (Mamba, ...) are sharded over attention TP as well and
   move as whole rows, so a model with one pairs only at equal attention TP.
5. The protocol version is checked before the fingerprint (``check_hello``): a peer of another
   version may not even have one.

:func:`link_plan` then says what prefill writes of each page over the link: whole pages, a
head slice (``KvPiece``), or no KV at all (a dummy link), by the rules of ``_slices``.

The rules are data and :func:`mismatch` is pure: it is tested directly, and the control plane
only carries its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final

import msgspec

from kvfsm.transport._slices import HeadShard, KvPiece, link_piece, targets

__all__ = [
    "DECLARED_MATCH",
    "MUST_MATCH",
    "SHAPE_RULES",
    "Fingerprint",
    "link_plan",
    "link_slot",
    "mismatch",
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

    def __post_init__(self) -> None:
        if self.attn_tp >= 1 and self.attn_rank >= self.attn_tp:  # (attn_tp < 1: msgspec says)
            raise ValueError(f"attention-TP rank {self.attn_rank} of attention TP {self.attn_tp}")


#: Rule 1: the fields that must be equal, with how a reason names each.
MUST_MATCH: Final[tuple[tuple[str, str], ...]] = (
    ("layers", "layers"),
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


def _both_one(prefill: int, decode: int) -> bool:
    return prefill == decode == 1


#: Rule 3: (field, supported(prefill value, decode value), what an unsupported pair is).
SHAPE_RULES: Final[tuple[tuple[str, Callable[[int, int], bool], str], ...]] = (
    (
        "attn_tp",
        _multiple,
        "one attention TP must be a multiple of the other",
    ),
    ("pp", _both_one, "pipeline parallelism is not supported"),
)


def mismatch(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """``None`` if a prefill rank declaring ``prefill`` may serve a decode rank declaring
    ``decode``; otherwise the first reason, naming the field and both values. Both sides call
    it with the roles in this order, so both refuse with the same words."""
    for name, label in MUST_MATCH:
        mine, theirs = getattr(prefill, name), getattr(decode, name)
        if mine != theirs:
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
    return _split_problem(prefill, decode)


def _split_problem(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Rule 4, for unequal attention TP."""
    if prefill.attn_tp == decode.attn_tp:
        return None
    problem = None if prefill.mla else _heads_problem(prefill, decode)
    if problem is None and prefill.state_types:
        # SGLang shards a request's state (Mamba conv/SSM) over attention TP too; one leg
        # writes whole state rows, which fit only an equal shard.
        problem = (
            "fingerprint mismatch: state pools "
            f"({', '.join(prefill.state_types)}) with unequal attention TP (prefill "
            f"{prefill.attn_tp}, decode {decode.attn_tp}) are not supported (state_types, attn_tp)"
        )
    return problem


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
    link's decode rank is, and how many there are (one sender room, a leg, for each). 0 of 1
    unless decode's attention TP is larger than prefill's."""
    if decode.attn_tp <= prefill.attn_tp:
        return 0, 1
    total = 1 if prefill.mla else prefill.kv_heads
    shard = HeadShard(total, prefill.attn_tp, prefill.attn_rank)
    ranks = [piece.decode_rank for piece in targets(shard, decode.attn_tp)]
    if decode.attn_rank not in ranks:
        return 0, 1  # no KV for it: a dummy link (never with decode's TP the larger)
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
