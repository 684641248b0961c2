"""A replay of SGLang 0.5.23's scheduler call sequences against kvfsm's adapter classes.

SGLang's prefill and decode scheduler loops (``disaggregation/prefill.py`` and
``decode.py``), call for call, on simulated TP ranks in one process:
each rank has its own ``KvfsmKVManager`` (its own NIXL agent over real UCX, DRAM buffers), the
instance has a real bootstrap server (``KvfsmKVBootstrapServer``), and each scheduler loop
MIN-reduces a request's polls over its ranks, the decode one behind the metadata gate (Success
counts only once the rank's aux row holds the request's ``bootstrap_room``).

:class:`Checker` watches every call and records a violation of the adapter's obligations
to the scheduler (docs/sglang.md) instead of raising, so a scenario reports all of them at once:

* before ``init``/``send_metadata``, ``poll`` is Failed, Bootstrapping or WaitingForInput;
* a rank's poll only moves forward, or into Failed; Success and Failed are sticky;
* right after ``abort()``, that rank's ``poll`` is Failed;
* ``failure_exception()`` raises (with a reason) every time it is called;
* no scheduler-facing call blocks: none takes longer than :data:`BLOCK_LIMIT_S`, and no kind of
  call is slower than :data:`CALL_LIMIT_S` more than now and then (time spent in the process's
  cyclic garbage collection, which stops every thread, not counted);
* Success means the KV pages, the aux row (``bootstrap_room`` included) and the state rows on
  every decode rank equal prefill's bytes: KV head slice by head slice (prefill fills by global
  head, so with unequal attention TP each decode head is checked against the prefill rank that
  holds it), the rows against the prefill rank writing the decode rank's first head;
* pages of a failed request, once decode was told they may be reused, are never written again
  (canary bytes, checked at the end of the scenario);
* decode prefix caching: the pages decode already holds for a request's prefix (filled with
  :data:`PREFIX_FILL`) are never written, on commit and at the end of the scenario.

Decode prefix caching is replayed as SGLang does it (docs/decode-prefix.md): decode passes only
the pages past its cached prefix, with ``decode_prefix_len``; prefill's ``finalize_bootstrap``
pops the prefix, sizes ``init`` as ``ceil((input_len - prefix) / page_size)`` and sends from the
prefix's page on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np

from kvfsm.sglang import KvfsmKVManager, KvfsmKVReceiver, KvfsmKVSender
from kvfsm.sglang._bases import DisaggregationMode, KVArgs, KVPoll
from tests.helpers.waiting import ConditionTimeoutError, wait_until_sync

# Shape of every rank's pools: small, so a scenario moves real bytes quickly on 2 vCPUs.
LAYERS, PAGES, PAGE_BYTES, PAGE_TOKENS = 2, 96, 1024, 16
#: Bytes of one head of one token: with one head per rank (the default), a page is PAGE_BYTES.
HEAD_BYTES = PAGE_BYTES // PAGE_TOKENS
AUX_ROWS, STATE_ROWS, STATE_ROW_BYTES = 24, 24, 256
#: Slots of the replay's DeepSeek-V4-style tail ring (a ring-row state type's rows).
RING_SLOTS = 8
#: Generations between DP groups' prefill fills (a scenario's generations stay below it).
DP_GENERATIONS = 1000


@dataclass(frozen=True)
class Shard:
    """One state buffer sharded over attention TP as SGLang shards it. An item is ``outer``
    rows of the buffer's channels, ``per`` bytes each. ``kind``: "channels" (Mamba's conv and
    SSM tensors: ``channels`` whole-model channels split into contiguous shares, each sub-block
    of ``conv`` apart when given, as GDN's ``q | k | v``); "heads" (an SWA page: ``PAGE_TOKENS``
    rows of the rank's KV heads, split as the KV heads are); "replicated" (every rank holds
    all ``channels``: SGLang's ``state_dim_per_tensor`` 0). Bytes are a function of the
    whole-model channel, so each side's check knows what its shard must hold."""

    kind: str
    channels: int
    per: int
    outer: int = 1
    conv: tuple[int, ...] = ()

    def channel_map(self, rank: int, tp: int, heads: Sequence[int]) -> np.ndarray:
        """The whole-model channel of each of rank ``rank``'s channels, in its item's order."""
        if self.kind == "heads":
            return np.asarray(heads, np.uint64)
        if self.kind == "replicated":
            return np.arange(self.channels, dtype=np.uint64)
        out: list[int] = []
        base = 0
        for full in self.conv or (self.channels,):
            share = full // tp
            out.extend(range(base + rank * share, base + (rank + 1) * share))
            base += full
        return np.asarray(out, np.uint64)

    def rows(self) -> int:
        return PAGE_TOKENS if self.kind == "heads" else self.outer

    def fill(
        self, seed: int, buffer: int, items: Sequence[int], channels: np.ndarray
    ) -> np.ndarray:
        """``[len(items), item bytes]``: what items ``items`` of state buffer ``buffer`` hold
        on a rank holding ``channels`` (prefill's fill; decode's expectation)."""
        return _hash_bytes(
            np.asarray(seed, np.uint64).reshape(1, 1, 1, 1, 1),
            np.asarray(0xBEEF00 + buffer, np.uint64).reshape(1, 1, 1, 1, 1),
            np.asarray(items, np.uint64).reshape(-1, 1, 1, 1, 1),
            np.arange(self.rows(), dtype=np.uint64).reshape(1, -1, 1, 1, 1),
            channels.reshape(1, 1, -1, 1, 1),
            np.arange(self.per, dtype=np.uint64).reshape(1, 1, 1, -1, 1),
        ).reshape(len(items), self.rows() * len(channels) * self.per)

    def dims(self, channels: np.ndarray) -> int | None:
        """SGLang's ``state_dim_per_tensor`` for it (None: SGLang declares none)."""
        return {"channels": len(channels), "replicated": 0}.get(self.kind)


@dataclass(frozen=True)
class StateSpec:
    """One SGLang state type of the replayed model: its name, its buffers' item sizes (one
    buffer each), items per buffer, and which of a request's items it names: ``"slot"`` its one
    state slot (Mamba), ``"window"`` the state items of its last ``window`` KV pages, the page
    ids themselves (SWA-, DSA-, MiniMax-style page-indexed pools, sized like the KV pool)."""

    name: str
    item_bytes: tuple[int, ...]
    items: int = STATE_ROWS
    names: str = "slot"
    window: int = 2
    #: How each buffer is sharded over attention TP (:class:`Shard`); empty: every rank holds
    #: bytes of its own (``item_bytes``), which pair only at equal TP or from one writer.
    shards: tuple[Shard, ...] = ()
    #: The model layer of each buffer; empty: none. ``declare_layers``: the scheduler passes
    #: them as SGLang's ``state_layer_ids`` (a pipeline stage holds its layers' buffers anyway).
    layers: tuple[int, ...] = ()
    declare_layers: bool = True
    #: A tail ring's ``(compression ring, speculative slots)``: the entries are then SGLang's
    #: own (``get_dsa_tail_state_indices`` for the request's length), each side's from its own
    #: ring of ``sum(ring)`` slots; empty: the replay's fixed ring of ``RING_SLOTS``.
    ring: tuple[int, int] = ()

    def indices(self, req: Request, side: str) -> list[int]:
        """What the scheduler passes for ``req`` on ``side`` ("src" or "dst")."""
        row = req.src_state if side == "src" else req.dst_state
        if self.names == "ring" and self.ring:
            with warnings.catch_warnings():  # its imports warn of kernels this CPU lacks
                warnings.simplefilter("ignore")
                from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

            pool = SimpleNamespace(
                kpool_use_compress=True, index_kpool=self.ring[0], tail_extra_slots=self.ring[1]
            )
            return [int(x) for x in get_dsa_tail_state_indices(pool, row, req.input_len)]
        if self.names == "ring":
            # DeepSeek V4's tail ring: the live slots of the request's ring row, wrapped
            # (SGLang's get_dsa_tail_state_indices); [] when none is live.
            live = req.room % 7
            if not live:
                return []
            start = (req.room * 3) % RING_SLOTS
            first = min(live, RING_SLOTS - start)
            return [row, start, first, 0, live - first, RING_SLOTS]
        return self.items_of(req, side)

    def items_of(self, req: Request, side: str) -> list[int]:
        """The items of this type's buffers that ``req`` owns on ``side``."""
        if self.names == "ring":
            ring = self.indices(req, side)
            return ring[:1]
        if self.names == "slot":
            return [req.src_state if side == "src" else req.dst_state]
        pages = req.src_pages if side == "src" else req.dst_pages
        return list(pages[-self.window :]) if pages else []


