"""A request's prefill DP rank, as SGLang 0.5.23 finds it (``kvfsm/sglang/_dp_ranks.py``, the
registry's ``/register_dp_rank`` and ``/query_dp_ranks``).

The rules first, then the SGLang replay over real NIXL with a DP-attention prefill instance
(two DP ranks) and SGLang's own decode-side resolution (:mod:`tests.helpers.sglang_dp`): rooms
run on the DP rank the room id names, on another one that the prefill rank registers and decode
asks for (``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK``, or a prefill whose load
balancing does not follow the room), on one the router named; a request dispatched against
``follow_bootstrap_room`` fails with SGLang's reason; a registration that cannot reach the
registry fails its request with the registry's error. Every byte is checked against the DP
group that ran the request.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator

import pytest

from kvfsm.sglang import KvfsmKVBootstrapServer, KvfsmKVSender
from kvfsm.sglang import _manager as adapter_manager
from kvfsm.sglang._dp_ranks import FORCE_QUERY_ENV, DpPlan, dp_by_room, force_query, prefill_dp_plan
from kvfsm.states import KVPoll
from tests.helpers.sglang_dp import DpPair
from tests.helpers.sglang_replay import Instance, Outcome, Request, random_requests
from tests.helpers.waiting import wait_until_sync

if os.environ.get("KVFSM_NO_SGLANG") == "1":
    pytest.skip("KVFSM_NO_SGLANG=1", allow_module_level=True)

# -- the rules ------------------------------------------------------------------------------------

CONFLICT = "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 4"


@pytest.mark.parametrize(
    ("room", "dp_size", "dp_rank", "by_room", "force", "named", "plan"),
    [
        # One DP rank, or a rank the router named: nothing to do.
        (4, 1, 0, True, True, False, DpPlan()),
        (4, 2, 1, True, False, True, DpPlan()),
        (4, 2, 1, False, True, True, DpPlan()),
        # follow_bootstrap_room: the room names the rank; another rank refuses the request.
        (4, 2, 0, True, False, False, DpPlan()),
        (5, 2, 1, True, False, False, DpPlan()),
        (4, 2, 1, True, False, False, None),
        # Another balancer, or SGLang told to ask always: the rank registers the room.
        (4, 2, 1, False, False, False, DpPlan(register=True)),
        (4, 2, 0, True, True, False, DpPlan(register=True)),
        (4, 2, 1, True, True, False, DpPlan(register=True)),
    ],
)
def test_prefill_dp_plan_is_sglangs_rule(  # noqa: PLR0917 - one parameter per column
    room: int,
    dp_size: int,
    dp_rank: int,
    by_room: bool,
    force: bool,
    named: bool,
    plan: DpPlan | None,
) -> None:
    got = prefill_dp_plan(
        room=room,
        dp_size=dp_size,
        dp_rank=dp_rank,
        by_room=by_room,
        force=force,
        rank_named=named,
    )
    if plan is None:
        assert not got.register
        assert got.failure is not None
        assert got.failure.startswith(CONFLICT)
        assert f"{FORCE_QUERY_ENV}=1" in got.failure
    else:
        assert got == plan


@pytest.mark.parametrize(
    ("method", "mode", "expected"),
    [
        (None, "prefill", True),
        ("auto", "prefill", True),
        ("auto", "decode", False),
        ("follow_bootstrap_room", "prefill", True),
        ("FOLLOW_BOOTSTRAP_ROOM", "prefill", True),
        ("round_robin", "prefill", False),
        ("total_requests", "prefill", False),
    ],
)
def test_dp_by_room_follows_the_load_balance_method(
    method: str | None, mode: str, expected: bool
) -> None:
    assert dp_by_room(method, mode) is expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("", False), ("0", False), ("false", False), ("No", False), ("1", True), ("TRUE", True)],
)
def test_force_query_reads_sglangs_booleans(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool
) -> None:
    monkeypatch.setenv(FORCE_QUERY_ENV, raw)
    assert force_query() is expected


def test_force_query_refuses_what_sglang_would_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_QUERY_ENV, "sometimes")
    with pytest.raises(ValueError, match=f"{FORCE_QUERY_ENV}='sometimes'"):
        force_query()


def test_the_sglang_rule_agrees_with_sglangs_env_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.environ import envs

    for raw in ("1", "true", "yes", "y", "0", "false", "no", "n"):
        monkeypatch.setenv(FORCE_QUERY_ENV, raw)
        assert force_query() is envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()


# -- the replay -----------------------------------------------------------------------------------

DP = 2


@pytest.fixture
def dp_pair(request: pytest.FixtureRequest, bootstrap: KvfsmKVBootstrapServer) -> Iterator[DpPair]:
    """Prefill: DP attention, 2 DP ranks of attention TP 1, with the load balancing of the
    test's indirect parameter (default ``auto``: follow_bootstrap_room); decode: TP 1."""
    method = getattr(request, "param", "auto")
    prefill = Instance.start(
        "prefill", bootstrap.port, 1, dp_size=DP, load_balance_method=method, generation=1
    )
    try:
        decode = Instance.start("decode", bootstrap.port, 1)
    except BaseException:
        prefill.close()
        raise
    yield DpPair(prefill, decode, bootstrap.port)
    decode.close()
    prefill.close()


