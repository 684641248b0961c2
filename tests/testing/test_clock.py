"""``kvfsm.testing._clock``: ``VirtualClock``, through the plugin's ``kvfsm_clock`` fixture (the way
a user's tests get it): it moves only when told, and never back."""

from __future__ import annotations

import pytest

from kvfsm.testing import VirtualClock


def test_the_virtual_clock_moves_only_when_told(kvfsm_clock: VirtualClock) -> None:
    start = kvfsm_clock()
    assert kvfsm_clock.after(5) == start + 5
    assert kvfsm_clock() == start
    assert kvfsm_clock.advance(2.5) == start + 2.5
    with pytest.raises(ValueError, match="does not go back"):
        kvfsm_clock.advance(-1)
