"""The registry's rank table (``kvfsm/registry/_rank_table.py``), driven directly without IO:
its rules (register, refresh, replace, clashes, readiness, the bound on engines) and expiry, with
explicit ``now`` values."""

from __future__ import annotations

import pytest

from kvfsm.registry._rank_table import RankTable, RefusedError
from tests.helpers.rank_info import ENGINE, info


def test_registry_rules_without_io() -> None:
    reg = RankTable(expected_ranks=2, ttl_s=10.0)
    assert reg.register(info(0), now=0.0) == "registered"
    assert reg.register(info(0), now=5.0) == "refreshed"
    assert reg.register(info(0, incarnation=2, port=9), now=6.0) == "replaced"
    with pytest.raises(RefusedError) as exc:
        reg.ranks(ENGINE, now=6.0)
    assert (exc.value.status, exc.value.registered, exc.value.expected) == (503, 1, 2)
    reg.register(info(1), now=7.0)
    assert [i.rank for i in reg.ranks(ENGINE, now=7.0)] == [0, 1]
    assert reg.health(now=7.0).ready
    # rank 0 was last registered at 6.0: it expires at 16.0; rank 1 at 17.0.
    assert reg.rank(ENGINE, 0, now=15.9).port == 9
    assert [i.rank for i in reg.expire(now=16.0)] == [0]
    assert [i.rank for i in reg.expire(now=17.0)] == [1]
    assert len(reg) == 0
    assert reg.health(now=17.0).detail == "not ready: no ranks registered"
    with pytest.raises(ValueError, match="expected_ranks"):
        RankTable(expected_ranks=0, ttl_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        RankTable(expected_ranks=1, ttl_s=float("nan"))


def test_registry_refuses_clashes_and_bounds_engines() -> None:
    reg = RankTable(expected_ranks=4, ttl_s=10.0, max_engines=2)
    reg.register(info(0), now=0.0)
    cases = [
        (info(0, port=1), 409, "different fields"),  # same incarnation, other fields
        (info(1, tp_rank=0), 409, "already held by live rank 0"),
        (info(1, tp_size=8), 409, "tp_size 8"),
        (info(4, tp_rank=0, tp_size=1), 400, "ranks 0..3"),
    ]
    for bad, status, words in cases:
        with pytest.raises(RefusedError, match=words) as exc:
            reg.register(bad, now=1.0)
        assert exc.value.status == status
    assert reg.rank(ENGINE, 0, now=1.0) == info(0)
    reg.register(info(0, engine="b"), now=1.0)
    with pytest.raises(RefusedError, match="registry full") as exc:
        reg.register(info(0, engine="c"), now=1.0)
    assert exc.value.status == 429


def test_entries_expire_unless_refreshed() -> None:
    reg = RankTable(expected_ranks=2, ttl_s=10.0)
    reg.register(info(0), now=0.0)
    reg.register(info(1), now=0.0)
    assert len(reg.ranks(ENGINE, now=0.0)) == 2
    # Heartbeats keep rank 0 alive across several ttls; rank 1 goes silent (expires at 10.0).
    for beat in (4.0, 8.0, 12.0, 16.0, 20.0):
        assert reg.register(info(0), now=beat) == "refreshed"
    assert reg.rank(ENGINE, 0, now=20.0).rank == 0
    with pytest.raises(RefusedError, match="rank 1 of engine 'prefill-a' is not registered") as exc:
        reg.rank(ENGINE, 1, now=20.0)
    assert exc.value.status == 404
    with pytest.raises(RefusedError, match="1 of 2") as exc:
        reg.ranks(ENGINE, now=20.0)
    assert exc.value.status == 503
    # Nobody reads now: the sweep's expire() alone empties the table (rank 0 expires at 30.0).
    assert reg.expire(now=29.9) == []
    assert [i.rank for i in reg.expire(now=30.0)] == [0]
    assert len(reg) == 0
    # An expired rank registers afresh.
    assert reg.register(info(1), now=31.0) == "registered"
