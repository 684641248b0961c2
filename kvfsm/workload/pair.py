"""A prefill rank and a decode rank (:mod:`kvfsm.workload.ranks`) as the driving process sees
them: where they run (a :class:`Site`), starting them with a registry, collecting their outcomes,
and stopping them (prefill first) and the registry whatever happens.

``kvfsm demo`` runs one pair on this machine; ``kvfsm demo --two-hosts`` and the link-cut scenario
(:mod:`kvfsm.chaos._two_hosts`) run one across two network namespaces through another site.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvfsm._child import ChildProcess, spawn_quietly
from kvfsm.manager import ManagerConfig
from kvfsm.registry import RegistryThread
from kvfsm.workload.interrupts import sigint_deferred
from kvfsm.workload.options import DemoOptions
from kvfsm.workload.ranks import STARVED, Outcome, rank_main

__all__ = ["Site", "collect", "running_ranks"]

_log = logging.getLogger("kvfsm.demo")


class Site:
    """Where the pair's processes run. This one: the registry in this process on loopback, both
    ranks on this machine with default configs. ``kvfsm demo --two-hosts`` uses another
    (:mod:`kvfsm.chaos._two_hosts`): each rank in its own network namespace."""

    def start_registry(self) -> tuple[str, Callable[[], None]]:
        """Start the registry; its URL and how to stop it."""
        registry = RegistryThread()
        return registry.url, registry.close

    def rank(self, role: str) -> tuple[Sequence[str], Callable[[str], ManagerConfig] | None]:
        """How to start ``role``'s process: a command prefix and a picklable config factory."""
        return (), None

    def started(self) -> None:
        """Both ranks are up; the run starts now."""

    def report(self) -> dict[str, Any]:
        """Added to the summary after the run (before the ranks stop)."""
        return {}


@contextlib.contextmanager
def running_ranks(
    site: Site, opts: DemoOptions, seed: int
) -> Iterator[tuple[ChildProcess, ChildProcess]]:
    """The registry and both ranks, started at ``site``; on the way out (Ctrl-C included, which
    waits until the teardown is over) each rank is told it is stopping, then prefill is stopped
    first, decode next, the registry last."""
    level = logging.getLogger("kvfsm").getEffectiveLevel()
    stop_registry: Callable[[], None] | None = None
    children: list[ChildProcess] = []
    try:
        url, stop_registry = site.start_registry()

        def factory(role: str) -> Callable[[], ChildProcess]:
            prefix, configure = site.rank(role)
            return lambda: ChildProcess(
                rank_main, role, opts, seed, url, level, configure, what=role, prefix=prefix
            )

        children = spawn_quietly([factory("prefill"), factory("decode")])
        site.started()
        yield children[0], children[1]
    finally:
        with sigint_deferred():
            for child in children:
                with contextlib.suppress(Exception):
                    child.ask("stopping", timeout=5)
            for child in sorted(children, key=lambda c: c.what != "prefill"):
                try:
                    child.close()
                except Exception:
                    _log.exception("stopping the %s process failed", child.what)
            if stop_registry is not None:
                try:
                    stop_registry()
                except Exception:
                    _log.exception("stopping the registry failed")


def collect(
    child: ChildProcess, into: dict[int, Outcome], what: str, timeout: float = 60.0
) -> bool:
    """Add what ``child`` reported since the last call; True if a request was not started."""
    if not child.process.is_alive():
        raise RuntimeError(f"the {what} process exited (status {child.process.exitcode})")
    starved = False
    for raw in child.ask("results", timeout=timeout):
        outcome = into[raw["room"]] = Outcome(**raw)
        starved |= outcome.reason == STARVED
    return starved
