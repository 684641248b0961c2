"""Conformance: SGLang 0.5.23's scheduler sequences, replayed call for call against kvfsm's adapter
over real NIXL (DRAM) and a real bootstrap server, with two TP ranks on each side.

Every scenario checks the adapter's obligations to the scheduler through
:class:`tests.helpers.sglang_replay.Checker` (legal polls, forward-only, sticky terminals, abort →
Failed, ``failure_exception`` raises, no call over a few ms, Success ⇒ identical KV/aux/state
bytes, no write after release), that every per-room entry is gone once the rooms settle, and that
decode never had to fall back on SGLang's deferred-release timeout. Scenarios include the
failures SGLang's own NIXL backend is known for (docs/sglang.md). Unequal attention TP and
MLA: ``test_heterogeneous.py``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator

import pytest

from kvfsm.chaos._plan import FaultPlan, TransferRates
from kvfsm.chaos._transport_faults import TransportFaults, faulty_agent_config
from kvfsm.sglang import KvfsmKVBootstrapServer, configure
from tests.helpers.sglang_config import CONFIG
from tests.helpers.sglang_replay import (
    BLOCK_LIMIT_S,
    CALL_LIMIT_S,
    LAYERS,
    PAGE_BYTES,
    PAGE_TOKENS,
    Checker,
    Instance,
    Outcome,
    Pair,
    Request,
    prefix_requests,
    random_requests,
    step_until,
)

TP = 2


@pytest.fixture
def pair(bootstrap: KvfsmKVBootstrapServer) -> Iterator[Pair]:
    prefill = Instance.start("prefill", bootstrap.port, TP)
    try:
        decode = Instance.start("decode", bootstrap.port, TP)
    except BaseException:
        prefill.close()
        raise
    yield Pair(prefill, decode, bootstrap.port)
    decode.close()
    prefill.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def test_requests_succeed_with_identical_bytes(pair: Pair) -> None:
    requests = random_requests(random.Random(7), 14)
    requests[0].src_pages = requests[0].dst_pages = []
    requests[0].chunks = [[]]  # no pages at all: init(0) and one zero-page last chunk
    out = pair.run(requests)
    assert_clean(out)
    assert [r.prefill_outcome for r in requests] == ["Success"] * len(requests)
    assert [r.decode_outcome for r in requests] == ["Success"] * len(requests)
    metric = requests[1].metric
    assert metric.transfer_latency_s is not None
    assert metric.transfer_latency_s >= 0
    assert metric.transfer_total_bytes >= len(requests[1].src_pages) * 4 * 1024


def test_decode_prefix_caching_moves_only_the_pages_past_the_prefix(pair: Pair) -> None:
    """decode_prefix_len > 0 (decode's radix cache): decode names only the pages past its
    prefix, prefill pops the prefix at WaitingForInput and sends from it. Every page past the
    prefix equals prefill's on commit; decode's prefix pages are never written (checked on
    commit and at the end); a full hit moves no page and still ends in Success with the aux row.
    """
    requests = prefix_requests(random.Random(23))
    assert any(r.prefix_tokens and not r.dst_pages for r in requests)  # a full hit
    assert any(len(r.dst_pages) == 1 and len(r.prefix_dst) > 1 for r in requests)
    assert any(r.tail_tokens < PAGE_TOKENS and r.prefix_tokens for r in requests)
    out = pair.run(requests)
    assert_clean(out)
    for req in requests:
        assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), (
            req.room,
            req.prefill_reasons,
            req.decode_reasons,
        )
        assert req.popped == [req.prefix_tokens] * TP, req.room
        sent = sum(len(c) for c in req.rank_chunks[0])
        assert sent == len(req.dst_pages)
        kv_bytes = sent * 2 * LAYERS * PAGE_BYTES  # K and V of every layer
        assert kv_bytes <= req.metric.transfer_total_bytes < kv_bytes + PAGE_BYTES


def test_an_unaligned_decode_prefix_is_refused_with_a_reason(pair: Pair) -> None:
    """SGLang's radix match is page-aligned, so decode never sends a prefix that ends inside a
    page; kvfsm refuses one (prefill would overwrite the page's cached tokens)."""
    (req,) = prefix_requests(random.Random(24))[:1]
    req.prefix_tokens += PAGE_TOKENS // 2
    out = pair.run([req])
    assert_clean(out)
    assert (req.prefill_outcome, req.decode_outcome) == ("Failed", "Failed")
    assert all("not a multiple of the page size" in r for r in req.decode_reasons)


def test_abort_during_a_non_last_chunk_fails_the_request_on_every_rank(pair: Pair) -> None:
    requests = random_requests(random.Random(11), 8, max_pages=8)
    aborted = []
    for req in requests:
        if len(req.src_pages) >= 3:
            # three chunks at least; the abort comes after the first, before the last
            k = len(req.src_pages)
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:k]]
            req.prefill_abort_after = 1
            req.prefill_abort_rank = len(aborted) % TP
            aborted.append(req)
    assert aborted
    out = pair.run(requests)
    assert_clean(out)
    for req in requests:
        expected = "Failed" if req in aborted else "Success"
        assert (req.prefill_outcome, req.decode_outcome) == (expected, expected), req.room
    for req in aborted:
        reasons = req.prefill_reasons
        assert "AbortReq" in reasons[req.prefill_abort_rank]
        assert any("another rank" in r for r in reasons)
        assert all(req.decode_reasons)


