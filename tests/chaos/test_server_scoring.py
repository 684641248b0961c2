"""The scores of ``kvfsm chaos servers``: what makes a violation, what the table counts."""

from __future__ import annotations

from kvfsm.chaos._server_plan import (
    CALIBRATION,
    Action,
    Fault,
    PlannedRequest,
    ServerEpisode,
)
from kvfsm.chaos._server_scoring import (
    SGLANG_SLACK_S,
    DrainReading,
    EpisodeRecord,
    RequestOutcome,
    classify_error,
    end_bound_s,
    score,
)

BOUNDS = {"liveness_s": 10.0, "lease_s": 10.0, "unclaimed_s": 8.0}
REQ = PlannedRequest(0, (5, 6), 4, False, 0.0)


def episode(fault: Fault, index: int = 0) -> ServerEpisode:
    return ServerEpisode(index, fault, 0.5, (REQ,))


def clean(name: str = "prefill") -> DrainReading:
    return DrainReading(name, 0, 0, 3, 3)


def outcome(
    status: str, ended: float = 2.0, ids: list[int] | None = None, **kw: str
) -> RequestOutcome:
    return RequestOutcome(0, 0, status, 1.0, ended, ids or [], **kw)


KILL = Fault(Action.KILL_SERVER, "prefill")


def test_bound_is_the_pause_liveness_lease_and_slack() -> None:
    stop = Fault(Action.STOP, "decode", 30.0, "long")
    assert end_bound_s(stop, 10, 10, 8) == 30 + 10 + 10 + SGLANG_SLACK_S
    drop = Fault(Action.DROP_DECODE_HALF, "router")
    assert end_bound_s(drop, 10, 10, 8) == 10 + 10 + 8 + SGLANG_SLACK_S
    # The pipeline's own time for the episode's load is added: queueing.
    assert end_bound_s(stop, 10, 10, 8, queue_s=12.5) == 30 + 10 + 10 + SGLANG_SLACK_S + 12.5


def test_a_request_slow_behind_its_episodes_load_is_within_the_bound_and_not_past_it() -> None:
    bound = end_bound_s(KILL, 10, 10, 8, queue_s=20.0)
    within = RequestOutcome(0, 0, "completed", 1.0, 1.5 + bound - 1, [7])
    past = RequestOutcome(1, 0, "completed", 1.0, 1.5 + bound + 1, [7])
    for outcome, over in ((within, 0), (past, 1)):
        rec = EpisodeRecord(
            episode(KILL), 1.5, [clean(), clean("decode")], load_s=2.0, queue_s=20.0
        )
        result = score([rec], [outcome], {outcome.index: [7]}, **BOUNDS)
        assert result.rows[0].over_bound == over, result.violations
        assert result.rows[0].bound_s == bound


def test_with_no_fault_an_error_is_a_violation() -> None:
    """The calibration episode: nothing was done to the servers, so no request may fail."""
    rec = EpisodeRecord(episode(CALIBRATION), 0.5, [clean(), clean("decode")], queue_s=5.0)
    ok = score([rec], [outcome("completed", ids=[3])], {0: [3]}, **BOUNDS)
    assert ok.ok, ok.violations
    assert ok.rows[0].kind == "no-fault"
    bad = score([rec], [outcome("errored", reason="http 500")], {}, **BOUNDS)
    assert bad.violations == ["no-fault: request 0 errored with no fault (http 500)"]
    # The same error under a fault is the fault's doing, counted and not a violation.
    under = EpisodeRecord(episode(KILL), 0.5, [clean(), clean("decode")], queue_s=5.0)
    assert score([under], [outcome("errored", reason="http 500")], {}, **BOUNDS).ok


def test_a_clean_episode_has_no_violation_and_counts_its_row() -> None:
    rec = EpisodeRecord(episode(KILL), 1.5, [clean(), clean("decode")])
    outs = [
        outcome("completed", ids=[1, 2, 3, 4]),
        outcome("errored", reason="kvfsm: peer lost"),
        outcome("disconnected"),
        outcome("aborted"),
    ]
    s = score([rec], outs, {0: [1, 2, 3, 4]}, **BOUNDS)
    assert s.ok, s.violations
    (row,) = s.rows
    assert (row.kind, row.requests, row.completed, row.exact) == ("sigkill-server prefill", 4, 1, 1)
    assert (row.disconnected, row.aborted, row.hung, row.over_bound) == (1, 1, 0, 0)
    assert row.errored == {"kvfsm: peer lost": 1}
    assert row.slowest_end_s == 0.5  # ended at 2.0, the fault at 1.5 after it was sent


def test_inexact_hung_late_and_undrained_are_violations() -> None:
    late = 1.5 + end_bound_s(KILL, 10, 10, 8) + 1
    dirty = DrainReading("decode", 1, 16, 0, 0)
    leak = DrainReading("prefill", 0, 0, 5, 4)
    rec = EpisodeRecord(episode(KILL), 1.5, [leak, dirty])
    outs = [outcome("completed", ids=[9]), outcome("hung"), outcome("errored", ended=late)]
    s = score([rec], outs, {0: [1]}, **BOUNDS)
    text = "\n".join(s.violations)
    assert "completed inexact" in text
    assert "hung" in text
    assert "after the fault" in text
    assert "decode not drained (live 1, pages 16" in text
    assert "prefill not drained (live 0, pages 0, handles 5 created / 4 released" in text
    (row,) = s.rows
    assert (row.hung, row.over_bound, row.drained) == (1, 1, False)


