"""Conformance with unequal attention TP and with MLA: the SGLang replay of
:mod:`tests.helpers.sglang_replay` between a prefill instance of attention TP ``P`` and a decode
instance of attention TP ``D``, every byte checked.

What the adapter does (the feature's contract):

* One attention TP a multiple of the other. ``P > D``: each decode rank is written by the
  prefill ranks holding its heads; MHA pools are token-major, so each writes its heads' slice
  of every row. ``P < D``: a prefill rank writes into each decode rank the heads that rank
  holds. Every decode head has exactly one writer, replicated heads included, so the bytes moved
  are exactly one replica per decode rank (the prefill transports' ``bytes_done``).
* MLA: every rank holds the whole latent; exactly one prefill rank writes into each decode
  rank, the others are dummies for it that still reach Success.
* Aux and state rows: decode rank d gets them from the lowest-numbered prefill rank writing
  into it, the writer of its first head (:func:`~tests.helpers.sglang_replay.row_sources`). Which
  replica writes a replicated head is the adapter's choice: the rig learns it from the
  rank-specific aux row and ties it to the byte counts (MLA) and to one rank per decode rank.
* Refused with a reason, per request or at the handshake: TPs neither of which divides the
  other ("attention TP"), a Mamba state with unequal TP whose shards SGLang does not describe
  ("state_dim_per_tensor"; described ones move shard by shard: ``test_state_sharding.py``),
  prefill heads the handshake cannot plan without head counts.

The rig fills prefill KV by global head (:func:`~tests.helpers.sglang_replay.kv_bytes`), so
replicas agree and decode's check knows what every head slice must hold
(:func:`~tests.helpers.sglang_replay.verify_kv`); aux output ids and state rows are
rank-specific, so a wrong pairing shows. The equal-TP shapes (the rig's head splits, MLA) pass
with equal-TP kvfsm too, and ``test_the_checks_pass_a_correct_delivery_and_catch_wrong_bytes``
runs the checks on hand-made deliveries, correct and corrupted: the rig itself is tested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.chaos._plan import FaultPlan, TransferRates
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.sglang import KvfsmKVBootstrapServer, configure
from tests.helpers.sglang_config import CONFIG
from tests.helpers.sglang_replay import (
    PAGES,
    Checker,
    DecodeScheduler,
    HeadCounts,
    Instance,
    Outcome,
    Pair,
    PrefillScheduler,
    RankBuffers,
    Request,
    moved_bytes,
    prefix_requests,
    random_requests,
    rank_heads,
    row_sources,
    step_until,
    stray_writes,
    verify_success,
)


@dataclass(frozen=True)
class Shape:
    """A prefill-decode pair: attention TP of each side, the model's KV heads, bytes per head
    and token, MLA or not."""

    prefill_tp: int
    decode_tp: int
    heads: int = 4
    head_bytes: int = 16
    mla: bool = False
    #: When decode's scheduler sets the MHA head counts (prefill's sets them before the
    #: manager, as SGLang's does): "never" and "after" are SGLang's decode without and with
    #: heterogeneous-TP staging.
    decode_head_counts: HeadCounts = "before"
    #: A hybrid-state pool on both sides (the replay's default Mamba-like type, without a
    #: description of its shards). Default: at equal TP only; sharded state under unequal TP
    #: is ``test_state_sharding.py``'s.
    state: bool | None = None

    @property
    def has_state(self) -> bool:
        return self.prefill_tp == self.decode_tp if self.state is None else self.state

    def __str__(self) -> str:
        model = "mla" if self.mla else f"mha{self.heads}h"
        late = "" if self.decode_head_counts == "before" else f"-heads-{self.decode_head_counts}"
        state = "-state" if self.has_state else ""
        return f"{model}-p{self.prefill_tp}-d{self.decode_tp}{late}{state}"


#: Equal TP with the rig's head splits, MLA and a state pool: pass with equal-TP kvfsm already.
EQUAL = [Shape(2, 2, heads=4), Shape(2, 2, heads=1), Shape(2, 2, mla=True)]
#: Unequal attention TP (no state pool). P > D: heads=2 replicates prefill heads (4 ranks over
#: 2); heads=1 (MQA) replicates both sides. P < D: decode ranks share a prefill rank's heads;
#: heads=2 over decode TP 4 replicates decode's. Decode's head counts as SGLang's decode sets
#: them: never (no staging) or after the manager (staging).
UNEQUAL = [
    Shape(2, 1, heads=4),
    Shape(4, 2, heads=4),
    Shape(4, 2, heads=2),
    Shape(4, 2, heads=1),
    Shape(2, 1, heads=4, decode_head_counts="never"),
    Shape(4, 2, heads=4, decode_head_counts="after"),
    Shape(1, 2, heads=4),
    Shape(2, 4, heads=4),
    Shape(2, 4, heads=2),
]
MLA = [
    Shape(2, 2, mla=True),
    Shape(2, 1, mla=True),
    Shape(4, 2, mla=True),
    Shape(1, 2, mla=True),
    Shape(2, 4, mla=True),
]
#: Shapes kvfsm refuses, with what the reason names: attention TPs neither of which divides
#: the other; a Mamba state with unequal attention TP and no description of its shards.
REFUSED = [
    (Shape(2, 3, heads=6), "attention TP"),
    (Shape(2, 1, heads=4, state=True), "state_dim_per_tensor"),
]


@contextlib.contextmanager
def started(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape, prefill_faults: TransportFaults | None = None
) -> Iterator[Pair]:
    """A pair of ``shape``; ``prefill_faults``: every prefill rank's NIXL calls go through
    them (decode's stay real)."""
    port = bootstrap.port

    def start(mode: str, tp: int) -> Instance:
        return Instance.start(
            mode,
            port,
            tp,
            heads=shape.heads,
            head_bytes=shape.head_bytes,
            mla=shape.mla,
            head_counts="before" if mode == "prefill" else shape.decode_head_counts,
            state=shape.has_state,
        )

    if prefill_faults is not None:
        configure(dataclasses.replace(CONFIG, agent=faulty_agent_config(prefill_faults)))
    try:
        prefill = start("prefill", shape.prefill_tp)
    finally:
        configure(CONFIG)
    try:
        decode = start("decode", shape.decode_tp)
    except BaseException:
        prefill.close()
        raise
    try:
        yield Pair(prefill, decode, port)
    finally:
        decode.close()
        prefill.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def with_empty_request(requests: list[Request]) -> list[Request]:
    """The first request moves no pages (init(0), one zero-page last chunk with aux and state)."""
    requests[0].src_pages = requests[0].dst_pages = []
    requests[0].chunks = [[]]
    return requests


def bytes_done(instance: Instance) -> list[int]:
    return [snap["bytes_done"] for snap in instance.transport_snapshots()]


def assert_all_succeeded(requests: list[Request]) -> None:
    for req in requests:
        outcome = (req.prefill_outcome, req.decode_outcome)
        why = (req.room, req.prefill_reasons, req.decode_reasons)
        assert outcome == ("Success", "Success"), why


def offline(shape: Shape) -> tuple[Instance, Instance]:
    """Both instances' buffers, no managers: for checking the checks."""

    def side(mode: str, tp: int) -> Instance:
        total = 1 if shape.mla else shape.heads
        buffers = [
            RankBuffers.make(
                0 if mode == "prefill" else None,
                rank=r,
                heads=[0] if shape.mla else rank_heads(r, tp, total),
                total_heads=total,
                head_bytes=shape.head_bytes,
                mla=shape.mla,
                state=shape.has_state,
            )
            for r in range(tp)
        ]
        return Instance(mode, buffers, [], total, shape.head_bytes, shape.mla)

    return side("prefill", shape.prefill_tp), side("decode", shape.decode_tp)


def test_the_rig_splits_heads_as_sglang_does() -> None:
    assert [rank_heads(r, 2, 4) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_heads(r, 4, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert [rank_heads(r, 1, 4) for r in range(1)] == [[0, 1, 2, 3]]
    prefill, decode = offline(Shape(4, 2, heads=4))
    assert [row_sources(d, prefill, decode) for d in range(2)] == [[0], [2]]
    prefill, decode = offline(Shape(4, 2, heads=2))
    assert [row_sources(d, prefill, decode) for d in range(2)] == [[0, 1], [2, 3]]
    prefill, decode = offline(Shape(4, 2, mla=True))
    assert [row_sources(d, prefill, decode) for d in range(2)] == [[0, 1, 2, 3]] * 2
    prefill, decode = offline(Shape(2, 2, heads=1))
    assert [row_sources(d, prefill, decode) for d in range(2)] == [[0], [1]]


def deliver(req: Request, prefill: Instance, decode: Instance, *, spread: bool) -> None:
    """What a correct adapter does: each head of each decode rank written by one prefill rank
    holding it, into that head's slice of every row; the writer of the decode rank's first head
    also writes the aux and state rows. Which replica writes a replicated head: the lowest
    (``spread`` False), or the one whose index among the replicas is the decode rank's index
    modulo their number (the work spread over the replicas)."""
    for d, dst in enumerate(decode.buffers):
        writers = []
        for j, head in enumerate(dst.heads):
            holders = [r for r, b in enumerate(prefill.buffers) if head in b.heads]
            r = holders[d % len(holders)] if spread else holders[0]
            if prefill.tp == decode.tp:
                r = d
            src = prefill.buffers[r]
            k = src.heads.index(head)
            for i in range(len(src.kv)):
                dst.head_view(i)[req.dst_pages, :, j] = src.head_view(i)[req.src_pages, :, k]
            writers.append(r)
        src = prefill.buffers[writers[0]]
        dst.output_ids[req.dst_aux] = src.output_ids[req.src_aux]
        dst.rooms[req.dst_aux] = src.rooms[req.src_aux]
        dst.take_state(req, src)


@pytest.mark.parametrize("spread", [False, True], ids=["lowest-replica", "spread-replicas"])
@pytest.mark.parametrize("shape", EQUAL + UNEQUAL + MLA[1:], ids=str)
def test_the_checks_pass_a_correct_delivery_and_catch_wrong_bytes(
    shape: Shape, spread: bool
) -> None:
    (req,) = random_requests(random.Random(40), 1, max_pages=5)
    req.src_pages, req.dst_pages = [3, 9, 4], [11, 2, 7]
    prefill, decode = offline(shape)
    for r, b in enumerate(prefill.buffers):
        b.output_ids[req.src_aux] = np.arange(16) + req.room * 100 + r
        b.rooms[req.src_aux] = req.room
    deliver(req, prefill, decode, spread=spread)
    req.decode_outcome = "Success"
    assert verify_success(req, prefill, decode) == []
    assert stray_writes([req], prefill, decode) == []

    def caught(mutate: Callable[[RankBuffers], None], rank: int = -1) -> bool:
        saved = [(b.kv, b.output_ids, b.states) for b in decode.buffers]
        for b in decode.buffers:
            b.kv = [kv.copy() for kv in b.kv]
            b.output_ids = b.output_ids.copy()
            b.states = [[buf.copy() for buf in group] for group in b.states]
        mutate(decode.buffers[rank])
        found = verify_success(req, prefill, decode) + stray_writes([req], prefill, decode)
        for b, (kv, ids, state) in zip(decode.buffers, saved, strict=True):
            b.kv, b.output_ids, b.states = kv, ids, state
        return bool(found)

    def swap_pages(b: RankBuffers) -> None:
        b.kv[0][[11, 2]] = b.kv[0][[2, 11]]

    def one_byte(b: RankBuffers) -> None:
        b.kv[-1][7, -1] ^= 1

    def stray(b: RankBuffers) -> None:
        b.kv[0][PAGES - 1, 0] = 1  # a page no request owns

    def missing_head(b: RankBuffers) -> None:
        b.head_view(1)[req.dst_pages, :, -1] = 0

    def aux_of_no_rank(b: RankBuffers) -> None:
        b.output_ids[req.dst_aux, 5] += 1000

    def state_row(b: RankBuffers) -> None:
        b.states[0][0][req.dst_state, 5] ^= 0x40

    mutations = [swap_pages, one_byte, stray, missing_head, aux_of_no_rank]
    for mutate in [*mutations, state_row] if shape.has_state else mutations:
        assert caught(mutate), mutate.__name__
        assert caught(mutate, rank=0), mutate.__name__
    if len(decode.buffers[0].heads) > 1:

        def heads_swapped(b: RankBuffers) -> None:
            view = b.head_view(0)
            view[req.dst_pages] = view[req.dst_pages][:, :, ::-1]

        assert caught(heads_swapped)
    allowed = row_sources(0, prefill, decode)
    others = [r for r in range(prefill.tp) if r not in allowed]
    if others:
        # both rows of a prefill rank that does not write decode rank 0's first head
        src = prefill.buffers[others[0]]

        def rows_of_a_wrong_rank(b: RankBuffers) -> None:
            b.output_ids[req.dst_aux] = src.output_ids[req.src_aux]
            b.take_state(req, src)

        assert caught(rows_of_a_wrong_rank, rank=0)
    if len(allowed) > 1 and shape.has_state:
        # the aux row of one replica, the state row of another
        a, b_ = (prefill.buffers[r] for r in allowed[:2])

        def rows_of_two_replicas(b: RankBuffers) -> None:
            b.output_ids[req.dst_aux] = a.output_ids[req.src_aux]
            b.take_state(req, b_)

        assert caught(rows_of_two_replicas, rank=0)


def assert_one_row_source_per_decode_rank(pair: Pair) -> dict[int, int]:
    """Each decode rank took the rows of every request from one prefill rank (its plan does
    not change from request to request); that rank, by decode rank."""
    sources = pair.row_sources
    assert sorted(sources) == list(range(pair.decode.tp)), sources
    assert all(len(s) == 1 for s in sources.values()), sources
    return {d: min(s) for d, s in sources.items()}


@pytest.mark.parametrize("shape", EQUAL + UNEQUAL, ids=str)
def test_requests_succeed_with_every_head_slice_checked(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape
) -> None:
    with started(bootstrap, shape) as pair:
        requests = with_empty_request(random_requests(random.Random(41), 14))
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)
        assert stray_writes(requests, pair.prefill, pair.decode) == []
        assert_one_row_source_per_decode_rank(pair)
        # every decode byte moved exactly once: one writer per decode head, replicas included
        done = bytes_done(pair.prefill)
        assert sum(done) == moved_bytes(requests, pair.decode), done


@pytest.mark.parametrize("shape", MLA, ids=str)
def test_mla_moves_one_replica_per_decode_rank(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape
) -> None:
    """Every prefill rank holds the whole latent; one writes into each decode rank, KV and rows
    (the rank whose aux row decode holds), the others are dummies for it: a prefill rank moves
    one decode rank's share of the bytes for each decode rank it writes, dummies nothing."""
    with started(bootstrap, shape) as pair:
        requests = with_empty_request(random_requests(random.Random(42), 12))
        out = pair.run(requests)
        assert_clean(out)
        # Success is the MIN over the prefill ranks: the dummy ranks reached it too.
        assert_all_succeeded(requests)
        assert stray_writes(requests, pair.prefill, pair.decode) == []
        writer = assert_one_row_source_per_decode_rank(pair)
        done = bytes_done(pair.prefill)
        total = moved_bytes(requests, pair.decode)
        assert sum(done) == total, done
        share = total // pair.decode.tp
        assert done == [share * list(writer.values()).count(r) for r in range(pair.prefill.tp)], (
            done,
            writer,
        )


@pytest.mark.parametrize(
    "shape", [Shape(4, 2, heads=4), Shape(2, 4, heads=4), Shape(4, 2, mla=True)], ids=str
)
def test_decode_prefix_caching_on_unequal_tp(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape
) -> None:
    """Decode holds part or all of a prompt (its radix cache): every prefill rank pops the
    prefix and sends only the pages past it, each decode head slice of those pages is checked,
    the prefix pages are never written (on commit and at the end), a full hit moves no page."""
    with started(bootstrap, shape) as pair:
        requests = prefix_requests(random.Random(45))
        assert any(r.prefix_tokens and not r.dst_pages for r in requests)  # a full hit
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)
        for req in requests:
            assert req.popped == [req.prefix_tokens] * shape.prefill_tp, req.room
        assert stray_writes(requests, pair.prefill, pair.decode) == []
        done = bytes_done(pair.prefill)
        assert sum(done) == moved_bytes(requests, pair.decode), done


@pytest.mark.parametrize(("shape", "reason"), REFUSED, ids=[str(s) for s, _ in REFUSED])
@pytest.mark.usefixtures("refused_pair")
def test_unsupported_shapes_are_refused_with_a_reason(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape, reason: str
) -> None:
    """Every request fails on both sides (no hang, no leak), decode's with a reason naming
    what is not supported, and nothing is written into decode."""
    with started(bootstrap, shape) as pair:
        requests = random_requests(random.Random(43), 3)
        out = pair.run(requests, timeout=60)
        assert_clean(out)
        for req in requests:
            assert req.decode_outcome == "Failed", req.room
            assert all(req.decode_reasons), req.decode_reasons
            assert any(reason in r for r in req.decode_reasons), req.decode_reasons
            assert req.prefill_outcome == "Failed", req.room
            assert all(req.prefill_reasons), req.prefill_reasons
        assert stray_writes(requests, pair.prefill, pair.decode) == []


def test_unequal_tp_without_head_counts_is_refused_at_the_handshake(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """Prefill TP 2 to decode TP 1, but neither side's KVArgs declare head counts: prefill
    cannot plan the head slices, so the handshake refuses the pair by name and decode's
    request fails at once with that reason (not at transfer time, never wrong bytes)."""
    port = bootstrap.port
    kw: dict[str, Any] = {"heads": 2, "head_bytes": 64, "head_counts": "never", "state": False}
    prefill = Instance.start("prefill", port, 2, **kw)
    try:
        decode = Instance.start("decode", port, 1, **kw)
    except BaseException:
        prefill.close()
        raise
    try:
        check = Checker()
        d = DecodeScheduler(decode, check, f"127.0.0.1:{port}")
        p = PrefillScheduler(prefill, check, f"127.0.0.1:{port}")
        (req,) = random_requests(random.Random(19), 1)
        req.prefill_ignores = True
        p.add(req)
        d.add(req)
        step_until(d.step, lambda: req.decode_outcome is not None, timeout=30)
        assert req.decode_outcome == "Failed"
        assert (
            "fingerprint mismatch: unequal attention TP (prefill 2, decode 1) needs prefill "
            "to declare its KV heads"
        ) in req.decode_reasons[0]
        assert check.violations == []
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("shape", [Shape(4, 2, heads=4), Shape(2, 4, heads=4)], ids=str)
def test_aborts_on_an_unequal_pair_end_every_request(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape
) -> None:
    """Decode aborts mid-transfer on one of its ranks, or one prefill rank aborts after the
    first chunk: every request ends, Failed with reasons on every rank, and decode's pages go
    back only once no write can reach them (canaries checked by ``Pair.finish``)."""
    with started(bootstrap, shape) as pair:
        requests = random_requests(random.Random(44), 10, max_pages=8)
        by_decode: list[Request] = []
        by_prefill: list[Request] = []
        for req in requests:
            if len(req.src_pages) < 3:
                continue
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
            if len(by_decode) <= len(by_prefill):
                req.decode_abort_after = 1
                req.decode_abort_rank = len(by_decode) % shape.decode_tp
                by_decode.append(req)
            else:
                req.prefill_abort_after = 1
                req.prefill_abort_rank = (1 + 2 * len(by_prefill)) % shape.prefill_tp
                by_prefill.append(req)
        assert by_decode
        assert by_prefill
        out = pair.run(requests)
        assert_clean(out)
        for req in by_decode:
            assert req.decode_outcome == "Failed", req.room
            assert "AbortReq" in req.decode_reasons[req.decode_abort_rank], req.decode_reasons
            assert all(req.decode_reasons), req.decode_reasons
            # prefill may have sent its last chunk before the abort reached it
            assert req.prefill_outcome in ("Failed", "Success"), req.room
            if req.prefill_outcome == "Failed":
                assert all(req.prefill_reasons), req.prefill_reasons
        for req in by_prefill:
            assert req.prefill_outcome == "Failed", req.room
            assert "AbortReq" in req.prefill_reasons[req.prefill_abort_rank], req.prefill_reasons
            assert all(req.prefill_reasons), req.prefill_reasons
            assert req.decode_outcome == "Failed", req.room
            assert all(req.decode_reasons), req.decode_reasons
        aborted = {r.room for r in by_decode + by_prefill}
        assert_all_succeeded([r for r in requests if r.room not in aborted])
        assert {r.room for r in pair.d.released} >= aborted
        assert stray_writes(requests, pair.prefill, pair.decode) == []


@pytest.mark.parametrize("shape", [Shape(2, 1, heads=4), Shape(1, 2, heads=4)], ids=str)
def test_a_stalled_chunk_on_one_leg_fails_its_request_and_every_leg_settles(
    bootstrap: KvfsmKVBootstrapServer, shape: Shape
) -> None:
    """NIXL handles that report PROC forever on prefill (a dead or wedged peer's), on an unequal
    pair: the stalled leg fails by its chunk deadline, its request fails on every rank of both
    sides (the first failure ends the other legs), every leg settles, nothing leaks, and no
    page decode released is written again (canaries checked by ``Pair.finish``)."""
    faults = TransportFaults(FaultPlan(23, TransferRates(never_complete=0.25)))
    with started(bootstrap, shape, prefill_faults=faults) as pair:
        requests = random_requests(random.Random(23), 12)
        out = pair.run(requests, timeout=90)
        assert_clean(out)
        assert faults.plan.counts[("xfer", "never_complete")] > 0, faults.plan.counts
        failed = [r for r in requests if r.decode_outcome == "Failed"]
        assert failed
        for req in failed:
            assert req.prefill_outcome == "Failed", req.room
            assert any("stall" in r or "deadline" in r for r in req.prefill_reasons), req
            assert all(req.decode_reasons), req.decode_reasons
        assert_all_succeeded([r for r in requests if r not in failed])
        assert {r.room for r in pair.d.released} >= {r.room for r in failed}
        assert stray_writes(requests, pair.prefill, pair.decode) == []


class _DeviceTensor:
    """What SGLang's staging handler reads of a KV pool tensor when it is built: its device.
    SGLang's handler asserts an indexed accelerator device (a CPU tensor's has no index);
    this machine has none, so a stand-in names GPU 0, as the pools of a GPU decode would."""

    device = torch.device("cuda", 0)


def test_staging_buffers_on_decode_are_served_without_staging(
    bootstrap: KvfsmKVBootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SGLANG_DISAGG_STAGING_BUFFER=1`` on both sides, prefill TP 4 into decode TP 2 (the
    shape SGLang's NIXL backend stages), decode's head counts set after its manager as
    SGLang's staging decode sets them. SGLang's own staging handler is built from kvfsm's
    decode managers as SGLang's decode builds it at start-up; kvfsm's receivers never ask for
    staging, so the handler never holds a request and its ring never allocates. Every head
    slice of every request is checked; an abort mid-transfer on decode and one on a prefill
    rank end their requests, their pages released only once no write can reach them."""
    if os.environ.get("KVFSM_NO_SGLANG") == "1":
        pytest.skip("KVFSM_NO_SGLANG=1: SGLang's staging handler is not importable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's model stack warns that AWQ/GGUF need CUDA
        from sglang.srt.disaggregation.common.staging_handler import DecodeStagingHandler

    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    shape = Shape(4, 2, heads=4, decode_head_counts="after")
    with started(bootstrap, shape) as pair:
        handlers = []
        for r, mgr in enumerate(pair.decode.managers):
            assert mgr.enable_staging
            # DecodePreallocQueue._init_kv_manager: the pools' K and V buffers, then
            # _init_staging_handler (sglang/srt/disaggregation/decode.py).
            half = len(pair.decode.buffers[r].kv) // 2
            mgr.set_kv_buffer_tensors([_DeviceTensor()] * half, [_DeviceTensor()] * half, 4)
            handler = DecodeStagingHandler.create(mgr, None, r)
            mgr._staging_handler = handler
            assert handler.decode_tp == 2
            assert handler.total_kv_heads == 4
            handlers.append(handler)
        for mgr in pair.prefill.managers:
            assert mgr.enable_staging
            assert mgr._staging_ctx.allocator is None  # prefill keeps no ring
        requests = with_empty_request(random_requests(random.Random(46), 10, max_pages=8))
        staged = [r for r in requests if len(r.src_pages) >= 3][:2]
        assert len(staged) == 2
        for req in staged:
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
        staged[0].decode_abort_after, staged[0].decode_abort_rank = 1, 1
        staged[1].prefill_abort_after, staged[1].prefill_abort_rank = 1, 3
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded([r for r in requests if r not in staged])  # every slice checked
        for req in staged:
            assert req.decode_outcome == "Failed", req.room
            assert all(req.decode_reasons), req.decode_reasons
        assert "AbortReq" in staged[1].prefill_reasons[3], staged[1].prefill_reasons
        assert {r.room for r in pair.d.released} >= {r.room for r in staged}
        assert stray_writes(requests, pair.prefill, pair.decode) == []
        for handler in handlers:
            assert not any(handler.is_staging_room(r.room) for r in requests)
            ring = handler.staging_allocator
            assert (ring.get_total_size(), ring.get_watermark()) == (0, (0, 0))
            assert ring.assign(1) is None  # a ring of no bytes: nothing fits
