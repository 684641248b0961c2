"""SGLang's hybrid state (``KVArgs.state_*``) as kvfsm's state groups, and the rows a request
names in them.

SGLang's scheduler describes a hybrid model's state as one entry per ``StateType`` in
``kv_args.state_types``, each with its own buffers (``state_data_ptrs[i]``, ``_lens[i]``,
``_item_lens[i]``): Mamba's conv and SSM tensors per layer, a sliding-window KV pool, DSA's
indexer cache, MiniMax's index-K and dense-KV pools, and so on. Each request then names, per
state type, which items of those buffers are its own (``state_indices[i]``: Mamba's one slot, the
SWA pages of its window, its DSA pages, ...; ``None`` or empty when it has none of that type).
SGLang's NIXL backend moves item ``src[k]`` of every buffer of type ``i`` into item ``dst[k]`` of
the same buffer on decode (``maybe_send_extra`` in sglang/srt/disaggregation/nixl/conn.py).

kvfsm registers the buffers of every state type that has any as one state group of its
:class:`~kvfsm.transport.Layout`, one state type after another (``state_groups``: the buffer
count of each), so a layout row of type ``t`` is ``first_row(t) + item``, and moving it moves
that item of each of the type's buffers, exactly what SGLang moves. A request's indices become
layout rows here; each is checked against its own type's range (a row past the Mamba pool is
refused as such, not taken for a row of the next type), and the transport checks again that
every source row lands in a row of the same type on decode.

Which state types move how
--------------------------

:data:`INDEXED` are the types whose items SGLang pairs one to one, source index ``k`` to
destination index ``k`` (it raises on a length mismatch): every state type of SGLang 0.5.23's
NIXL backend except :data:`SLOT_ONE` and ``dsa_tail``. Mamba (:data:`SLOT_ONE`) names one slot
per request (SGLang asserts it). ``dsa_tail`` (:data:`RING_ROW`, DeepSeek V4's compressed-KV
tail ring) names the live slots of one ring row (at most two segments, the ring wrapped). Each
side's ring is its pool's compression ring plus its speculative slots (``tail_extra_slots``),
and a request's live slots start at its length, less the live count, modulo that side's own
ring. :meth:`StateMap.rows` turns the entry into the row and keeps its live segments beside the
rows (:class:`~kvfsm.rooms.StateRows`), which decode sends prefill with the rows
(``RoomMetadata.rings``). With rings of one size (the same row bytes: SGLang requires equal
slot sizes) the whole row moves, and every live slot lands at its offset. With rings of
different sizes the state plan (``kvfsm.control``, rule 7) leaves the ring regions to the
transport, which pairs prefill's live slots with decode's in token order for each request
(``kvfsm.transport._rings``), as SGLang's ``build_dsa_tail_transfer_blocks`` does; segments that
do not pair (other live counts, a segment past its ring) fail that request.

Parallel shapes each type pairs under are the handshake's business (``kvfsm.control``'s
fingerprint rules); this module only says what this rank holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from kvfsm.rooms import StateRows
from kvfsm.sglang._errors import UnsupportedError

__all__ = ["INDEXED", "REFUSED", "RING_ROW", "SLOT_ONE", "StateMap", "state_name"]

#: State types whose request indices pair item to item (SGLang's ``_send_kvcache_generic``).
INDEXED: Final[frozenset[str]] = frozenset(
    {
        "swa",
        "dsa",
        "qsa_pending",
        "qsa_compressed",
        "minimax_index_k",
        "minimax_dense_kv",
        "swa_ring",
        "c128_state",  # DSV4_REQUEST_STATE's wire value
        "request_row",
        "block_scale",
        "block_scale_swa",
    }
)
#: State types with exactly one item (a slot) per request.
SLOT_ONE: Final[frozenset[str]] = frozenset({"mamba"})
#: State types whose request entry describes the live part of one ring row: DeepSeek V4's
#: compressed-KV tail, ``[row, offset1, count1, offset2, count2, ring size]``
#: (``get_dsa_tail_state_indices`` in sglang/srt/disaggregation/utils.py; empty when no token
#: is live).
RING_ROW: Final[frozenset[str]] = frozenset({"dsa_tail"})
#: State types kvfsm refuses at start-up, with why (none today: every type of SGLang 0.5.23's
#: NIXL backend moves).
REFUSED: Final[dict[str, str]] = {}


def _ring_problem(entry: Sequence[int]) -> str | None:
    """Why a ring-row entry is malformed, or None (SGLang's checks in
    ``build_dsa_tail_transfer_blocks``)."""
    if len(entry) != 6:
        return f"a ring-row entry has 6 values, not {len(entry)}"
    row, first_at, first_n, second_at, second_n, ring = entry
    if ring <= 0 or row < 0:
        return f"ring size {ring} and row {row} must be positive"
    for at, n in ((first_at, first_n), (second_at, second_n)):
        if min(at, n) < 0 or at + n > ring:
            return f"segment ({at}, {n}) exceeds the ring of {ring} slots"
    return None


def state_name(state_type: object) -> str:
    """SGLang's ``StateType`` (a ``str`` enum) or a plain string, as its wire value."""
    return str(getattr(state_type, "value", state_type))


