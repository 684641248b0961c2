"""Test kit for people who embed kvfsm: a real prefill/decode pair over NIXL on loopback, faults
at chosen positions, canaries on released pages, and a virtual clock for the sans-IO cores.

As a pytest plugin (``kvfsm.testing.plugin``, registered through the ``pytest11`` entry point,
so it loads wherever kvfsm is installed) it provides the fixtures ``kvfsm_pair``,
``kvfsm_pair_factory`` and ``kvfsm_clock``, and the marker ``@pytest.mark.kvfsm(...)`` that sets
a ``kvfsm_pair``'s :class:`PairOptions`. ``docs/testing.md`` has a worked example.
"""

from __future__ import annotations

from kvfsm.testing._clock import VirtualClock
from kvfsm.testing._faults import Direction, Faults
from kvfsm.testing._pair import CANARY, AbortAt, KvfsmPair, PairOptions, Transfer

__all__ = [
    "CANARY",
    "AbortAt",
    "Direction",
    "Faults",
    "KvfsmPair",
    "PairOptions",
    "Transfer",
    "VirtualClock",
]
