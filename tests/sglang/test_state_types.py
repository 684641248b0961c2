"""Hybrid models' state, replayed: SGLang 0.5.23's scheduler sequence against kvfsm's adapter
over real NIXL (DRAM) and a real bootstrap server, two TP ranks on each side, with several
state types per model, each with its own buffers, item sizes and indices (Mamba's one slot,
SWA and DSA page windows). Success means every byte of every state item of the request on
every decode rank equals prefill's (``verify_success``), on top of the KV and aux checks of
``test_conformance.py``; aborts mid-transfer fail the request on every rank."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer
from kvfsm.sglang._states import INDEXED, RING_ROW, SLOT_ONE
from tests.helpers.sglang_replay import (
    HYBRID,
    PAGE_BYTES,
    PAGE_TOKENS,
    PAGES,
    RING_SLOTS,
    Instance,
    Outcome,
    Pair,
    Request,
    StateSpec,
    random_requests,
)

TP = 2


def start(port: int, specs: tuple[StateSpec, ...]) -> Pair:
    prefill = Instance.start("prefill", port, TP, state=specs)
    try:
        decode = Instance.start("decode", port, TP, state=specs)
    except BaseException:
        prefill.close()
        raise
    return Pair(prefill, decode, port)


@pytest.fixture
def hybrid(bootstrap: KvfsmKVBootstrapServer) -> Iterator[Pair]:
    pair = start(bootstrap.port, HYBRID)
    yield pair
    pair.d.instance.close()
    pair.p.instance.close()


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def state_items(req: Request) -> dict[str, int]:
    return {spec.name: len(spec.items_of(req, "dst")) for spec in HYBRID}


def test_several_state_types_land_byte_for_byte_in_their_own_slots(hybrid: Pair) -> None:
    requests = random_requests(random.Random(31), 12)
    out = hybrid.run(requests)
    assert_clean(out)
    assert [(r.prefill_outcome, r.decode_outcome) for r in requests] == [("Success",) * 2] * 12
    # Every type moved items (a zero-page request moves its Mamba slot only).
    moved = [state_items(r) for r in requests]
    assert all(m["mamba"] == 1 for m in moved)
    assert sum(m["swa"] for m in moved) > 0
    assert sum(m["dsa"] for m in moved) > sum(m["swa"] for m in moved)


def test_an_abort_mid_transfer_fails_a_hybrid_request_everywhere(hybrid: Pair) -> None:
    requests = random_requests(random.Random(32), 8, max_pages=8)
    aborted = []
    for i, req in enumerate(requests):
        if len(req.src_pages) >= 3:
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
            if i % 2:
                req.prefill_abort_after, req.prefill_abort_rank = 1, i % TP
            else:
                req.decode_abort_after, req.decode_abort_rank = 1, i % TP
            aborted.append(req)
    assert aborted
    out = hybrid.run(requests)
    assert_clean(out)
    for req in requests:
        if req not in aborted:
            assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), req.room
        elif req.prefill_abort_after is not None:
            assert (req.prefill_outcome, req.decode_outcome) == ("Failed", "Failed"), req.room
        else:  # prefill may have finished its last chunk before the abort reached it
            assert req.decode_outcome == "Failed", req.room
            assert req.prefill_outcome in ("Failed", "Success"), req.room


def _alone(name: str) -> tuple[StateSpec, ...]:
    if name in RING_ROW:  # a ring row of 8 slots per request, key and score halves
        return (StateSpec(name, (RING_SLOTS * 24, RING_SLOTS * 8), names="ring"),)
    if name in SLOT_ONE or name in ("request_row", "c128_state"):  # one item per request row
        return (StateSpec(name, (72, 200)),)
    return (StateSpec(name, (PAGE_BYTES // 4, 40), items=PAGES, names="window", window=3),)


@pytest.mark.parametrize("name", sorted(INDEXED | SLOT_ONE | RING_ROW))
def test_each_state_type_sglangs_nixl_backend_moves_is_moved_byte_for_byte(
    name: str, bootstrap: KvfsmKVBootstrapServer
) -> None:
    pair = start(bootstrap.port, _alone(name))
    try:
        requests = random_requests(random.Random(zlib.crc32(name.encode())), 5)
        out = pair.run(requests)
    finally:
        pair.d.instance.close()
        pair.p.instance.close()
    assert_clean(out)
    assert [r.decode_outcome for r in requests] == ["Success"] * 5


def _ring(extra: int) -> StateSpec:
    """A DeepSeek-V4-style tail ring: a compression ring of ``RING_SLOTS`` plus ``extra``
    speculative slots, key and score rings, SGLang's own entries per request."""
    slots = RING_SLOTS + extra
    return StateSpec("dsa_tail", (slots * 24, slots * 8), names="ring", ring=(RING_SLOTS, extra))


