"""kvfsm's pytest plugin: fixtures for a real prefill/decode pair (``kvfsm.testing``).

Loaded automatically wherever kvfsm is installed (the ``pytest11`` entry point ``kvfsm``); to
load it by hand, ``-p kvfsm.testing.plugin``. Fixtures:

* ``kvfsm_pair``: a started :class:`~kvfsm.testing.KvfsmPair`. Its options come from the test's
  ``@pytest.mark.kvfsm(...)`` marker (the keyword arguments of
  :class:`~kvfsm.testing.PairOptions`, e.g. ``faults=Faults().stall_chunk(0)``), else the
  defaults. At teardown it is closed, and the test fails if a room, a held page or a transfer
  was left behind, or if a released page was written (canaries).
* ``kvfsm_pair_factory``: ``make(**options) -> KvfsmPair``, for tests that need several pairs or
  options computed at run time; same teardown checks for each.
* ``kvfsm_clock``: a :class:`~kvfsm.testing.VirtualClock` for the sans-IO cores.

The fixtures are synchronous (building a pair blocks: NIXL registration, the first
registration with the registry) and work in ``async def`` tests; the pair's own helpers
(``await kvfsm_pair.transfer(...)``) are async.

Nothing of kvfsm is imported when the plugin loads, only when a fixture runs: the plugin loads
into every pytest session of every project that has kvfsm installed, most of which never ask for
a pair (and the pair brings NIXL, the managers and the chaos proxies with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvfsm.testing import KvfsmPair, VirtualClock

__all__ = ["kvfsm_clock", "kvfsm_pair", "kvfsm_pair_factory"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kvfsm(**options): kvfsm.testing.PairOptions for this test's kvfsm_pair fixture",
    )


def _checked_close(pair: KvfsmPair) -> list[str]:
    try:
        problems = pair.leaks() + pair.canary_violations()
    finally:
        pair.close()
    return problems


@pytest.fixture
def kvfsm_pair_factory() -> Iterator[Callable[..., KvfsmPair]]:
    from kvfsm.testing import KvfsmPair, PairOptions  # noqa: PLC0415 - see the module's doc

    pairs: list[KvfsmPair] = []

    def make(**options: Any) -> KvfsmPair:
        pair = KvfsmPair(PairOptions(**options))
        pairs.append(pair)
        return pair

    yield make
    problems = []
    for pair in pairs:
        problems += _checked_close(pair)
    if problems:
        pytest.fail("kvfsm pair left something behind: " + "; ".join(problems))


@pytest.fixture
def kvfsm_pair(request: pytest.FixtureRequest) -> Iterator[KvfsmPair]:
    from kvfsm.testing import KvfsmPair, PairOptions  # noqa: PLC0415 - see the module's doc

    marker = request.node.get_closest_marker("kvfsm")
    options = PairOptions(**(marker.kwargs if marker is not None else {}))
    pair = KvfsmPair(options)
    yield pair
    problems = _checked_close(pair)
    if problems:
        pytest.fail("kvfsm pair left something behind: " + "; ".join(problems))


@pytest.fixture
def kvfsm_clock() -> VirtualClock:
    from kvfsm.testing import VirtualClock  # noqa: PLC0415 - see the module's doc

    return VirtualClock()