def test_decode_abort_mid_transfer_fails_both_sides_and_holds_pages_until_safe(pair: Pair) -> None:
    requests = random_requests(random.Random(12), 8, max_pages=8)
    aborted = []
    for i, req in enumerate(requests):
        if len(req.src_pages) >= 2:
            req.chunks = [req.src_pages[:1], req.src_pages[1:]]
            req.decode_abort_after = 1
            req.decode_abort_rank = i % TP
            aborted.append(req)
    assert aborted
    out = pair.run(requests)
    assert_clean(out)
    for req in aborted:
        assert req.decode_outcome == "Failed"
        # prefill may have finished the last chunk before the abort reached it; either way the
        # decode pages went back only once no write could reach them (canaries checked).
        assert req.prefill_outcome in ("Failed", "Success")
        assert "AbortReq" in req.decode_reasons[req.decode_abort_rank]
    assert {r.room for r in pair.d.released} >= {r.room for r in aborted}


def test_late_metadata_for_a_cleared_room_fails_the_decode_side(pair: Pair) -> None:
    requests = random_requests(random.Random(13), 6)
    late = requests[:3]
    for req in late:
        req.prefill_abort_early = True  # prefill aborts and clears while bootstrapping
        req.decode_waits_for_prefill = True  # decode's page list arrives only after that
    out = pair.run(requests)
    assert_clean(out)
    for req in late:
        assert req.prefill_outcome == "Failed"
        assert req.decode_outcome == "Failed"
        assert all("peer failed" in r or "another rank" in r for r in req.decode_reasons)
    assert all(r.decode_outcome == "Success" for r in requests[3:])


def test_duplicate_room_ids_fail_the_duplicate_not_the_original(pair: Pair) -> None:
    first, other = random_requests(random.Random(14), 2)
    twin = Request(
        room=first.room,
        src_pages=other.src_pages,
        dst_pages=other.dst_pages,
        chunks=other.chunks,
        src_aux=other.src_aux,
        dst_aux=other.dst_aux,
        src_state=other.src_state,
        dst_state=other.dst_state,
    )
    out = pair.run([first, twin])
    assert_clean(out)
    assert (first.prefill_outcome, first.decode_outcome) == ("Success", "Success"), (
        first.prefill_reasons,
        first.decode_reasons,
    )
    assert (twin.prefill_outcome, twin.decode_outcome) == ("Failed", "Failed")
    reasons = twin.prefill_reasons + twin.decode_reasons
    assert all("already live" in r or "another rank" in r for r in reasons), reasons
    assert any("already live" in r for r in reasons), reasons


def test_decode_times_out_when_prefill_never_sends(pair: Pair) -> None:
    requests = random_requests(random.Random(15), 3)
    requests[0].prefill_ignores = True
    # Bounded: Pair.run reports a request that never finished (its own timeout) as a violation.
    out = pair.run(requests)
    assert_clean(out)
    assert requests[0].decode_outcome == "Failed"
    assert all("deadline" in r or "another rank" in r for r in requests[0].decode_reasons)
    assert any("deadline" in r for r in requests[0].decode_reasons)
    assert all(r.decode_outcome == "Success" for r in requests[1:])