#: One Mamba-like state type with one buffer: the replay's default hybrid model.
MAMBA_ONLY = (StateSpec("mamba", (STATE_ROW_BYTES,)),)
#: A hybrid model with several state types (a Qwen3-Next-style Mamba with conv and SSM
#: tensors, an SWA pool's K and V, a DSA-style indexer pool), each its own pools and sizes.
HYBRID = (
    StateSpec("mamba", (96, 160)),
    StateSpec("swa", (PAGE_BYTES // 2, PAGE_BYTES // 2), items=PAGES, names="window"),
    StateSpec("dsa", (136,), items=PAGES, names="window", window=PAGES),
)
#: A scheduler-facing call slower than this is counted as slow. One such call is not a block: on
#: a loaded 2-vCPU machine a thread can wait that long for the CPU or the GIL (six ranks' loop
#: threads share this process), which a clean-clone CI run once showed (58 ms, no GC). A kind of
#: call that is slow more than now and then (:data:`SLOW_SHARE`) is reported: it waits on
#: something. Whether each call can wait on kvfsm's loop or the network at all is proven by
#: event order in tests/sglang/test_conn.py, not by a stopwatch.
CALL_LIMIT_S = 0.025
#: More than this share of a kind's calls (and more than 3 of them) slow: reported.
SLOW_SHARE = 0.05
#: One call this slow is reported on its own: it waited out something (SGLang's own backends'
#: blocking calls wait seconds).
BLOCK_LIMIT_S = 0.5
CANARY = 0xA5
#: What decode's cached prefix pages hold (prefill's bytes are random, never a whole page of it).
PREFIX_FILL = 0x5C
#: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s upstream).
DEFERRED_RELEASE_TIMEOUT_S = 30.0

#: When an instance's scheduler puts the MHA head counts into ``KVArgs`` (see Instance.start).
HeadCounts = Literal["before", "after", "never"]

PRE_INIT = frozenset({KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput})
TERMINAL = frozenset({KVPoll.Failed, KVPoll.Success})
NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def live_slots(entry: Sequence[int]) -> list[int]:
    """The ring slots a tail-ring entry names, in token order (both segments)."""
    if not entry:
        return []
    _, first_at, first_n, second_at, second_n, _ = entry
    return [*range(first_at, first_at + first_n), *range(second_at, second_at + second_n)]


def _ring_differs(
    req: Request,
    spec: StateSpec,
    src_spec: StateSpec,
    mine: Sequence[np.ndarray],
    theirs: Sequence[np.ndarray],
) -> list[str]:
    """Rings of different sizes on the two sides: decode's live slots (at SGLang's positions
    for decode's ring) must hold prefill's live slots (at its positions for its own ring), in
    token order, and every other slot of decode's row must be unwritten."""
    s_entry, d_entry = src_spec.indices(req, "src"), spec.indices(req, "dst")
    s_live, d_live = live_slots(s_entry), live_slots(d_entry)
    bad = []
    if len(s_live) != len(d_live):
        return [f"{spec.name}: {len(s_live)} live slots on prefill, {len(d_live)} on decode"]
    for b, (d_buf, s_buf) in enumerate(zip(mine, theirs, strict=True)):
        d_ring, s_ring = sum(spec.ring), sum(src_spec.ring)
        d_row = d_buf[req.dst_state].reshape(d_ring, -1)
        s_row = s_buf[req.src_state].reshape(s_ring, -1)
        if not np.array_equal(d_row[d_live], s_row[s_live]):
            bad.append(f"{spec.name} buffer {b}: live slots {d_live} differ")
        others = [i for i in range(d_ring) if i not in d_live]
        if d_row[others].any():
            bad.append(f"{spec.name} buffer {b}: slots {others} outside the live ones written")
    return bad


def rank_heads(rank: int, tp: int, total: int) -> list[int]:
    """The global KV heads attention-TP rank ``rank`` of ``tp`` holds, split as SGLang splits
    them: ``tp <= total`` (divisible), a contiguous block of ``total // tp``; ``tp > total``
    (``tp % total == 0``), one head, replicated on ``tp // total`` consecutive ranks."""
    if tp <= total:
        assert total % tp == 0, (tp, total)
        n = total // tp
        return list(range(rank * n, (rank + 1) * n))
    assert tp % total == 0, (tp, total)
    return [rank // (tp // total)]


def row_sources(rank: int, prefill: Instance, decode: Instance) -> list[int]:
    """The prefill ranks decode rank ``rank`` may take its aux and state rows from. The contract:
    the lowest-numbered prefill rank writing KV into it, which is the writer of its first head.
    Equal TP: the same rank. Otherwise the prefill ranks holding that head: one when prefill's
    heads are not replicated; when they are (MLA, or more ranks than heads), which replica
    writes is the adapter's choice, so the rig names the candidates, learns the choice from the
    rank-specific aux row, and the tests tie it to the transports' byte counts."""
    if prefill.tp == decode.tp:
        return [rank]
    first = decode.buffers[rank].heads[0]
    return [r for r, b in enumerate(prefill.buffers) if first in b.heads]


_MIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def _hash_bytes(*coords: np.ndarray) -> np.ndarray:
    """A deterministic byte in 1..255 for every point of the broadcast ``coords`` (never 0, the
    value of an unwritten decode byte; a splitmix-style mix, so no two neighbouring pages,
    rows, heads or bytes are related)."""
    v = np.zeros(np.broadcast_shapes(*(c.shape for c in coords)), np.uint64)
    for k, c in enumerate(coords):
        v = (v ^ c.astype(np.uint64)) * np.uint64(_MIX[k % 2])
        v ^= v >> np.uint64(29)
    v *= np.uint64(_MIX[1])
    v ^= v >> np.uint64(32)
    return (v % np.uint64(255) + np.uint64(1)).astype(np.uint8)


def kv_bytes(
    generation: int, buffer: int, pages: Sequence[int], heads: Sequence[int], head_bytes: int
) -> np.ndarray:
    """What every prefill replica of global heads ``heads`` holds in KV buffer ``buffer`` at
    ``pages``: uint8 ``[pages, PAGE_TOKENS, heads, head_bytes]``, a function of (generation,
    buffer, page, token row, global head, byte) only, so replicas agree and decode can say what
    each of its head slices must hold."""
    g = np.asarray(generation, np.uint64).reshape(1, 1, 1, 1)
    b = np.asarray(buffer, np.uint64).reshape(1, 1, 1, 1)
    p = np.asarray(pages, np.uint64).reshape(-1, 1, 1, 1)
    t = np.arange(PAGE_TOKENS, dtype=np.uint64).reshape(1, -1, 1, 1)
    h = np.asarray(heads, np.uint64).reshape(1, 1, -1, 1)
    x = np.arange(head_bytes, dtype=np.uint64).reshape(1, 1, 1, -1)
    return _hash_bytes(g, b, p, t, h, x)


@dataclass
class RankBuffers:
    """One rank's memory, shaped like SGLang's: per-layer K and V pools (MLA: one latent pool
    per layer), the metadata buffers (first output token ids, and ``bootstrap_room``, which the
    decode metadata gate reads), and one hybrid-state pool (one state type, as for Mamba).

    KV pools are token-major: a page is ``PAGE_TOKENS`` rows, each row the rank's heads side
    by side, ``head_bytes`` each (MLA: the whole latent row, as one "head" 0)."""

    kv: list[np.ndarray]
    output_ids: np.ndarray  # int32 [rows, 16]
    rooms: np.ndarray  # int64 [rows, 8]: column 0 is the request's bootstrap_room
    #: Per state type of ``specs``: its buffers, ``[items, item_bytes]`` each.
    states: list[list[np.ndarray]]
    #: The global KV heads this rank holds, in the order they sit in a row.
    heads: list[int] = field(default_factory=lambda: [0])
    total_heads: int = 1
    head_bytes: int = HEAD_BYTES
    mla: bool = False
    #: The model's state types; empty: no hybrid state (SGLang's KVArgs have no state
    #: buffers) and no state rows move.
    specs: tuple[StateSpec, ...] = MAMBA_ONLY
    #: Prefill's fill generation (None on decode), and the whole-model channels this rank
    #: holds of each sharded state buffer (per spec, per buffer; None for unsharded ones).
    seed: int | None = None
    channels: list[list[np.ndarray | None]] = field(default_factory=list)

    @property
    def has_state(self) -> bool:
        return bool(self.specs)

    @classmethod
    def make(
        cls,
        seed: int | None,
        *,
        rank: int = 0,
        heads: Sequence[int] = (0,),
        total_heads: int = 1,
        head_bytes: int = HEAD_BYTES,
        mla: bool = False,
        state: bool | tuple[StateSpec, ...] = True,
        layers: int = LAYERS,
        tp: int = 1,
    ) -> RankBuffers:
        """``seed``: the prefill fill's generation (KV bytes by :func:`kv_bytes`, the same on
        every replica; state rows also by rank, so a rank mix-up shows); None: zeros
        (decode). ``state``: with a hybrid-state pool. ``layers``: of the whole model."""
        n_kv = layers if mla else 2 * layers
        row = PAGE_TOKENS * len(heads) * head_bytes
        specs = (MAMBA_ONLY if state else ()) if isinstance(state, bool) else state
        if seed is None:
            kv = [np.zeros((PAGES, row), np.uint8) for _ in range(n_kv)]
        else:
            kv = [
                kv_bytes(seed, i, range(PAGES), heads, head_bytes).reshape(PAGES, row)
                for i in range(n_kv)
            ]
        states, n = [], 0
        maps: list[list[np.ndarray | None]] = []
        for spec in specs:
            group = []
            maps.append([])
            if spec.shards:
                for k, shard in enumerate(spec.shards):
                    chans = shard.channel_map(rank, tp, heads)
                    maps[-1].append(chans)
                    width = shard.rows() * len(chans) * shard.per
                    group.append(
                        np.zeros((spec.items, width), np.uint8)
                        if seed is None
                        else shard.fill(seed, n + k, range(spec.items), chans)
                    )
                n += len(spec.shards)
                states.append(group)
                continue
            for size in spec.item_bytes:
                n += 1
                maps[-1].append(None)
                if seed is None:
                    group.append(np.zeros((spec.items, size), np.uint8))
                    continue
                group.append(  # by rank too, so a rank mix-up shows; by buffer, so a swap does
                    _hash_bytes(
                        np.asarray(seed, np.uint64).reshape(1, 1),
                        np.asarray(0xFFFF + rank + (n << 8), np.uint64).reshape(1, 1),
                        np.arange(spec.items, dtype=np.uint64).reshape(-1, 1),
                        np.arange(size, dtype=np.uint64).reshape(1, -1),
                    )
                )
            states.append(group)
        return cls(
            kv=kv,
            output_ids=np.zeros((AUX_ROWS, 16), np.int32),
            rooms=np.zeros((AUX_ROWS, 8), np.int64),
            states=states,
            heads=list(heads),
            total_heads=total_heads,
            head_bytes=head_bytes,
            mla=mla,
            specs=specs,
            seed=seed,
            channels=maps,
        )

    def head_view(self, buffer: int) -> np.ndarray:
        """KV buffer ``buffer`` as ``[pages, PAGE_TOKENS, local heads, head_bytes]``."""
        return self.kv[buffer].reshape(PAGES, PAGE_TOKENS, len(self.heads), self.head_bytes)

    def page_bytes(self) -> int:
        return sum(b.shape[1] for b in self.kv)

    def aux_row_bytes(self) -> int:
        return self.output_ids[0].nbytes + self.rooms[0].nbytes

    def state_indices(self, req: Request, side: str) -> list[np.ndarray] | None:
        """What the scheduler passes as ``state_indices`` for ``req`` (``side``: "src" on
        prefill, "dst" on decode): one int32 array per state type, or None without state."""
        if not self.specs:
            return None
        return [np.asarray(spec.indices(req, side), np.int32) for spec in self.specs]

    def state_bytes(self, req: Request) -> int:
        """Bytes of ``req``'s state items on this rank, over every state type."""
        return sum(
            len(spec.items_of(req, "dst")) * sum(b.shape[1] for b in group)
            for spec, group in zip(self.specs, self.states, strict=True)
        )

    def take_state(self, req: Request, src: RankBuffers) -> None:
        """Copy ``req``'s state items from ``src`` (prefill) here, as a correct delivery does."""
        for spec, mine, theirs in zip(self.specs, self.states, src.states, strict=True):
            for d_buf, s_buf in zip(mine, theirs, strict=True):
                d_buf[spec.items_of(req, "dst")] = s_buf[spec.items_of(req, "src")]

    def state_differs(self, req: Request, src: RankBuffers) -> list[str]:
        """The state types whose items of ``req`` here differ from ``src``'s (prefill's)."""
        bad = []
        n = 0
        for k, (spec, mine, theirs) in enumerate(
            zip(self.specs, self.states, src.states, strict=True)
        ):
            if spec.ring and spec.ring != src.specs[k].ring:
                bad += _ring_differs(req, spec, src.specs[k], mine, theirs)
                n += len(mine)
                continue
            s_idx, d_idx = spec.items_of(req, "src"), spec.items_of(req, "dst")
            for b, (d_buf, s_buf) in enumerate(zip(mine, theirs, strict=True)):
                chans = self.channels[k][b] if spec.shards else None
                if chans is not None and src.seed is not None:
                    # This rank's shard of the whole-model item, whoever wrote which part.
                    want = spec.shards[b].fill(src.seed, n + b, s_idx, chans)
                else:
                    want = s_buf[s_idx]
                if not np.array_equal(want, d_buf[d_idx]):
                    bad.append(f"{spec.name} buffer {b}")
            n += len(mine)
        return bad

    def set_head_counts(self, args: KVArgs) -> None:
        """``kv_head_num`` (this rank's KV heads) and ``total_kv_head_num`` (the model's), as
        SGLang sets them for MHA pools (prefill.py:336-340, decode.py:780-789); not for MLA."""
        if not self.mla:
            args.kv_head_num = len(self.heads)
            args.total_kv_head_num = self.total_heads

    def kv_args(self, engine_rank: int, *, head_counts: bool = True) -> KVArgs:
        """What SGLang's scheduler assigns to ``KVArgs`` (prefill.py:258-356, decode.py:609-764)
        before it builds the manager; ``head_counts``: :meth:`set_head_counts` too."""
        args = KVArgs()
        args.engine_rank = engine_rank
        args.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        args.kv_data_lens = [b.nbytes for b in self.kv]
        args.kv_item_lens = [b.shape[1] for b in self.kv]
        if self.mla:
            args.kv_layer_ids = list(range(len(self.kv)))
        else:
            args.kv_layer_ids = [i // 2 for i in range(len(self.kv))]
        args.kv_data_mem_kinds = ["DRAM"] * len(self.kv)  # SGLang sets it on NIXL ranks
        if head_counts:
            self.set_head_counts(args)
        aux = (self.output_ids, self.rooms)
        args.aux_data_ptrs = [b.ctypes.data for b in aux]
        args.aux_data_lens = [b.nbytes for b in aux]
        args.aux_item_lens = [b.nbytes // b.shape[0] for b in aux]
        args.state_types = [spec.name for spec in self.specs]
        args.state_data_ptrs = [[b.ctypes.data for b in group] for group in self.states]
        args.state_data_lens = [[b.nbytes for b in group] for group in self.states]
        args.state_item_lens = [[b.shape[1] for b in group] for group in self.states]
        # How SGLang describes sharded state (its HybridLinearKVPool's lists; [] per type
        # where it declares none).
        args.state_dim_per_tensor = [
            [d for sh, c in zip(spec.shards, maps, strict=True) if (d := sh.dims(c)) is not None]
            if spec.shards
            else []
            for spec, maps in zip(self.specs, self.channels, strict=True)
        ]
        args.state_conv_shard_groups = [
            [list(sh.conv) or None for sh in spec.shards] for spec in self.specs
        ]
        args.state_slice_outer_counts = [[sh.outer for sh in spec.shards] for spec in self.specs]
        args.state_layer_ids = [
            list(spec.layers) if spec.declare_layers else [] for spec in self.specs
        ]
        args.gpu_id = 0
        args.page_size = PAGE_TOKENS
        args.system_dp_rank = 0
        args.pp_rank = 0
        return args


def server_args(
    port: int,
    tp_size: int,
    dp_size: int = 1,
    load_balance_method: str = "auto",
    http_port: int | None = None,
) -> SimpleNamespace:
    """The ServerArgs fields the adapter reads; ``dp_size > 1``: DP attention, ``tp_size``
    ranks in ``dp_size`` groups. ``http_port``: the server's ``--port``."""
    return SimpleNamespace(
        host="127.0.0.1",
        port=http_port,
        disaggregation_bootstrap_port=port,
        tp_size=tp_size,
        dp_size=dp_size,
        pp_size=1,
        enable_dp_attention=dp_size > 1,
        load_balance_method=load_balance_method,
        dist_init_addr=None,
    )


@dataclass
class Instance:
    """One SGLang instance: its TP ranks' buffers and managers."""

    mode: str
    buffers: list[RankBuffers]
    managers: list[KvfsmKVManager]
    #: The model's KV heads (1 for MLA), bytes per head and token, MLA or not.
    heads: int = 1
    head_bytes: int = HEAD_BYTES
    mla: bool = False
    generation: int = 0
    #: Data-parallel groups (DP attention): ``buffers`` and ``managers`` hold ``dp`` blocks of
    #: attention-TP ranks, one per DP rank.
    dp: int = 1

    @classmethod
    def start(
        cls,
        mode: str,
        port: int,
        tp_size: int,
        *,
        generation: int = 0,
        heads: int | None = None,
        head_bytes: int = HEAD_BYTES,
        mla: bool = False,
        head_counts: HeadCounts = "before",
        state: bool | tuple[StateSpec, ...] = True,
        layers: int = LAYERS,
        dp_size: int = 1,
        load_balance_method: str = "auto",
        http_port: int | None = None,
    ) -> Instance:
        """``heads``: the model's KV heads, split over the ranks as SGLang does
        (:func:`rank_heads`); default one per rank, so a page is ``PAGE_BYTES`` per buffer.
        ``mla``: one latent buffer per layer, the whole latent on every rank.
        ``head_counts``: when the MHA head counts land in ``KVArgs``: "before" the manager is
        built (SGLang's prefill), "after" it (SGLang's decode with heterogeneous-TP staging), or
        "never" (SGLang's decode without staging). ``state``: with a hybrid-state pool (one
        Mamba-like state type), none, or the given state types. ``layers``: the model's.
        ``dp_size``: DP attention with ``tp_size`` attention-TP ranks per DP rank (SGLang's
        ``--tp tp_size*dp_size --dp dp_size --enable-dp-attention``); each DP group's prefill
        fill is its own generation (:meth:`dp_group`), so bytes from the wrong DP rank show.
        ``load_balance_method``: SGLang's ``--load-balance-method``; ``http_port``: its
        ``--port`` (what prefill publishes for re-bootstrap recomputes)."""
        total = 1 if mla else (tp_size if heads is None else heads)
        buffers = [
            RankBuffers.make(
                generation + DP_GENERATIONS * (r // tp_size) if mode == "prefill" else None,
                rank=r % tp_size,
                heads=[0] if mla else rank_heads(r % tp_size, tp_size, total),
                total_heads=total,
                head_bytes=head_bytes,
                mla=mla,
                state=state,
                layers=layers,
                tp=tp_size,
            )
            for r in range(tp_size * dp_size)
        ]
        managers: list[KvfsmKVManager] = []
        try:
            for r, b in enumerate(buffers):
                args = b.kv_args(r, head_counts=head_counts == "before")
                managers.append(
                    KvfsmKVManager(
                        args,
                        DisaggregationMode(mode),
                        server_args(
                            port, tp_size * dp_size, dp_size, load_balance_method, http_port
                        ),
                        mla,
                    )
                )
                if head_counts == "after":
                    b.set_head_counts(args)
        except BaseException:
            for m in managers:
                m.close()
            raise
        return cls(mode, buffers, managers, total, head_bytes, mla, generation, dp_size)

    @property
    def tp(self) -> int:
        """Attention-TP ranks (of each DP group)."""
        return len(self.buffers) // self.dp

    def dp_group(self, dp_rank: int) -> Instance:
        """The ranks of DP rank ``dp_rank``, as an instance of their own (a request runs on one
        DP rank: its bytes are checked against that group's)."""
        tp = self.tp
        return Instance(
            self.mode,
            self.buffers[dp_rank * tp : (dp_rank + 1) * tp],
            self.managers[dp_rank * tp : (dp_rank + 1) * tp],
            self.heads,
            self.head_bytes,
            self.mla,
            self.generation + DP_GENERATIONS * dp_rank,
        )

    def holder(self, head: int) -> tuple[int, int]:
        """The lowest rank holding global ``head``, and the head's index in that rank's rows."""
        for r, b in enumerate(self.buffers):
            if head in b.heads:
                return r, b.heads.index(head)
        raise AssertionError(f"{self.mode}: no rank holds head {head}")

    def transport_snapshots(self) -> list[dict[str, Any]]:
        """Every rank's transport counters (``bytes_done``, ``chunks_done``, ...), read on its
        loop."""
        out = []
        for m in self.managers:
            engine = m.kvfsm.engine
            transport = getattr(m.kvfsm, "transport", None)
            assert engine is not None
            assert transport is not None
            out.append(engine.call(_snapshot(transport)))
        return out

    def close(self) -> None:
        for m in self.managers:
            m.close()

    def live_rooms(self) -> int:
        return sum(m.kvfsm.engine.stats()["live"] for m in self.managers if m.kvfsm.engine)

    def leaks(self) -> list[str]:
        """Per-room state left after a drain: rooms, adapter entries, NIXL handles."""
        found = []
        for r, m in enumerate(self.managers):
            engine = m.kvfsm.engine
            assert engine is not None
            if engine.stats()["live"]:
                found.append(f"{self.mode} rank {r}: live rooms {engine.rooms()}")
            if m.tracked_rooms():
                found.append(f"{self.mode} rank {r}: {m.tracked_rooms()} tracked receivers")
            transport = getattr(m.kvfsm, "transport", None)
            if transport is not None:
                snap = engine.call(_snapshot(transport))
                if snap.get("in_flight"):
                    found.append(f"{self.mode} rank {r}: transport in flight {snap}")
        return found


async def _snapshot(transport: Any) -> dict[str, Any]:
    snap: dict[str, Any] = transport.snapshot()
    return snap


@dataclass
class Request:
    """One request as both schedulers see it, with its scripted faults."""

    room: int
    src_pages: list[int]
    dst_pages: list[int]
    chunks: list[list[int]]  # the last may be empty
    src_aux: int
    dst_aux: int
    src_state: int
    dst_state: int
    #: Abort on the prefill side after this many chunks were sent, on this rank.
    prefill_abort_after: int | None = None
    prefill_abort_rank: int = 0
    #: Abort on the decode side once this many prefill chunks went out, on this rank.
    decode_abort_after: int | None = None
    decode_abort_rank: int = 0
    #: The prefill scheduler never admits it (no init/send): decode must time out.
    prefill_ignores: bool = False
    #: Decode never hears of it (the router failed to send it there): prefill must give up.
    decode_ignores: bool = False
    #: The prefill scheduler aborts and clears it while it is still bootstrapping.
    prefill_abort_early: bool = False
    #: Decode sends its metadata only once prefill gave up on the room.
    decode_waits_for_prefill: bool = False
    #: Decode prefix caching: prompt tokens decode already holds (``decode_prefix_len``), in
    #: its pages ``prefix_dst``; prefill's pages of those tokens, ``prefix_src``, are not sent.
    #: ``src_pages``/``dst_pages``/``chunks`` are the pages past the prefix.
    prefix_tokens: int = 0
    prefix_src: list[int] = field(default_factory=list)
    prefix_dst: list[int] = field(default_factory=list)
    #: Prompt tokens in the prompt's last page (1..PAGE_TOKENS).
    tail_tokens: int = PAGE_TOKENS
    #: The prefill DP rank SGLang's DP controller ran it on, and whether the router named it
    #: (``disagg_prefill_dp_rank``: then decode knows it without asking).
    prefill_dp: int = 0
    dp_named: bool = False
    #: A request decode retracted and bootstraps again: SGLang's re-bootstrap payload, which
    #: each decode rank hands ``submit_prefill_recompute`` right after ``send_metadata``.
    rebootstrap: dict[str, Any] | None = None
    # -- progress ----------------------------------------------------------------------------
    senders: list[KvfsmKVSender] = field(default_factory=list)
    receivers: list[KvfsmKVReceiver] = field(default_factory=list)
    chunks_sent: int = 0
    prefill_outcome: str | None = None
    decode_outcome: str | None = None
    prefill_reasons: list[str] = field(default_factory=list)
    decode_reasons: list[str] = field(default_factory=list)
    metric: Any = None
    #: What each prefill rank's ``pop_decode_prefix_len()`` returned, and the chunks it sends.
    popped: list[int] = field(default_factory=list)
    rank_chunks: list[list[list[int]]] = field(default_factory=list)

    @property
    def prompt_src(self) -> list[int]:
        """Prefill's pages of the whole prompt (its req_to_token row, in pages)."""
        return self.prefix_src + self.src_pages

    @property
    def input_len(self) -> int:
        """``len(req.origin_input_ids)``."""
        pages = len(self.prompt_src)
        return pages * PAGE_TOKENS - (PAGE_TOKENS - self.tail_tokens) if pages else 0

    def chunks_from(self, prefix: int) -> list[list[int]]:
        """The pages prefill sends when decode holds ``prefix`` tokens: from the prefix's page
        (``req.start_send_idx = decode_prefix_len``), cut as scripted, the rest in the last."""
        pages = self.prompt_src[prefix // PAGE_TOKENS :]
        out, at = [], 0
        for chunk in self.chunks[:-1]:
            out.append(pages[at : at + len(chunk)])
            at += len(chunk)
        return [*out, pages[at:]]

    @property
    def done(self) -> bool:
        prefill_done = self.prefill_outcome is not None or self.prefill_ignores
        return prefill_done and (self.decode_outcome is not None or self.decode_ignores)


def _chunked(rng: random.Random, pages: list[int]) -> list[list[int]]:
    """``pages`` cut into consecutive chunks at random places (none when there are none)."""
    k = len(pages)
    cuts = sorted(rng.sample(range(1, k), rng.randint(0, k - 1))) if k > 1 else []
    return [pages[a:b] for a, b in zip([0, *cuts], [*cuts, k], strict=True)]


def random_requests(
    rng: random.Random, n: int, *, first_room: int = 1, max_pages: int = 6
) -> list[Request]:
    """``n`` requests over disjoint pages and rows, chunked at random, some with no pages."""
    assert n * max_pages <= PAGES
    assert n <= min(AUX_ROWS, STATE_ROWS)
    src_pool = rng.sample(range(PAGES), n * max_pages)
    dst_pool = rng.sample(range(PAGES), n * max_pages)
    src_rows, dst_rows = rng.sample(range(AUX_ROWS), n), rng.sample(range(AUX_ROWS), n)
    out = []
    for i in range(n):
        # A request may move no pages at all (its whole prompt cached, or SGLang's warmup):
        # init(0) and one zero-page last chunk that still carries the aux and state rows.
        k = 0 if rng.random() < 0.15 else rng.randint(1, max_pages)
        src = src_pool[i * max_pages : i * max_pages + k]
        dst = dst_pool[i * max_pages : i * max_pages + k]
        chunks = _chunked(rng, src)
        out.append(
            Request(
                room=first_room + i,
                src_pages=src,
                dst_pages=dst,
                chunks=chunks,
                src_aux=src_rows[i],
                dst_aux=dst_rows[i],
                src_state=src_rows[i],
                dst_state=dst_rows[i],
            )
        )
    return out


class _GCClock:
    """Seconds this process spent in cyclic garbage collection, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


_GC = _GCClock()


class Checker:
    """Records contract violations (see the module docstring) instead of raising."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.last: dict[tuple[str, int, int, int], int] = {}
        self.slowest = 0.0
        self.calls = 0
        #: Calls per kind, and those slower than CALL_LIMIT_S.
        self.kinds: Counter[str] = Counter()
        self.slow: Counter[str] = Counter()

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start, collecting = time.perf_counter(), _GC.seconds
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            # A cyclic-GC pass stops every thread, for as long as the whole heap takes (this
            # process holds pytest, SGLang's imports and up to six ranks: passes of 100-300 ms
            # were measured here). It is the process's pause, not a call that blocks: count
            # only the time outside it. SGLang freezes its own heap after start-up for this.
            own = took - (_GC.seconds - collecting)
            self.calls += 1
            self.kinds[what] += 1
            self.slowest = max(self.slowest, own)
            if own > CALL_LIMIT_S:
                self.slow[what] += 1
            if own > BLOCK_LIMIT_S:
                self.violations.append(
                    f"{what} blocked the scheduler for {own * 1e3:.1f} ms "
                    f"({took * 1e3:.1f} ms with garbage collection)"
                )

    def slow_kinds(self) -> list[str]:
        """The kinds of call that were slow more than now and then (see SLOW_SHARE)."""
        return [
            f"{what} was slower than {CALL_LIMIT_S * 1e3:g} ms in {n} of {self.kinds[what]} calls"
            for what, n in sorted(self.slow.items())
            if n > max(3, SLOW_SHARE * self.kinds[what])
        ]

    def poll(self, side: str, req: Request, rank: int, conn: Any, *, before_init: bool) -> int:
        value = int(self.call(f"{side} poll", conn.poll))
        key = (side, req.room, id(conn), rank)
        name = f"{side} room {req.room} rank {rank}"
        if before_init and value not in PRE_INIT:
            self.violations.append(f"{name}: {NAMES[value]} before init/send_metadata")
        last = self.last.get(key)
        if last is not None:
            if last in TERMINAL and value != last:
                self.violations.append(f"{name}: left {NAMES[last]} for {NAMES[value]}")
            elif value < last and value != KVPoll.Failed:
                self.violations.append(f"{name}: went back from {NAMES[last]} to {NAMES[value]}")
        self.last[key] = value
        return value

    def abort(self, side: str, req: Request, rank: int, conn: Any) -> None:
        self.call(f"{side} abort", conn.abort)
        if int(conn.poll()) != KVPoll.Failed:
            self.violations.append(f"{side} room {req.room} rank {rank}: not Failed after abort()")

    def failure(self, side: str, req: Request, rank: int, conn: Any) -> str:
        """Call ``failure_exception()`` as the scheduler does; it must raise with a reason."""
        try:
            self.call(f"{side} failure_exception", conn.failure_exception)
        except Exception as exc:
            reason = str(getattr(exc, "failure_reason", "") or "")
            if not reason:
                self.violations.append(f"{side} room {req.room}: failure without a reason: {exc!r}")
            return reason
        self.violations.append(f"{side} room {req.room} rank {rank}: failure_exception() returned")
        return ""


def min_poll(polls: Sequence[int]) -> int:
    """SGLang's ``all_reduce(..., op=MIN)`` over the ranks (``disaggregation/utils.py``)."""
    return min(polls)


class PrefillScheduler:
    """``PrefillBootstrapQueue`` → chunked sends → ``disagg_prefill_inflight_queue``."""

    def __init__(self, instance: Instance, checker: Checker, bootstrap_addr: str) -> None:
        self.instance = instance
        self.check = checker
        self.addr = bootstrap_addr
        self.bootstrap: list[Request] = []
        self.forward: list[Request] = []
        self.inflight: list[Request] = []

    def add(self, req: Request) -> None:
        if req.prefill_ignores:
            return
        req.senders = [
            self.check.call(
                "KvfsmKVSender()",
                KvfsmKVSender,
                mgr=m,
                bootstrap_addr=self.addr,
                bootstrap_room=req.room,
                req_has_disagg_prefill_dp_rank=req.dp_named,
            )
            for m in self.instance.managers
        ]
        self.bootstrap.append(req)

    def _fail(self, req: Request) -> None:
        req.prefill_reasons = [
            self.check.failure("prefill", req, r, s) for r, s in enumerate(req.senders)
        ]
        req.prefill_outcome = "Failed"

    def step(self) -> None:
        for req in list(self.bootstrap):
            if req.prefill_abort_early:
                for r, s in enumerate(req.senders):
                    self.check.abort("prefill", req, r, s)
            polls = [
                self.check.poll("prefill", req, r, s, before_init=True)
                for r, s in enumerate(req.senders)
            ]
            status = min_poll(polls)
            if status == KVPoll.Failed:
                self.bootstrap.remove(req)
                self._fail(req)
            elif status == KVPoll.WaitingForInput:
                self.bootstrap.remove(req)
                # finalize_bootstrap (prefill.py:429-444), on each rank.
                req.popped, req.rank_chunks = [], []
                for s in req.senders:
                    prefix = self.check.call("pop_decode_prefix_len", s.pop_decode_prefix_len)
                    req.popped.append(prefix)
                    req.rank_chunks.append(req.chunks_from(prefix))
                    # _num_pages_to_send: kv_to_page_num(len(origin_input_ids) - prefix, ps)
                    num_pages = -(-(req.input_len - prefix) // PAGE_TOKENS)
                    self.check.call("sender init", s.init, num_pages, req.src_aux)
                self.forward.append(req)
        for req in list(self.forward):
            self._send_next_chunk(req)
        for req in list(self.inflight):
            polls = [
                self.check.poll("prefill", req, r, s, before_init=False)
                for r, s in enumerate(req.senders)
            ]
            status = min_poll(polls)
            if status == KVPoll.Success:
                self.inflight.remove(req)
                for s in req.senders:
                    self.check.call("sender clear", s.clear)
                    req.metric = self.check.call("get_transfer_metric", s.get_transfer_metric)
                req.prefill_outcome = "Success"
            elif status == KVPoll.Failed:
                self.inflight.remove(req)
                self._fail(req)

    def _send_next_chunk(self, req: Request) -> None:
        i = req.chunks_sent
        if req.prefill_abort_after is not None and i >= req.prefill_abort_after:
            # _retire_aborted_prefill_result: abort on the rank that saw the abort, stop sending;
            # the request then waits in the inflight queue for the MIN poll to say Failed.
            r = req.prefill_abort_rank
            self.check.abort("prefill", req, r, req.senders[r])
            self.forward.remove(req)
            self.inflight.append(req)
            return
        last = i == len(req.chunks) - 1
        for r, (s, b) in enumerate(zip(req.senders, self.instance.buffers, strict=True)):
            pages = np.asarray(req.rank_chunks[r][i], np.int32)
            if last:
                # metadata_buffers.set_buf(req): the first output token and bootstrap_room.
                b.output_ids[req.src_aux] = np.arange(16, dtype=np.int32) + req.room * 100 + r
                b.rooms[req.src_aux] = req.room
            state = b.state_indices(req, "src") if last else None
            if self.check.call("should_send_kv_chunk", s.should_send_kv_chunk, len(pages), last):
                self.check.call(
                    "sender send", s.send, pages, state, num_kv_tokens=len(pages) * PAGE_TOKENS
                )
        req.chunks_sent += 1
        if last:
            self.forward.remove(req)
            self.inflight.append(req)


class DecodeScheduler:
    """``DecodePreallocQueue`` (resolve, init, handshake, ``send_metadata``) →
    ``DecodeTransferQueue`` (metadata-gated MIN poll, commit or fail, deferred release)."""

    def __init__(self, instance: Instance, checker: Checker, prefill_addr: str) -> None:
        self.instance = instance
        self.check = checker
        self.addr = prefill_addr
        self.pending: list[Request] = []
        self.prealloc: list[Request] = []
        self.transfer: list[Request] = []
        self.deferred: list[tuple[Request, float]] = []
        self.released: list[Request] = []  # failed requests whose pages decode reused
        self.timed_out: list[Request] = []  # released by SGLang's timeout, not by kvfsm
        self.last_ensure = 0.0
        self.prefill_progress: Callable[[Request], int] = lambda req: 0
        #: _commit_transfer_to_req: runs before the aux slot is cleared.
        self.on_commit: Callable[[Request], None] = lambda req: None
        #: Each ready request's prefill DP rank (``_resolve_pending_reqs``); a request left out
        #: stays pending. Default: DP rank 0 (a prefill instance without DP).
        self.dp_ranks: Callable[[list[Request]], dict[int, int]] = lambda reqs: {
            req.room: 0 for req in reqs
        }

    def add(self, req: Request) -> None:
        if req.decode_ignores:
            return
        req.receivers = [
            self.check.call(
                "KvfsmKVReceiver()",
                KvfsmKVReceiver,
                mgr=m,
                bootstrap_addr=self.addr,
                bootstrap_room=req.room,
            )
            for m in self.instance.managers
        ]
        for b in self.instance.buffers:  # the prefix decode's radix cache holds already
            for kv in b.kv:
                kv[req.prefix_dst] = PREFIX_FILL
        self.pending.append(req)

    def _fail(self, req: Request) -> None:
        req.decode_reasons = [
            self.check.failure("decode", req, r, recv) for r, recv in enumerate(req.receivers)
        ]
        req.decode_outcome = "Failed"

    def _release(self, req: Request) -> None:
        for recv, b in zip(req.receivers, self.instance.buffers, strict=True):
            self.check.call("receiver clear", recv.clear)
            # metadata_buffers.clear_slot: the gate must start from zero for the next user.
            b.output_ids[req.dst_aux] = 0
            b.rooms[req.dst_aux] = 0

    def step(self) -> None:
        managers = self.instance.managers
        # _resolve_pending_reqs: once every rank knows the prefill instance, each request's
        # prefill DP rank (computed, named, or asked of the registry), then init.
        known = all(m.prefill_info_table.get(self.addr) is not None for m in managers)
        ranks = self.dp_ranks(self.pending) if known and self.pending else {}
        for req in list(self.pending):
            if req.room in ranks:
                self.pending.remove(req)
                for recv in req.receivers:
                    self.check.call("receiver init", recv.init, ranks[req.room])
                self.prealloc.append(req)
            elif not known and time.monotonic() - self.last_ensure > 0.05:
                # upstream retries every 1 s; the replay is faster to keep scenarios short
                self.last_ensure = time.monotonic()
                for m in managers:
                    self.check.call(
                        "try_ensure_parallel_info", m.try_ensure_parallel_info, self.addr
                    )
        # _update_handshake_waiters, then pop_preallocated → _send_kv_metadata.
        for req in list(self.prealloc):
            polls = [
                self.check.poll("decode", req, r, recv, before_init=True)
                for r, recv in enumerate(req.receivers)
            ]
            status = min_poll(polls)
            if status == KVPoll.Failed:
                self.prealloc.remove(req)
                self._fail(req)
                self._release(req)
            elif status == KVPoll.WaitingForInput:
                if req.decode_waits_for_prefill and req.prefill_outcome is None:
                    continue
                self.prealloc.remove(req)
                for recv, b in zip(req.receivers, self.instance.buffers, strict=True):
                    self.check.call(
                        "send_metadata",
                        recv.send_metadata,
                        np.asarray(req.dst_pages, np.int32),
                        req.dst_aux,
                        b.state_indices(req, "dst"),
                        # _send_kv_metadata: only the pages past the prefix (decode.py:1642)
                        decode_prefix_len=req.prefix_tokens,
                    )
                if req.rebootstrap is not None:  # _send_kv_metadata, policy "early"
                    for m, recv in zip(managers, req.receivers, strict=True):
                        self.check.call(
                            "submit_prefill_recompute",
                            m.submit_prefill_recompute,
                            recv,
                            req.rebootstrap,
                        )
                self.transfer.append(req)
        # pop_transferred with the metadata gate.
        for req in list(self.transfer):
            if (
                req.decode_abort_after is not None
                and self.prefill_progress(req) >= req.decode_abort_after
            ):
                r = req.decode_abort_rank
                self.check.abort("decode", req, r, req.receivers[r])
                req.decode_abort_after = None
            polls = []
            for r, (recv, b) in enumerate(zip(req.receivers, self.instance.buffers, strict=True)):
                value = self.check.poll("decode", req, r, recv, before_init=False)
                if value == KVPoll.Success and b.rooms[req.dst_aux, 0] == 0:
                    value = KVPoll.Transferring  # _apply_metadata_gate
                polls.append(value)
            status = min_poll(polls)
            if status == KVPoll.Success:
                self.transfer.remove(req)
                req.decode_outcome = "Success"
                self.on_commit(req)
                self._release(req)
            elif status == KVPoll.Failed:
                self.transfer.remove(req)
                self._fail(req)
                for recv in req.receivers:
                    if not recv.abort_notified:
                        self.check.call(
                            "ensure_abort_notified", recv.ensure_abort_notified, force_arm=True
                        )
                self.deferred.append((req, time.monotonic()))
        # resolve_deferred_releases: pages come back when every rank says it is safe, or
        # when SGLang's deferred-release timeout runs out (then kvfsm did not settle in time).
        now = time.monotonic()
        for req, since in list(self.deferred):
            if now - since > DEFERRED_RELEASE_TIMEOUT_S:
                self.deferred.remove((req, since))
                self.timed_out.append(req)
                self._release(req)
                continue
            safe = [
                self.check.call(
                    "is_abort_release_safe",
                    m.is_abort_release_safe,
                    req.room,
                    len(recv.bootstrap_infos) if recv.abort_notified else 0,
                )
                for m, recv in zip(managers, req.receivers, strict=True)
            ]
            if min(safe):
                self.deferred.remove((req, since))
                for m in managers:
                    self.check.call(
                        "clear_deferred_abort_state", m.clear_deferred_abort_state, req.room
                    )
                self._release(req)
                self.released.append(req)
                for b in self.instance.buffers:  # decode reuses the pages: mark them
                    for kv in b.kv:
                        kv[req.dst_pages] = CANARY

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.prealloc or self.transfer or self.deferred)


def verify_kv(req: Request, prefill: Instance, decode: Instance) -> list[str]:
    """Every KV byte of ``req`` on every decode rank: for each decode rank, buffer, page, token
    row and local head, the bytes equal the prefill bytes of that global head at the source
    page (read from the lowest prefill rank holding it; replicas hold the same bytes). With
    equal TP and unsplit heads that is the whole page of the same-numbered prefill rank."""
    bad = []
    for d, dst in enumerate(decode.buffers):
        for i in range(len(dst.kv)):
            got = dst.head_view(i)[req.dst_pages]
            for j, head in enumerate(dst.heads):
                r, k = prefill.holder(head)
                src = prefill.buffers[r]
                if src.head_bytes != dst.head_bytes or len(src.kv) != len(dst.kv):
                    bad.append(f"room {req.room}: the rig's prefill and decode shapes differ")
                    return bad
                want = src.head_view(i)[req.src_pages, :, k]
                if not np.array_equal(want, got[:, :, j]):
                    rows = np.argwhere((want != got[:, :, j]).any(axis=-1))
                    where = ", ".join(
                        f"page {req.dst_pages[p]} (src {req.src_pages[p]}) row {t}"
                        for p, t in rows[:3]
                    )
                    bad.append(
                        f"room {req.room} rank {d}: kv buffer {i} differs (head {head}, from "
                        f"prefill rank {r}): {len(rows)} rows, first {where}"
                    )
    return bad


def aux_writer(req: Request, dst: RankBuffers, prefill: Instance) -> int | None:
    """The prefill rank whose aux output ids ``dst`` holds for ``req`` (the prefill replay
    writes ``arange(16) + room * 100 + rank``), or None when they are no prefill rank's."""
    ids = dst.output_ids[req.dst_aux]
    rank = int(ids[0]) - req.room * 100
    if 0 <= rank < prefill.tp and np.array_equal(
        prefill.buffers[rank].output_ids[req.src_aux], ids
    ):
        return rank
    return None


def verify_success(
    req: Request,
    prefill: Instance,
    decode: Instance,
    sources: dict[int, set[int]] | None = None,
) -> list[str]:
    """Success ⇒ every byte the request owns on decode equals prefill's bytes. Called when
    decode commits the request (before its aux slot is cleared). KV: :func:`verify_kv`; aux
    row (``bootstrap_room`` included) and state row: both those of one prefill rank of
    :func:`row_sources` (aux output ids are rank-specific, so a wrong pairing shows), recorded
    in ``sources`` (decode rank → the prefill ranks its rows came from)."""
    bad = verify_kv(req, prefill, decode)
    for d, dst in enumerate(decode.buffers):
        allowed = row_sources(d, prefill, decode)
        r = aux_writer(req, dst, prefill)
        if r is None or r not in allowed:
            bad.append(
                f"room {req.room} rank {d}: aux output ids {dst.output_ids[req.dst_aux].tolist()} "
                f"are not those of prefill rank {' or '.join(map(str, allowed))}"
            )
        else:
            if sources is not None:
                sources.setdefault(d, set()).add(r)
            differs = dst.state_differs(req, prefill.buffers[r])
            if differs:
                bad.append(
                    f"room {req.room} rank {d}: state ({', '.join(differs)}) differs from "
                    f"prefill rank {r}'s, whose aux row it holds"
                )
        if dst.rooms[req.dst_aux, 0] != req.room:
            bad.append(
                f"room {req.room} rank {d}: aux bootstrap_room is {dst.rooms[req.dst_aux, 0]}"
            )
    return bad + prefix_untouched(req, decode)


def stray_writes(requests: Sequence[Request], prefill: Instance, decode: Instance) -> list[str]:
    """At the end of a run whose decode started from zeros and whose requests own disjoint
    pages: every decode KV page no request owns (its prefix pages included) is still zero on
    every rank, and every committed request's pages still hold its bytes (nothing wrote into
    them after Success)."""
    owned = sorted({p for req in requests for p in req.dst_pages + req.prefix_dst})
    free = np.setdiff1d(np.arange(PAGES), np.asarray(owned, np.int64))
    bad = []
    for d, b in enumerate(decode.buffers):
        for i, kv in enumerate(b.kv):
            written = free[kv[free].any(axis=1)]
            if written.size:
                bad.append(
                    f"decode rank {d}: kv buffer {i}: pages {written.tolist()} owned by no "
                    "request were written"
                )
    for req in requests:
        if req.decode_outcome == "Success":
            bad.extend(f"after the run: {v}" for v in verify_kv(req, prefill, decode))
        bad.extend(f"after the run: {v}" for v in prefix_untouched(req, decode))
    return bad


def moved_bytes(requests: Sequence[Request], decode: Instance) -> int:
    """Bytes that must reach decode for ``requests``, one replica per decode rank: each of its
    pages once, its aux row and state row once."""
    total = 0
    for b in decode.buffers:
        for req in requests:
            total += len(req.dst_pages) * b.page_bytes() + b.aux_row_bytes()
            total += b.state_bytes(req)
    return total


def prefix_untouched(req: Request, decode: Instance) -> list[str]:
    """The pages decode held for ``req``'s prefix still hold what decode put there."""
    bad = []
    for r, b in enumerate(decode.buffers):
        for i, kv in enumerate(b.kv):
            if req.prefix_dst and not (kv[req.prefix_dst] == PREFIX_FILL).all():
                bad.append(f"room {req.room} rank {r}: kv buffer {i}: a prefix page was written")
    return bad


def prefix_requests(rng: random.Random, *, first_room: int = 1) -> list[Request]:
    """Requests whose prompt decode partly or wholly holds, over disjoint pages and rows: a
    prefix of all pages but the last, a full hit (no page moves: SGLang's decode radix match is
    not capped below the prompt), a prefix with a partial last page, random prefixes and
    chunkings, two requests sharing one cached prefix (the radix cache shares its pages), and
    plain requests among them."""
    shapes: list[tuple[int, int, int]] = [  # (prefix pages, pages past it, tokens in last page)
        (5, 1, PAGE_TOKENS),  # all but the last page
        (3, 0, PAGE_TOKENS),  # full hit
        (2, 3, 5),  # partial last page
        (1, 4, 1),
        (0, 3, PAGE_TOKENS),  # no prefix
    ]
    shapes += [
        (rng.randint(1, 4), rng.randint(0, 4), rng.randint(1, PAGE_TOKENS)) for _ in range(5)
    ]
    shapes = [(p, 1 if n == 0 and t < PAGE_TOKENS else n, t) for p, n, t in shapes]
    need = sum(p + n for p, n, _ in shapes)
    src_pool, dst_pool = rng.sample(range(PAGES), need), rng.sample(range(PAGES), need)
    rows = len(shapes) + 1
    src_rows, dst_rows = rng.sample(range(AUX_ROWS), rows), rng.sample(range(AUX_ROWS), rows)
    out, at = [], 0
    for i, (p, n, tail) in enumerate(shapes):
        prefix_src, src = src_pool[at : at + p], src_pool[at + p : at + p + n]
        prefix_dst, dst = dst_pool[at : at + p], dst_pool[at + p : at + p + n]
        at += p + n
        chunks = _chunked(rng, src) or [[]]
        out.append(
            Request(
                room=first_room + i,
                src_pages=src,
                dst_pages=dst,
                chunks=chunks,
                src_aux=src_rows[i],
                dst_aux=dst_rows[i],
                src_state=src_rows[i],
                dst_state=dst_rows[i],
                prefix_tokens=p * PAGE_TOKENS,
                prefix_src=prefix_src,
                prefix_dst=prefix_dst,
                tail_tokens=tail,
            )
        )
    # Another request with the first one's cached prefix (same decode pages), its own suffix.
    first, last = out[0], len(shapes)
    spare_src = [x for x in range(PAGES) if x not in src_pool][:1]
    spare_dst = [x for x in range(PAGES) if x not in dst_pool][:1]
    out.append(
        dataclasses.replace(
            first,
            room=first_room + last,
            src_pages=spare_src,
            dst_pages=spare_dst,
            chunks=[spare_src],
            src_aux=src_rows[last],
            dst_aux=dst_rows[last],
            src_state=src_rows[last],
            dst_state=dst_rows[last],
        )
    )
    return out


def step_until(
    step: Callable[[], object],
    done: Callable[[], bool],
    *,
    timeout: float = 60.0,
    message: str | None = None,
) -> None:
    """Run ``step`` (a scheduler's iteration) until ``done()``: a scheduler's event loop polls
    its queues over and over, here once a millisecond (``wait_until_sync``'s interval is that
    pace). :class:`ConditionTimeoutError` after ``timeout`` seconds."""

    def stepped() -> bool:
        if done():
            return True
        step()
        return False

    wait_until_sync(stepped, timeout=timeout, interval=0.001, message=message or _source(done))


def _source(done: Callable[[], bool]) -> str:
    try:
        return inspect.getsource(done).strip()
    except (OSError, TypeError):
        return repr(done)


@dataclass
class Outcome:
    requests: list[Request]
    violations: list[str]
    leaks: list[str]
    #: Failed requests whose pages SGLang's timeout released because kvfsm never said safe.
    timed_out: list[int]
    slowest_call_s: float
    calls: int

    def by_room(self) -> dict[int, Request]:
        return {r.room: r for r in self.requests}


class Pair:
    """A prefill instance and a decode instance with their schedulers, driven in lockstep."""

    def __init__(self, prefill: Instance, decode: Instance, port: int) -> None:
        self.prefill = prefill
        self.decode = decode
        self.addr = f"127.0.0.1:{port}"
        self.check = Checker()
        self.p = PrefillScheduler(prefill, self.check, self.addr)
        self.d = DecodeScheduler(decode, self.check, self.addr)
        self.d.prefill_progress = lambda req: req.chunks_sent
        #: Decode rank → the prefill ranks its committed requests' aux and state rows came from.
        self.row_sources: dict[int, set[int]] = {}
        self.d.on_commit = lambda req: self.check.violations.extend(
            verify_success(req, prefill, decode, self.row_sources)
        )

    def run(self, requests: Sequence[Request], timeout: float = 60.0) -> Outcome:
        """Submit ``requests`` to both schedulers and drive them to the end."""
        self.submit(requests)
        return self.drive(requests, timeout)

    def submit(self, requests: Sequence[Request]) -> None:
        for req in requests:
            self.d.add(req)
            self.p.add(req)

    def step(self) -> None:
        """One iteration of each scheduler's event loop."""
        self.p.step()
        self.d.step()

    def step_until(
        self, done: Callable[[], bool], *, timeout: float = 60.0, message: str | None = None
    ) -> None:
        """Both schedulers' iterations until ``done()`` (see :func:`step_until`)."""
        step_until(self.step, done, timeout=timeout, message=message)

    def drive(self, requests: Sequence[Request], timeout: float = 60.0) -> Outcome:
        """Step both schedulers until every request ended on both sides, then drain."""
        try:
            self.step_until(
                lambda: all(r.done for r in requests) and not self.d.busy, timeout=timeout
            )
        except ConditionTimeoutError:
            stuck = [r.room for r in requests if not r.done]
            self.check.violations.append(f"requests never finished: {stuck}")
        return self.finish(requests)

    def finish(self, requests: Sequence[Request]) -> Outcome:
        leaks = self.drain()
        self.check.violations.extend(self.check.slow_kinds())
        for req in requests:
            self.check.violations.extend(prefix_untouched(req, self.decode))
        for req in self.d.released:
            for r, b in enumerate(self.decode.buffers):
                for i, kv in enumerate(b.kv):
                    if not (kv[req.dst_pages] == CANARY).all():
                        self.check.violations.append(
                            f"room {req.room} rank {r}: kv buffer {i} written after its pages "
                            "were released"
                        )
        return Outcome(
            list(requests),
            self.check.violations,
            leaks,
            [r.room for r in self.d.timed_out],
            self.check.slowest,
            self.check.calls,
        )

    def drain(self, timeout: float = 30.0) -> list[str]:
        """Wait until every room on both sides is settled and reaped; report what is left."""
        # What is still live after the timeout is reported as a leak, not raised.
        with contextlib.suppress(ConditionTimeoutError):
            wait_until_sync(
                lambda: not self.prefill.live_rooms() and not self.decode.live_rooms(),
                timeout=timeout,
                interval=0.005,
            )
        return self.prefill.leaks() + self.decode.leaks()
