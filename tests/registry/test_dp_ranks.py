"""The registry's table of rooms' DP ranks (``kvfsm/registry/_dp_ranks.py``): its rules with
explicit ``now`` values, no sockets and no sleeps."""

from __future__ import annotations

import pytest

from kvfsm.registry._dp_ranks import DP_RANK_TTL_S, DpRankTable


def test_a_registered_room_is_found_by_its_id_as_a_string() -> None:
    table = DpRankTable()
    table.register(7, 1, now=0.0)
    table.register(2**63 - 5, 0, now=0.0)
    # SGLang's JSON answer: room ids as keys (strings), unknown rooms left out.
    assert table.lookup([7, 8, 2**63 - 5], now=1.0) == {"7": 1, str(2**63 - 5): 0}
    assert table.lookup([], now=1.0) == {}


def test_an_entry_lives_ttl_s_after_its_last_registration() -> None:
    table = DpRankTable(ttl_s=10.0)
    table.register(1, 0, now=100.0)
    assert table.lookup([1], now=109.999) == {"1": 0}
    assert table.lookup([1], now=110.0) == {}
    assert len(table) == 0
    # Registering again (a reused room id) replaces the rank and restarts the clock.
    table.register(2, 0, now=200.0)
    table.register(3, 1, now=205.0)
    table.register(2, 1, now=208.0)
    assert table.lookup([2, 3], now=214.0) == {"2": 1, "3": 1}
    assert table.lookup([2, 3], now=215.0) == {"2": 1}
    assert table.lookup([2], now=218.0) == {}


def test_expire_drops_only_the_entries_whose_time_ran_out() -> None:
    table = DpRankTable(ttl_s=5.0)
    for room in range(10):
        table.register(room, room % 2, now=float(room))
    assert table.expire(now=4.5) == 0
    assert table.expire(now=9.0) == 5  # rooms 0-4 (expired at 5..9)
    assert len(table) == 5
    assert table.lookup(range(10), now=9.0) == {str(r): r % 2 for r in range(5, 10)}


def test_the_table_holds_at_most_max_rooms_dropping_the_oldest() -> None:
    table = DpRankTable(max_rooms=3)
    for room in range(5):
        table.register(room, 0, now=0.0)
    assert len(table) == 3
    assert table.evicted == 2
    assert table.lookup(range(5), now=0.0) == {"2": 0, "3": 0, "4": 0}
    # A re-registered room is the newest again: the next one pushes out room 3, not it.
    table.register(2, 1, now=1.0)
    table.register(9, 0, now=1.0)
    assert table.lookup(range(10), now=1.0) == {"2": 1, "4": 0, "9": 0}


def test_the_default_ttl_is_sglangs_cleanup_interval() -> None:
    assert DpRankTable().ttl_s == DP_RANK_TTL_S == 120.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl_s": 0.0}, "ttl_s must be a positive number"),
        ({"ttl_s": float("inf")}, "ttl_s must be a positive number"),
        ({"max_rooms": 0}, "max_rooms must be a positive integer"),
        ({"max_rooms": True}, "max_rooms must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DpRankTable(**kwargs)  # type: ignore[arg-type]


def test_a_lookup_never_answers_an_expired_entry_behind_a_live_one() -> None:
    """Entries registered before ttl_s was shortened stand ahead of shorter-lived ones: the
    sweep stops at the first live entry, the lookup still judges each by its own expiry."""
    table = DpRankTable(ttl_s=100.0)
    table.register(1, 0, now=0.0)  # lives until 100
    table.ttl_s = 1.0
    table.register(2, 1, now=0.0)  # lives until 1, behind room 1
    assert table.lookup([1, 2], now=5.0) == {"1": 0}
