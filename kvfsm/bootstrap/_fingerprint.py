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

1. **Layout fields must be equal** (:data:`MUST_MATCH`): layers, KV heads of the whole
   model, head size in bytes, dtype, page size in tokens, MLA or not, and the state types. A
   field left at its default (0 or empty: "not declared") is compared like any other value, so
   a side that declares nothing pairs only with a side that declares nothing; the layout check
   of the data path (item sizes, ``Layout.compatible_with``) still applies to those.
2. **Parallel shapes must be a pair the data path supports** (:data:`SHAPE_RULES`): today equal
   attention TP and no pipeline parallelism on either side.
3. The protocol version is checked before the fingerprint (``check_hello``): a peer of another
   version may not even have one.

The rules are data and :func:`mismatch` is pure: it is tested directly, and the control plane
only carries its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final

import msgspec

__all__ = ["MUST_MATCH", "SHAPE_RULES", "Fingerprint", "mismatch"]

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


#: Rule 1: the fields that must be equal, with how a reason names each.
MUST_MATCH: Final[tuple[tuple[str, str], ...]] = (
    ("layers", "layers"),
    ("kv_heads", "KV heads"),
    ("head_bytes", "head size in bytes"),
    ("dtype", "KV dtype"),
    ("page_tokens", "page size (tokens)"),
    ("mla", "MLA"),
    ("state_types", "state types"),
)


def _equal(prefill: int, decode: int) -> bool:
    return prefill == decode


def _both_one(prefill: int, decode: int) -> bool:
    return prefill == decode == 1


#: Rule 2: (field, supported(prefill value, decode value), what an unsupported pair is).
SHAPE_RULES: Final[tuple[tuple[str, Callable[[int, int], bool], str], ...]] = (
    ("attn_tp", _equal, "unequal attention TP is not supported"),
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
    for name, supported, what in SHAPE_RULES:
        mine, theirs = getattr(prefill, name), getattr(decode, name)
        if not supported(mine, theirs):
            return f"fingerprint mismatch: {what} ({name}): prefill has {mine}, decode has {theirs}"
    return None


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]" if value else "none"
    if value in {0, ""}:
        return f"{value!r} (not declared)"
    return repr(value) if isinstance(value, str) else str(value)
