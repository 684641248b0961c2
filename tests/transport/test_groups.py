"""``kvfsm.transport._transport.group_staged``: how a batch's staged records are grouped into
NIXL requests (the ledger's rule 8), sans-IO. Per (peer generation, fence), each group in
posting order within ``merge_max_chunks`` and ``merge_max_bytes``; dropped and non-mergeable
records alone; law 4: no group mixes peer generations or fences. The same grouping on real
NIXL, with several decode processes: ``test_transport.py``."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.rooms import RoomKey
from kvfsm.transport._chunks import Xfer
from kvfsm.transport._transport import group_staged

NONE = np.empty(0, np.int32)
_ROOMS = itertools.count(1)


class Gen:
    """Stands in for a peer generation: the grouping compares them by identity only."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def rec(
    peer: Gen,
    nbytes: int = 10,
    *,
    fence: int = 0,
    mergeable: bool = True,
    dropped: bool = False,
) -> Xfer:
    record = Xfer(
        RoomKey(next(_ROOMS), 1),
        0,
        peer=peer,
        fence=fence,
        src=NONE,
        dst=NONE,
        src_aux=None,
        dst_aux=None,
        src_state=NONE,
        dst_state=NONE,
        nbytes=nbytes,
    )
    record.mergeable = mergeable
    record.dropped = dropped
    return record


def test_chunks_interleaved_over_three_peers_group_per_peer_in_posting_order() -> None:
    a, b, c = Gen("a"), Gen("b"), Gen("c")
    staged = [rec(p) for _ in range(4) for p in (a, b, c)]
    groups, growing = group_staged(staged, 64, 1 << 20)
    assert groups == [staged[0::3], staged[1::3], staged[2::3]]
    assert growing == 2  # the last record went to c


def test_fences_and_generations_never_share_a_group() -> None:
    old, new = Gen("decode gen 1"), Gen("decode gen 2")  # one peer id, two generations
    staged = [
        rec(old, fence=1),
        rec(old, fence=2),
        rec(new, fence=1),
        rec(old, fence=1),
        rec(new, fence=1),
        rec(old, fence=2),
    ]
    groups, growing = group_staged(staged, 64, 1 << 20)
    assert groups == [
        [staged[0], staged[3]],
        [staged[1], staged[5]],
        [staged[2], staged[4]],
    ]
    assert growing == 1


def test_each_peer_s_group_is_bounded_by_chunks_and_bytes_apart_from_the_others() -> None:
    a, b = Gen("a"), Gen("b")
    staged = [rec(a), rec(b), rec(a), rec(b), rec(a), rec(b, 25)]
    by_chunks, _ = group_staged(staged, 2, 1 << 20)
    assert by_chunks == [
        [staged[0], staged[2]],
        [staged[1], staged[3]],
        [staged[4]],
        [staged[5]],
    ]
    by_bytes, growing = group_staged(staged, 64, 30)
    # b's third record (25 bytes) does not fit beside its first two (20): a new group for b,
    # while a's group (30 bytes) is full to the byte and still one request.
    assert by_bytes == [
        [staged[0], staged[2], staged[4]],
        [staged[1], staged[3]],
        [staged[5]],
    ]
    assert growing == 2


def test_dropped_records_go_alone_and_close_nothing() -> None:
    a, b = Gen("a"), Gen("b")
    staged = [rec(a), rec(a, dropped=True), rec(b), rec(a), rec(b, dropped=True)]
    groups, growing = group_staged(staged, 64, 1 << 20)
    assert groups == [[staged[0], staged[3]], [staged[1]], [staged[2]], [staged[4]]]
    assert growing == -1  # the last record will never be posted: nothing to keep growing


