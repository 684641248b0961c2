"""Scores of ``kvfsm chaos servers``: every request's end, every fault's drain, the table per
fault kind and the violations. Pure: the campaign records what it saw (``RequestOutcome``,
``EpisodeRecord``) and this module judges it.

The invariants (a violation each):

* every request ends (output, error, or the end its client chose) within the episode's bound
  (:func:`end_bound_s`); a request its client gave up on is *hung*;
* a completed request's tokens equal the reference server's;
* after the episode's drain, prefill and decode hold 0 live rooms and 0 pages, and prefill's
  NIXL handles created equal those released;
* a room of the dropped-decode-half fault fails by the unclaimed bound (within it and the
  liveness bound), or sooner (the router, told decode failed, may drop its prefill request, and
  SGLang then aborts the room at once), never by a deadline.

A room that ended by a state deadline instead of a peer-loss signal is no violation by itself
(SGLang may own the wait) but is named in the report, with its room and reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfsm.chaos._server_plan import Action, Fault, ServerEpisode

__all__ = [
    "SGLANG_SLACK_S",
    "DrainReading",
    "EpisodeRecord",
    "FaultRow",
    "RequestOutcome",
    "Score",
    "classify_error",
    "end_bound_s",
    "score",
]

#: What the campaign allows SGLang's own waits beside kvfsm's bounds: a scheduler starved on a
#: loaded 2-core host before it answers, the router's health checks (every second) before it stops
#: routing to a dead worker, a restarted server's start-up that requests queue behind.
SGLANG_SLACK_S = 30.0


def end_bound_s(
    fault: Fault, liveness_s: float, lease_s: float, unclaimed_s: float, queue_s: float = 0.0
) -> float:
    """How long after the fault (or after its own start, if later) a request may take to end:
    the fault's freeze, kvfsm's liveness bound plus its lease (a peer's loss, then the pages'
    settle), the unclaimed bound for a dropped decode half, SGLang's slack, and ``queue_s``,
    the time the pipeline itself needs for the episode's whole load with no fault (the
    reference server's time for it, times the factor a no-fault calibration measured): a
    request sent with many others may wait behind all of them in SGLang's queues (64 at once,
    with prompts up to 2,000 tokens, take about a minute through router, prefill and decode on
    two cores), which no fault causes. A request that waits longer than that, finished or not,
    is over its bound: a transfer that stalled and then succeeded is caught too."""
    bound = fault.pause_s + liveness_s + lease_s + SGLANG_SLACK_S + queue_s
    if fault.action is Action.DROP_DECODE_HALF:
        bound += unclaimed_s
    return bound


@dataclass
class RequestOutcome:
    index: int
    episode: int
    #: ``completed``, ``errored``, ``disconnected`` (its client left on purpose), ``aborted``
    #: (an ``/abort_request`` named it) or ``hung`` (its client gave up waiting).
    status: str
    #: Seconds since the campaign began.
    sent_s: float
    ended_s: float
    output_ids: list[int] = field(default_factory=list)
    #: The error's class (:func:`classify_error`), for ``errored``.
    reason: str = ""
    #: The error's text as it came (its first 300 characters).
    detail: str = ""


@dataclass
class DrainReading:
    """One server's status after the episode's drain (``/stats``)."""

    server: str
    live: int
    held_pages: int
    handles_created: int = 0
    handles_released: int = 0
    #: Whether its status server answered at all.
    read: bool = True

    @property
    def clean(self) -> bool:
        return (
            self.read
            and self.live == 0
            and self.held_pages == 0
            and self.handles_created == self.handles_released
        )


@dataclass
class EpisodeRecord:
    episode: ServerEpisode
    #: Seconds since the campaign began when the fault landed (None: not injected).
    fault_s: float | None
    drain: list[DrainReading] = field(default_factory=list)
    #: Rooms (``/failures`` rows of this episode) that failed by a state deadline.
    deadline_rooms: list[dict[str, Any]] = field(default_factory=list)
    #: Prefill rooms this episode failed by the unclaimed bound.
    unclaimed_rooms: list[dict[str, Any]] = field(default_factory=list)
    #: Why the fault was not injected, if it was not.
    skipped: str = ""
    #: Seconds the reference server took to serve the episode's requests (its bound's share
    #: for queueing behind its own load: :func:`end_bound_s`).
    load_s: float = 0.0
    #: Seconds its bound allows for queueing behind its own load (:func:`end_bound_s`): its
    #: ``load_s`` times the calibration's factor (the calibration's own: the pipeline's time).
    queue_s: float = 0.0
    #: kvfsm servers that ended themselves during the episode (``name: why``), which the
    #: campaign started again as their supervisor: named in the report, not a violation.
    supervisor_restarts: list[str] = field(default_factory=list)
    #: Seconds of each phase of the episode (``reference``, ``load``, ``restart``, ``serving``,
    #: ``drain``), for the log and the report: where a campaign's time goes.
    phases_s: dict[str, float] = field(default_factory=dict)


def classify_error(status: int, text: str) -> str:
    """An error's class, for the table: kvfsm's reason kind when an answer quotes it, else what
    SGLang or the connection said."""
    low = text.lower()
    if "no decode room claimed" in low:
        return "kvfsm: unclaimed"
    if "peer lost" in low:
        return "kvfsm: peer lost"
    if "deadline expired" in low:
        return "kvfsm: deadline"
    if "abort" in low:
        return "aborted"
    if "connection refused" in low or "cannot connect" in low:
        return "connection refused"
    if "payload" in low:  # aiohttp: the answer's body ended before its length or last chunk
        return "answer cut off"
    if "disconnect" in low or "reset" in low or "broken pipe" in low:
        return "connection reset"
    if status:
        return f"http {status}"
    return text.split(":", 1)[0][:40] or "unknown"


@dataclass
class FaultRow:
    kind: str
    requests: int = 0
    completed: int = 0
    exact: int = 0
    errored: dict[str, int] = field(default_factory=dict)
    disconnected: int = 0
    aborted: int = 0
    hung: int = 0
    over_bound: int = 0
    #: Requests sent and not ended when the fault landed (0: the fault hit no request).
    in_flight: int = 0
    #: The latest end of a request after the fault, seconds.
    slowest_end_s: float = 0.0
    bound_s: float = 0.0
    drained: bool = True
    deadline_rooms: int = 0
    skipped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Score:
    rows: list[FaultRow]
    violations: list[str]
    #: Rooms that ended by a state deadline: ``(fault kind, server, room, reason)``.
    deadline_rooms: list[tuple[str, str, int, str]]

    @property
    def ok(self) -> bool:
        return not self.violations


def _row(
    record: EpisodeRecord,
    outcomes: list[RequestOutcome],
    reference: dict[int, list[int]],
    bounds: tuple[float, float, float],
    violations: list[str],
) -> FaultRow:
    fault = record.episode.fault
    row = FaultRow(fault.kind, requests=len(outcomes), skipped=record.skipped)
    if record.skipped:
        violations.append(f"{fault.kind}: not injected: {record.skipped}")
    row.bound_s = end_bound_s(fault, *bounds, queue_s=record.queue_s)
    errors: Counter[str] = Counter()
    for o in outcomes:
        if o.status == "completed":
            row.completed += 1
            if o.output_ids == reference.get(o.index):
                row.exact += 1
            else:
                violations.append(f"{fault.kind}: request {o.index} completed inexact")
        elif o.status == "errored":
            errors[o.reason] += 1
            if fault.action is Action.NONE:
                violations.append(
                    f"{fault.kind}: request {o.index} errored with no fault ({o.reason})"
                )
        elif o.status == "disconnected":
            row.disconnected += 1
        elif o.status == "aborted":
            row.aborted += 1
        elif o.status == "hung":
            row.hung += 1
            violations.append(f"{fault.kind}: request {o.index} hung")
        if record.fault_s is not None and o.sent_s <= record.fault_s < o.ended_s:
            row.in_flight += 1
        if record.fault_s is not None and o.status != "hung":
            after = o.ended_s - max(o.sent_s, record.fault_s)
            row.slowest_end_s = max(row.slowest_end_s, round(after, 2))
            if after > row.bound_s:
                row.over_bound += 1
                violations.append(
                    f"{fault.kind}: request {o.index} ended {after:.1f}s after the fault "
                    f"(bound {row.bound_s:g}s)"
                )
    row.errored = dict(sorted(errors.items()))
    for d in record.drain:
        if not d.clean:
            row.drained = False
            violations.append(
                f"{fault.kind}: {d.server} not drained (live {d.live}, pages {d.held_pages}, "
                f"handles {d.handles_created} created / {d.handles_released} released"
                + ("" if d.read else ", status server unreadable")
                + ")"
            )
    row.deadline_rooms = len(record.deadline_rooms)
    return row


def score(
    records: list[EpisodeRecord],
    outcomes: list[RequestOutcome],
    reference: dict[int, list[int]],
    *,
    liveness_s: float,
    lease_s: float,
    unclaimed_s: float,
) -> Score:
    """The table (one row per fault kind, in the order the episodes ran) and the violations."""
    by_episode: dict[int, list[RequestOutcome]] = {}
    for o in outcomes:
        by_episode.setdefault(o.episode, []).append(o)
    rows: dict[str, FaultRow] = {}
    violations: list[str] = []
    deadline: list[tuple[str, str, int, str]] = []
    bounds = (liveness_s, lease_s, unclaimed_s)
    for record in records:
        fault = record.episode.fault
        row = _row(record, by_episode.get(record.episode.index, []), reference, bounds, violations)
        rows[fault.kind] = _merge(rows.get(fault.kind), row)
        deadline += [
            (fault.kind, str(r.get("server", "")), int(r["room"]), str(r.get("reason", "")))
            for r in record.deadline_rooms
        ]
        if fault.action is Action.DROP_DECODE_HALF and record.skipped == "":
            violations.extend(
                f"{fault.kind}: room {r['room']} failed unclaimed after {r['duration_s']}s "
                f"(bound {unclaimed_s:g}s)"
                for r in record.unclaimed_rooms
                if float(r.get("duration_s", 0.0)) > unclaimed_s + liveness_s
            )
            violations.extend(
                f"{fault.kind}: room {r['room']} ended by a deadline ({r.get('reason')}), "
                "not by the unclaimed bound"
                for r in record.deadline_rooms
            )
    return Score(list(rows.values()), violations, deadline)


def _merge(old: FaultRow | None, new: FaultRow) -> FaultRow:
    """Two episodes of one kind (a soak repeats the plan) in one row."""
    if old is None:
        return new
    errored = Counter(old.errored) + Counter(new.errored)
    return FaultRow(
        kind=old.kind,
        requests=old.requests + new.requests,
        completed=old.completed + new.completed,
        exact=old.exact + new.exact,
        errored=dict(sorted(errored.items())),
        disconnected=old.disconnected + new.disconnected,
        aborted=old.aborted + new.aborted,
        hung=old.hung + new.hung,
        over_bound=old.over_bound + new.over_bound,
        in_flight=old.in_flight + new.in_flight,
        slowest_end_s=max(old.slowest_end_s, new.slowest_end_s),
        bound_s=max(old.bound_s, new.bound_s),
        drained=old.drained and new.drained,
        deadline_rooms=old.deadline_rooms + new.deadline_rooms,
        skipped=old.skipped or new.skipped,
    )
