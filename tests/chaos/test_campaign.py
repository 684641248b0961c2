"""``kvfsm chaos`` end to end: real prefill and decode processes, real NIXL, real sockets, under
every fault kind at once, and a deliberately broken invariant that the checker must report."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvfsm.chaos._campaign import _Campaign, run_campaign
from kvfsm.chaos._options import CampaignOptions
from kvfsm.chaos._plan import ControlRates, TransferRates
from tests.helpers.waiting import wait_until_sync

pytestmark = pytest.mark.slow


# Judges every scheduler-facing call's own time (a 17 MB send_metadata copy among them):
# run alone, not beside another worker's SGLang servers.
@pytest.mark.alone
def test_a_short_campaign_has_no_violation() -> None:
    opts = CampaignOptions(seed=20260507, episodes=2, rooms=24, sigkill_rate=1.0)
    report = run_campaign(opts)
    assert report["violations"] == [], report
    assert report["wedged"] == report["late_writes"] == report["slow_calls"] == 0
    assert set(report["leaks"].values()) == {0}, report["leaks"]
    # Every room settles: decode's rooms of a lost link the lease plus the fence margin after
    # their last grant (with a secret no disordered frame is excused).
    assert sum(report["unsettled"].values()) == 0, report["unsettled"]
    assert report["starved"] == 0
    assert report["rooms"] == 48
    faults = report["faults"]
    assert any(k.startswith("sigkill_") for k in faults), faults
    assert any(k.startswith("hostile_") for k in faults), faults


def test_the_checker_reports_a_late_write() -> None:
    quiet = CampaignOptions(
        seed=3,
        episodes=1,
        rooms=12,
        abort_rate=0.0,
        transfer=TransferRates(),
        control=ControlRates(),
        sigstop_rate=0.0,
        sigkill_rate=0.0,
        registry_restart_rate=0.0,
        hostile_per_episode=0,
    )
    assert run_campaign(quiet)["ok"]
    report = run_campaign(dataclasses.replace(quiet, break_invariant="canary"))
    # Exactly the one planted write: counters are reported as deltas, so the drain after the
    # episode and the one at close do not count it twice.
    assert report["late_writes"] == 1
    assert not report["ok"]
    assert any("late write" in v for v in report["violations"])


# Judges every scheduler-facing call's own time (a 17 MB send_metadata copy among them):
# run alone, not beside another worker's SGLang servers.
@pytest.mark.alone
def test_freezes_past_the_settle_bound_reused_ids_and_oversized_calls() -> None:
    """Faults outside the old model, each in every episode or often: prefill frozen 1.5 to 4 times
    decode's settle bound with chunks in flight (fencing must keep every late write out, and
    decode's rooms must fail within the silence limit, not wait for prefill), room ids reused
    right after an abort, and send_metadata calls over max_pages or over the frame limit
    (their room fails at once, nothing else does)."""
    opts = CampaignOptions(
        seed=20261201,
        episodes=2,
        rooms=32,
        long_freeze_rate=1.0,
        reuse_rate=0.25,
        oversized_rate=0.15,
        sigstop_rate=0.0,
        sigkill_rate=0.0,
    )
    report = run_campaign(opts)
    assert report["violations"] == [], report
    assert report["wedged"] == report["late_writes"] == report["mismatched_bytes"] == 0
    assert report["slow_calls"] == 0
    assert set(report["leaks"].values()) == {0}, report["leaks"]
    assert sum(report["unsettled"].values()) == 0, report["unsettled"]
    freezes = report["long_freezes"]
    assert freezes["count"] == 2
    assert freezes["min_s"] > report["settle_after_loss_s"]
    assert report["faults"]["long_freeze_prefill"] == 2
    # Decode's rooms bound to the frozen prefill (if any were, at that moment) failed within
    # the silence limit; a late one is a violation too.
    assert report["liveness"]["max_s"] <= report["liveness"]["bound_s"]
    reuse = report["reuse"]
    assert reuse["rooms"] >= 2, reuse
    assert report["faults"]["reuse_decode"] == reuse["rooms"]
    oversized = report["oversized"]
    assert oversized.get("max_pages", 0) >= 1, oversized
    assert oversized.get("frame", 0) >= 1, oversized


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.mark.parametrize(("ended", "frozen"), [(0.2, False), (0.6, True)])
def test_a_long_freeze_waits_for_chunks_in_flight_only_while_rooms_still_move(
    ended: float, frozen: bool
) -> None:
    """The campaign's own ``_act`` on a stand-in prefill process: with no chunk seen in flight it
    waits (retries soon) early in an episode, but freezes once 60% of the rooms ended, so that a
    fast pair cannot end the episode before its freeze (CI once saw a freeze never made)."""
    campaign = _Campaign(CampaignOptions(seed=1, long_freeze_factor=(1.5, 1.6)))
    campaign.prefill_in_flight = 0
    campaign.ended = ended
    prefill = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped: dict[str, float] = {}
    try:
        rank = SimpleNamespace(pid=prefill.pid)
        retry = campaign._act("long_freeze", "prefill", 0, {"prefill": rank}, stopped, set())  # type: ignore[dict-item]
        if frozen:
            assert retry is None
            wait_until_sync(lambda: _state(prefill.pid) == "T", timeout=10)
            assert campaign.tally.long_freezes
            assert "prefill" in stopped
            assert campaign.tally.long_freezes_in_flight == 0
        else:
            assert retry is not None
            assert retry - time.monotonic() < 0.1  # soon: a poll may see chunks in flight
            assert not campaign.tally.long_freezes
            assert not stopped
            assert _state(prefill.pid) != "T"
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
        prefill.kill()
        prefill.wait()
