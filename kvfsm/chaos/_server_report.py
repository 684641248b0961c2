"""The report of ``kvfsm chaos servers``: the table per fault kind (text), the same as JSON, and
a PNG timeline of requests in flight, errors and faults (matplotlib, the ``report`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfsm.chaos._server_campaign import CampaignResult
from kvfsm.chaos._server_plan import CALIBRATION
from kvfsm.chaos._server_soak import growth

__all__ = ["as_json", "print_table", "write_png"]

_COLUMNS = (
    ("fault", 28),
    ("reqs", 5),
    ("hit", 4),
    ("done", 5),
    ("exact", 6),
    ("disc", 5),
    ("abort", 6),
    ("hung", 5),
    ("late", 5),
    ("slowest", 8),
    ("bound", 6),
    ("drained", 8),
    ("deadline", 9),
)


def as_json(r: CampaignResult) -> dict[str, Any]:
    return {
        "seed": r.seed,
        "ok": r.score.ok,
        "elapsed_s": round(r.elapsed_s, 1),
        "requests": len(r.outcomes),
        "bounds_s": {
            "liveness": r.liveness_s,
            "lease": r.lease_s,
            "unclaimed": r.unclaimed_s,
        },
        "faults": [row.as_dict() for row in r.score.rows],
        "skipped": r.skipped,
        "topology": r.topology,
        "deadline_rooms": [
            {"fault": f, "server": s, "room": room, "reason": why}
            for f, s, room, why in r.score.deadline_rooms
        ],
        "unclaimed_rooms": [
            {
                "fault": rec.episode.fault.kind,
                "server": x.get("server", ""),
                "room": x["room"],
                "duration_s": x["duration_s"],
                "reason": x["reason"],
            }
            for rec in r.records
            for x in rec.unclaimed_rooms
        ],
        "supervisor_restarts": [
            {"fault": rec.episode.fault.kind, "episode": rec.episode.index, "server": why}
            for rec in r.records
            for why in rec.supervisor_restarts
        ],
        "calibration": None
        if r.calibration is None
        else {
            "requests": r.calibration.requests,
            "reference_s": r.calibration.reference_s,
            "pipeline_s": r.calibration.pipeline_s,
            "factor": round(r.calibration.factor, 2),
        },
        "phases_s": [
            {"episode": rec.episode.index, "fault": rec.episode.fault.kind, **rec.phases_s}
            for rec in r.records
        ],
        "violations": r.score.violations,
        "soak": growth(r.samples) if r.minutes is not None else {},
        "log_dir": str(r.log_dir),
    }


def print_table(r: CampaignResult) -> None:
    print(" ".join(name.ljust(width) for name, width in _COLUMNS))
    for row in r.score.rows:
        cells = (
            row.kind,
            row.requests,
            row.in_flight,
            row.completed,
            row.exact,
            row.disconnected,
            row.aborted,
            row.hung,
            row.over_bound,
            f"{row.slowest_end_s:.1f}s",
            f"{row.bound_s:g}s",
            "yes" if row.drained else "NO",
            row.deadline_rooms,
        )
        print(" ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
        for reason, n in row.errored.items():
            print(f"    errored {n}: {reason}")
    print(f"prefill and decode: {r.topology}")
    if r.calibration is not None:
        c = r.calibration
        print(
            f"calibration (no fault, {c.requests} requests): reference {c.reference_s:g}s, "
            f"pipeline {c.pipeline_s:g}s; each bound allows its episode's reference time "
            f"x {c.factor:.1f} for queueing"
        )
    for kind, why in r.skipped.items():
        print(f"skipped {kind}: {why}")
    for rec in r.records:
        for why in rec.supervisor_restarts:
            print(f"restarted as its supervisor would: {rec.episode.fault.kind}: {why}")
    for kind, server, room, why in r.score.deadline_rooms:
        print(f"deadline: {kind}: {server} room {room}: {why}")
    for server, g in (growth(r.samples) if r.minutes is not None else {}).items():
        print(
            f"soak {server}: {g['requests']} requests over {g['minutes']} min: RSS "
            f"{g['rss_mib_first']} -> {g['rss_mib_last']} MiB "
            f"({g['rss_kib_per_1000_requests']} KiB per 1,000 requests), fds "
            f"{g['fds_first']} -> {g['fds_last']} ({g['fds_per_1000_requests']} per 1,000)"
        )
    for v in r.score.violations:
        print(f"VIOLATION: {v}")
    verdict = "ok" if r.score.ok else f"{len(r.score.violations)} violation(s)"
    kinds = sum(row.kind != CALIBRATION.kind for row in r.score.rows)
    print(
        f"seed {r.seed}: {len(r.outcomes)} requests, {kinds} fault kinds in "
        f"{r.elapsed_s:.0f}s: {verdict}"
    )


def write_png(r: CampaignResult, path: Path) -> None:
    """Requests in flight over time (a step line), errors and hung requests as marks at their
    end, each fault as a shaded span (a SIGSTOP's pause) or a line, labelled."""
    import matplotlib  # noqa: PLC0415 - the report extra, only for --png

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    edges = sorted(
        [(o.sent_s, 1) for o in r.outcomes] + [(o.ended_s, -1) for o in r.outcomes],
    )
    xs, ys, level = [0.0], [0], 0
    for t, step in edges:
        level += step
        xs.append(t)
        ys.append(level)
    fig, ax = plt.subplots(figsize=(14, 5))
    ax.step(xs, ys, where="post", color="tab:blue", label="requests in flight")
    errs = [o for o in r.outcomes if o.status == "errored"]
    hung = [o for o in r.outcomes if o.status == "hung"]
    top = max(ys) + 1
    ax.scatter([o.ended_s for o in errs], [top] * len(errs), marker="x", color="tab:red",
               label="errored")  # fmt: skip
    ax.scatter([o.ended_s for o in hung], [top + 0.5] * len(hung), marker="v", color="black",
               label="hung")  # fmt: skip
    for rec in r.records:
        fault = rec.episode.fault
        if rec.fault_s is None or fault == CALIBRATION:
            continue
        if fault.pause_s:
            ax.axvspan(rec.fault_s, rec.fault_s + fault.pause_s, color="tab:orange", alpha=0.2)
        ax.axvline(rec.fault_s, color="tab:orange", linewidth=0.8)
        ax.text(rec.fault_s, top + 1, fault.kind, rotation=90, fontsize=6, va="bottom")
    if r.outcomes:  # from the first request: the servers' start-up before it is empty
        ax.set_xlim(min(o.sent_s for o in r.outcomes) - 5, max(o.ended_s for o in r.outcomes) + 5)
    ax.set_xlabel("seconds since the campaign began")
    ax.set_ylabel("requests")
    ax.set_ylim(0, top + 8)
    ax.set_title(f"kvfsm chaos servers, seed {r.seed}")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
