"""``TransferConfig`` refuses settings that would disable what they bound, and prices a
chunk's deadline by its bytes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvfsm.transport import TransferConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("deadline_base_s", 0.0, "deadline_base_s"),
        ("floor_bandwidth_bps", -1.0, "floor_bandwidth_bps"),
        ("quarantine_s", -0.1, "quarantine_s"),
        ("reconnect_interval_s", -1.0, "reconnect_interval_s"),
        ("linger_s", -1.0, "linger_s"),
        ("linger_interval_s", 0.0, "linger_interval_s"),
        ("poll_spin_s", -0.001, "poll_spin_s"),
        ("poll_max_wait_s", -0.001, "poll_max_wait_s"),
        ("merge_max_chunks", 0, "merge_max_chunks"),
        ("merge_max_bytes", -1, "merge_max_bytes"),
        ("hand_back_bytes", -1, "hand_back_bytes"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_name(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferConfig(**{field: value})


def test_zero_hand_back_bytes_is_allowed_and_the_default_bounds_the_hold() -> None:
    assert TransferConfig(hand_back_bytes=0).hand_back_bytes == 0
    # the default holds small requests' results for a bounded stretch, never an unbounded one
    assert 0 < TransferConfig().hand_back_bytes <= 8 << 20


def test_a_chunk_deadline_grows_with_its_bytes_at_the_floor_bandwidth() -> None:
    config = TransferConfig(deadline_base_s=2.0, floor_bandwidth_bps=1e6)
    assert config.deadline_s(0) == 2.0
    assert math.isclose(config.deadline_s(3_000_000), 5.0)