@dataclass(frozen=True, slots=True)
class _Pool:
    """One state type this rank registered: where it sits in ``state_types`` and in the
    layout's state rows."""

    index: int
    name: str
    first_row: int = 0
    rows: int = 0


@dataclass(slots=True)
class _Shards:
    """SGLang's per-buffer sharding lists, gathered for the buffers kvfsm registers."""

    args: Any
    dims: list[int | None] = field(default_factory=list)
    conv: list[tuple[int, ...]] = field(default_factory=list)
    outer: list[int] = field(default_factory=list)
    layers: list[int | None] = field(default_factory=list)

    def _entry(self, name: str, i: int, k: int) -> Any:
        lists = getattr(self.args, name, None) or []
        entry = lists[i] if i < len(lists) else None
        return entry[k] if entry and k < len(entry) else None

    def add(self, i: int, buffers: Sequence[int], ring_of: int = 0) -> None:
        """Buffers ``buffers`` of state type ``i``; ``ring_of``: a tail-ring type's buffer
        count, whose layers SGLang implies when it names none (:meth:`_ring_layer`)."""
        for k in buffers:
            dim = self._entry("state_dim_per_tensor", i, k)
            self.dims.append(None if dim is None else int(dim))
            conv = self._entry("state_conv_shard_groups", i, k)
            self.conv.append(tuple(int(g) for g in conv) if conv else ())
            outer = self._entry("state_slice_outer_counts", i, k)
            self.outer.append(int(outer) if outer else 1)
            layer = self._entry("state_layer_ids", i, k)
            if layer is None and ring_of:
                layer = self._ring_layer(k, ring_of)
            self.layers.append(None if layer is None else int(layer))

    def _ring_layer(self, k: int, count: int) -> int | None:
        """The model layer of buffer ``k`` of a tail ring SGLang lists without layer ids: the
        key ring of every layer of this rank's span, then the score ring of every layer
        (``get_compress_tail_buf_infos``), the span starting at ``prefill_start_layer`` (0
        on decode, which holds every layer). SGLang's NIXL backend pairs a pipeline stage's
        rings with decode's by exactly these layers (``slice_dsa_tail_dst_ptrs_for_pp`` in
        sglang/srt/disaggregation/utils.py)."""
        if count % 2:
            return None
        first = int(getattr(self.args, "prefill_start_layer", 0) or 0)
        return first + k % (count // 2)

    @staticmethod
    def declared(values: list[int | None]) -> tuple[int, ...]:
        # -1 for a buffer SGLang declares none for (an SWA pool beside Mamba's tensors).
        if all(v is None for v in values):
            return ()
        return tuple(-1 if v is None else v for v in values)


@dataclass(frozen=True, slots=True)
class StateMap:
    """This rank's state types, in ``KVArgs`` order, with the buffers each registers."""

    #: ``len(kv_args.state_types)``: how many entries SGLang's ``state_indices`` have.
    types: int
    pools: tuple[_Pool, ...]
    ptrs: tuple[int, ...] = ()
    lens: tuple[int, ...] = ()
    items: tuple[int, ...] = ()
    #: Buffers per registered state type, in order (the layout's ``state_groups``).
    groups: tuple[int, ...] = ()
    #: Per registered buffer: how SGLang shards it over attention TP (``state_dim_per_tensor``,
    #: ``state_conv_shard_groups``, ``state_slice_outer_counts``), what the fingerprint
    #: declares for the state plan of unequal TP. ``dims``: -1 for a buffer without one, empty
    #: when no buffer has one.
    dims: tuple[int, ...] = ()
    conv: tuple[tuple[int, ...], ...] = ()
    outer: tuple[int, ...] = ()
    #: Per registered buffer: its model layer (``state_layer_ids``), -1 where none is given;
    #: empty when none is (what a pipeline stage's state pairs by).
    layers: tuple[int, ...] = ()
    #: A prefill pipeline stage: a type the model declares but this stage holds no buffer of
    #: (its layers sit on other stages) is skipped in a request's indices, as SGLang's NIXL
    #: backend skips it (it sends nothing of a type without buffers); elsewhere such indices
    #: are refused.
    stage: bool = False

    @classmethod
    def from_kv_args(cls, args: Any) -> StateMap:
        """The state types with buffers in ``args``; raises :class:`UnsupportedError` naming a
        type kvfsm does not move, and ``ValueError`` for lists that do not line up."""
        ptrs = list(getattr(args, "state_data_ptrs", None) or [])
        lens = list(getattr(args, "state_data_lens", None) or [])
        items = list(getattr(args, "state_item_lens", None) or [])
        names = [state_name(t) for t in (getattr(args, "state_types", None) or [])]
        if not names and any(ptrs):
            names = [f"state type {i}" for i in range(len(ptrs))]
        pools: list[_Pool] = []
        flat: tuple[list[int], list[int], list[int]] = ([], [], [])
        groups: list[int] = []
        shards = _Shards(args)
        for i, name in enumerate(names):
            group = list(ptrs[i]) if i < len(ptrs) else []
            if not group:
                continue  # declared, but this model has no buffers of it
            if name in REFUSED:
                raise UnsupportedError(f"state type {name!r} {REFUSED[name]}")
            if name not in INDEXED and name not in SLOT_ONE and name not in RING_ROW:
                raise UnsupportedError(
                    f"state type {name!r} is not one SGLang 0.5.23's NIXL backend moves"
                )
            sizes = list(lens[i]) if i < len(lens) else []
            item = list(items[i]) if i < len(items) else []
            if not len(group) == len(sizes) == len(item):
                raise ValueError(
                    f"state type {name!r}: {len(group)} state_data_ptrs, {len(sizes)} "
                    f"state_data_lens, {len(item)} state_item_lens"
                )
            # An empty buffer (no rows, item length 0) holds a layer's place only: DeepSeek's
            # index-sharing layers have no tail ring of their own, and SGLang keeps their entry
            # so that the peers' layers stay aligned, and moves nothing of it. Both sides leave
            # out the same places (the layout check refuses a pair that does not).
            kept = [k for k in range(len(group)) if int(item[k]) > 0 and int(sizes[k]) > 0]
            if not kept:
                continue
            pools.append(_Pool(i, name))
            for target, values in zip(flat, (group, sizes, item), strict=True):
                target.extend(int(values[k]) for k in kept)
            groups.append(len(kept))
            shards.add(i, kept, len(group) if name in RING_ROW else 0)
        return cls(
            len(names),
            tuple(pools),
            tuple(flat[0]),
            tuple(flat[1]),
            tuple(flat[2]),
            tuple(groups),
            shards.declared(shards.dims),
            tuple(shards.conv),
            tuple(shards.outer),
            shards.declared(shards.layers),
        )

    @property
    def group_legs(self) -> bool:
        """A state type a decode rank takes from every prefill rank of its group under unequal
        attention TP (``kvfsm.control``'s ``GROUP_LEGS``): Mamba's shards, DSA's indexer."""
        return any(pool.name in ("mamba", "dsa") for pool in self.pools)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered state types' names, in order (what the fingerprint declares)."""
        return tuple(pool.name for pool in self.pools)

    def placed(self, type_rows: Sequence[tuple[int, int]]) -> StateMap:
        """This map with each type's layout rows, ``(first_row, rows)`` per registered type as
        the layout reports them (:meth:`~kvfsm.transport.Layout.state_type_rows`)."""
        if len(type_rows) != len(self.pools):
            raise ValueError(f"{len(type_rows)} state types in the layout, {len(self.pools)} here")
        pools = tuple(
            _Pool(p.index, p.name, first, rows)
            for p, (first, rows) in zip(self.pools, type_rows, strict=True)
        )
        return dataclasses.replace(self, pools=pools)

    def rows(self, state_indices: Sequence[Any] | None) -> StateRows | str | None:
        """The layout rows a request's ``state_indices`` name (one entry per state type, a
        sequence of items or None), type after type; None when it names none; a string when
        the request cannot be served, saying why. A ring row's live segments ride with the
        rows (``StateRows.rings``, ``RING_FIELDS`` per ring row: its position among the rows,
        then the entry less its row)."""
        if state_indices is None:
            return None
        registered = {pool.index for pool in self.pools}
        for i, entry in enumerate(state_indices):
            if self.stage and i < self.types:
                continue  # declared by the model: another stage holds its buffers
            if i not in registered and entry is not None and len(entry):
                return (
                    f"state indices for state type {i}, but this rank registered no buffers of it"
                )
        out = StateRows()
        rings: list[int] = []
        for pool in self.pools:
            entry = state_indices[pool.index] if pool.index < len(state_indices) else None
            if entry is None or not len(entry):
                continue
            items = [int(x) for x in entry]
            if pool.name in SLOT_ONE and len(items) != 1:
                return f"state type {pool.name!r} moves one slot per request, not {len(items)}"
            if pool.name in RING_ROW:
                problem = _ring_problem(items)
                if problem is not None:
                    return f"state type {pool.name!r}: {problem}"
                rings += [len(out), *items[1:]]
                items = items[:1]
            bad = next((x for x in items if not 0 <= x < pool.rows), None)
            if bad is not None:
                return f"state type {pool.name!r}: index {bad} is outside its {pool.rows} items"
            out.extend(pool.first_row + x for x in items)
        if rings:
            out.rings = np.asarray(rings, "<i4").tobytes()
        return out or None
