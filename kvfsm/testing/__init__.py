"""Test kit for people who embed kvfsm: a real prefill/decode pair over NIXL on loopback, faults
at chosen positions, canaries on released pages, and a virtual clock for the sans-IO cores.

As a pytest plugin (``kvfsm.testing.plugin``, registered through the ``pytest11`` entry point,
so it loads wherever kvfsm is installed) it provides the fixtures ``kvfsm_pair``,
``kvfsm_pair_factory`` and ``kvfsm_clock``, and the marker ``@pytest.mark.kvfsm(...)`` that sets
a ``kvfsm_pair``'s :class:`PairOptions`. ``docs/testing.md`` has a worked example.

The names below are imported on first use (PEP 562): the plugin loads this package into every
pytest session of every project that has kvfsm installed, and the pair and its faults bring in
NIXL, the chaos proxies and the managers, which only a test that asks for a pair needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: The module of this package each lazy name comes from.
_HOMES: dict[str, str] = {
    "VirtualClock": "_clock",
    "Direction": "_faults",
    "Faults": "_faults",
    "CANARY": "_pair",
    "AbortAt": "_pair",
    "KvfsmPair": "_pair",
    "PairOptions": "_pair",
    "Transfer": "_pair",
}

# Hidden from the type checker, which reads the TYPE_CHECKING imports instead (a __getattr__ it
# could see would type every misspelt name as Any).
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'kvfsm.testing' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"kvfsm.testing.{home}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
