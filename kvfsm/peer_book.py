"""``PeerBook``: who a rank's peers are and how their links fare, for operators.

A room knows its peer only as the control plane named it (a sender: the receiver's NIXL agent
and the fence of its lease; a receiver: the prefill rank). The book turns that into the peer's
identity (engine, rank, incarnation, agent) from the control plane's links, and remembers links
after they are gone (a failed room is often read after its link was lost), the last
:data:`REMEMBERED` of them. It also lists every link, up or down, with how long ago the peer
was last heard from, whether this rank holds a live write lease on it (prefill), and the
link's round trip as its heartbeats and lease exchange measured it.

Loop thread only. It reads the control plane's links; it changes nothing there.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Any, Final

from kvfsm.states import Role

__all__ = ["REMEMBERED", "PeerBook", "engine_of"]

#: Links the book still names after they are gone.
REMEMBERED: Final = 256
#: ``default_agent_name``'s shape: kvfsm-<role>-<engine>-r<rank>-<host>-pid<pid>-<hex>.
_AGENT: Final = re.compile(r"^kvfsm-(?:prefill|decode)-(?P<engine>.+)-r\d+-[^-]+-pid\d+-[0-9a-f]+$")


def engine_of(agent: str) -> str:
    """The engine id a default agent name carries ("" for another name)."""
    match = _AGENT.match(agent)
    return match.group("engine") if match else ""


class PeerBook:
    """The peers of one control plane (``kvfsm.control.ControlPlane``), by link."""

    def __init__(self, control: Any, leases: Any = None) -> None:
        self._control = control
        self._leases = leases
        #: link generation -> the peer's row, newest last (lost ones kept, REMEMBERED).
        self._seen: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def refresh(self) -> None:
        """Note every live link; mark the ones that went since as down."""
        live = self._live_links()
        now = time.monotonic()
        current = set()
        for link in live:
            generation = int(link.generation)
            current.add(generation)
            row = self._seen.get(generation)
            if row is None:
                hello = link.hello
                row = self._seen[generation] = {
                    "peer_id": str(link.peer_id),
                    "role": str(hello.role),
                    "engine": engine_of(str(hello.agent)),
                    "rank": int(hello.rank),
                    "incarnation": int(hello.incarnation),
                    "agent": str(hello.agent),
                    "link": generation,
                    "up": True,
                    "rtt_ms": None,
                }
            row["up"] = not link.closed
            row["last_heard_s"] = round(
                max(0.0, self._loop_time() - float(link.liveness.last_seen)), 3
            )
            row["leased"] = self._leased(generation, now)
            row["rtt_ms"] = _ms(getattr(getattr(link, "round_trip", None), "smoothed_s", None))
        for generation, row in self._seen.items():
            if generation not in current and row["up"]:
                row["up"] = False
                row["leased"] = False
        while len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)

    def links(self) -> list[dict[str, Any]]:
        """Every link the book knows, newest last: up or down, last heard, leased, and its
        smoothed round trip in ms (``rtt_ms``: null until measured; a lost link
        keeps its last)."""
        self.refresh()
        return [dict(row) for row in self._seen.values()]

    def name(self, role: Role, agent: str, rank: int, fence: int) -> dict[str, Any] | None:
        """The peer of a room that named it by ``agent``/``fence`` (sender) or prefill ``rank``
        (receiver): engine, rank, incarnation, agent; None if the book never saw its link."""
        self.refresh()
        row: dict[str, Any] | None = None
        if fence and fence in self._seen:
            row = self._seen[fence]
        elif agent:
            row = next((r for r in reversed(self._seen.values()) if r["agent"] == agent), None)
        elif rank >= 0:
            row = next(
                (
                    r
                    for r in reversed(self._seen.values())
                    if r["rank"] == rank and r["role"] == "prefill"
                ),
                None,
            )
        if row is None:
            return None
        return {k: row[k] for k in ("engine", "rank", "incarnation", "agent", "link", "up")}

    # -- reading the control plane (defensively: its internals are not an API) -------------------

    def _live_links(self) -> list[Any]:
        links = getattr(self._control, "_links", None)
        return list(links.values()) if isinstance(links, dict) else []

    def _loop_time(self) -> float:
        loop = getattr(self._control, "_loop", None)
        return float(loop.time()) if loop is not None else time.monotonic()

    def _leased(self, generation: int, now: float) -> bool:
        leases = self._leases
        if leases is None:
            return False
        try:
            return bool(leases.valid(generation, now))
        except Exception:
            return False


def _ms(seconds: object) -> float | None:
    return round(seconds * 1000, 3) if isinstance(seconds, float) else None
