"""Prometheus metrics for rooms and the data path (optional: ``pip install kvfsm[metrics]``).

``RoomMetrics`` is a room :class:`~kvfsm.rooms.Observer` and a transport chunk observer. It keeps

* ``kvfsm_rooms{role,state}``: rooms that still have a task, by state (terminal rooms count
  until they are settled and reaped: a Failed room that will not settle shows up here);
* ``kvfsm_transitions_total{role,from_state,to_state}``;
* ``kvfsm_failures_total{role,kind}``: ``kind`` is the reason's class, numbers stripped
  (``aborted (peer)``, ``deadline expired``, ``peer lost``, ``chunk # stalled``...);
* ``kvfsm_room_state_seconds{role,state}`` (histogram, 100 µs to 300 s): how long each room
  spent in each non-terminal state, observed as it left it;
* ``kvfsm_chunks_total{outcome}``, ``kvfsm_bytes_total``, ``kvfsm_chunk_seconds`` (histogram);

and, read at each scrape from the engine and its control plane (:meth:`RoomMetrics.watch`):

* ``kvfsm_oldest_room_age_seconds{role,state}``: how long the oldest room in each
  non-terminal state has been in it (0: none). A wedge shows as an age that keeps growing;
  the alert compares it with twice the state's deadline (``kvfsm_state_deadline_seconds``);
* ``kvfsm_peer_up{peer_role,peer_rank,incarnation}`` (1 up, 0 down) and
  ``kvfsm_peer_last_heard_seconds{...}`` per control link;
* ``kvfsm_peer_heartbeat_rtt_seconds{peer_role,peer_rank,incarnation}``: each live control
  link's round trip, smoothed, as the frames it carries anyway measure it (heartbeats and the
  lease exchange, within a lease renewal of the link's start; absent until measured);
* ``kvfsm_control_<counter>_total``: the control plane's counters (``frames_rejected``,
  ``handshakes_refused``, ``unexpected_errors``...), each a counter. Among them
  ``leases_granted`` (decode: write leases it granted; prefill: grants it received) and
  ``leases_fenced`` (links lost while their write lease was still live: decode holds their
  exposed pages until that lease plus its fence margin ran out, prefill revokes it at once).

The room hooks run on the loop thread for every room of every request: they only add to plain
lists (a few hundred nanoseconds a state change), and the families are built from those lists
when Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvfsm.states import NON_TERMINAL, KVPoll, Role, deadline_of, reason_kind

__all__ = ["STATE_BUCKETS", "RoomMetrics", "reason_kind"]

_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0, 30.0)
#: ``kvfsm_room_state_seconds``'s upper bounds: a loopback handshake takes a few hundred
#: microseconds, and the longest default deadline (a receiver's WaitingForInput) is 300 s.
STATE_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_STATES: Final = len(KVPoll)
# Read by the hooks: a module global is cheaper than an enum class's attribute.
_SENDER: Final = Role.SENDER
_FAILED: Final = KVPoll.Failed
_BOOTSTRAPPING: Final = int(KVPoll.Bootstrapping)


class _Tally:
    """One role's room counts, as plain lists indexed by state (a ``KVPoll`` is an int): what
    the hooks add to. Keyed by enum members, a dict would hash each one in Python."""

    __slots__ = ("edges", "failures", "live", "times")

    def __init__(self) -> None:
        self.live = [0] * _STATES
        self.edges = [0] * (_STATES * _STATES)  # [before * _STATES + after]
        #: Per state: a count per bucket of STATE_BUCKETS, one for +Inf, then the sum.
        self.times = [[0.0] * (len(STATE_BUCKETS) + 2) for _ in range(_STATES)]
        self.failures: dict[str, int] = {}


class RoomMetrics:
    """Room and chunk metrics in their own ``CollectorRegistry`` (so two engines in one process
    do not collide)."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = "kvfsm") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, ns = self.registry, namespace
        self._tallies = {role: _Tally() for role in Role}
        self._sender = self._tallies[Role.SENDER]
        self._receiver = self._tallies[Role.RECEIVER]
        r.register(_RoomFamilies(ns, self._tallies))
        self.chunks = Counter(f"{ns}_chunks", "Chunks finished", ["outcome"], registry=r)
        self._done = self.chunks.labels("done")
        self._failed = self.chunks.labels("failed")
        self.bytes = Counter(f"{ns}_bytes", "Bytes moved by finished chunks", registry=r)
        self.latency = Histogram(
            f"{ns}_chunk_seconds",
            "Chunk time from acceptance to completion",
            buckets=_BUCKETS,
            registry=r,
        )

    # -- room observer ---------------------------------------------------------------------

    def spawned(self, role: Role) -> None:
        tally = self._sender if role is _SENDER else self._receiver
        tally.live[_BOOTSTRAPPING] += 1

    def transition(
        self, role: Role, before: KVPoll, after: KVPoll, reason: str, seconds: float
    ) -> None:
        tally = self._sender if role is _SENDER else self._receiver
        live = tally.live
        live[before] -= 1
        live[after] += 1
        tally.edges[before * _STATES + after] += 1
        times = tally.times[before]
        times[bisect_left(STATE_BUCKETS, seconds)] += 1
        times[-1] += seconds
        if after is _FAILED:
            kind = reason_kind(reason)
            tally.failures[kind] = tally.failures.get(kind, 0) + 1

    def reaped(self, role: Role, state: KVPoll) -> None:
        tally = self._sender if role is _SENDER else self._receiver
        tally.live[state] -= 1

    # -- chunk observer ----------------------------------------------------------------------

    def chunk(self, nbytes: int, seconds: float, ok: bool) -> None:
        if ok:
            self._done.inc()
            self.bytes.inc(nbytes)
            self.latency.observe(seconds)
        else:
            self._failed.inc()

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


