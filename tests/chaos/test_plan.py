"""FaultPlan: decisions come from the seed alone, per site, whatever else is asked."""

from __future__ import annotations

import pytest

from kvfsm.chaos._plan import ControlRates, FaultPlan, FrameFault, TransferFault, TransferRates

RATES = TransferRates(post_error=0.2, completion_error=0.2, never_complete=0.2, delay=0.2)
FRAMES = ControlRates(drop=0.2, duplicate=0.2, reorder=0.2, corrupt=0.2)


def decisions(plan: FaultPlan, n: int) -> list[tuple[TransferFault, float]]:
    return [plan.transfer_fault() for _ in range(n)]


def test_same_seed_same_decisions() -> None:
    a, b = FaultPlan(7, RATES, FRAMES), FaultPlan(7, RATES, FRAMES)
    assert decisions(a, 200) == decisions(b, 200)
    assert [a.frame_fault("to_prefill") for _ in range(50)] == [
        b.frame_fault("to_prefill") for _ in range(50)
    ]
    assert a.decisions == b.decisions
    assert a.injected() == b.injected()


def test_another_seed_other_decisions() -> None:
    assert decisions(FaultPlan(7, RATES), 200) != decisions(FaultPlan(8, RATES), 200)


def test_sites_are_independent_streams() -> None:
    a, b = FaultPlan(3, RATES, FRAMES), FaultPlan(3, RATES, FRAMES)
    for _ in range(37):  # only plan a is asked about another site in between
        a.frame_fault("to_decode")
        a.transfer_fault("other")
    assert decisions(a, 100) == decisions(b, 100)


def test_every_kind_fires_and_none_without_rates() -> None:
    plan = FaultPlan(1, RATES, FRAMES)
    kinds = {kind for kind, _ in decisions(plan, 500)}
    assert kinds == {
        TransferFault.NONE,
        TransferFault.POST_ERROR,
        TransferFault.COMPLETION_ERROR,
        TransferFault.NEVER_COMPLETE,
        TransferFault.DELAY,
    }
    frames = {plan.frame_fault("x")[0] for _ in range(500)}
    assert FrameFault.CORRUPT in frames
    assert FrameFault.REORDER in frames
    quiet = FaultPlan(1)
    assert {kind for kind, _ in decisions(quiet, 100)} == {TransferFault.NONE}
    assert quiet.injected() == {}


def test_rates_are_checked() -> None:
    with pytest.raises(ValueError, match="add up"):
        TransferRates(post_error=0.6, delay=0.6)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        ControlRates(drop=-0.1)
