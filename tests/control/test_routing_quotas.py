"""Prefill's routing core under links that flood it within their quotas, driven directly with
``now``: every table a peer's frames can fill is bounded per link, and no link's traffic
pushes out another link's entries (early-abort marks, marks of answered rooms, held claims and
page lists, the marks a lost link leaves). A legit decode runs through each flood: its early
aborts still fail its rooms at once, its late frames are still stale, its rooms succeed."""

from __future__ import annotations

import gc
import logging
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm.control._frames import (
    Reconcile,
    RoomAbort,
    RoomClaim,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
    pack_refs,
)
from kvfsm.control._routing import Action, Deliver, PrefillRouting, RoutingConfig, Send
from kvfsm.rooms._actor import RoomKey
from kvfsm.states import AbortRequested, DestinationReceived, KVPoll

CONFIG = RoutingConfig(pending_max=64, pending_ttl_s=10.0, held_bytes_max=64 * 1024)
PAGES = np.arange(4, dtype="<i4").tobytes()
LEGIT = 1  # the legit decode's link
LEGIT_PEER = "decode-0-7"
LEGIT_HOST = "10.0.0.2"
FLOOD_HOST = "10.0.0.66"  # every flooding link comes from this one host


def sends(actions: list[Action], link: int | None = None) -> list[object]:
    return [a.frame for a in actions if isinstance(a, Send) and (link is None or a.link == link)]


def delivered(actions: list[Action]) -> list[tuple[RoomKey, object]]:
    return [(a.key, a.event) for a in actions if isinstance(a, Deliver)]


def open_link(core: PrefillRouting, link: int, peer: str, host: str, now: float = 0.0) -> None:
    core.link_opened(link, peer, now=now, hello_sent=now, lease_ms=2000, host=host)