class _RoomFamilies:
    """The room hooks' lists as metric families, built when Prometheus scrapes."""

    def __init__(self, namespace: str, tallies: Mapping[Role, _Tally]) -> None:
        self._ns = namespace
        self._tallies = tallies

    def collect(self) -> Iterator[Metric]:
        ns = self._ns
        rooms = GaugeMetricFamily(
            f"{ns}_rooms", "Rooms with a task, by state", labels=["role", "state"]
        )
        edges = CounterMetricFamily(
            f"{ns}_transitions", "Room state changes", labels=["role", "from_state", "to_state"]
        )
        failures = CounterMetricFamily(
            f"{ns}_failures", "Failed rooms by reason", labels=["role", "kind"]
        )
        times = HistogramMetricFamily(
            f"{ns}_room_state_seconds",
            "Time a room spent in a non-terminal state, observed as it left it",
            labels=["role", "state"],
        )
        bounds = [_le(b) for b in STATE_BUCKETS] + ["+Inf"]
        for role, tally in self._tallies.items():
            for state in KVPoll:
                rooms.add_metric([role.value, state.name], float(tally.live[state]))
                for after in KVPoll:
                    count = tally.edges[state * _STATES + after]
                    if count:
                        edges.add_metric([role.value, state.name, after.name], float(count))
            for kind, count in sorted(tally.failures.items()):
                failures.add_metric([role.value, kind], float(count))
            for state in NON_TERMINAL:
                row = tally.times[state]
                cumulative, buckets = 0.0, []
                for le, observed in zip(bounds, row[:-1], strict=True):
                    cumulative += observed
                    buckets.append((le, cumulative))
                times.add_metric([role.value, state.name], buckets, row[-1])
        yield rooms
        yield edges
        yield failures
        yield times


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client's own histograms write it (``0.0001``, ``1.0``)."""
    return repr(float(bound))


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
            rtt = GaugeMetricFamily(
                "kvfsm_peer_heartbeat_rtt_seconds",
                "Smoothed round trip of a live control link, from its heartbeats and leases",
                labels=["peer_role", "peer_rank", "incarnation"],
            )
            # One series per label set: the same incarnation reconnecting opens a new link
            # beside its lost one, and two samples with one label set are a broken exposition
            # (Prometheus keeps either). The up link wins, else the newest (rows come oldest
            # first).
            chosen: dict[tuple[str, str, str], dict[str, Any]] = {}
            for link in self._links():
                peer = (str(link["role"]), str(link["rank"]), str(link["incarnation"]))
                kept = chosen.get(peer)
                if kept is None or link["up"] or not kept["up"]:
                    chosen[peer] = link
            for peer, link in chosen.items():
                labels = list(peer)
                up.add_metric(labels, 1.0 if link["up"] else 0.0)
                if "last_heard_s" in link:
                    heard.add_metric(labels, float(link["last_heard_s"]))
                if link["up"] and link.get("rtt_ms") is not None:
                    rtt.add_metric(labels, float(link["rtt_ms"]) / 1000)
            yield up
            yield heard
            yield rtt
        if self._control is not None:
            for name, value in sorted(self._control().items()):
                if name.endswith("_max_ms"):
                    continue  # a maximum, not a count
                counter = CounterMetricFamily(
                    f"kvfsm_control_{name}", f"The control plane's {name} counter"
                )
                counter.add_metric([], float(value))
                yield counter