def test_prefill_gives_up_on_a_request_decode_never_hears_of(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    # The router sent the request to prefill only: no decode room ever claims it. Prefill's
    # rooms fail after the unclaimed bound with that reason, not after their Bootstrapping
    # deadline (10 s here, 300 s by default), and the other requests are untouched. The bound
    # is 2 s: a loaded CI host can block this process's loop for a good part of a second, and
    # a stall of over half the bound is, rightly, blamed instead.
    configure(
        dataclasses.replace(CONFIG, channel=dataclasses.replace(CONFIG.channel, unclaimed_s=2.0))
    )
    try:
        prefill = Instance.start("prefill", bootstrap.port, TP)
        decode = Instance.start("decode", bootstrap.port, TP)
    finally:
        configure(CONFIG)
    pair = Pair(prefill, decode, bootstrap.port)
    try:
        requests = random_requests(random.Random(16), 3)
        requests[0].decode_ignores = True
        out = pair.run(requests)
    finally:
        decode.close()
        prefill.close()
    assert_clean(out)
    assert requests[0].prefill_outcome == "Failed"
    assert any("no decode room claimed it within 2s" in r for r in requests[0].prefill_reasons), (
        requests[0].prefill_reasons
    )
    assert not any("deadline" in r for r in requests[0].prefill_reasons)
    assert all((r.prefill_outcome, r.decode_outcome) == ("Success",) * 2 for r in requests[1:])


def test_random_failures_on_one_rank_fail_the_request_everywhere(pair: Pair) -> None:
    """SGLANG_TEST_DISAGG_FAILURE_PROB: a rank's poll is replaced by Failed at random; the MIN makes
    the request Failed on every rank, whose ``failure_exception()`` must raise and clear."""
    rng = random.Random(16)
    requests = random_requests(rng, 12)
    doomed = {r.room for r in requests if rng.random() < 0.4}

    def inject(check_poll):  # type: ignore[no-untyped-def]
        def poll(side, req, rank, conn, *, before_init):  # type: ignore[no-untyped-def]
            value = check_poll(side, req, rank, conn, before_init=before_init)
            return 0 if req.room in doomed and rank == 1 and side == "decode" else value

        return poll

    pair.d.check = type(pair.check)()  # the injected zeros are not the adapter's polls
    pair.d.check.poll = inject(pair.d.check.poll)  # type: ignore[method-assign]
    out = pair.run(requests)
    assert_clean(out)
    assert pair.d.check.violations == []
    for req in requests:
        if req.room in doomed:
            assert req.decode_outcome == "Failed"
            assert any("another rank" in r for r in req.decode_reasons)
        else:
            assert req.decode_outcome == "Success"


def test_prefill_restarted_behind_the_same_address(bootstrap: KvfsmKVBootstrapServer) -> None:
    prefill = Instance.start("prefill", bootstrap.port, TP)
    decode = Instance.start("decode", bootstrap.port, TP)
    try:
        pair = Pair(prefill, decode, bootstrap.port)
        before = random_requests(random.Random(17), 6)
        for req in before:
            req.chunks = [[p] for p in req.src_pages] or [[]]
        pair.submit(before)
        pair.step_until(lambda: any(r.chunks_sent for r in before), timeout=30)
        prefill.close()  # the prefill instance dies with requests in flight
        # Its scheduler is gone too: only decode's goes on, and must end every request.
        step_until(
            pair.d.step,
            lambda: all(r.decode_outcome is not None for r in before) and not pair.d.busy,
            timeout=40,
            message="decode to end every request",
        )
        assert any(r.decode_outcome == "Failed" for r in before)
        assert pair.check.violations == []

        restarted = Instance.start("prefill", bootstrap.port, TP, generation=1)
        prefill = restarted
        pair2 = Pair(restarted, decode, bootstrap.port)
        after = random_requests(random.Random(18), 6, first_room=100)
        out = pair2.run(after, timeout=60)
        assert_clean(out)
        assert all(r.decode_outcome == "Success" for r in after)
    finally:
        decode.close()
        prefill.close()


def test_a_transfer_stuck_in_progress_fails_in_bounded_time(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """NIXL handles that report PROC forever (a dead or wedged peer's): the chunk deadline fails
    the request on both sides, the pages stay reserved until the quarantine ends, nothing leaks."""
    faults = TransportFaults(FaultPlan(21, TransferRates(never_complete=0.3)))
    configure(dataclasses.replace(CONFIG, agent=faulty_agent_config(faults)))
    try:
        prefill = Instance.start("prefill", bootstrap.port, TP)
    finally:
        configure(CONFIG)
    decode = Instance.start("decode", bootstrap.port, TP)
    try:
        requests = random_requests(random.Random(22), 12)
        # Bounded: a request that never finished within run()'s timeout is a violation.
        out = Pair(prefill, decode, bootstrap.port).run(requests, timeout=90)
        assert_clean(out)
        assert faults.plan.counts[("xfer", "never_complete")] > 0, faults.plan.counts
        failed = [r for r in requests if r.decode_outcome == "Failed"]
        assert failed
        for req in failed:
            assert req.prefill_outcome == "Failed"
            assert any("stall" in r or "deadline" in r for r in req.prefill_reasons), req
        assert all(r.prefill_outcome == "Success" for r in requests if r not in failed)
    finally:
        decode.close()
        prefill.close()


def test_the_checker_reports_a_block_and_a_kind_that_is_often_slow_not_one_hiccup() -> None:
    check = Checker()
    check.call("quick", lambda: None)
    check.call("hiccup", time.sleep, CALL_LIMIT_S * 1.5)  # one slow call: a machine hiccup
    assert check.violations == []
    assert check.slow_kinds() == []
    check.call("blocks", time.sleep, BLOCK_LIMIT_S * 1.2)
    assert len(check.violations) == 1
    assert check.violations[0].startswith("blocks blocked the scheduler for ")
    for _ in range(5):
        check.call("often slow", time.sleep, CALL_LIMIT_S * 1.5)
    assert check.slow_kinds() == [
        f"often slow was slower than {CALL_LIMIT_S * 1e3:g} ms in 5 of 5 calls"
    ]