def routed(requests: list[Request], rank: Callable[[int], int]) -> list[Request]:
    """Each request runs on prefill DP rank ``rank(room)`` (SGLang's DP controller's choice)."""
    for req in requests:
        req.prefill_dp = rank(req.room)
    return requests


def assert_clean(out: Outcome) -> None:
    assert out.violations == []
    assert out.leaks == []
    assert out.timed_out == []


def succeeded(requests: list[Request]) -> bool:
    return all(r.prefill_outcome == r.decode_outcome == "Success" for r in requests)


def test_rooms_on_the_dp_rank_their_id_names_need_no_lookup(dp_pair: DpPair) -> None:
    requests = routed(random_requests(random.Random(3), 12), lambda room: room % DP)
    assert_clean(dp_pair.run(requests))
    assert succeeded(requests)
    assert {r.prefill_dp for r in requests} == {0, 1}
    assert dp_pair.resolver.queries == 0


def test_forced_queries_find_rooms_run_on_any_dp_rank(
    dp_pair: DpPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 on both sides: every room's prefill
    rank registers it, decode asks the registry (SGLang's query), and rooms run against
    ``room % dp_size`` (a mixed routing) still succeed with every byte from their own group."""
    monkeypatch.setenv(FORCE_QUERY_ENV, "1")
    for m in dp_pair.prefill.managers:
        m.force_dp_query = True  # read at start-up, as SGLang's managers read their envs
    requests = routed(random_requests(random.Random(5), 12), lambda room: (room + 1) % DP)
    assert_clean(dp_pair.run(requests))
    assert succeeded(requests)
    assert dp_pair.resolver.queries >= 1
    assert sorted(set(dp_pair.resolver.asked)) == sorted(r.room for r in requests)
    # What the registry holds, as SGLang's decode reads it.
    rooms = [r.room for r in requests]
    answer = dp_pair.resolver.receiver.query_prefill_dp_ranks(dp_pair.addr, rooms)
    assert answer == {str(r.room): r.prefill_dp for r in requests}


@pytest.mark.parametrize("dp_pair", ["round_robin"], indirect=True)
def test_a_prefill_balancing_round_robin_registers_every_room(dp_pair: DpPair) -> None:
    """Without the variable: the prefill publishes that it does not follow the room, so
    decode's SGLang asks for every room (``follow_bootstrap_room`` False in its table)."""
    requests = routed(random_requests(random.Random(9), 12), lambda room: (room // 3) % DP)
    assert_clean(dp_pair.run(requests))
    assert succeeded(requests)
    info = dp_pair.decode.managers[0].prefill_info_table[dp_pair.addr]
    assert (info.dp_size, info.follow_bootstrap_room) == (DP, False)
    assert sorted(set(dp_pair.resolver.asked)) == sorted(r.room for r in requests)


def test_a_dp_rank_the_router_named_needs_no_lookup(dp_pair: DpPair) -> None:
    requests = routed(random_requests(random.Random(11), 8), lambda room: (room + 1) % DP)
    for req in requests:
        req.dp_named = True
    assert_clean(dp_pair.run(requests))
    assert succeeded(requests)
    assert dp_pair.resolver.queries == 0


def test_a_request_dispatched_against_its_room_fails_with_sglangs_reason(
    dp_pair: DpPair,
) -> None:
    """follow_bootstrap_room, no variable, a request run on the other DP rank: prefill fails
    it at once with SGLang's reason (decode looks for it on the rank the room names, which
    never got it, and ends at its deadline); the others succeed."""
    requests = routed(random_requests(random.Random(13), 6), lambda room: room % DP)
    wrong = requests[2]
    wrong.prefill_dp = (wrong.room + 1) % DP
    assert_clean(dp_pair.run(requests))
    assert wrong.prefill_outcome == wrong.decode_outcome == "Failed"
    assert all("follow_bootstrap_room conflict" in r for r in wrong.prefill_reasons)
    assert wrong.decode_reasons
    assert succeeded([r for r in requests if r is not wrong])


def test_a_registration_that_cannot_reach_the_registry_fails_the_request(
    bootstrap: KvfsmKVBootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry gone after the ranks registered: the prefill rank retries the room's DP
    rank for DP_REGISTER_WAIT_S, then fails the request with the registry client's error
    (decode could never find it), instead of leaving it to a deadline."""
    monkeypatch.setattr(adapter_manager, "DP_REGISTER_WAIT_S", 0.3)
    prefill = Instance.start(
        "prefill", bootstrap.port, 1, dp_size=DP, load_balance_method="round_robin"
    )
    try:
        bootstrap.close()
        mgr = prefill.managers[1]
        sender = KvfsmKVSender(mgr, f"127.0.0.1:{bootstrap.port}", 77)
        wait_until_sync(lambda: sender.poll() == KVPoll.Failed, timeout=30)
        assert "registering its prefill DP rank 1 failed, so decode cannot find it" in (
            sender.reason
        )
        assert "UnreachableError" in sender.reason
        sender.clear()
        # Rank 0 of another DP group registers too; a TP rank past the first would not.
        assert prefill.managers[0].register_dp_rank(78) is not None
    finally:
        prefill.close()