def _ring_pair(port: int, prefill_extra: int, decode_extra: int) -> Pair:
    prefill = Instance.start("prefill", port, TP, state=(_ring(prefill_extra),))
    try:
        decode = Instance.start("decode", port, TP, state=(_ring(decode_extra),))
    except BaseException:
        prefill.close()
        raise
    return Pair(prefill, decode, port)


def _ring_requests(seed: int, n: int) -> list[Request]:
    """Requests whose lengths end anywhere in their last page: a live count of 0 to 7."""
    rng = random.Random(seed)
    requests = random_requests(rng, n, max_pages=6)
    for req in requests:
        req.tail_tokens = rng.randint(1, PAGE_TOKENS)
    return requests


@pytest.mark.parametrize(("prefill_extra", "decode_extra"), [(0, 3), (2, 0)])
def test_tail_rings_of_different_sizes_land_every_live_slot_where_sglang_puts_it(
    prefill_extra: int, decode_extra: int, bootstrap: KvfsmKVBootstrapServer
) -> None:
    """Other speculative slot counts on the two sides: each side's entry is SGLang's own for
    its ring (``get_dsa_tail_state_indices``), and every live slot of prefill's ring row must
    land, in token order, at decode's live slots for the request, every other slot of decode's
    row unwritten (``_ring_differs``: byte for byte, key and score rings, on both decode
    ranks). Moving whole rows, or the slots at prefill's offsets, fails it. Aborts mid-transfer
    on either side fail their request everywhere."""
    pair = _ring_pair(bootstrap.port, prefill_extra, decode_extra)
    requests = _ring_requests(41, 14)
    aborted = [r for r in requests if len(r.src_pages) >= 3][:2]
    assert len(aborted) == 2
    for req in aborted:
        req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
    aborted[0].prefill_abort_after, aborted[0].prefill_abort_rank = 1, 1
    aborted[1].decode_abort_after, aborted[1].decode_abort_rank = 1, 0
    try:
        out = pair.run(requests)
    finally:
        pair.d.instance.close()
        pair.p.instance.close()
    assert_clean(out)
    served = [r for r in requests if r not in aborted]
    for req in served:
        assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), [
            (r.room, r.prefill_outcome, r.decode_outcome, r.decode_reasons[:1]) for r in requests
        ]
    assert aborted[0].decode_outcome == "Failed"
    assert aborted[1].decode_outcome == "Failed"
    # The requests cover a ring that wraps, one that does not, and no live slot at all, and
    # the live slots sit at other offsets on the two sides.
    sides = [
        (_ring(prefill_extra).indices(r, "src"), _ring(decode_extra).indices(r, "dst"))
        for r in served
    ]
    assert any(d and d[4] for _, d in sides) or any(s and s[4] for s, _ in sides)
    assert any(d and not d[4] for _, d in sides)
    assert any(not d for _, d in sides)
    assert any(s and d and s[1] != d[1] for s, d in sides)


class _Tampered(StateSpec):
    """Decode's entries, with the rooms of ``bad`` given another one."""

    bad: dict[int, list[int]] = {}  # noqa: RUF012 - set per test before the pair starts

    def indices(self, req: Request, side: str) -> list[int]:
        entry = super().indices(req, side)
        return self.bad.get(req.room, entry) if entry else entry


