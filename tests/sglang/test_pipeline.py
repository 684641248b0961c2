"""Conformance with pipeline parallelism on prefill (``--pp-size``): SGLang's PP scheduler
sequence (:mod:`tests.helpers.sglang_pipeline`) against kvfsm's adapter over real NIXL, several
stages of real ranks in one process, every byte checked on decode.

What the adapter does (the feature's contract):

* Each stage writes its own span of layers into decode's whole-model pools (the handshake
  fingerprint maps its buffers onto decode's: ``_fingerprint.stage_buffers``); decode's request
  is one leg per stage, the last stage's also carrying the aux row.
* Stage 0's ``poll_pp_consensus()`` is the MIN over every stage, a stage that has not reported
  the room counting as Bootstrapping (SGLang's ``check_status_pp_consensus``): when the
  scheduler's consensus says WaitingForInput, every stage's sender really is (the replay checks
  it at ``init``). A failure on any stage, or a lost stage, fails the request everywhere.
* A hybrid model's state buffers belong to layers (SGLang's ``state_layer_ids``): each stage
  writes the items of its own layers' state buffers, paired with decode's by layer
  (``_fingerprint.stage_state``), over its leg.
* A stage that holds no buffer of a state type (all that type's layers on other stages) sends
  none of it and goes on, as SGLang's NIXL backend does.
* DSA tail rings carry no layer ids in SGLang; their layers are implied (every key ring, then
  every score ring, of the stage's span) and they pair by those, as SGLang's do.
* Refused by name: PP on decode, PP with unequal attention TP, stages whose layers do not tile
  decode's, other state buffers without layer ids (SGLang refuses those too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer, KvfsmKVReceiver, KvfsmKVSender, UnsupportedError
from kvfsm.sglang._bases import DisaggregationMode, KVPoll
from kvfsm.sglang._manager import KvfsmKVManager
from tests.helpers.sglang_pipeline import Pipeline, PipelinePair, spans
from tests.helpers.sglang_replay import (
    PAGE_TOKENS,
    PAGES,
    RING_SLOTS,
    Instance,
    Outcome,
    RankBuffers,
    Request,
    StateSpec,
    random_requests,
    server_args,
    stray_writes,
)
from tests.helpers.waiting import stays_true_sync, wait_until_sync


@contextlib.contextmanager
def started(
    bootstrap: KvfsmKVBootstrapServer,
    *,
    tp: int,
    pp: int,
    layers: int,
    decode_tp: int | None = None,
    state: tuple[StateSpec, ...] = (),
    decode_state: tuple[StateSpec, ...] | None = None,
) -> Iterator[PipelinePair]:
    """``decode_state``: decode's state types when they differ from prefill's ``state``."""
    port = bootstrap.port
    pipeline = Pipeline.start(port, tp, pp, layers=layers, state=state)
    try:
        decode = Instance.start(
            "decode",
            port,
            decode_tp or tp,
            state=state if decode_state is None else decode_state,
            layers=layers,
        )
    except BaseException:
        pipeline.close()
        raise
    try:
        pair = PipelinePair(pipeline, decode, port)
        pair.wait_for_stages()
        yield pair
    finally:
        decode.close()
        pipeline.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def assert_all_succeeded(requests: list[Request]) -> None:
    for req in requests:
        outcome = (req.prefill_outcome, req.decode_outcome)
        assert outcome == ("Success", "Success"), (
            req.room,
            req.prefill_reasons,
            req.decode_reasons,
        )


def with_empty_request(requests: list[Request]) -> list[Request]:
    requests[0].src_pages = requests[0].dst_pages = []
    requests[0].chunks = [[]]
    return requests


#: A hybrid model of 6 layers: Mamba on layers 0, 2, 3 and 5 (a conv and an SSM tensor each,
#: all conv tensors first, as SGLang lists them), and a DSA-style page-indexed pool on every
#: layer. Every stage of 2 or 3 holds layers of both.
STAGED_LAYERS = 6
STAGED_STATE = (
    StateSpec("mamba", (96,) * 4 + (160,) * 4, layers=(0, 2, 3, 5) * 2),
    StateSpec("dsa", (136,) * 6, items=PAGES, names="window", window=3, layers=tuple(range(6))),
)


def assert_each_stage_moved_its_own(pair: PipelinePair, requests: list[Request]) -> None:
    """Each stage's rank moved exactly its own layers of every page and of every state item,
    and only the last stage the aux rows (its transport's bytes, per rank)."""
    snaps = pair.pipeline.transport_snapshots()
    stages = pair.pipeline.stages
    pages = sum(len(r.src_pages) for r in requests)
    for s, stage in enumerate(stages):
        for r, b in enumerate(stage.buffers):
            want = pages * b.page_bytes() + sum(b.state_bytes(req) for req in requests)
            if s == len(stages) - 1:
                want += len(requests) * b.aux_row_bytes()
            assert snaps[s][r]["bytes_done"] == want, (s, r)


@pytest.mark.parametrize(
    ("tp", "pp"), [(1, 2), (2, 2), (1, 3)], ids=["tp1-pp2", "tp2-pp2", "tp1-pp3"]
)
def test_each_stage_moves_the_state_of_its_own_layers(
    bootstrap: KvfsmKVBootstrapServer, tp: int, pp: int
) -> None:
    with started(bootstrap, tp=tp, pp=pp, layers=STAGED_LAYERS, state=STAGED_STATE) as pair:
        requests = with_empty_request(random_requests(random.Random(70 + tp + pp), 10))
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)  # every state item of every layer checked on decode
        assert_each_stage_moved_its_own(pair, requests)