def test_a_record_that_is_not_mergeable_goes_alone_and_closes_only_its_own_peer_s_group() -> None:
    a, b = Gen("a"), Gen("b")
    big = rec(a, 1 << 30, mergeable=False)
    staged = [rec(a), rec(b), big, rec(a), rec(b), rec(a)]
    groups, growing = group_staged(staged, 64, 1 << 20)
    # a's records after the big one start a new group behind it: a's order holds; b's group
    # is not a's business.
    assert groups == [[staged[0]], [staged[1], staged[4]], [big], [staged[3], staged[5]]]
    assert growing == 3
    _, growing = group_staged([*staged, rec(b, mergeable=False)], 64, 1 << 20)
    assert growing == -1


def test_one_peer_gives_the_runs_of_posting_order() -> None:
    """With one decode peer the grouping is what it was before it was per peer: greedy runs
    in posting order, each non-mergeable record between two of them."""
    a = Gen("a")
    staged = [rec(a), rec(a), rec(a, mergeable=False), rec(a), rec(a), rec(a)]
    groups, growing = group_staged(staged, 2, 1 << 20)
    assert groups == [staged[0:2], staged[2:3], staged[3:5], staged[5:6]]
    assert growing == 3
    assert group_staged([], 64, 1 << 20) == ([], -1)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Xfer], int, int]:
    gens = [Gen(f"g{i}") for i in range(draw(st.integers(1, 4)))]
    staged = [
        rec(
            draw(st.sampled_from(gens)),
            draw(st.integers(0, 40)),
            fence=draw(st.integers(0, 2)),
            mergeable=draw(st.booleans() | st.just(True)),
            dropped=draw(st.integers(0, 9)) == 0,
        )
        for _ in range(draw(st.integers(0, 40)))
    ]
    return staged, draw(st.integers(1, 5)), draw(st.integers(0, 100))


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_record_once_groups_of_one_key_within_bounds_and_each_key_s_order_kept(
    batch: tuple[list[Xfer], int, int],
) -> None:
    staged, max_chunks, max_bytes = batch
    groups, growing = group_staged(staged, max_chunks, max_bytes)
    flat = [record for group in groups for record in group]
    assert sorted(map(id, flat)) == sorted(map(id, staged))  # each record once
    position = {id(record): i for i, record in enumerate(staged)}
    for group in groups:
        assert [position[id(r)] for r in group] == sorted(position[id(r)] for r in group)
        if len(group) > 1:
            assert all(r.mergeable and not r.dropped for r in group)
            assert len({(id(r.peer), r.fence) for r in group}) == 1  # law 4
            assert len(group) <= max_chunks
            assert sum(r.nbytes for r in group) <= max_bytes
    # Groups in the order of their first records, and every key's records that will be
    # posted reach the poster in posting order.
    firsts = [position[id(group[0])] for group in groups]
    assert firsts == sorted(firsts)
    handed = [r for r in flat if not r.dropped]
    for key in {(id(r.peer), r.fence) for r in handed}:
        of_key = [position[id(r)] for r in handed if (id(r.peer), r.fence) == key]
        assert of_key == sorted(of_key)
    # No group is split without cause: a key's next mergeable group starts only because the
    # one before could not take its first record, or a non-mergeable record of that key came
    # between them.
    for i, group in enumerate(groups):
        first = group[0]
        if not first.mergeable or first.dropped:
            continue
        key = (id(first.peer), first.fence)
        before = [
            g
            for g in groups[:i]
            if g[0].mergeable and not g[0].dropped and (id(g[0].peer), g[0].fence) == key
        ]
        if not before:
            continue
        prev = before[-1]
        between = staged[position[id(prev[-1])] + 1 : position[id(first)]]
        closed = any(
            not r.mergeable and not r.dropped and (id(r.peer), r.fence) == key for r in between
        )
        full = len(prev) >= max_chunks or sum(r.nbytes for r in prev) + first.nbytes > max_bytes
        assert closed or full
    last = staged[-1] if staged else None
    if last is None or last.dropped or not last.mergeable:
        assert growing == -1
    else:
        assert last in groups[growing]