def flood(core: PrefillRouting, links: list[int], now: float) -> None:
    """Each link, within every quota: ``pending_max`` early aborts, claims and page lists held
    up to its quota (half each), and one Reconcile of ``pending_max`` unknown rooms. Room ids
    are the link's own (no collision with anybody's)."""
    n = CONFIG.pending_max
    for link in links:
        base = link * 1_000_000
        for i in range(n):
            assert core.on_abort(link, RoomAbort(base + i, 1, "flood"), now) == [
                Send(link, RoomSettled(base + i, 1))
            ]
        for i in range(n // 2):
            assert core.on_claim(link, RoomClaim(base + n + i, 1), now) == []
        for i in range(n // 2):
            frame = RoomMetadata(base + 2 * n + i, 1, PAGES, 0)
            assert core.on_metadata(link, frame, now) == []
        refs = pack_refs([(base + 3 * n + i, 1) for i in range(n)])
        assert len(sends(core.on_reconcile(link, Reconcile(refs), now))) == n


@pytest.mark.parametrize("n", [1, 9, 100])
def test_links_flooding_within_their_quotas_leave_a_legit_decode_whole(n: int) -> None:
    core = PrefillRouting(CONFIG)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    # The legit decode, before the flood: 20 rooms claimed and aborted before prefill has
    # their senders (the documented early-abort path), 10 rooms whose page lists wait for
    # their senders, and 10 rooms served and over (their late frames must stay stale).
    for room in range(20):
        core.on_claim(LEGIT, RoomClaim(room, 1), 0.0)
        assert sends(core.on_abort(LEGIT, RoomAbort(room, 1, "client gone"), 0.0)) == [
            RoomSettled(room, 1)
        ]
    for room in range(100, 110):
        assert core.on_metadata(LEGIT, RoomMetadata(room, 1, PAGES, 0), 0.0) == []
    for room in range(200, 210):
        key = RoomKey(room, 5000 + room)
        core.sender_spawned(key, 0.0)
        core.on_metadata(LEGIT, RoomMetadata(room, 1, PAGES, 0), 0.0)
        assert sends(core.sender_outcome(key, KVPoll.Success, "", 0.1)) == [
            RoomOutcome(room, 1, int(KVPoll.Success), "")
        ]
        core.sender_reaped(key)

    flooders = list(range(10, 10 + n))
    for link in flooders:
        open_link(core, link, f"decode-{link}-1", FLOOD_HOST)
    flood(core, flooders, 1.0)
    # Within their quotas: nothing refused, everything kept (per link, not a shared pool).
    assert core.stats["early_aborts_over_quota"] == 0
    assert core.stats["held_over_quota"] == 0
    entries = core.entries()
    assert entries["early_aborts"] == 20 + n * CONFIG.pending_max
    assert entries["held"] == 10 + n * CONFIG.pending_max

    # The legit decode's early aborts still fail its rooms at once.
    for room in range(20):
        key = RoomKey(room, 9000 + room)
        assert delivered(core.sender_spawned(key, 2.0)) == [
            (key, AbortRequested("client gone", origin="peer"))
        ]
        core.sender_outcome(key, KVPoll.Failed, "aborted (peer): client gone", 2.0)
        core.sender_reaped(key)
    # Its late frames are still recognised as stale: an abort after Success is answered and
    # marks nothing, a page list behind an answered room is not held.
    stale = core.stats["stale_frames"]
    for room in range(200, 210):
        assert core.on_abort(LEGIT, RoomAbort(room, 1, "late"), 2.0) == [
            Send(LEGIT, RoomSettled(room, 1))
        ]
        assert core.on_metadata(LEGIT, RoomMetadata(room, 1, PAGES, 0), 2.0) == []
    assert core.stats["stale_frames"] == stale + 20
    for room in range(200, 210):  # the ids' next senders are not aborted by those late aborts
        key = RoomKey(room, 7000 + room)
        assert core.sender_spawned(key, 2.1) == []
        core.sender_outcome(key, KVPoll.Failed, "never claimed", 2.1)
        core.sender_reaped(key)
    # Its held page lists bind, and its rooms succeed.
    for room in range(100, 110):
        key = RoomKey(room, 8000 + room)
        ((got, event),) = delivered(core.sender_spawned(key, 2.2))
        assert got == key
        assert isinstance(event, DestinationReceived)
        assert event.fence == LEGIT
        assert sends(core.sender_outcome(key, KVPoll.Success, "", 2.3), LEGIT) == [
            RoomOutcome(room, 1, int(KVPoll.Success), "")
        ]
        core.sender_reaped(key)
    # Every link lost, everything expires: nothing is left behind.
    for link in [LEGIT, *flooders]:
        core.link_lost(link, "gone", 3.0)
    core.tick(100.0)
    assert {k: v for k, v in core.entries().items() if v} == {}


def test_a_link_over_its_share_of_answered_rooms_loses_its_own_oldest() -> None:
    """Aborts of 4x its quota of unknown rooms (each answered, and marked so): that link keeps
    its newest marks; the legit decode's marks are untouched (before, the marks of every link
    were one pool of ``pending_max``, and such a flood replaced them all)."""
    core = PrefillRouting(CONFIG)
    m = CONFIG.pending_max
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    open_link(core, 2, "decode-9-9", FLOOD_HOST)
    core.on_abort(LEGIT, RoomAbort(5, 1, "client gone"), 0.0)  # answered: marked finished
    for i in range(4 * m):
        core.on_abort(2, RoomAbort(1000 + i, 1, "flood"), 1.0)
    assert core.stats["finished_over_quota"] == 3 * m
    assert core.entries()["finished"] == m + 1
    # The legit room's late page list is still stale, not held for the id's next sender.
    stale = core.stats["stale_frames"]
    assert core.on_metadata(LEGIT, RoomMetadata(5, 1, PAGES, 0), 1.5) == []
    assert core.stats["stale_frames"] == stale + 1
    assert core.entries()["held"] == 0
    # The flooder's newest marks are kept (a late frame of one is stale), its oldest gone.
    core.on_claim(2, RoomClaim(1000 + 4 * m - 1, 1), 2.0)
    assert core.stats["stale_frames"] == stale + 2
    core.on_claim(2, RoomClaim(1000, 1), 2.0)  # forgotten: held as a new claim
    assert core.stats["stale_frames"] == stale + 2
    assert core.entries()["held"] == 1


def test_a_reconcile_answers_at_most_a_quota_of_rooms_it_does_not_know() -> None:
    """One Reconcile of 4,096 unknown rooms on a link whose quota is 64: 64 are answered,
    the rest not (decode settles them at its lost-link bound); the orphans it names are
    re-attached whatever their place in it; the legit decode's marks are untouched."""
    core = PrefillRouting(CONFIG)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    core.on_abort(LEGIT, RoomAbort(5, 1, "client gone"), 0.0)
    # An orphan of the flooding decode's first link, named last in its Reconcile.
    open_link(core, 2, "decode-9-9", FLOOD_HOST)
    key = RoomKey(77, 1)
    core.sender_spawned(key, 0.0)
    core.on_metadata(2, RoomMetadata(77, 3, PAGES, 0), 0.0)
    core.link_lost(2, "cut", 0.5)
    assert core.entries()["orphans"] == 1
    open_link(core, 3, "decode-9-9", FLOOD_HOST, now=1.0)
    refs = pack_refs([(1000 + i, 1) for i in range(4096)] + [(77, 3)])
    answered = sends(core.on_reconcile(3, Reconcile(refs), 1.0), 3)
    assert answered == [RoomSettled(1000 + i, 1) for i in range(CONFIG.pending_max)]
    assert core.stats["reconcile_refs_over_quota"] == 4096 - CONFIG.pending_max
    assert core.entries()["orphans"] == 0
    assert core.bound_to(3) == [key]
    stale = core.stats["stale_frames"]
    assert core.on_abort(LEGIT, RoomAbort(5, 1, "again"), 2.0) == [Send(LEGIT, RoomSettled(5, 1))]
    assert core.stats["stale_frames"] == stale + 1


def test_held_page_lists_are_capped_by_their_bytes_per_link() -> None:
    """A link's page lists held for rooms that do not exist yet count their bytes against its
    own ``held_bytes_max``: over it the room is refused (Failed + Settled) with that reason,
    whether the page list comes alone or behind its held claim; another link is not."""
    core = PrefillRouting(CONFIG)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    open_link(core, 2, "decode-9-9", FLOOD_HOST)
    big = np.arange(CONFIG.held_bytes_max // 4 // 2, dtype="<i4").tobytes()  # half the quota
    assert core.on_metadata(2, RoomMetadata(1, 1, big, 0), 0.0) == []
    assert core.on_metadata(2, RoomMetadata(2, 1, big, 0), 0.0) == []
    assert core.entries()["held_bytes"] == CONFIG.held_bytes_max
    outcome, settled = sends(core.on_metadata(2, RoomMetadata(3, 1, PAGES, 0), 0.0), 2)
    assert isinstance(outcome, RoomOutcome)
    assert outcome.status == int(KVPoll.Failed)
    assert f"over their quota of {CONFIG.held_bytes_max} bytes" in outcome.reason
    assert settled == RoomSettled(3, 1)
    # A claim still fits (it holds no bytes); its page list does not, and the room is refused.
    assert core.on_claim(2, RoomClaim(4, 1), 0.0) == []
    outcome, settled = sends(core.on_metadata(2, RoomMetadata(4, 1, PAGES, 0), 0.0), 2)
    assert isinstance(outcome, RoomOutcome)
    assert "bytes" in outcome.reason
    assert settled == RoomSettled(4, 1)
    assert core.stats["held_over_quota"] == 2
    assert core.entries()["held"] == 2
    # The legit decode's page lists are held as before, and bind.
    assert core.on_metadata(LEGIT, RoomMetadata(4, 1, big, 0), 0.0) == []
    ((_, event),) = delivered(core.sender_spawned(RoomKey(4, 44), 0.1))
    assert isinstance(event, DestinationReceived)
    assert event.fence == LEGIT
    # A bound page list no longer counts: the flooder's bytes go with its held claims.
    assert core.entries()["held_bytes"] == CONFIG.held_bytes_max
    core.link_lost(2, "gone", 1.0)
    assert core.entries()["held_bytes"] == 0


def test_an_abort_of_an_id_another_decode_aborted_does_not_replace_its_mark() -> None:
    """Room ids come from clients and can collide: another link's abort or claim of the same
    id neither replaces nor undoes the first decode's early abort."""
    core = PrefillRouting(CONFIG)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    open_link(core, 2, "decode-9-9", FLOOD_HOST)
    core.on_abort(LEGIT, RoomAbort(7, 1, "client gone"), 0.0)
    core.on_abort(2, RoomAbort(7, 3, "someone else's"), 0.1)
    core.on_claim(2, RoomClaim(7, 4), 0.2)  # held for the id's sender, and takes it
    key = RoomKey(7, 70)
    assert delivered(core.sender_spawned(key, 0.3)) == []
    assert core.bound_to(2) == [key]
    # The legit mark stood: the next sender of the id still fails at once with its reason.
    core.sender_outcome(key, KVPoll.Failed, "x", 0.4)
    core.sender_reaped(key)
    assert delivered(core.sender_spawned(RoomKey(7, 71), 0.5)) == [
        (RoomKey(7, 71), AbortRequested("client gone", origin="peer"))
    ]


# -- the marks a lost link leaves ------------------------------------------------------------


def test_a_lost_links_early_aborts_still_fail_its_rooms_at_once() -> None:
    core = PrefillRouting(CONFIG)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    for room in range(5):
        core.on_abort(LEGIT, RoomAbort(room, 1, "client gone"), 0.0)
    core.link_lost(LEGIT, "cut", 1.0)
    for room in range(5):
        key = RoomKey(room, 50 + room)
        assert delivered(core.sender_spawned(key, 2.0)) == [
            (key, AbortRequested("client gone", origin="peer"))
        ]
    assert core.entries()["early_aborts"] == 0


def test_a_host_that_drops_links_in_a_loop_pushes_out_only_its_own_marks() -> None:
    """Each lost link's early aborts are kept in its host's share of lost links' marks
    (``pending_max * max_links_per_host``): a host that opens a link, fills its quota and
    drops it, again and again, loses its own oldest marks, never another host's."""
    config = RoutingConfig(pending_max=16, pending_ttl_s=10.0, max_links=8, max_links_per_host=2)
    core = PrefillRouting(config)
    open_link(core, LEGIT, LEGIT_PEER, LEGIT_HOST)
    for room in range(5):
        core.on_abort(LEGIT, RoomAbort(room, 1, "client gone"), 0.0)
    core.link_lost(LEGIT, "cut", 0.5)  # its marks are a lost link's now too
    for cycle in range(10):
        link = 100 + cycle
        open_link(core, link, f"decode-{link}-1", FLOOD_HOST, now=1.0)
        for i in range(config.pending_max):
            core.on_abort(link, RoomAbort(link * 1000 + i, 1, "flood"), 1.0)
        core.link_lost(link, "dropped", 1.0)
    share = config.pending_max * config.max_links_per_host
    assert core.entries()["early_aborts"] == 5 + share
    assert core.stats["early_aborts_dropped"] == 10 * config.pending_max - share
    for room in range(5):
        key = RoomKey(room, 50 + room)
        assert delivered(core.sender_spawned(key, 2.0)) == [
            (key, AbortRequested("client gone", origin="peer"))
        ]
    # The flooding host kept its newest marks.
    newest = 109 * 1000 + config.pending_max - 1
    assert len(delivered(core.sender_spawned(RoomKey(newest, 1), 2.0))) == 1
    assert delivered(core.sender_spawned(RoomKey(100 * 1000, 1), 2.0)) == []


def test_lost_links_marks_are_bounded_in_all() -> None:
    """Over every host's lost links (``pending_max * max_links``), a newly lost link's marks
    that do not fit are not kept; those already kept stay."""
    config = RoutingConfig(pending_max=4, pending_ttl_s=10.0, max_links=3, max_links_per_host=2)
    core = PrefillRouting(config)
    for i in range(5):  # five hosts, one link each, each at its quota
        link = 10 + i
        open_link(core, link, f"decode-{i}-1", f"10.0.1.{i}")
        for r in range(config.pending_max):
            core.on_abort(link, RoomAbort(link * 100 + r, 1, "x"), 0.0)
        core.link_lost(link, "gone", 0.0)
    assert core.entries()["early_aborts"] == config.pending_max * config.max_links
    assert core.stats["early_aborts_dropped"] == 2 * config.pending_max
    assert len(delivered(core.sender_spawned(RoomKey(1000, 1), 1.0))) == 1  # the first host's
    assert delivered(core.sender_spawned(RoomKey(1400, 1), 1.0)) == []  # the last one's
    core.tick(11.0)
    assert core.entries()["early_aborts"] == 0


def test_a_link_over_a_quota_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    core = PrefillRouting(CONFIG)
    open_link(core, 2, "decode-9-9", FLOOD_HOST)
    with caplog.at_level(logging.WARNING, logger="kvfsm.control"):
        for i in range(CONFIG.pending_max + 10):
            core.on_abort(2, RoomAbort(i, 1, "flood"), 0.0)
    lines = [r.getMessage() for r in caplog.records if "early_aborts_over_quota" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "decode-9-9" in lines[0]
    assert core.stats["early_aborts_over_quota"] == 10


# -- memory ------------------------------------------------------------------------------------


@pytest.fixture
def traced() -> Iterator[None]:
    gc.collect()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


#: Generous upper bounds of what one entry of each table costs (measured with
#: benchmarks/routing_quotas.py, which prints the real figures): a held claim with a 16-byte
#: page list, an early-abort mark, an answered room's mark.
ENTRY_BYTES_MAX = {"held": 1500, "early": 600, "finished": 400}


@pytest.mark.usefixtures("traced")
@pytest.mark.parametrize("n", [9, 100])
def test_what_flooding_links_cost_is_bounded_by_their_quotas(
    n: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``n`` links each fill every quota (and go over it: twice as many frames of each kind):
    what the core keeps grows with ``n`` times the per-link quotas, never with the frames
    sent, and comes back once the links are lost and the marks expired."""
    caplog.set_level(logging.CRITICAL, logger="kvfsm.control")  # the captured records'd count
    core = PrefillRouting(CONFIG)
    before, _ = tracemalloc.get_traced_memory()
    links = list(range(10, 10 + n))
    for link in links:
        open_link(core, link, f"decode-{link}-1", FLOOD_HOST)
    flood(core, links, 1.0)
    _over(core, links, 1.0)  # as many frames again, each over its link's quota
    kept, _peak = tracemalloc.get_traced_memory()
    m = CONFIG.pending_max
    per_link = m * sum(ENTRY_BYTES_MAX.values()) + 16 * 1024  # + the link's own record
    assert kept - before <= n * per_link, (kept - before, n * per_link)
    for link in links:
        core.link_lost(link, "gone", 2.0)
    core.tick(100.0)
    assert {k: v for k, v in core.entries().items() if v} == {}
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    assert after - before <= 16 * 1024, after - before  # the tables were given back too


def _over(core: PrefillRouting, links: list[int], now: float) -> None:
    """Every frame of :func:`flood` again, for other rooms: all over the links' quotas."""
    n = CONFIG.pending_max
    for link in links:
        base = link * 1_000_000 + 500_000
        for i in range(n):
            core.on_abort(link, RoomAbort(base + i, 1, "flood"), now)
            core.on_metadata(link, RoomMetadata(base + n + i, 1, PAGES, 0), now)
        refs = pack_refs([(base + 2 * n + i, 1) for i in range(n)])
        core.on_reconcile(link, Reconcile(refs), now)