def test_state_without_layer_ids_under_pipeline_parallelism_is_refused_by_name(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    unnamed = tuple(dataclasses.replace(spec, declare_layers=False) for spec in STAGED_STATE)
    with started(bootstrap, tp=1, pp=2, layers=STAGED_LAYERS, state=unnamed) as pair:
        requests = random_requests(random.Random(5), 2)
        out = pair.run(requests)
    assert out.leaks == []
    for req in requests:
        assert req.decode_outcome == "Failed"
        assert any("state_layer_ids" in why for why in req.decode_reasons), req.decode_reasons


#: Mamba on layers 0 and 1 only (a conv and an SSM tensor each), DSA on every layer: with 2
#: stages of 3 layers, stage 1 holds no Mamba buffer; with 3 stages of 2, stages 1 and 2 none.
SPARSE_STATE = (
    StateSpec("mamba", (96, 96, 160, 160), layers=(0, 1, 0, 1)),
    STAGED_STATE[1],
)
#: Mamba on layer 0 only: the later stages hold no state buffer at all.
FIRST_STAGE_STATE = (StateSpec("mamba", (96, 160), layers=(0, 0)),)


@pytest.mark.parametrize(
    ("pp", "state"),
    [(2, SPARSE_STATE), (3, SPARSE_STATE), (2, FIRST_STAGE_STATE)],
    ids=["pp2-no-mamba-on-stage-1", "pp3-mamba-on-stage-0-only", "pp2-no-state-on-stage-1"],
)
def test_a_stage_without_buffers_of_a_state_type_sends_none_of_it(
    bootstrap: KvfsmKVBootstrapServer, pp: int, state: tuple[StateSpec, ...]
) -> None:
    """SGLang declares every state type on every stage, with no buffers where a stage has
    none of its layers, passes every type's indices on every stage, and its NIXL backend sends
    nothing of a type without buffers. Every byte of every state item is checked on decode
    (written by the stage that holds its layer); each stage moved exactly its own buffers'
    bytes, none of a type it does not hold; an abort mid-transfer on a stage without Mamba
    and one on decode end their requests, their pages released only once no stage can
    write them."""
    with started(bootstrap, tp=1, pp=pp, layers=STAGED_LAYERS, state=state) as pair:
        for s, stage in enumerate(pair.pipeline.stages):
            held = stage.managers[0].states.names
            assert (held == ("mamba", "dsa")[: len(state)]) == (s == 0), (s, held)
        # Disjoint pages and rows for both runs: the first delivers, the second aborts.
        drawn = random_requests(random.Random(80 + pp + len(state)), 16)
        requests = with_empty_request(drawn[:10])
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)  # every state item of every layer checked on decode
        assert_each_stage_moved_its_own(pair, requests)

        _aborts_on_the_last_stage_and_on_decode(pair, pp, drawn[10:], requests)


#: DeepSeek V4's tail rings, SGLang's way: no layer ids, the key ring of every layer, then the
#: score ring of every layer; layer 4 shares its index (an empty buffer in its place).
TAIL_RINGS = (
    StateSpec(
        "dsa_tail",
        tuple(0 if layer == 4 else RING_SLOTS * 24 for layer in range(6))
        + tuple(0 if layer == 4 else RING_SLOTS * 8 for layer in range(6)),
        names="ring",
        layers=tuple(range(6)) * 2,
        declare_layers=False,
    ),
)


