"""``kvfsm.testing._faults``: ``Faults`` checks the positions and directions it is given. (Faults
injected into a real pair are in ``test_pair.py``.)"""

from __future__ import annotations

import pytest

from kvfsm.testing import Faults


def test_fault_positions_are_checked() -> None:
    with pytest.raises(ValueError, match="count from 0"):
        Faults().stall_chunk(-1)
    with pytest.raises(ValueError, match="direction"):
        Faults().drop_frame("sideways", 0)  # type: ignore[arg-type]