def test_malformed_ring_segments_fail_their_own_room_only(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """A decode entry whose live count differs from prefill's fails at prefill's transport
    (nothing posted); one whose segment runs past its ring fails on decode before it is sent.
    Every other request is served byte for byte."""
    prefill = Instance.start("prefill", bootstrap.port, TP, state=(_ring(0),))
    spec = _Tampered("dsa_tail", (11 * 24, 11 * 8), names="ring", ring=(RING_SLOTS, 3))
    try:
        decode = Instance.start("decode", bootstrap.port, TP, state=(spec,))
    except BaseException:
        prefill.close()
        raise
    pair = Pair(prefill, decode, bootstrap.port)
    requests = _ring_requests(43, 10)
    live = [r for r in requests if spec.indices(r, "dst")]
    assert len(live) >= 4
    count, past = live[0], live[1]
    entry = spec.indices(count, "dst")
    total = entry[2] + entry[4]
    _Tampered.bad = {
        count.room: [entry[0], 0, total + 1 if total < RING_SLOTS - 1 else total - 1, 0, 0, 11],
        past.room: [spec.indices(past, "dst")[0], 9, 3, 0, 0, 11],
    }
    try:
        out = pair.run(requests)
    finally:
        _Tampered.bad = {}
        decode.close()
        prefill.close()
    assert_clean(out)
    for req in requests:
        if req in (count, past):
            assert req.decode_outcome == "Failed", req.room
        else:
            assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), req.room
    assert any(
        "ring live slots differ" in why for why in count.decode_reasons + count.prefill_reasons
    ), (
        count.decode_reasons,
        count.prefill_reasons,
    )
    assert any("exceeds the ring of 11 slots" in why for why in past.decode_reasons), (
        past.decode_reasons
    )


def test_zero_row_state_buffers_are_kept_in_place_and_move_nothing(
    bootstrap: KvfsmKVBootstrapServer,
) -> None:
    """DeepSeek's index-sharing layers have no tail ring of their own: SGLang keeps an empty
    buffer (no rows, item length 0) in their place in ``state_data_ptrs`` so that the layers
    stay aligned between the peers, and its NIXL backend skips it (``item_len=0`` in
    ``get_compress_tail_buf_infos``, skipped by ``build_dsa_tail_transfer_blocks``). Here
    layers 1 and 3 of 4 share: every other buffer moves byte for byte, in its own place."""
    ring = StateSpec(
        "dsa_tail",
        (RING_SLOTS * 24, 0, RING_SLOTS * 16, 0, RING_SLOTS * 8, 0, RING_SLOTS * 4, 0),
        names="ring",
    )
    pages = StateSpec("dsa", (PAGE_BYTES // 4, 0, 40, 0), items=PAGES, names="window", window=3)
    pair = start(bootstrap.port, (pages, ring))
    try:
        rings = tuple(RING_SLOTS * n for n in (24, 16, 8, 4))
        assert pair.p.instance.managers[0].states.items == (PAGE_BYTES // 4, 40, *rings)
        requests = random_requests(random.Random(33), 8, max_pages=8)
        aborted = [r for r in requests if len(r.src_pages) >= 3][:2]
        assert len(aborted) == 2
        for req in aborted:
            req.chunks = [req.src_pages[:1], req.src_pages[1:2], req.src_pages[2:]]
        aborted[0].prefill_abort_after, aborted[0].prefill_abort_rank = 1, 1
        aborted[1].decode_abort_after, aborted[1].decode_abort_rank = 1, 0
        out = pair.run(requests)
    finally:
        pair.d.instance.close()
        pair.p.instance.close()
    assert_clean(out)
    for req in requests:
        if req in aborted:
            assert req.decode_outcome == "Failed", req.room
        else:  # every byte of every non-empty buffer checked on decode
            assert (req.prefill_outcome, req.decode_outcome) == ("Success", "Success"), req.room