@pytest.mark.parametrize("pp", [2, 3])
def test_tail_rings_without_layer_ids_pair_by_their_implied_layers(
    bootstrap: KvfsmKVBootstrapServer, pp: int
) -> None:
    """SGLang lists a DSA tail ring's buffers without layer ids, every key ring then every
    score ring of the rank's layers, and its NIXL backend pairs a stage's with decode's by
    those layers (``slice_dsa_tail_dst_ptrs_for_pp``): so does kvfsm. Every ring byte checked
    on decode, each stage moving only its own layers' rings; an abort mid-transfer on decode
    ends its request with its pages released only once no stage can write them."""
    with started(bootstrap, tp=1, pp=pp, layers=STAGED_LAYERS, state=TAIL_RINGS) as pair:
        drawn = random_requests(random.Random(90 + pp), 16)
        requests = with_empty_request(drawn[:10])
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)
        assert_each_stage_moved_its_own(pair, requests)
        aborted = next(r for r in drawn[10:] if len(r.src_pages) >= 3)
        aborted.chunks = [aborted.src_pages[:1], aborted.src_pages[1:2], aborted.src_pages[2:]]
        aborted.decode_abort_after = 1
        out = pair.run([aborted])
        assert_clean(out)
        assert aborted.decode_outcome == "Failed"
        assert aborted.room in {r.room for r in pair.d.released}
        assert stray_writes([*requests, aborted], pair.pipeline.view, pair.decode) == []


def tail_rings(extra: int) -> tuple[StateSpec, ...]:
    """Mamba on layer 0 only, then ``TAIL_RINGS`` with ``extra`` speculative slots after the
    compression ring, each request's entries SGLang's own for that ring
    (``get_dsa_tail_state_indices``). The later stages hold no Mamba buffer, so their state
    rows leave decode's Mamba row out and the ring row's position among them moves."""
    slots = RING_SLOTS + extra
    return (
        FIRST_STAGE_STATE[0],
        StateSpec(
            "dsa_tail",
            tuple(0 if layer == 4 else slots * 24 for layer in range(6))
            + tuple(0 if layer == 4 else slots * 8 for layer in range(6)),
            names="ring",
            layers=tuple(range(6)) * 2,
            declare_layers=False,
            ring=(RING_SLOTS, extra),
        ),
    )


def live_slot_count(spec: StateSpec, req: Request) -> int:
    entry = spec.indices(req, "src")
    return entry[2] + entry[4] if entry else 0


@pytest.mark.parametrize(
    ("pp", "prefill_extra", "decode_extra", "seed"),
    [(2, 0, 3, 5), (3, 2, 0, 6)],
    ids=["pp2-8+0-to-8+3", "pp3-8+2-to-8+0"],
)
def test_tail_rings_of_different_sizes_under_pipeline_parallelism(
    bootstrap: KvfsmKVBootstrapServer, pp: int, prefill_extra: int, decode_extra: int, seed: int
) -> None:
    """Other speculative slot counts on the two sides, prefill in stages: each stage pairs its
    layers' ring rows with decode's (positions translated to the stage's own state rows) and
    remaps the request's live slots from its ring into decode's. Every live slot of every
    layer's key and score ring must land, in token order, at decode's live slots for the
    request, every other slot of decode's row unwritten (``_ring_differs``); each stage moved
    exactly its own layers' live slots (stage 0 also the Mamba row). Rings that wrap, that do
    not and that hold no live slot are all served. An abort mid-transfer on a stage and one
    on decode end their requests everywhere."""
    prefill_spec, decode_spec = tail_rings(prefill_extra), tail_rings(decode_extra)
    with started(
        bootstrap,
        tp=1,
        pp=pp,
        layers=STAGED_LAYERS,
        state=prefill_spec,
        decode_state=decode_spec,
    ) as pair:
        rng = random.Random(seed)  # drawn to cover the cases asserted below
        drawn = random_requests(rng, 10, max_pages=6)
        for req in drawn:  # lengths that end anywhere in their last page: 0 to 7 live slots
            req.tail_tokens = rng.randint(1, PAGE_TOKENS)
        requests = drawn[:6]
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)  # every live slot of every layer checked on decode
        sides = [
            (prefill_spec[1].indices(r, "src"), decode_spec[1].indices(r, "dst")) for r in requests
        ]
        assert any(s and s[4] for s, _ in sides) or any(d and d[4] for _, d in sides)
        assert any(d and not d[4] for _, d in sides)
        assert any(not d for _, d in sides)
        assert any(s and d and s[1] != d[1] for s, d in sides)
        snaps = pair.pipeline.transport_snapshots()
        pages = sum(len(r.src_pages) for r in requests)
        for s, stage in enumerate(pair.pipeline.stages):
            b = stage.buffers[0]
            mamba = len(requests) * sum(buf.shape[1] for buf in b.states[0])
            slot_bytes = sum(buf.shape[1] for buf in b.states[1]) // sum(prefill_spec[1].ring)
            live = sum(live_slot_count(prefill_spec[1], r) for r in requests)
            want = pages * b.page_bytes() + mamba + live * slot_bytes
            if s == pp - 1:
                want += len(requests) * b.aux_row_bytes()
            assert snaps[s][0]["bytes_done"] == want, s

        _aborts_on_the_last_stage_and_on_decode(pair, pp, drawn[6:], requests)


