"""``kvfsm chaos servers``, short and seeded, on real SGLang 0.5.23 servers on this CPU machine:
a reference server, a kvfsm prefill and decode (each in its own network namespace, joined by a
data link), SGLang's router; one fault of each kind, under a small streamed and non-streamed
load.

The campaign's own checks are the invariants (``kvfsm/chaos/_server_scoring.py``), and this test
asserts them from its record, not only its verdict:

* every request ended (none hung), each within its fault's bound after the fault;
* every completed request's tokens equal the reference server's;
* after each fault's drain, prefill and decode show 0 live rooms, 0 held pages, and prefill's
  NIXL handles created equal those released;
* the dropped decode half: its requests fail, and prefill's rooms fail by the unclaimed bound
  (``KVFSM_UNCLAIMED_S``, short here) or sooner, never by the 300 s Bootstrapping deadline;
* the data link cut, down and as a black hole: the requests across it end with kvfsm's
  reason (both sides lose the other within the liveness bound), and once it is restored the
  router serves through prefill and decode again (the campaign waits for that).

The namespaces need root and iproute2, as the two-host tests do; with ``KVFSM_NO_NETNS=1`` the
campaign runs on one host's loopback and must report the two link cuts as not injected, with
their reason.
"""

from __future__ import annotations

import os

import pytest

from kvfsm.chaos._server_campaign import (
    LINK_CUT_SKIP,
    ServerCampaignOptions,
    run_server_campaign,
)
from kvfsm.chaos._server_plan import ALL_FAULTS, CALIBRATION, PlanOptions
from kvfsm.chaos._server_report import as_json

#: Most of the run is the servers' start-ups: the rig's four, then five restarts (two scheduler
#: kills, two server kills, the prefill restart), about 30 s each on a machine to itself and
#: three minutes each under a load average of 9 (docs/reliability.md has the figures).
pytestmark = pytest.mark.timeout(1800)

SEED = 29
#: Short: 3 requests per fault (the plan gives each fault kind its own), prompts up to 2,000
#: tokens, the long SIGSTOP 20 s (past the liveness bound and the lease, as 30 s is), a link cut
#: 12 s (past the 10 s liveness bound: both sides lose the other).
PLAN = PlanOptions(requests=3, concurrency=3, long_stop_s=20.0, cut_s=12.0)
UNCLAIMED_S = 6.0


def test_a_short_server_campaign_accounts_for_every_request_and_drains(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path_factory.mktemp("chaos-servers")
    one_host = os.environ.get("KVFSM_NO_NETNS") == "1"
    opts = ServerCampaignOptions(
        seed=SEED, plan=PLAN, unclaimed_s=UNCLAIMED_S, log_dir=log_dir, one_host=one_host
    )
    with capsys.disabled():
        result = run_server_campaign(opts, lambda line: print(f"chaos servers: {line}"))
        print(f"chaos servers report: {as_json(result)}")
    score = result.score

    # First the calibration: the same shape of load with no fault, every request completed and
    # exact, and the queueing factor every bound took from it.
    calibration = result.calibration
    assert calibration is not None
    assert calibration.factor >= 1.0
    assert calibration.requests == PLAN.requests
    (first, *_) = score.rows
    assert first.kind == CALIBRATION.kind
    assert (first.requests, first.completed, first.exact) == (3, 3, 3), first
    for record in result.records[1:]:
        assert record.queue_s == pytest.approx(record.load_s * calibration.factor, abs=0.06)

    ran = {row.kind for row in score.rows} - {CALIBRATION.kind}
    links = {"link-down link", "link-blackhole link"}
    if one_host:
        assert ran == set(ALL_FAULTS) - links
        assert set(result.skipped) == links
        assert all(why.startswith(LINK_CUT_SKIP) for why in result.skipped.values())
    else:
        assert ran == set(ALL_FAULTS)
        assert result.skipped == {}
        assert result.topology.startswith("netns ")
        cuts = [r for r in result.records if r.episode.fault.kind in links]
        assert len(cuts) == 2
        for cut in cuts:
            assert cut.fault_s is not None
            assert cut.skipped == "", cut.skipped
            ends = [o for o in result.outcomes if o.episode == cut.episode.index]
            # A request either finished before the cut or failed with kvfsm's reason.
            for o in ends:
                assert o.status in ("completed", "errored"), o
                if o.status == "errored":
                    assert o.reason.startswith("kvfsm: "), o
            assert any(o.status == "errored" for o in ends), ends

    assert [o.index for o in result.outcomes if o.status == "hung"] == []
    assert sum(row.over_bound for row in score.rows) == 0, score.violations
    completed = [o for o in result.outcomes if o.status == "completed"]
    assert completed, "no request completed"
    wrong = [o.index for o in completed if o.output_ids != result.reference[o.index]]
    assert wrong == []
    for record in result.records:
        assert [d.server for d in record.drain] == ["prefill", "decode"]
        for reading in record.drain:
            assert reading.clean, (record.episode.fault.kind, reading)

    (dropped,) = [r for r in result.records if r.episode.fault.action.value == "drop-decode-half"]
    errored = [o for o in result.outcomes if o.episode == dropped.episode.index]
    assert [o.status for o in errored].count("errored") >= 1, errored
    # Its prefill rooms failed by the unclaimed bound, or at once when the router dropped the
    # prefill half too (SGLang aborts the room); none waited for a deadline.
    for room in dropped.unclaimed_rooms:
        assert float(room["duration_s"]) < UNCLAIMED_S + result.liveness_s, room
    assert dropped.deadline_rooms == []

    assert score.ok, score.violations
