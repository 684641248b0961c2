"""The plan of ``kvfsm chaos servers``: one episode per fault kind, from the seed alone, with
loads inside the limits the options set."""

from __future__ import annotations

from kvfsm.chaos._server_plan import (
    ALL_FAULTS,
    CALIBRATION,
    Action,
    PlanOptions,
    calibration_episode,
    plan_episodes,
)

OPTS = PlanOptions(requests=12, concurrency=4)


def test_same_seed_same_plan_another_seed_another() -> None:
    assert plan_episodes(5, OPTS) == plan_episodes(5, OPTS)
    assert plan_episodes(5, OPTS) != plan_episodes(6, OPTS)


def test_one_episode_per_kind_each_kind_once() -> None:
    kinds = [e.fault.kind for e in plan_episodes(1, OPTS)]
    assert sorted(kinds) == sorted(ALL_FAULTS)
    assert len(set(kinds)) == len(kinds) == 17


def test_skipped_kinds_and_chosen_kinds() -> None:
    skip = frozenset({"link-down link", "link-blackhole link"})
    kinds = {e.fault.kind for e in plan_episodes(1, PlanOptions(skip=skip))}
    assert kinds == set(ALL_FAULTS) - skip
    chosen = plan_episodes(1, OPTS, ["sigstop", "restart router"])
    assert {e.fault.kind for e in chosen} == {
        "sigstop prefill 1s",
        "sigstop prefill past-lease",
        "sigstop prefill long",
        "sigstop decode 1s",
        "sigstop decode past-lease",
        "sigstop decode long",
        "restart router",
    }


def test_stops_last_1s_past_the_lease_and_long() -> None:
    o = PlanOptions(lease_s=7.0, long_stop_s=20.0)
    pauses = {e.fault.kind: e.fault.pause_s for e in plan_episodes(3, o, ["sigstop"])}
    assert pauses["sigstop decode 1s"] == 1.0
    assert pauses["sigstop decode past-lease"] > o.lease_s
    assert pauses["sigstop prefill long"] == 20.0


def test_loads_stay_in_bounds_and_mix_streaming() -> None:
    episodes = plan_episodes(9, OPTS)
    requests = [r for e in episodes for r in e.requests]
    assert [r.index for r in requests] == list(range(len(requests)))
    lengths = [len(r.prompt) for r in requests]
    assert min(lengths) >= OPTS.min_prompt
    assert max(lengths) <= OPTS.max_prompt
    assert min(lengths) < 50
    assert max(lengths) > 500
    assert all(3 <= t < OPTS.vocab for r in requests for t in r.prompt)
    assert {r.stream for r in requests} == {True, False}
    assert all(OPTS.min_new <= r.max_new <= OPTS.max_new for r in requests)
    for e in episodes:
        # At most ``concurrency`` start in one 0.3 s wave: waves are 0.3 s apart.
        waves = [int(r.start_s // 0.3) for r in e.requests]
        assert max(waves.count(w) for w in set(waves)) <= OPTS.concurrency


def test_disconnects_and_aborts_only_in_their_episodes() -> None:
    for e in plan_episodes(4, OPTS):
        disconnects = [r for r in e.requests if r.disconnect_s is not None]
        aborts = [r for r in e.requests if r.abort_s is not None]
        assert bool(disconnects) == (e.fault.action is Action.DISCONNECT)
        assert bool(aborts) == (e.fault.action is Action.ABORT)
        assert all(r.stream for r in disconnects)


def test_faults_that_take_a_server_down_name_it_for_a_restart() -> None:
    restarts = {e.fault.kind: e.fault.restarts for e in plan_episodes(2, OPTS)}
    assert restarts["sigkill-scheduler decode"] == "decode"
    assert restarts["sigkill-server prefill"] == "prefill"
    assert restarts["restart router"] == "router"
    assert restarts["sigstop prefill long"] is None
    assert restarts["drop-decode-half router"] is None


def test_a_later_pass_numbers_on_from_the_last() -> None:
    first = plan_episodes(1, OPTS)
    requests = sum(len(e.requests) for e in first)
    later = plan_episodes(2, OPTS, first_episode=len(first), first_request=requests)
    assert [e.index for e in later] == list(range(len(first), 2 * len(first)))
    assert later[0].requests[0].index == requests
    indices = [r.index for e in first + later for r in e.requests]
    assert len(set(indices)) == len(indices)


def test_the_calibration_is_a_seeded_load_with_no_fault() -> None:
    o = PlanOptions(requests=6, concurrency=3)
    cal = calibration_episode(4, o)
    assert cal == calibration_episode(4, o)
    assert cal != calibration_episode(5, o)
    assert (cal.index, cal.fault, cal.fault_at_s) == (0, CALIBRATION, 0.0)
    assert cal.fault.kind == "no-fault"
    assert cal.fault.restarts is None
    assert [r.index for r in cal.requests] == list(range(6))
    assert all(r.disconnect_s is None and r.abort_s is None for r in cal.requests)
    assert all(o.min_prompt <= len(r.prompt) <= o.max_prompt for r in cal.requests)
    # Its own random stream: the plan after it is the plan without it, numbered on.
    after = plan_episodes(4, o, first_episode=1, first_request=6)
    alone = plan_episodes(4, o)
    assert [e.requests[0].prompt for e in after] == [e.requests[0].prompt for e in alone]
    assert "no-fault" not in ALL_FAULTS