def test_sglang_splits_layers_over_stages_as_the_rig_does() -> None:
    assert spans(2, 2) == [(0, 1), (1, 1)]
    assert spans(4, 3) == [(0, 1), (1, 1), (2, 2)]
    assert spans(7, 2) == [(0, 3), (3, 4)]


@pytest.mark.parametrize(
    ("tp", "pp", "layers"),
    [(1, 2, 2), (2, 2, 2), (1, 3, 4), (1, 2, 5)],
    ids=["tp1-pp2", "tp2-pp2", "tp1-pp3-uneven", "tp1-pp2-uneven"],
)
def test_requests_succeed_with_every_layer_from_its_stage(
    bootstrap: KvfsmKVBootstrapServer, tp: int, pp: int, layers: int
) -> None:
    with started(bootstrap, tp=tp, pp=pp, layers=layers) as pair:
        requests = with_empty_request(random_requests(random.Random(50 + pp + layers), 12))
        out = pair.run(requests)
        assert_clean(out)
        assert_all_succeeded(requests)
        assert stray_writes(requests, pair.pipeline.view, pair.decode) == []
        # Each stage moved its own layers of every page and nothing else; only the last stage
        # the aux rows.
        snaps = pair.pipeline.transport_snapshots()
        pages = sum(len(r.src_pages) for r in requests)
        for s, stage in enumerate(pair.pipeline.stages):
            for r, b in enumerate(stage.buffers):
                want = pages * b.page_bytes()
                if s == pp - 1:
                    want += len(requests) * b.aux_row_bytes()
                assert snaps[s][r]["bytes_done"] == want, (s, r)


