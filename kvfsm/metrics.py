"""Prometheus metrics for rooms and the data path (optional: ``pip install kvfsm[metrics]``).

``RoomMetrics`` is a room :class:`~kvfsm.rooms.Observer` and a transport chunk observer. It keeps

* ``kvfsm_rooms{role,state}``: rooms that still have a task, by state (terminal rooms count
  until they are settled and reaped: a Failed room that will not settle shows up here);
* ``kvfsm_transitions_total{role,from_state,to_state}``;
* ``kvfsm_failures_total{role,kind}``: ``kind`` is the reason's class, numbers stripped
  (``aborted (peer)``, ``deadline expired``, ``peer lost``, ``chunk # stalled``...);
* ``kvfsm_chunks_total{outcome}``, ``kvfsm_bytes_total``, ``kvfsm_chunk_seconds`` (histogram);

and, read at each scrape from the engine and its control plane (:meth:`RoomMetrics.watch`):

* ``kvfsm_oldest_room_age_seconds{role,state}``: how long the oldest room in each
  non-terminal state has been in it (0: none). A wedge shows as an age that keeps growing;
  the alert compares it with twice the state's deadline (``kvfsm_state_deadline_seconds``);
* ``kvfsm_peer_up{peer_role,peer_rank,incarnation}`` (1 up, 0 down) and
  ``kvfsm_peer_last_heard_seconds{...}`` per control link;
* ``kvfsm_control_<counter>_total``: the control plane's counters (``frames_rejected``,
  ``handshakes_refused``, ``unexpected_errors``, ``leases_granted``...), each a counter.

Every hook runs on the loop thread and costs a few label lookups.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvfsm.states import NON_TERMINAL, KVPoll, Role, deadline_of

__all__ = ["RoomMetrics", "reason_kind"]

_DIGITS: Final = re.compile(r"\d+")
_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0, 30.0)


def reason_kind(reason: str) -> str:
    """The class of a failure reason: the part before the first colon, numbers as ``#``."""
    return _DIGITS.sub("#", reason.split(":", 1)[0].strip()) or "unknown"


class RoomMetrics:
    """Room and chunk metrics in their own ``CollectorRegistry`` (so two engines in one process
    do not collide)."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = "kvfsm") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, ns = self.registry, namespace
        self.rooms = Gauge(
            f"{ns}_rooms", "Rooms with a task, by state", ["role", "state"], registry=r
        )
        self.transitions = Counter(
            f"{ns}_transitions",
            "Room state changes",
            ["role", "from_state", "to_state"],
            registry=r,
        )
        self.failures = Counter(
            f"{ns}_failures", "Failed rooms by reason", ["role", "kind"], registry=r
        )
        self.chunks = Counter(f"{ns}_chunks", "Chunks finished", ["outcome"], registry=r)
        self.bytes = Counter(f"{ns}_bytes", "Bytes moved by finished chunks", registry=r)
        self.latency = Histogram(
            f"{ns}_chunk_seconds",
            "Chunk time from acceptance to completion",
            buckets=_BUCKETS,
            registry=r,
        )

    # -- room observer ---------------------------------------------------------------------

    def spawned(self, role: Role) -> None:
        self.rooms.labels(role.value, KVPoll.Bootstrapping.name).inc()

    def transition(self, role: Role, before: KVPoll, after: KVPoll, reason: str) -> None:
        self.rooms.labels(role.value, before.name).dec()
        self.rooms.labels(role.value, after.name).inc()
        self.transitions.labels(role.value, before.name, after.name).inc()
        if after is KVPoll.Failed:
            self.failures.labels(role.value, reason_kind(reason)).inc()

    def reaped(self, role: Role, state: KVPoll) -> None:
        self.rooms.labels(role.value, state.name).dec()

    # -- chunk observer ----------------------------------------------------------------------

    def chunk(self, nbytes: int, seconds: float, ok: bool) -> None:
        self.chunks.labels("done" if ok else "failed").inc()
        if ok:
            self.bytes.inc(nbytes)
            self.latency.observe(seconds)

    # -- read at scrape time -------------------------------------------------------------------

    def watch(
        self,
        rooms: Callable[[], list[Any]],
        *,
        deadlines: Mapping[Role, Mapping[KVPoll, float]] | None = None,
        links: Callable[[], list[dict[str, Any]]] | None = None,
        control: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """Read at each scrape (on the engine's loop, where the status server runs): ``rooms``
        gives the engine's live rooms (``Registry.rooms``), ``links`` the peer book's rows,
        ``control`` the control plane's counters."""
        self.registry.register(_Scraped(rooms, deadlines or {}, links, control))

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)


class _Scraped:
    """A collector of what is read when Prometheus scrapes, not kept as it happens."""

    def __init__(
        self,
        rooms: Callable[[], list[Any]],
        deadlines: Mapping[Role, Mapping[KVPoll, float]],
        links: Callable[[], list[dict[str, Any]]] | None,
        control: Callable[[], Mapping[str, int]] | None,
    ) -> None:
        self._rooms = rooms
        self._deadlines = deadlines
        self._links = links
        self._control = control

    def collect(self) -> Iterator[Metric]:
        oldest = GaugeMetricFamily(
            "kvfsm_oldest_room_age_seconds",
            "Time the oldest room in each non-terminal state has spent in it (0: none)",
            labels=["role", "state"],
        )
        deadline = GaugeMetricFamily(
            "kvfsm_state_deadline_seconds",
            "Each non-terminal state's deadline",
            labels=["role", "state"],
        )
        # How long each room has been in its state: its deadline less what is left of it.
        now = asyncio.get_running_loop().time()
        ages: dict[tuple[Role, KVPoll], float] = {}
        for room in self._rooms():
            info = room.info(now)
            state = KVPoll[str(info["state"])]
            left = info["deadline_in_s"]
            if state in NON_TERMINAL and isinstance(left, float | int):
                seconds = deadline_of(room.role, state, self._deadlines.get(room.role))
                key = (room.role, state)
                ages[key] = max(ages.get(key, 0.0), seconds - float(left))
        for role in Role:
            for state in NON_TERMINAL:
                oldest.add_metric([role.value, state.name], ages.get((role, state), 0.0))
                seconds = deadline_of(role, state, self._deadlines.get(role))
                deadline.add_metric([role.value, state.name], seconds)
        yield oldest
        yield deadline
        if self._links is not None:
            up = GaugeMetricFamily(
                "kvfsm_peer_up",
                "Control link to a peer: 1 up, 0 down",
                labels=["peer_role", "peer_rank", "incarnation"],
            )
            heard = GaugeMetricFamily(
                "kvfsm_peer_last_heard_seconds",
                "Seconds since the peer was last heard from on its control link",
                labels=["peer_role", "peer_rank", "incarnation"],
            )
            for link in self._links():
                labels = [str(link["role"]), str(link["rank"]), str(link["incarnation"])]
                up.add_metric(labels, 1.0 if link["up"] else 0.0)
                if "last_heard_s" in link:
                    heard.add_metric(labels, float(link["last_heard_s"]))
            yield up
            yield heard
        if self._control is not None:
            for name, value in sorted(self._control().items()):
                if name.endswith("_max_ms"):
                    continue  # a maximum, not a count
                counter = CounterMetricFamily(
                    f"kvfsm_control_{name}", f"The control plane's {name} counter"
                )
                counter.add_metric([], float(value))
                yield counter
