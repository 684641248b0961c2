"""``kvfsm chaos`` end to end: real prefill and decode processes, real NIXL, real sockets, under
every fault kind at once, and a deliberately broken invariant that the checker must report."""

from __future__ import annotations

import dataclasses

import pytest

from kvfsm.chaos._campaign import run_campaign
from kvfsm.chaos._options import CampaignOptions
from kvfsm.chaos._plan import ControlRates, TransferRates

pytestmark = pytest.mark.slow


def test_a_short_campaign_has_no_violation() -> None:
    opts = CampaignOptions(seed=20260507, episodes=2, rooms=24, sigkill_rate=1.0)
    report = run_campaign(opts)
    assert report["violations"] == [], report
    assert report["ok"]
    assert report["wedged"] == report["late_writes"] == report["slow_calls"] == 0
    assert set(report["leaks"].values()) == {0}, report["leaks"]
    # Every room settles: decode's rooms of a lost link after peer_lost_grace_s. The only
    # exception allowed is a room whose frames to decode the proxy dropped or reordered.
    assert report["unsettled"] == {}, report["unsettled"]
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