def test_the_consensus_waits_for_a_stage_that_has_not_reported(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """Stage 0's own sender is WaitingForInput, but stage 1 has not built its sender yet (its
    scheduler is behind): the consensus stays Bootstrapping until stage 1's sender has its
    destination too, then says WaitingForInput."""
    with started(bootstrap, tp=1, pp=2, layers=2) as pair:
        addr = pair.addr
        m0, m1 = pair.pipeline.managers
        decode = pair.decode.managers[0]
        receiver = KvfsmKVReceiver(decode, addr, 77)
        first = KvfsmKVSender(m0, addr, 77)
        wait_until_sync(lambda: decode.try_ensure_parallel_info(addr), timeout=10)
        receiver.init(0)
        wait_until_sync(lambda: receiver.poll() == KVPoll.WaitingForInput, timeout=10)
        receiver.send_metadata(np.asarray([3, 4], np.int32), 1)
        wait_until_sync(lambda: first.poll() == KVPoll.WaitingForInput, timeout=10)
        # Long enough for any report stage 1 would have sent (it has no sender to report on).
        stays_true_sync(
            lambda: first.poll_pp_consensus() == KVPoll.Bootstrapping,
            duration=0.2,
            message="stage 0's consensus still Bootstrapping",
        )
        second = KvfsmKVSender(m1, addr, 77)
        wait_until_sync(
            lambda: first.poll_pp_consensus() == KVPoll.WaitingForInput,
            timeout=10,
            message="the consensus to follow stage 1's new sender",
        )
        assert second.poll() == KVPoll.WaitingForInput
        for conn in (first, second, receiver):
            conn.abort()
            conn.clear()


def test_aborts_on_any_stage_end_the_request_everywhere(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """A later stage aborts after the first chunk, or decode aborts mid-transfer: every request
    ends, Failed with reasons, decode's pages go back only once no stage can write them
    (canaries checked by ``Pair.finish``), nothing leaks on any stage."""
    with started(bootstrap, tp=1, pp=2, layers=2) as pair:
        requests = random_requests(random.Random(61), 10, max_pages=8)
        aborted = []
        for i, req in enumerate(r for r in requests if len(r.src_pages) >= 3):
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
            if i % 2:
                req.prefill_abort_after, req.prefill_abort_rank = 1, 1  # stage 1
            else:
                req.decode_abort_after = 1
            aborted.append(req)
        assert len(aborted) >= 2
        out = pair.run(requests)
        assert_clean(out)
        for req in aborted:
            assert req.decode_outcome == "Failed", req.room
            assert all(req.decode_reasons), req.decode_reasons
            if req.prefill_abort_after is not None:
                assert req.prefill_outcome == "Failed", req.room
                assert any("AbortReq" in r for r in req.prefill_reasons), req.prefill_reasons
        assert_all_succeeded([r for r in requests if r not in aborted])
        assert {r.room for r in pair.d.released} >= {r.room for r in aborted}
        assert stray_writes(requests, pair.pipeline.view, pair.decode) == []


def test_a_lost_stage_fails_the_requests_it_had_not_joined(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """Stage 1 goes away while requests wait for their destination: stage 0's consensus says
    Failed, naming the lost stage, well before any deadline."""
    with started(bootstrap, tp=1, pp=2, layers=2) as pair:
        requests = random_requests(random.Random(62), 4)
        for req in requests:
            req.decode_waits_for_prefill = True  # decode holds its page lists back
        pair.submit(requests)
        stage_zero = pair.pipeline.managers[0]
        pair.step_until(
            lambda: stage_zero.stage_entries() == len(requests),
            timeout=10,
            message="stage 0 to hold stage 1's report of every request",
        )
        pair.pipeline.stages[1].close()
        pair.step_until(
            lambda: all(r.prefill_outcome for r in requests),
            timeout=15,
            message="a prefill outcome for every request",
        )
        for req in requests:
            assert req.prefill_outcome == "Failed"
            assert any("PP stage 1 lost" in r for r in req.prefill_reasons), req.prefill_reasons
        # then decode's requests end too (their prefill legs were told), and nothing leaks
        pair.step_until(
            lambda: all(r.done for r in requests) and not pair.d.busy,
            timeout=30,
            message="decode to end every request",
        )
        assert all(r.decode_outcome == "Failed" for r in requests)


def test_pipeline_parallelism_on_decode_is_refused_by_name(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    args = RankBuffers.make(None, state=False).kv_args(0)
    sargs = server_args(bootstrap.port, 1)
    sargs.pp_size = 2
    with pytest.raises(UnsupportedError, match="pipeline parallelism on decode"):
        KvfsmKVManager(args, DisaggregationMode("decode"), sargs, False)


@pytest.mark.usefixtures("refused_pair")
def test_a_pipeline_with_unequal_attention_tp_is_refused_with_a_reason(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    with started(bootstrap, tp=2, pp=2, layers=2, decode_tp=1) as pair:
        requests = random_requests(random.Random(63), 3)
        out = pair.run(requests, timeout=30)
        assert out.violations == []
        for req in requests:
            assert req.decode_outcome == "Failed"
            assert any("equal attention TP" in r for r in req.decode_reasons), req.decode_reasons


def _aborts_on_the_last_stage_and_on_decode(
    pair: PipelinePair, pp: int, candidates: list[Request], requests: list[Request]
) -> None:
    """Two more requests of three chunks: one aborted on the last stage after its first chunk,
    one on decode. Both fail everywhere, each with a reason, decode releases their pages, and
    nothing of any request lands outside its pages."""
    aborted = [r for r in candidates if len(r.src_pages) >= 3][:2]
    assert len(aborted) == 2
    for req in aborted:
        req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
    aborted[0].prefill_abort_after, aborted[0].prefill_abort_rank = 1, pp - 1  # last stage
    aborted[1].decode_abort_after = 1
    out = pair.run(aborted)
    assert_clean(out)
    for req in aborted:
        assert req.decode_outcome == "Failed", req.room
        assert all(req.decode_reasons), req.decode_reasons
    assert any("AbortReq" in r for r in aborted[0].prefill_reasons)
    assert {r.room for r in pair.d.released} >= {r.room for r in aborted}
    assert stray_writes(requests + aborted, pair.pipeline.view, pair.decode) == []
