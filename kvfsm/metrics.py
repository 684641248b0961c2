"""Prometheus metrics for rooms and the data path (optional: ``pip install kvfsm[metrics]``).

``RoomMetrics`` is a room :class:`~kvfsm.rooms.Observer` and a transport chunk observer. It keeps

* ``kvfsm_rooms{role,state}``: rooms that still have a task, by state (terminal rooms count
  until they are settled and reaped: a Failed room that will not settle shows up here);
* ``kvfsm_transitions_total{role,from_state,to_state}``;
* ``kvfsm_failures_total{role,kind}``: ``kind`` is the reason's class, numbers stripped
  (``aborted (peer)``, ``deadline expired``, ``peer lost``, ``chunk # stalled``...);
* ``kvfsm_chunks_total{outcome}``, ``kvfsm_bytes_total``, ``kvfsm_chunk_seconds`` (histogram).

Every hook runs on the loop thread and costs a few label lookups.
"""

from __future__ import annotations

import re
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfsm.states import KVPoll, Role

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

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