def test_an_unreadable_status_server_is_not_drained() -> None:
    rec = EpisodeRecord(episode(KILL), 1.5, [DrainReading("prefill", -1, -1, read=False)])
    s = score([rec], [], {}, **BOUNDS)
    assert not s.ok
    assert "unreadable" in s.violations[0]


def test_the_dropped_decode_half_fails_by_the_unclaimed_bound_or_sooner_never_a_deadline() -> None:
    drop = Fault(Action.DROP_DECODE_HALF, "router")
    # The router may drop the prefill half too (SGLang then aborts its room at once): no room
    # waits for the bound at all, and that is no violation.
    none = EpisodeRecord(episode(drop), 1.0, [clean()])
    assert score([none], [], {}, **BOUNDS).ok
    room = {"room": 7, "duration_s": 8.4, "reason": "peer lost: no decode room claimed it"}
    good = EpisodeRecord(episode(drop), 1.0, [clean()], unclaimed_rooms=[room])
    assert score([good], [], {}, **BOUNDS).ok
    slow = EpisodeRecord(
        episode(drop), 1.0, [clean()], unclaimed_rooms=[{**room, "duration_s": 300}]
    )
    assert "failed unclaimed after 300s" in score([slow], [], {}, **BOUNDS).violations[0]
    waited = {"room": 8, "server": "prefill", "reason": "deadline expired: Bootstrapping"}
    by_deadline = EpisodeRecord(episode(drop), 1.0, [clean()], [waited], [room])
    s = score([by_deadline], [], {}, **BOUNDS)
    assert "ended by a deadline" in s.violations[0]
    assert s.deadline_rooms == [("drop-decode-half router", "prefill", 8, waited["reason"])]


def test_a_deadline_room_elsewhere_is_named_not_a_violation() -> None:
    row = {
        "room": 3,
        "server": "decode",
        "reason": "deadline expired: Transferring for more than 30s",
    }
    rec = EpisodeRecord(episode(KILL), 1.0, [clean()], [row])
    s = score([rec], [], {}, **BOUNDS)
    assert s.ok
    assert s.deadline_rooms == [("sigkill-server prefill", "decode", 3, row["reason"])]
    assert s.rows[0].deadline_rooms == 1


def test_episodes_of_one_kind_merge_into_one_row() -> None:
    a = EpisodeRecord(episode(KILL, 0), 1.0, [clean()])
    b = EpisodeRecord(episode(KILL, 1), 50.0, [clean()])
    outs = [
        RequestOutcome(0, 0, "errored", 0.5, 3.0, reason="http 500"),
        RequestOutcome(1, 1, "errored", 50.0, 51.0, reason="http 500"),
    ]
    (row,) = score([a, b], outs, {}, **BOUNDS).rows
    assert row.requests == 2
    assert row.errored == {"http 500": 2}
    assert row.slowest_end_s == 2.0


def test_classify_error_names_kvfsm_reasons_first() -> None:
    assert classify_error(500, "Failed: peer lost: link down") == "kvfsm: peer lost"
    assert (
        classify_error(500, "peer lost: no decode room claimed it within 8s") == "kvfsm: unclaimed"
    )
    assert classify_error(500, "deadline expired: Bootstrapping") == "kvfsm: deadline"
    assert classify_error(0, "ClientConnectorError(Connection refused)") == "connection refused"
    assert classify_error(0, "ServerDisconnectedError('Server disconnected')") == "connection reset"
    assert classify_error(502, "bad gateway") == "http 502"


def test_a_fault_that_did_not_land_is_a_violation() -> None:
    rec = EpisodeRecord(episode(KILL), None, [clean()], skipped="no scheduler process")
    s = score([rec], [], {}, **BOUNDS)
    assert s.violations == ["sigkill-server prefill: not injected: no scheduler process"]


def test_requests_in_flight_at_the_fault_are_counted() -> None:
    rec = EpisodeRecord(episode(KILL), 1.5, [clean()])
    outs = [
        RequestOutcome(0, 0, "errored", 1.0, 2.0, reason="kvfsm: peer lost"),  # hit
        RequestOutcome(1, 0, "completed", 0.2, 1.4, [1]),  # ended before the fault
        RequestOutcome(2, 0, "completed", 1.6, 2.5, [1]),  # sent after it
    ]
    (row,) = score([rec], outs, {1: [1], 2: [1]}, **BOUNDS).rows
    assert row.in_flight == 1


def test_an_answer_cut_off_is_its_own_class() -> None:
    assert classify_error(0, 'ClientPayloadError("Response payload is not completed")') == (
        "answer cut off"
    )
